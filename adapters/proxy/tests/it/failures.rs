//! Worker failures: connect errors retried elsewhere, broken streams, slow workers,
//! ejection and readmission.

use std::time::Duration;

use crate::*;

fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    sample(text, name, labels).unwrap_or(0.0)
}

#[tokio::test]
async fn connect_failures_are_retried_on_other_workers_once_each() {
    let live = Fake::start(&[MODEL]).await;
    let (dead1, dead2) = (Fake::dead_addr().await, Fake::dead_addr().await);
    let mut cfg = config(&[(1, dead1), (2, dead2), (3, live.addr)]);
    cfg.ejection.consecutive_failures = 0; // keep the dead workers in rotation
    cfg.retry.budget_initial = 100;
    let p = start(cfg).await;
    let fails = |text: &str, w: &str| {
        metric(text, "kvroute_upstream_failures_total", &[&format!("worker=\"{w}\""), "kind=\"connect\""])
    };
    let mut before = (0.0, 0.0);
    let mut retried = 0;
    for i in 0..6 {
        let a = post(p.local_addr(), "/v1/chat/completions", &[], &chat(&format!("q{i}"))).await;
        assert_eq!((a.status.as_u16(), a.worker()), (200, Some(3)), "{}", a.text());
        let text = get(p.local_addr(), "/metrics").await.text();
        let now = (fails(&text, "1"), fails(&text, "2"));
        let delta = (now.0 - before.0, now.1 - before.1);
        assert!(delta.0 <= 1.0 && delta.1 <= 1.0, "request {i} tried a dead worker twice: {delta:?}");
        retried += (delta.0 + delta.1) as u32;
        before = now;
    }
    assert!(retried >= 4, "round-robin starts most requests on a dead worker ({retried} retries)");
    assert_eq!(live.seen().len(), 6, "every request reached the live worker exactly once");
    let text = get(p.local_addr(), "/metrics").await.text();
    assert_eq!(f64::from(retried), metric(&text, "kvroute_retries_total", &[]));
    eventually(10_000, "released", || released(p.local_addr())).await;
}

#[tokio::test]
async fn retries_stop_at_retries_max_and_the_budget() {
    let dead: Vec<_> = [Fake::dead_addr().await, Fake::dead_addr().await, Fake::dead_addr().await].into();
    let mut cfg = config(&[(1, dead[0]), (2, dead[1]), (3, dead[2])]);
    cfg.ejection.consecutive_failures = 0;
    cfg.retry.retries_max = 1;
    cfg.retry.budget_initial = 1;
    cfg.retry.budget_ratio = 0.0;
    let p = start(cfg).await;
    let a = post(p.local_addr(), "/v1/chat/completions", &[], &chat("x")).await;
    assert_eq!(a.status, 502);
    assert_eq!(a.json()["error"]["code"], "upstream_unavailable");
    let b = post(p.local_addr(), "/v1/chat/completions", &[], &chat("y")).await;
    assert_eq!(b.status, 502);
    let text = get(p.local_addr(), "/metrics").await.text();
    assert_eq!(
        metric(&text, "kvroute_retries_total", &[]),
        1.0,
        "one retry for the first, the budget is empty for the second"
    );
    assert_eq!(total(&text, "kvroute_upstream_failures_total", "kind=\"connect\""), 3.0, "two tries, then one");
    eventually(10_000, "released", || released(p.local_addr())).await;
}

#[tokio::test]
async fn a_broken_stream_ends_with_an_error_event() {
    let w = Fake::start(&[MODEL]).await;
    let chunks = sse_chunks(4);
    w.set(Behavior::DieAfter { chunks: chunks[..2].to_vec() });
    let p = start(config(&[(1, w.addr)])).await;
    let a = post(p.local_addr(), "/v1/chat/completions", &[("x-session-id", "s")], &chat("x")).await;
    assert_eq!(a.status, 200);
    let text = a.text();
    assert!(text.starts_with(&String::from_utf8_lossy(&chunks[..2].concat()).into_owned()), "{text}");
    assert!(text.contains("event: error\ndata: {"), "{text}");
    assert!(text.contains("upstream_stream_broken"), "{text}");
    assert!(!text.contains("[DONE]"), "a broken stream never ends cleanly");
    eventually(10_000, "released", || released(p.local_addr())).await;
    let m = get(p.local_addr(), "/metrics").await.text();
    assert_eq!(sample(&m, "kvroute_requests_total", &["outcome=\"stream_broken\""]), Some(1.0));
    assert_eq!(sample(&m, "kvroute_upstream_failures_total", &["kind=\"stream_broken\""]), Some(1.0));
}

#[tokio::test]
async fn a_slow_worker_times_out_and_releases() {
    let w = Fake::start(&[MODEL]).await;
    // Stalls far past the time-out, so an answer before the stall ends is the time-out's.
    w.set(Behavior::Stall { ms: 30_000 });
    let mut cfg = config(&[(1, w.addr)]);
    cfg.limits.request_timeout_ms = 300;
    let p = start(cfg).await;
    let t0 = tokio::time::Instant::now();
    let a = post(p.local_addr(), "/v1/chat/completions", &[], &chat("x")).await;
    assert_eq!(a.status, 504);
    assert!(t0.elapsed() < Duration::from_millis(10_000), "answered at the time-out, not after the stall");
    eventually(10_000, "released", || released(p.local_addr())).await;
}

async fn health_of(addr: std::net::SocketAddr, id: u64) -> String {
    let w = get(addr, "/workers").await.json();
    let found = w["workers"].as_array().unwrap().iter().find(|w| w["id"] == id).cloned();
    found.map(|w| w["health"].as_str().unwrap().to_string()).unwrap_or_default()
}

#[tokio::test]
async fn consecutive_failures_eject_and_a_probe_readmits() {
    let (bad, good) = (Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await);
    bad.set(Behavior::Status(500));
    bad.set_healthy(false);
    let mut cfg = config(&[(1, bad.addr), (2, good.addr)]);
    cfg.ejection.consecutive_failures = 2;
    cfg.ejection.base_ms = 100;
    cfg.ejection.max_ms = 200;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let pin = [("x-worker-id", "1")];
    for _ in 0..2 {
        let a = post(addr, "/v1/chat/completions", &pin, &chat("x")).await;
        assert_eq!((a.status.as_u16(), a.worker()), (500, Some(1)), "the worker's own error passes through");
    }
    assert_eq!(health_of(addr, 1).await, "ejected");
    let a = post(addr, "/v1/chat/completions", &pin, &chat("x")).await;
    assert_eq!(a.status, 503, "a pin to an ejected worker is refused: {}", a.text());
    for _ in 0..3 {
        assert_eq!(
            post(addr, "/v1/chat/completions", &[], &chat("y")).await.worker(),
            Some(2),
            "unpinned traffic avoids it"
        );
    }
    // Probes fail while the health check fails: it stays out, backing off.
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(health_of(addr, 1).await, "ejected");
    bad.set_healthy(true);
    bad.set(Behavior::Stream { chunks: sse_chunks(1), gap_ms: 0 });
    eventually(10_000, "a passing probe readmits the worker", || async { health_of(addr, 1).await == "healthy" }).await;
    assert_eq!(post(addr, "/v1/chat/completions", &pin, &chat("x")).await.status, 200);
    let m = get(addr, "/metrics").await.text();
    assert_eq!(sample(&m, "kvroute_worker_ejections_total", &["worker=\"1\""]), Some(1.0));
    assert!(sample(&m, "kvroute_upstream_failures_total", &["worker=\"1\"", "kind=\"probe\""]).unwrap_or(0.0) >= 1.0);
}

#[tokio::test]
async fn active_health_checks_eject_a_dead_worker() {
    let (sick, good) = (Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await);
    sick.set_healthy(false);
    let mut cfg = config(&[(1, sick.addr), (2, good.addr)]);
    cfg.health_check.interval_ms = 50;
    cfg.ejection.consecutive_failures = 2;
    cfg.ejection.base_ms = 5_000;
    let p = start(cfg).await;
    let addr = p.local_addr();
    eventually(10_000, "failed checks eject the worker", || async { health_of(addr, 1).await == "ejected" }).await;
    assert_eq!(health_of(addr, 2).await, "healthy");
}
