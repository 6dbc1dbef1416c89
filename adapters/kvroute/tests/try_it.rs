//! The README's try-it path through the real binary: `kvroute serve` in front of two
//! `kvroute sim-worker` processes, over real HTTP and ZeroMQ on loopback. A model without
//! a tokenizer routes on the byte fallback, which the sim-workers use too, so their KV
//! events match what the router hashes: after one request, a follow-up sharing its
//! prefix shows overlap on the worker that served it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStderr, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// How long anything here may take before the test fails instead of hanging.
const STEP_TIMEOUT: Duration = Duration::from_secs(20);
/// Tokens per KV block: the default of the router and of the workers alike, which the
/// test leaves unset on both, so that it checks the try-it path as a newcomer runs it.
const BLOCK_SIZE: u32 = 64;
const MODEL: &str = "sim";

/// A child process, killed when dropped; its stderr lines arrive on `lines`.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Proc {
    fn start(args: &[&str]) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvroute starts");
        let stderr: ChildStderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc { child, lines, seen: Vec::new() }
    }

    /// The first stderr line containing `needle` (the lines before it are kept).
    #[track_caller]
    fn wait_line(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(line) => self.seen.push(line),
                Err(_) => panic!("no line with {needle:?}; stderr so far: {:#?}", self.seen),
            }
        }
    }

    /// Waits for the process to exit; its status and whole stderr.
    fn finish(mut self) -> (std::process::ExitStatus, String) {
        let status = self.child.wait().expect("wait");
        let mut all = self.seen.join("\n");
        while let Ok(line) = self.lines.recv_timeout(STEP_TIMEOUT) {
            all.push('\n');
            all.push_str(&line);
        }
        (status, all)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange: status, headers (lower-case names) and body.
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
    #[track_caller]
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> Reply {
    let mut s = TcpStream::connect_timeout(&addr, STEP_TIMEOUT).expect("connect");
    s.set_read_timeout(Some(STEP_TIMEOUT)).expect("timeout");
    let body = body.map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).and_then(|()| s.write_all(body.as_bytes())).expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let raw = String::from_utf8(raw).expect("utf-8 reply");
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a header block");
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|c| c.parse().ok()).expect("status");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked { dechunk(rest) } else { rest.to_string() };
    Reply { status, headers, body }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

/// A sim-worker on free ports with its default tokenization and block size, plus
/// `extra` arguments: its HTTP address and KV-event endpoint.
fn sim_worker(extra: &[&str]) -> (Proc, String, String) {
    let args = ["sim-worker", "--port", "0", "--events-port", "0", "--speedup", "50", "--model", MODEL];
    let mut p = Proc::start(&[&args[..], extra].concat());
    let line = p.wait_line("kvroute sim-worker: serving ");
    let rest = line.split("serving http://").nth(1).expect("address");
    let (http_addr, events) = rest.split_once(" with KV events on ").expect("events endpoint");
    (p, http_addr.to_string(), events.trim().to_string())
}

/// `kvroute serve` with `config`: the process and the address it serves on.
fn serve(name: &str, config: &str) -> (Proc, SocketAddr) {
    let path = write_config(name, config);
    let mut p = Proc::start(&["serve", "--config", path.to_str().expect("utf-8 path")]);
    let line = p.wait_line("kvroute: serving ");
    let addr = line.rsplit("http://").next().expect("address").trim().parse().expect("socket address");
    (p, addr)
}

fn write_config(name: &str, config: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("try-it-{name}-{}.toml", std::process::id()));
    std::fs::write(&path, config).expect("write the config");
    path
}

/// Two sim-workers publishing KV events, a model without a tokenizer, trusted loopback,
/// `approximate = false` (predictions still cover event-publishing workers of a model
/// without a tokenizer, but only for requests the router itself routed).
fn fleet_config(workers: &[(String, String)]) -> String {
    let mut c = format!(
        "listen = \"127.0.0.1:0\"\n[router]\napproximate = false\n\
         [trust]\ncidrs = [\"127.0.0.1/32\"]\n[[models]]\nname = \"{MODEL}\"\n"
    );
    for (i, (url, events)) in workers.iter().enumerate() {
        c.push_str(&format!(
            "[[workers]]\nid = {}\nurl = \"http://{url}\"\nmodel = \"{MODEL}\"\nkv_events = \"{events}\"\n",
            i + 1
        ));
    }
    c
}

/// A request body of `kind` whose prompt starts with `prefix` (about `len` bytes).
fn body(kind: &str, prefix: &str, tail: &str) -> (String, Value) {
    let text = format!("{prefix} {}{tail}", "the cached part of a long shared prompt. ".repeat(24));
    match kind {
        "text" => ("/v1/completions".into(), json!({"model": MODEL, "prompt": text, "max_tokens": 2})),
        "chat" => {
            let mut msgs = vec![json!({"role": "system", "content": text})];
            if !tail.is_empty() {
                msgs.push(json!({"role": "user", "content": tail}));
            }
            ("/v1/chat/completions".into(), json!({"model": MODEL, "messages": msgs, "max_tokens": 2}))
        }
        _ => {
            // Token ids pass through unchanged: 40 blocks' worth, then the tail's bytes.
            let seed = prefix.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b))) % 1000;
            let mut ids: Vec<u32> = (0..BLOCK_SIZE * 40).map(|i| seed * 10_000 + i).collect();
            ids.extend(tail.bytes().map(u32::from));
            ("/v1/completions".into(), json!({"model": MODEL, "prompt": ids, "max_tokens": 2}))
        }
    }
}

/// Has one request of `kind` served by `send` (which returns the serving worker), then
/// previews a follow-up sharing its prefix until that worker's overlap shows (its KV
/// events travel asynchronously). A fresh prefix per attempt covers batches lost before
/// the subscription settled (ZeroMQ's slow joiner). Returns the worker and the preview.
#[track_caller]
fn previewed_after(addr: SocketAddr, kind: &str, send: impl Fn(&str, &Value) -> u64) -> (u64, Value) {
    for attempt in 0..10 {
        let prefix = format!("{kind} attempt {attempt}:");
        let (path, first) = body(kind, &prefix, "");
        let worker = send(&path, &first);
        let (_, follow_up) = body(kind, &prefix, " and a different question at the end");
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            let p = http(addr, "POST", "/route/preview", Some(&follow_up));
            assert_eq!(p.status, 200, "{}", p.body);
            let v = p.json();
            if v["overlap_blocks"].as_u64().unwrap_or(0) > 0 {
                return (worker, v);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    panic!("{kind}: no overlap after 10 requests; the workers' events never matched the router's blocks");
}

/// `send` for [`previewed_after`]: through the router, which names the worker.
fn through(addr: SocketAddr) -> impl Fn(&str, &Value) -> u64 {
    move |path, body| {
        let r = http(addr, "POST", path, Some(body));
        assert_eq!(r.status, 200, "{}", r.body);
        r.header("x-kvroute-worker").and_then(|w| w.parse().ok()).expect("x-kvroute-worker")
    }
}

/// `send` for [`previewed_after`]: straight to worker `id` at `url`, so the router
/// predicts nothing and any overlap it shows comes from that worker's KV events.
fn straight_to(id: u64, url: &str) -> impl Fn(&str, &Value) -> u64 + '_ {
    move |path, body| {
        let r = http(url.parse().expect("worker address"), "POST", path, Some(body));
        assert_eq!(r.status, 200, "{}", r.body);
        id
    }
}

#[test]
fn serve_in_front_of_sim_workers_routes_text_chat_and_token_prompts_by_cache() {
    let (w1, url1, ev1) = sim_worker(&[]);
    let (w2, url2, ev2) = sim_worker(&[]);
    let (mut proxy, addr) = serve("fleet", &fleet_config(&[(url1.clone(), ev1), (url2, ev2)]));
    for kind in ["text", "chat", "tokens"] {
        // Cached by worker 1 behind the router's back: only its events can tell.
        let (worker, v) = previewed_after(addr, kind, straight_to(1, &url1));
        assert_eq!(v["worker"], worker, "{kind}: the follow-up goes where its prefix is cached: {v}");
        let row = v["explanation"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["worker"] == worker))
            .unwrap_or_else(|| panic!("a row for worker {worker}: {v}"));
        let (overlap, blocks) =
            (row["overlap"]["device"].as_u64().unwrap_or(0), v["request_blocks"].as_u64().unwrap_or(0));
        assert!(overlap * 2 >= blocks, "{kind}: most of the follow-up is cached ({overlap} of {blocks} blocks): {v}");
    }

    // No tokenizer while the workers publish events: said at startup, in /workers and
    // in /metrics.
    let warnings: Vec<&String> = proxy.seen.iter().filter(|l| l.contains("WARN") && l.contains("tokenizer")).collect();
    assert_eq!(warnings.len(), 1, "one startup warning: {:#?}", proxy.seen);
    let warning = warnings[0];
    for part in [&format!("model {MODEL:?}"), "no `tokenizer`", "set `tokenizer`", "local folder", "sim-worker"] {
        assert!(warning.contains(part), "the startup warning says {part:?}: {warning:?}");
    }
    let w = http(addr, "GET", "/workers", None).json();
    assert_eq!(w["pools"][0]["tokenizer"], false, "{w}");
    for worker in w["workers"].as_array().expect("workers") {
        assert_eq!(worker["tokenizer_missing"], true, "{worker}");
    }
    let metrics = http(addr, "GET", "/metrics", None).body;
    assert!(metrics.contains(&format!("kvroute_tokenizer_missing{{model=\"{MODEL}\"}} 1")), "{metrics}");
    drop((w1, w2));
    let _ = proxy.child.kill();
}

/// A real tokenizer folder unlike the router's fallback: whole words, most of them
/// unknown. Workers that tokenize with it publish KV events the router never matches,
/// as a real engine's are for a model configured without its tokenizer.
fn word_tokenizer() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("try-it-words-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tokenizer folder");
    let words = ["[UNK]", "the", "cached", "part", "of", "a", "long", "shared", "prompt", ".", "text", "attempt"];
    let vocab: serde_json::Map<String, Value> =
        words.iter().enumerate().map(|(i, w)| (w.to_string(), json!(i))).collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("write tokenizer.json");
    dir
}

#[test]
fn a_model_without_a_tokenizer_routes_on_predictions_when_events_cannot_match() {
    let dir = word_tokenizer();
    let dir = dir.to_str().expect("utf-8 path");
    let (w1, url1, ev1) = sim_worker(&["--tokenizer", dir]);
    let (w2, url2, ev2) = sim_worker(&["--tokenizer", dir]);
    // `approximate = false`: any overlap must come from the predictions kvroute turns on
    // for a model whose tokens are its own estimate.
    let (mut proxy, addr) = serve("words", &fleet_config(&[(url1, ev1), (url2, ev2)]));
    let w = http(addr, "GET", "/workers", None).json();
    assert!(w["workers"].as_array().expect("workers").iter().all(|w| w["tokenizer_missing"] == true), "{w}");
    let (worker, v) = previewed_after(addr, "text", through(addr));
    assert_eq!(v["worker"], worker, "the follow-up goes where the router predicts its prefix: {v}");
    let other = v["explanation"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["worker"] != worker))
        .unwrap_or_else(|| panic!("a row for the other worker: {v}"));
    assert_eq!(other["overlap"]["device"], 0, "nothing is predicted where nothing was sent: {v}");
    drop((w1, w2));
    let _ = proxy.child.kill();
}

/// `tokenizer` takes a local folder; anything else stops `serve` with what to do.
#[track_caller]
fn check_tokenizer_refused(value: &str, want: &[&str]) {
    let config = format!(
        "listen = \"127.0.0.1:0\"\n[[models]]\nname = \"m\"\ntokenizer = \"{value}\"\n\
         [[workers]]\nid = 1\nurl = \"http://127.0.0.1:9\"\nmodel = \"m\"\n"
    );
    let path = write_config("tokenizer", &config);
    let p = Proc::start(&["serve", "--config", path.to_str().expect("utf-8 path")]);
    let (status, stderr) = p.finish();
    assert!(!status.success(), "{value}: serve must refuse to start");
    for part in want {
        assert!(stderr.contains(part), "{value}: the error says {part:?}: {stderr}");
    }
}

#[test]
fn a_tokenizer_that_is_not_a_local_folder_stops_serve() {
    check_tokenizer_refused(
        "meta-llama/Llama-3.1-8B-Instruct",
        &["\"m\"", "hub id", "local folder", "download", "tokenizer.json", "tokenizer_config.json"],
    );
    check_tokenizer_refused("/no/such/tokenizer/folder", &["\"m\"", "is not a folder", "tokenizer.json"]);
}

/// `serve`'s library log lines reach stderr: a worker whose port refuses connections
/// fails its health checks, and its ejection is logged as a warning.
#[test]
fn serve_logs_a_failing_workers_ejection() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let config = format!(
        "listen = \"127.0.0.1:0\"\n[health_check]\ninterval_ms = 50\n[ejection]\nconsecutive_failures = 2\n\
         [[models]]\nname = \"{MODEL}\"\n[[workers]]\nid = 7\nurl = \"http://{closed}\"\nmodel = \"{MODEL}\"\n"
    );
    let (mut p, _addr) = serve("ejection", &config);
    let line = p.wait_line("worker ejected");
    assert!(line.contains("WARN") && line.contains("worker=7"), "a warning naming the worker: {line}");
}

/// A LLaVA-style model folder: a word-level tokenizer whose `<image>` word is the
/// placeholder, a chat template, and a `config.json` whose vision tower makes every image
/// `IMAGE_TOKENS` tokens. `kvroute serve` and `kvroute sim-worker` both read it.
fn llava_folder() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("try-it-llava-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("model folder");
    let words =
        ["[UNK]", "<image>", "the", "cached", "part", "of", "a", "long", "shared", "prompt.", "what", "is", "it?"];
    let vocab: serde_json::Map<String, Value> =
        words.iter().enumerate().map(|(i, w)| (w.to_string(), json!(i))).collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    });
    let template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}\
                    {% if add_generation_prompt %}assistant {% endif %}";
    let config = json!({"model_type": "llava", "image_token_index": 1,
        "vision_config": {"image_size": 14 * 8, "patch_size": 14}});
    for (name, v) in [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", json!({"chat_template": template, "unk_token": "[UNK]"})),
        ("config.json", config),
    ] {
        std::fs::write(dir.join(name), v.to_string()).expect("write the model folder");
    }
    dir
}

/// Tokens per image in [`llava_folder`] (8 × 8 patches) and the block size of the image test.
const IMAGE_TOKENS: u64 = 64;
const IMAGE_BLOCK: u64 = 16;

fn image_url(png: &[u8]) -> String {
    use base64::Engine as _;
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png))
}

/// A chat about the image at `url` whose system prompt starts with `prefix`; the
/// follow-up turn adds an answer and a question.
fn image_chat(prefix: &str, url: &str, follow_up: bool) -> Value {
    let system = format!("{prefix} {}", "the cached part of a long shared prompt. ".repeat(8));
    let mut msgs = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                           {"type": "text", "text": "what is it?"}]}),
    ];
    if follow_up {
        msgs.push(json!({"role": "assistant", "content": "a long shared prompt."}));
        msgs.push(json!({"role": "user", "content": "what is the cached part of it?"}));
    }
    json!({"model": MODEL, "messages": msgs, "max_tokens": 2})
}

/// A preview's device overlap on worker `id`.
fn overlap_on(v: &Value, id: u64) -> u64 {
    let rows = v["explanation"].as_array().cloned().unwrap_or_default();
    rows.iter().find(|r| r["worker"] == id).and_then(|r| r["overlap"]["device"].as_u64()).unwrap_or(0)
}

#[test]
fn image_chats_route_to_the_sim_worker_that_holds_the_image() {
    let dir = llava_folder();
    let dir = dir.to_str().expect("utf-8 path");
    let bs = IMAGE_BLOCK.to_string();
    let (w1, url1, ev1) = sim_worker(&["--tokenizer", dir, "--block-size", &bs]);
    let (w2, url2, ev2) = sim_worker(&["--tokenizer", dir, "--block-size", &bs]);
    let mut config = fleet_config(&[(url1.clone(), ev1), (url2, ev2)]);
    config = config.replace("approximate = false\n", &format!("approximate = false\nblock_size = {IMAGE_BLOCK}\n"));
    config = config.replace(&format!("name = \"{MODEL}\"\n"), &format!("name = \"{MODEL}\"\ntokenizer = \"{dir}\"\n"));
    config.push_str("[media]\nitems_max = 4\n");
    let (x, y) = (
        image_url(include_bytes!("../../media/tests/images/rgb.png")),
        image_url(include_bytes!("../../media/tests/images/gray.png")),
    );
    // Lost for sure, as ZeroMQ's slow joiner may lose any first batch: the router is not
    // subscribed yet. The attempts after the first must still tell it.
    straight_to(1, &url1)("/v1/chat/completions", &image_chat(&fresh_words(0), &x, false));
    let (proxy, addr) = serve("images", &config);
    let (first, follow_up) = first_turn_indexed(addr, &url1, &x);
    let rendered = http(url1.parse().expect("address"), "POST", "/v1/chat/completions/render", Some(&first)).json();
    let ids: Vec<u64> = rendered["token_ids"].as_array().expect("token ids").iter().filter_map(Value::as_u64).collect();
    let image_at = ids.iter().position(|&t| t == 1).expect("the image's placeholders") as u64;
    assert_eq!(ids.iter().filter(|&&t| t == 1).count() as u64, IMAGE_TOKENS, "the placeholder expanded");
    let first_blocks = ids.len() as u64 / IMAGE_BLOCK;
    assert!(
        first_blocks > image_at / IMAGE_BLOCK + 1,
        "the first turn's full blocks hold the image's: {first_blocks} blocks, image at {image_at} of {}",
        ids.len()
    );

    // The same image: every first-turn block, on worker 1, where the follow-up goes.
    let eventually_all = Instant::now() + STEP_TIMEOUT;
    let v = loop {
        let v = http(addr, "POST", "/route/preview", Some(&follow_up)).json();
        if overlap_on(&v, 1) == first_blocks || Instant::now() > eventually_all {
            break v;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!((v["worker"].as_u64(), overlap_on(&v, 1)), (Some(1), first_blocks), "{v}");
    // Another image: the blocks before the image, and not one more.
    let other = http(addr, "POST", "/route/preview", Some(&image_chat_like(&follow_up, &y))).json();
    assert_eq!(overlap_on(&other, 1), image_at / IMAGE_BLOCK, "another image diverges at the image: {other}");
    // Served through the router: worker 1, whose own hits are the overlap predicted.
    let served = http(addr, "POST", "/v1/chat/completions", Some(&follow_up));
    assert_eq!((served.status, served.header("x-kvroute-worker")), (200, Some("1")), "{}", served.body);
    let cached = served.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(cached, Some(first_blocks * IMAGE_BLOCK), "{}", served.body);
    // The follow-up was tokenized more than once, its pieces from the prefix cache after
    // the first time.
    let metrics = http(addr, "GET", "/metrics", None).body;
    let hits = format!("kvroute_tokenizer_cache_pieces_total{{model=\"{MODEL}\",result=\"hit\"}} ");
    let hit: u64 = metrics.lines().find_map(|l| l.strip_prefix(&hits)?.parse().ok()).unwrap_or(0);
    assert!(hit > 0, "the tokenizer's prefix cache served pieces: {metrics}");
    drop((w1, w2, proxy));
}

/// Sends an image chat's first turn straight to worker 1 (only its KV events can tell
/// the router) until a preview of its follow-up overlaps there; a fresh prefix per
/// attempt covers batches lost before the subscription settled. Returns the first turn
/// and the follow-up.
fn first_turn_indexed(addr: SocketAddr, url1: &str, image: &str) -> (Value, Value) {
    let mut last_preview = String::new();
    for attempt in 0..10 {
        let prefix = fresh_words(attempt);
        let first = image_chat(&prefix, image, false);
        straight_to(1, url1)("/v1/chat/completions", &first);
        let follow_up = image_chat(&prefix, image, true);
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            let preview = http(addr, "POST", "/route/preview", Some(&follow_up));
            if overlap_on(&preview.json(), 1) > 0 {
                return (first, follow_up);
            }
            last_preview = format!("{} {}", preview.status, preview.body);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // The streams' state, the last preview and the worker's own counters tell a lost
    // batch from a refused preview or a hashing mismatch.
    let workers = http(addr, "GET", "/workers", None).body;
    panic!(
        "worker 1's image blocks never reached the index; last preview: {last_preview}; GET /workers: {workers}; \
         worker 1's event counters: {}",
        event_counters(url1)
    )
}

/// Three words of [`llava_folder`]'s vocabulary, different for each `n` below 343: a
/// word it does not know is `[UNK]`, so "attempt 1" and "attempt 2" would be the same
/// tokens, the same cached blocks, and no new KV event after the first.
fn fresh_words(n: u32) -> String {
    const WORDS: [&str; 7] = ["the", "cached", "part", "of", "a", "long", "shared"];
    let digit = |k: u32| WORDS[(n / 7u32.pow(k) % 7) as usize];
    format!("{} {} {}", digit(2), digit(1), digit(0))
}

/// The sim-worker's own KV-event counters, to tell batches never published from
/// batches lost on the way.
fn event_counters(url: &str) -> String {
    let metrics = http(url.parse().expect("worker address"), "GET", "/metrics", None).body;
    metrics.lines().filter(|l| l.starts_with("kvroute_sim:kv_event")).collect::<Vec<_>>().join(", ")
}

/// `body` with its image replaced by the one at `url`.
fn image_chat_like(body: &Value, url: &str) -> Value {
    let mut b = body.clone();
    b["messages"][1]["content"][0]["image_url"]["url"] = json!(url);
    b
}
