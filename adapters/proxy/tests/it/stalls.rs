//! Hangs that no per-try timeout bounds: a stream that cannot migrate and stalls after
//! its first byte ends at the idle timeout with an error event; a non-streaming request
//! that names no output limit, waiting on a wedged worker, is retried elsewhere when the
//! health checks eject that worker.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::fake::{sse_chunks, Behavior, Fake};
use crate::fault_common::health_of;
use crate::sims::*;
use crate::*;

/// Far above every bound the tests assert, so a request that waits for it fails them.
const REQUEST_TIMEOUT_MS: u64 = 60_000;

/// Streams `body` through a proxy whose only worker sends one chunk and stalls, with an
/// idle timeout of 200 ms: the client gets that chunk, a `stream_stalled` error event
/// and `[DONE]` well before the request timeout; the stall counts against the worker
/// as a broken stream, and nothing stays booked.
async fn check_stall_ends_the_stream(what: &str, addr: SocketAddr, body: &Value) {
    let t = Instant::now();
    let mut ev = Events::open(addr, "/v1/completions", &[], body).await;
    assert_eq!(ev.status, 200, "{what}");
    let got = read(&ev.rest().await);
    let took = t.elapsed();
    assert_eq!(got.chunks.len(), 1, "{what}: the chunk before the stall stays sent: {got:?}");
    let e = got.error.as_ref().unwrap_or_else(|| panic!("{what}: an error event: {got:?}"));
    assert_eq!(e["error"]["code"], "stream_stalled", "{what}: {e}");
    assert!(got.done, "{what}: the stream ends with [DONE]: {got:?}");
    assert!(took < Duration::from_secs(20), "{what}: ended by the idle timeout, not the request's: {took:?}");
    let m = get(addr, "/metrics").await.text();
    let broken = counted(&m, "kvroute_requests_total", &["outcome=\"stream_broken\""]);
    assert_eq!(broken, 1.0, "{what}: counted as a broken stream\n{m}");
    let against = counted(&m, "kvroute_upstream_failures_total", &["worker=\"1\"", "kind=\"idle_timeout\""]);
    assert_eq!(against, 1.0, "{what}: counted against the worker\n{m}");
    eventually(5_000, &format!("{what}: released"), || released(addr)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn st1_a_stream_that_cannot_migrate_ends_at_the_idle_timeout() {
    // Migration off: a sim-worker that stalls after one token.
    let sims = Sims::start(1).await;
    sims.of(1).set_stall_after_tokens(Some(1));
    let mut cfg = sims.config();
    cfg.retry.idle_stream_timeout_ms = 200;
    cfg.limits.request_timeout_ms = REQUEST_TIMEOUT_MS;
    cfg.ejection.consecutive_failures = 0;
    cfg.migration.attempts_max = 0;
    let p = proxy(cfg).await;
    check_stall_ends_the_stream("attempts_max = 0", p.local_addr(), &completion("stall", 8)).await;
    sims.stop().await;

    // Migration on, but two choices (and a worker that sends no token ids).
    let fake = Fake::start(&[MODEL]).await;
    let gate = Arc::new(Semaphore::new(0));
    fake.set(Behavior::GatedAfterFirst { chunks: sse_chunks(3), gate: gate.clone() });
    let mut cfg = config(&[(1, fake.addr)]);
    cfg.retry.idle_stream_timeout_ms = 200;
    cfg.limits.request_timeout_ms = REQUEST_TIMEOUT_MS;
    cfg.ejection.consecutive_failures = 0;
    let p = proxy(cfg).await;
    let mut body = completion("two", 8);
    body["n"] = 2.into();
    check_stall_ends_the_stream("n = 2", p.local_addr(), &body).await;
    // A worker that keeps sending is not cut: the timer restarts with every chunk (8
    // chunks 60 ms apart outlast the 200 ms idle timeout).
    gate.add_permits(1_000);
    fake.set(Behavior::Stream { chunks: sse_chunks(8), gap_ms: 60 });
    let got = stream_all(p.local_addr(), "/v1/completions", &body).await;
    assert!(got.done && got.error.is_none() && got.chunks.len() == 8, "{got:?}");
}

/// A worker that accepts connections, reads what comes, and never answers, not even
/// its health checks.
async fn wedged_worker() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    addr
}

/// A non-streaming request without `max_tokens` has no answer timeout. Two at once in
/// round-robin over a wedged worker and a sim-worker: the one on the wedged worker is
/// retried on the sim-worker once the health checks eject the wedged one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn st2_a_try_waiting_on_a_worker_that_is_ejected_is_retried_elsewhere() {
    let sims = Sims::start(1).await;
    let wedged = wedged_worker().await;
    let mut cfg = config(&[(1, wedged), (2, sims.workers[0].http_addr())]);
    cfg.retry.backoff_base_ms = 1;
    cfg.limits.request_timeout_ms = REQUEST_TIMEOUT_MS;
    cfg.health_check.interval_ms = 100;
    cfg.health_check.timeout_ms = 100;
    cfg.ejection.consecutive_failures = 2;
    cfg.ejection.base_ms = 60_000;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let body = json!({"model": MODEL, "prompt": "no limit named", "temperature": 0});
    let t = Instant::now();
    let sends: Vec<_> = (0..2)
        .map(|_| {
            let body = body.clone();
            tokio::spawn(async move {
                let resp = call(addr, http::Method::POST, "/v1/completions", &[], Some(&body)).await;
                (resp, Instant::now())
            })
        })
        .collect();
    for s in sends {
        let (a, at) = within(30_000, s).await.unwrap();
        assert_eq!((a.status.as_u16(), a.worker()), (200, Some(2)), "{}", a.text());
        let took = at - t;
        assert!(took < Duration::from_secs(20), "retried at the ejection, not the request timeout: {took:?}");
    }
    assert_eq!(health_of(addr, 1).await, "ejected");
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, "kvroute_retries_total", &["reason=\"ejected\""]), 1.0, "{m}");
    assert_eq!(counted(&m, "kvroute_retries_total", &[]), 1.0, "no other retries\n{m}");
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

/// A client that stops reading for longer than the idle timeout holds its stream back;
/// the worker did not stall, so the stream must go on where it stopped, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn st3_a_client_that_pauses_reading_does_not_stall_its_stream() {
    let fake = Fake::start(&[MODEL]).await;
    let chunk = bytes::Bytes::from_static(b"data: {\"choices\":[{\"index\":0,\"text\":\"flood\"}]}\n\n");
    let total = 32u64 << 20;
    fake.set(Behavior::Flood { chunk: chunk.clone(), bytes_total: total });
    let mut cfg = config(&[(1, fake.addr)]);
    // A second of silence, so that a loaded host's scheduling delays never reach it.
    cfg.retry.idle_stream_timeout_ms = 1_000;
    cfg.limits.request_timeout_ms = REQUEST_TIMEOUT_MS;
    cfg.limits.connection_buffer_bytes_max = 16 << 10;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let mut ev = Events::open(addr, "/v1/completions", &[], &completion("pause", 8)).await;
    assert_eq!(ev.status, 200);
    let first = ev.next().await.expect("a first event");
    // The proxy's buffers and the sockets' fill up, and the proxy stops reading too.
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let rest = ev.rest().await;
    let got = read(&rest);
    assert!(got.error.is_none(), "a paused client is not a stalled worker: {:?}", got.error);
    let events = 1 + rest.len() as u64;
    assert_eq!(events, total / chunk.len() as u64, "every event of the stream arrives once: {first:?}");
    eventually(5_000, "released", || released(addr)).await;
}
