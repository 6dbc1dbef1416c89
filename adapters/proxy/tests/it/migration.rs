//! Mid-stream migration (issue #16, part 2) against sim-workers, whose greedy decoding
//! continues any prefix of prompt and output exactly as the uninterrupted run would:
//! a stream whose worker dies or stalls after N chunks continues elsewhere and the
//! client gets exactly the uninterrupted text, one chunk identity, a whole usage, and
//! only standard fields; structured output is not migrated; the attempts are bounded.

use std::time::Duration;

use serde_json::{json, Value};

use crate::sims::*;
use crate::*;

const MIGRATIONS: &str = "kvroute_migrations_total";

/// How the serving worker fails after `after` chunks reached the client. Either way it
/// first stops after `after` tokens, so that the break falls exactly there (a sim
/// worker is fast enough to have sent everything by the time a client reacts).
#[derive(Clone, Copy, Debug)]
enum Break {
    /// The process dies: connections cut, port closed.
    Kill,
    /// The stream goes silent (the idle timeout hands it to migration).
    Stall,
}

/// One stream of `body` at `path` whose worker breaks (`how`) after `after` token
/// chunks. The client gets exactly the text, the usage and the chunk count of an
/// uninterrupted run, one `id`/`created`/`model`, no token-id fields, `[DONE]` last;
/// one migration is counted; nothing is left booked. Returns the seam: the time
/// between the last chunk before the break and the first after it.
async fn check_migrates(path: &str, body: Value, how: Break, after: usize) -> Duration {
    let sims = Sims::start(2).await;
    let mut cfg = sims.config();
    cfg.retry.idle_stream_timeout_ms = match how {
        Break::Kill => 10_000,
        Break::Stall => 100,
    };
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let whole = stream_all(addr, path, &body).await;
    assert!(whole.done && whole.error.is_none(), "{whole:?}");

    for f in &sims.faults {
        f.set_stall_after_tokens(Some(after as u32));
    }
    let mut ev = Events::open(addr, path, &[], &body).await;
    let home = ev.worker.expect("x-kvroute-worker");
    // Only the first worker stops; its continuation runs free.
    sims.of(3 - home).set_stall_after_tokens(None);
    let mut events = Vec::new();
    while events.iter().filter(|(e, _): &&(String, _)| e.contains("\"choices\":[{")).count() < after {
        events.push(ev.next().await.expect("the first chunks"));
    }
    if let Break::Kill = how {
        sims.of(home).kill();
    }
    let before = events.last().unwrap().1;
    let rest = ev.rest().await;
    let seam = rest.first().expect("chunks after the break").1 - before;
    events.extend(rest);
    let got = read(&events);
    let case = format!("{path} {how:?} after {after}");
    assert!(got.done && got.error.is_none(), "{case}: {got:?}");
    assert_eq!(got.text, whole.text, "{case}: exactly the uninterrupted text");
    assert_eq!(got.chunks.len(), whole.chunks.len(), "{case}: as many chunks");
    let first = &got.chunks[0];
    for c in &got.chunks {
        for k in ["id", "created", "model", "object"] {
            assert_eq!(c[k], first[k], "{case}: `{k}` is kept across the seam: {c}");
        }
        assert!(c.get("prompt_token_ids").is_none() && c["choices"][0].get("token_ids").is_none(), "{case}: {c}");
        assert!(c["choices"][0].get("prompt_token_ids").is_none(), "{case}: {c}");
    }
    let (usage, want) = (&got.chunks.last().unwrap()["usage"], &whole.chunks.last().unwrap()["usage"]);
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage[k], want[k], "{case}: usage.{k} covers the whole generation");
    }
    // The engine gave cache details: they stay, counted within the client's prompt.
    assert!(want["prompt_tokens_details"].is_object(), "the sim-worker gives details: {want}");
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached.is_some_and(|c| Some(c) <= usage["prompt_tokens"].as_u64()), "{case}: {usage}");
    let reason = match how {
        Break::Kill => "stream_broken",
        Break::Stall => "idle_timeout",
    };
    let m = get(addr, "/metrics").await.text();
    let label = format!("reason=\"{reason}\"");
    assert_eq!(counted(&m, MIGRATIONS, &[&label, "outcome=\"resumed\""]), 1.0, "{case}\n{m}");
    eventually(5_000, "released", || released(addr)).await;
    drop(p);
    sims.stop().await;
    seam
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m1_a_completion_whose_worker_dies_continues_with_exactly_the_uninterrupted_text() {
    let mut seams = Vec::new();
    for after in [1, 3, 7] {
        seams.push(check_migrates("/v1/completions", completion("the quick brown fox", 12), Break::Kill, after).await);
    }
    let chat = greedy_chat("tell me about caches", 12);
    seams.push(check_migrates("/v1/chat/completions", chat, Break::Kill, 4).await);
    let shown: Vec<String> = seams.iter().map(|s| format!("{:.2}", ms(*s))).collect();
    eprintln!("migration seam after a killed worker (ms): {}", shown.join(", "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m2_a_stalled_stream_is_migrated_after_the_idle_timeout() {
    // The seam includes the idle timeout, counted from when the proxy got the last chunk.
    let seam = check_migrates("/v1/completions", completion("a stalled stream", 10), Break::Stall, 3).await;
    let chat = check_migrates("/v1/chat/completions", greedy_chat("stall", 10), Break::Stall, 5).await;
    eprintln!("migration seam after a stall (ms): {:.1}, {:.1} (idle timeout 100)", ms(seam), ms(chat));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m3_structured_output_is_not_migrated_and_ends_with_an_error_event() {
    let sims = Sims::start(2).await;
    let mut cfg = sims.config();
    cfg.retry.idle_stream_timeout_ms = 50;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    for f in &sims.faults {
        f.set_stall_after_tokens(Some(2));
    }
    let mut body = completion("json please", 8);
    body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}});
    let got = stream_all(addr, "/v1/completions", &body).await;
    assert_eq!(got.chunks.len(), 2, "the tokens sent before the break stay sent");
    assert!(!got.done, "no [DONE] after a break");
    let e = got.error.expect("an error event");
    assert_eq!(e["error"]["code"], "migration_refused", "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("response_format"), "{e}");
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, MIGRATIONS, &["outcome=\"refused_structured\""]), 1.0, "{m}");
    assert_eq!(counted(&m, MIGRATIONS, &["outcome=\"resumed\""]), 0.0);
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

/// Every worker stalls after 2 tokens: each continuation breaks too. After
/// `attempts_max` migrations the next break ends the stream with an error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m4_the_migration_limit_ends_the_stream_with_an_error_event() {
    let sims = Sims::start(3).await;
    let mut cfg = sims.config();
    cfg.retry.idle_stream_timeout_ms = 50;
    cfg.migration.attempts_max = 2;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let body = completion("limits", 12);
    let whole = stream_all(addr, "/v1/completions", &body).await;
    for f in &sims.faults {
        f.set_stall_after_tokens(Some(2));
    }
    let got = stream_all(addr, "/v1/completions", &body).await;
    assert_eq!(got.chunks.len(), 6, "2 tokens from each of 3 workers: {got:?}");
    assert!(whole.text.starts_with(&got.text), "what was sent is exact: {:?} vs {:?}", got.text, whole.text);
    let e = got.error.expect("an error event");
    assert_eq!(e["error"]["code"], "migration_limit", "{e}");
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, MIGRATIONS, &["outcome=\"resumed\""]), 2.0, "{m}");
    assert_eq!(counted(&m, MIGRATIONS, &["outcome=\"attempts_exhausted\""]), 1.0, "{m}");
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

/// A session's binding follows its stream to the new worker: of three, the one that
/// continued it, while the stalled one is still up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m5_the_sessions_binding_moves_with_the_migration() {
    let sims = Sims::start(3).await;
    let mut cfg = sims.config();
    cfg.retry.idle_stream_timeout_ms = 100;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let session = [("x-session-id", "mover")];
    for f in &sims.faults {
        f.set_stall_after_tokens(Some(1));
    }
    let mut ev = Events::open(addr, "/v1/completions", &session, &completion("move me", 10)).await;
    let home = ev.worker.unwrap();
    for id in (1..=3).filter(|&id| id != home) {
        sims.of(id).set_stall_after_tokens(None);
    }
    let rest = read(&ev.rest().await);
    assert!(rest.done && rest.error.is_none(), "{rest:?}");
    sims.of(home).set_stall_after_tokens(None);
    let m = get(addr, "/metrics").await.text();
    let served = |w: u64| counted(&m, "kvroute_requests_total", &[&format!("worker=\"{w}\""), "outcome=\"ok\""]);
    let target = (1..=3).find(|&w| served(w) == 1.0).expect("one worker finished the stream");
    assert_ne!(target, home);
    let preview = post(addr, "/route/preview", &session, &completion("next", 2)).await.json();
    assert_eq!(preview["worker"], target, "{preview}");
    for row in preview["explanation"].as_array().unwrap() {
        let pinned_elsewhere = row["worker"] != target && row["excluded"] == "not_pinned";
        assert!(row["worker"] == target || pinned_elsewhere, "the binding pins the target: {preview}");
    }
    for i in 0..3 {
        let next = post(addr, "/v1/completions", &session, &completion(&format!("next{i}"), 2)).await;
        assert_eq!((next.status.as_u16(), next.worker()), (200, Some(target)), "{}", next.text());
    }
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

/// The continuation's worker is wedged: no first byte comes within
/// `migration.deadline_ms` of the break, and the stream ends with its own error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m6_a_continuation_past_the_migration_deadline_ends_the_stream() {
    let sims = Sims::start(2).await;
    let mut cfg = sims.config();
    cfg.retry.idle_stream_timeout_ms = 300;
    cfg.migration.deadline_ms = 150;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    for f in &sims.faults {
        f.set_stall_after_tokens(Some(2));
    }
    let mut ev = Events::open(addr, "/v1/completions", &[], &completion("late", 10)).await;
    let home = ev.worker.unwrap();
    sims.of(3 - home).set_wedged(true);
    let first = ev.next().await.expect("a first chunk").1;
    let events = ev.rest().await;
    let got = read(&events);
    let took = events.last().unwrap().1 - first;
    assert!(!got.done, "{got:?}");
    let e = got.error.expect("an error event");
    assert_eq!(e["error"]["code"], "migration_deadline", "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("150 ms"), "{e}");
    assert!(took < Duration::from_secs(3), "the first-byte timeout (15 s) did not decide: {took:?}");
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, MIGRATIONS, &["outcome=\"deadline\""]), 1.0, "{m}");
    assert_eq!(counted(&m, MIGRATIONS, &["outcome=\"no_worker\""]), 0.0, "{m}");
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

/// A chat whose continuation would change what the client gets (`extra` asks for
/// logprobs or offers tools) is not migrated: the break ends it with an error event
/// naming `why`, counted as `refused_fidelity`.
async fn check_unfaithful_is_refused(extra: Value, why: &str) {
    let sims = Sims::start(2).await;
    let mut cfg = sims.config();
    cfg.retry.idle_stream_timeout_ms = 50;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    for f in &sims.faults {
        f.set_stall_after_tokens(Some(2));
    }
    let mut body = greedy_chat("faithful", 8);
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let got = stream_all(addr, "/v1/chat/completions", &body).await;
    assert!(!got.done && !got.chunks.is_empty(), "{why}: {got:?}");
    let e = got.error.expect("an error event");
    assert_eq!(e["error"]["code"], "migration_refused", "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains(why), "{e}");
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, MIGRATIONS, &["outcome=\"refused_fidelity\""]), 1.0, "{why}\n{m}");
    assert_eq!(counted(&m, MIGRATIONS, &["outcome=\"resumed\""]), 0.0, "{why}");
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m7_a_chat_with_logprobs_or_tools_is_not_migrated() {
    check_unfaithful_is_refused(json!({"logprobs": true, "top_logprobs": 1}), "logprobs").await;
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    check_unfaithful_is_refused(json!({"tools": tools}), "tools").await;
}

/// The worker dies after the chunk with the `finish_reason` but before the usage the
/// client asked for: the client still gets a usage chunk, built from the prompt's and
/// the output's token ids, then `[DONE]`, and no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m8_a_break_between_the_last_token_and_the_usage_still_gives_the_usage() {
    let fake = Fake::start(&[MODEL]).await;
    let chunk = |choice: Value, first: bool| {
        let mut c =
            json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": MODEL, "choices": [choice]});
        if first {
            c["choices"][0]["prompt_token_ids"] = json!([5, 6, 7, 8]);
        }
        bytes::Bytes::from(format!("data: {c}\n\n"))
    };
    let chunks = vec![
        chunk(json!({"index": 0, "text": "a", "token_ids": [11], "finish_reason": null}), true),
        chunk(json!({"index": 0, "text": "b", "token_ids": [12], "finish_reason": null}), false),
        chunk(json!({"index": 0, "text": "c", "token_ids": [13], "finish_reason": "length"}), false),
    ];
    fake.set(Behavior::DieAfter { chunks });
    let p = proxy(config(&[(1, fake.addr)])).await;
    let addr = p.local_addr();
    let got = stream_all(addr, "/v1/completions", &completion("usage please", 3)).await;
    assert!(got.done && got.error.is_none(), "{got:?}");
    assert_eq!(got.text, "abc");
    let last = got.chunks.last().unwrap();
    let want = json!({"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7});
    assert_eq!(last["usage"], want, "{last}");
    assert_eq!(
        (&last["id"], &last["created"], &last["object"]),
        (&json!("cmpl-1"), &json!(7), &json!("text_completion"))
    );
    assert!(got.chunks.iter().all(|c| c["choices"][0].get("token_ids").is_none()), "{:?}", got.chunks);
    // Without include_usage, none is made up.
    let mut body = completion("no usage", 3);
    body.as_object_mut().unwrap().remove("stream_options");
    let plain = stream_all(addr, "/v1/completions", &body).await;
    assert!(plain.done && plain.error.is_none() && plain.chunks.iter().all(|c| c.get("usage").is_none()), "{plain:?}");
    eventually(5_000, "released", || released(addr)).await;
}

/// A continuation prefills the prompt and what was generated: its first-byte timeout is
/// sized by both. Worker 1 streams two tokens of a 1,000-token prompt and dies; worker 2
/// takes 2 s to its first byte, within 1 s plus 2 ms per token of the continuation's
/// prompt, though beyond that for the client's short text. (Seconds, not the 100 ms it
/// once had, which a loaded host's first bytes overran.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m9_a_continuations_first_byte_timeout_counts_the_prompt_and_the_output() {
    let (dying, slow) = (Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await);
    let ids: Vec<u32> = (0..1_000).collect();
    let first = json!({"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "text": "a", "token_ids": [5000], "prompt_token_ids": ids}]});
    let second = json!({"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "text": "b", "token_ids": [5001]}]});
    let chunks = [first, second].map(|c| bytes::Bytes::from(format!("data: {c}\n\n"))).to_vec();
    dying.set(Behavior::DieAfter { chunks });
    slow.set(Behavior::Delayed { ms: 2_000, chunks: sse_chunks(2) });
    let mut cfg = config(&[(1, dying.addr), (2, slow.addr)]);
    cfg.retry.first_byte_timeout_base_ms = 1_000;
    cfg.retry.first_byte_timeout_per_token_us = 2_000;
    cfg.ejection.consecutive_failures = 0;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let got = stream_all(addr, "/v1/completions", &completion("hi", 8)).await;
    assert!(got.done && got.error.is_none(), "{got:?}");
    let cont = slow.seen();
    assert_eq!(cont.len(), 1, "one continuation");
    assert_eq!(cont[0].body["prompt"].as_array().map(Vec::len), Some(1_002), "the prompt and the two tokens");
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, MIGRATIONS, &["outcome=\"resumed\""]), 1.0, "{m}");
    eventually(5_000, "released", || released(addr)).await;
}
