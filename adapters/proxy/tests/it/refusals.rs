//! Refusals and timeouts before the first byte that the failover tests do not cover: a
//! hard session whose worker refuses one request keeps its worker; a reset before the
//! response head is retried; a non-streaming try to a wedged worker has an answer
//! timeout; and the first-byte timeout grows with the uncached prompt.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::sims::*;
use crate::*;

const RETRIES: &str = "kvroute_retries_total";

/// A non-streaming completion of `prompt`, `max_tokens` long.
fn whole(prompt: &str, max_tokens: u32) -> Value {
    let mut b = completion(prompt, max_tokens);
    b["stream"] = false.into();
    b.as_object_mut().unwrap().remove("stream_options");
    b
}

/// A hard session (the default) bound to its worker, which then answers one request
/// `status`: that request is served by the other worker, and the session's next request
/// is back on its own, which is still available.
async fn check_refusal_keeps_the_session(status: u16, reason: &str) {
    let sims = Sims::start(2).await;
    let mut cfg = sims.config();
    cfg.ejection.consecutive_failures = 0;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let session = [("x-session-id", "stay")];
    let bound = post(addr, "/v1/completions", &session, &whole("hi", 2)).await;
    assert_eq!(bound.status, 200, "{}", bound.text());
    let home = bound.worker().unwrap();
    sims.of(home).set_status(Some(status), None);
    let refused = post(addr, "/v1/completions", &session, &whole("again", 2)).await;
    assert_eq!((refused.status.as_u16(), refused.worker()), (200, Some(3 - home)), "{status}: {}", refused.text());
    sims.of(home).set_status(None, None);
    for i in 0..3 {
        let next = post(addr, "/v1/completions", &session, &whole(&format!("n{i}"), 2)).await;
        assert_eq!((next.status.as_u16(), next.worker()), (200, Some(home)), "{status}: the session kept its worker");
    }
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, RETRIES, &[&format!("reason=\"{reason}\"")]), 1.0, "{m}");
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rf1_a_hard_session_keeps_its_worker_after_a_429_or_a_5xx() {
    check_refusal_keeps_the_session(429, "status_429").await;
    check_refusal_keeps_the_session(500, "status_5xx").await;
}

/// A worker that reads each request and closes the connection without a response head;
/// counts the requests it cut.
async fn resetting_worker() -> (SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cut = Arc::new(AtomicU64::new(0));
    let c = cut.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let c = c.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                if matches!(s.read(&mut buf).await, Ok(n) if n > 0) {
                    c.fetch_add(1, Ordering::Relaxed);
                }
                // Dropped with the rest of the request unread: the peer sees a reset.
            });
        }
    });
    (addr, cut)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rf2_a_reset_before_the_response_head_is_retried_elsewhere() {
    let sims = Sims::start(1).await;
    let (reset_addr, cut) = resetting_worker().await;
    let mut cfg = config(&[(1, reset_addr), (2, sims.workers[0].http_addr())]);
    cfg.retry.backoff_base_ms = 1;
    cfg.ejection.consecutive_failures = 0;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    for i in 0..4 {
        let a = post(addr, "/v1/completions", &[], &whole(&format!("r{i}"), 2)).await;
        assert_eq!((a.status.as_u16(), a.worker()), (200, Some(2)), "request {i}: {}", a.text());
        let s = stream_all(addr, "/v1/completions", &completion(&format!("s{i}"), 2)).await;
        assert!(s.done && s.error.is_none(), "stream {i}: {s:?}");
    }
    let cut = cut.load(Ordering::Relaxed) as f64;
    assert!(cut >= 2.0, "round-robin sent requests to the resetting worker: {cut}");
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, RETRIES, &["reason=\"reset\""]), cut, "one retry per reset\n{m}");
    assert_eq!(counted(&m, RETRIES, &[]), cut, "no other retries");
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

/// Non-streaming requests in round-robin over a wedged worker and a healthy one: each
/// that meets the wedged worker waits out its answer timeout (first-byte timeout plus
/// a time per output token asked for), not the request's, and is served elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rf3_a_non_streaming_try_to_a_wedged_worker_times_out_by_its_output_size() {
    let sims = Sims::start(2).await;
    sims.of(1).set_wedged(true);
    let mut cfg = sims.config();
    cfg.retry.first_byte_timeout_base_ms = 80;
    cfg.retry.first_byte_timeout_per_token_us = 0;
    cfg.retry.answer_timeout_per_output_token_ms = 20;
    cfg.retry.budget_initial = 100;
    cfg.ejection.consecutive_failures = 0;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let mut slowest = Duration::ZERO;
    for i in 0..6 {
        let t = Instant::now();
        let a = post(addr, "/v1/completions", &[], &whole(&format!("w{i}"), 4)).await;
        assert_eq!((a.status.as_u16(), a.worker()), (200, Some(2)), "request {i}: {}", a.text());
        slowest = slowest.max(t.elapsed());
    }
    // 80 ms + 4 × 20 ms per try on the wedged worker; the request timeout is 10 s.
    assert!(slowest >= Duration::from_millis(160), "the answer timeout covers the output: {slowest:?}");
    assert!(slowest < Duration::from_secs(3), "no request waited for the request timeout: {slowest:?}");
    let m = get(addr, "/metrics").await.text();
    let timed_out = counted(&m, RETRIES, &["reason=\"first_byte_timeout\""]);
    assert!(timed_out >= 1.0, "{m}");
    assert_eq!(counted(&m, "kvroute_upstream_failures_total", &["worker=\"1\""]), timed_out, "counted against it\n{m}");
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

/// One worker whose first byte takes 400 ms, a first-byte timeout of 100 ms plus 1 ms
/// per uncached prompt token: a short prompt times out, a long one (about 2,000
/// uncached tokens) gets the time its prefill needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rf4_the_first_byte_timeout_grows_with_the_uncached_prompt() {
    let fake = Fake::start(&[MODEL]).await;
    fake.set(Behavior::Delayed { ms: 400, chunks: sse_chunks(2) });
    let mut cfg = config(&[(1, fake.addr)]);
    cfg.retry.first_byte_timeout_base_ms = 100;
    cfg.retry.first_byte_timeout_per_token_us = 1_000;
    cfg.ejection.consecutive_failures = 0;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let long = "lorem ipsum dolor sit amet ".repeat(300);
    let a = send(addr, http::Method::POST, "/v1/completions", &[], Some(&completion(&long, 2))).await;
    assert_eq!(a.status(), 200, "a long uncached prompt gets its prefill time");
    let short = send(addr, http::Method::POST, "/v1/completions", &[], Some(&completion("hi", 2))).await;
    assert_eq!(short.status(), 502, "a short prompt's first byte is late");
    let m = get(addr, "/metrics").await.text();
    // One worker: the retry found nowhere to go, so none was made.
    assert_eq!(counted(&m, RETRIES, &[]), 0.0, "{m}");
    let timed_out = counted(&m, "kvroute_upstream_failures_total", &["kind=\"first_byte_timeout\""]);
    assert_eq!(timed_out, 1.0, "the timeout still counts against the worker\n{m}");
    eventually(5_000, "released", || released(addr)).await;
}
