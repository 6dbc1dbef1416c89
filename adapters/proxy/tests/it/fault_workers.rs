//! Fault injection, workers that fail (issue #8, scenarios 1, 2 and 4): a worker that
//! refuses connections, a worker that dies mid-stream, and a fleet where every worker is
//! down. Each test's name states what must hold; counts are exact where the proxy's
//! rules make them so, and bounds where concurrency makes them vary.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::fault_common::{assert_openai_error, holdings, metric, outlier, sse_ok};
use crate::*;

/// Connect attempts the proxy made to `worker` (each one failed: nothing listens).
fn connect_attempts(metrics: &str, worker: u64) -> f64 {
    metric(metrics, "kvroute_upstream_failures_total", &[&format!("worker=\"{worker}\""), "kind=\"connect\""])
}

/// Scenario 1: `clients` clients send `per_client` requests each through a fleet whose
/// worker 1 refuses connections. Every request succeeds on another worker, and worker 1
/// is tried at most `consecutive_failures + clients - 1` times (requests already past
/// the router when it is ejected may still try it), exactly `consecutive_failures` when
/// the clients take turns.
async fn check_refusing_worker(consecutive_failures: u32, clients: usize, per_client: usize) {
    let live = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    let mut cfg = config(&[(1, Fake::dead_addr().await), (2, live[0].addr), (3, live[1].addr)]);
    cfg.ejection.consecutive_failures = consecutive_failures;
    cfg.ejection.base_ms = 60_000; // no probe while the test runs
    cfg.retry.budget_initial = 100;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        tasks.spawn(async move {
            let mut served = Vec::new();
            for i in 0..per_client {
                let a = post(addr, "/v1/chat/completions", &[], &chat(&format!("c{c} q{i}"))).await;
                assert_eq!(a.status, 200, "request {i} of client {c}: {}", a.text());
                assert!(sse_ok(&a.text()), "{}", a.text());
                served.push(a.worker().unwrap());
            }
            served
        });
    }
    let served: Vec<u64> = within(30_000, tasks.join_all()).await.concat();
    assert!(!served.contains(&1), "nothing was served by the refusing worker: {served:?}");
    let m = get(addr, "/metrics").await.text();
    let attempts = connect_attempts(&m, 1);
    let most = f64::from(consecutive_failures) + clients as f64 - 1.0;
    assert!(
        attempts >= f64::from(consecutive_failures) && attempts <= most,
        "worker 1 was tried {attempts} times; want {consecutive_failures}..={most}"
    );
    let retried = metric(&m, "kvroute_retries_total", &["reason=\"connect\""]);
    assert_eq!(retried, attempts, "each refusal was retried elsewhere once");
    // A try still connecting when the worker was ejected is retried at the ejection.
    let ejected = metric(&m, "kvroute_retries_total", &["reason=\"ejected\""]);
    assert_eq!(total(&m, "kvroute_retries_total", ""), attempts + ejected, "no other retries\n{m}");
    assert_eq!(metric(&m, "kvroute_worker_ejections_total", &["worker=\"1\""]), 1.0);
    assert_eq!(outlier(addr, 1).await["ejected"], true);
    let seen = live[0].seen().len() + live[1].seen().len();
    assert_eq!(seen, clients * per_client, "the live workers got each request exactly once");
    eventually(10_000, "released", || released(addr)).await;
}

#[tokio::test]
async fn f1_a_refusing_worker_fails_no_request_and_is_tried_only_until_ejected() {
    check_refusing_worker(1, 1, 12).await;
    check_refusing_worker(3, 1, 12).await;
    check_refusing_worker(2, 8, 6).await;
}

/// Scenario 2: two workers each hold `n` open streams (a session each); worker 1's
/// process dies. Its streams end with an SSE `error` event and never `[DONE]`; worker 2's
/// streams finish whole; load, leases and queue return to the baseline measured before;
/// worker 1 counts one failure per broken stream; the next request goes to worker 2.
#[tokio::test]
async fn f2_a_worker_dying_mid_stream_ends_its_streams_with_an_error_event_and_frees_everything() {
    let n = 4;
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    let gates = [Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0))];
    let chunks = sse_chunks(4);
    for (f, g) in fakes.iter().zip(&gates) {
        f.set(Behavior::GatedAfterFirst { chunks: chunks.clone(), gate: g.clone() });
    }
    let mut cfg = config(&[(1, fakes[0].addr), (2, fakes[1].addr)]);
    cfg.ejection.consecutive_failures = 100; // count failures, never eject
    let p = start(cfg).await;
    let addr = p.local_addr();
    let baseline = holdings(addr).await;
    let mut streams = Vec::new();
    for i in 0..2 * n {
        let session = format!("s{i}");
        let resp =
            send(addr, Method::POST, "/v1/chat/completions", &[("x-session-id", &session)], Some(&chat("x"))).await;
        assert_eq!(resp.status(), 200);
        let worker: u64 = resp.headers()["x-kvroute-worker"].to_str().unwrap().parse().unwrap();
        streams.push((worker, resp.into_body()));
    }
    assert_eq!(streams.iter().filter(|(w, _)| *w == 1).count(), n, "round-robin splits the streams");
    // Every stream gets its first chunk (the proxy answers a stream with its first
    // chunk), so each is mid-stream when the worker dies.
    for (_, body) in &mut streams {
        within(10_000, body.frame()).await.unwrap().unwrap();
    }
    assert_eq!(pool(addr).await["affinity_live_leases"], 2 * n, "every stream holds its lease");
    fakes[0].kill();
    gates[1].add_permits(n * chunks.len());
    for (worker, body) in streams {
        let rest = within(10_000, body.collect()).await.expect("the client's stream ends, not errs").to_bytes();
        let text = String::from_utf8_lossy(&rest).into_owned();
        if worker == 1 {
            assert!(text.contains("event: error\ndata: {") && text.contains("upstream_stream_broken"), "{text}");
            assert!(!text.contains("[DONE]"), "a broken stream never ends cleanly: {text}");
        } else {
            assert!(text.ends_with("data: [DONE]\n\n"), "the other worker's streams are unharmed: {text}");
        }
    }
    eventually(10_000, "load, leases and queue back to the baseline", || async { holdings(addr).await == baseline })
        .await;
    let m = get(addr, "/metrics").await.text();
    let broken =
        |w: u64| metric(&m, "kvroute_upstream_failures_total", &[&format!("worker=\"{w}\""), "kind=\"stream_broken\""]);
    assert_eq!((broken(1), broken(2)), (n as f64, 0.0));
    assert_eq!(outlier(addr, 1).await["consecutive_failures"], n, "the dead worker counts each broken stream");
    assert_eq!(outlier(addr, 2).await["consecutive_failures"], 0);
    fakes[1].set(Behavior::Stream { chunks: sse_chunks(1), gap_ms: 0 });
    let a = post(addr, "/v1/chat/completions", &[("x-session-id", "s0")], &chat("again")).await;
    assert_eq!((a.status.as_u16(), a.worker()), (200, Some(2)), "{}", a.text());
}

/// Scenario 4: all three workers refuse connections. Every request is answered with a
/// 502 (retries used up) or a 503 (everything ejected) in the OpenAI error shape, each
/// well within `request_timeout_ms`, and the upstream attempts stay within the retry
/// budget: attempts <= requests + budget_initial + budget_ratio x requests. Once every
/// worker is ejected, a request costs no upstream attempt at all.
#[tokio::test]
async fn f4_with_every_worker_down_answers_are_fast_errors_and_attempts_stay_within_the_budget() {
    let dead = [Fake::dead_addr().await, Fake::dead_addr().await, Fake::dead_addr().await];
    let mut cfg = config(&[(1, dead[0]), (2, dead[1]), (3, dead[2])]);
    cfg.ejection.consecutive_failures = 3;
    cfg.ejection.base_ms = 60_000;
    cfg.retry.retries_max = 2;
    cfg.retry.budget_initial = 4;
    cfg.retry.budget_ratio = 0.2;
    cfg.limits.request_timeout_ms = 20_000;
    let (budget_initial, budget_ratio) = (cfg.retry.budget_initial, cfg.retry.budget_ratio);
    let p = start(cfg).await;
    let addr = p.local_addr();
    let (clients, per_client) = (8usize, 5usize);
    // Three attempts of at most `connect_timeout_ms` (500) each; the rest is slack for a
    // busy machine, still well short of the request time-out.
    let statuses = hammer(addr, clients, per_client, 8_000).await;
    let requests = (clients * per_client) as f64;
    let m = get(addr, "/metrics").await.text();
    let attempts: f64 = (1..=3).map(|w| connect_attempts(&m, w)).sum();
    let bound = requests + f64::from(budget_initial) + (budget_ratio * requests).ceil();
    assert!(attempts <= bound, "{attempts} upstream attempts for {requests} requests; the budget allows {bound}");
    assert!(statuses.iter().all(|s| *s == 502 || *s == 503), "{statuses:?}");
    eventually(10_000, "every worker ejected", || async {
        let w = get(addr, "/workers").await.json();
        w["workers"].as_array().unwrap().iter().all(|w| w["health"] == "ejected")
    })
    .await;
    let after = hammer(addr, 4, 5, 8_000).await;
    assert!(after.iter().all(|s| *s == 503), "an empty fleet answers 503: {after:?}");
    let m2 = get(addr, "/metrics").await.text();
    let attempts2: f64 = (1..=3).map(|w| connect_attempts(&m2, w)).sum();
    assert_eq!(attempts2, attempts, "no upstream attempt once every worker is ejected");
    eventually(10_000, "released", || released(addr)).await;
}

/// Scenario 4 with workers that never complete the TCP handshake (their accept queue is
/// full): every request is still answered, within `connect_timeout_ms` per attempt,
/// never hanging until `request_timeout_ms`.
#[tokio::test]
async fn f4_blackholed_workers_cost_at_most_one_connect_timeout_per_attempt() {
    let (holes, _held) = blackholes(2).await;
    let mut cfg = config(&[(1, holes[0]), (2, holes[1])]);
    cfg.limits.connect_timeout_ms = 200;
    cfg.limits.request_timeout_ms = 20_000;
    cfg.retry.retries_max = 1;
    cfg.ejection.consecutive_failures = 100;
    let p = start(cfg).await;
    let addr = p.local_addr();
    // Two attempts of 200 ms each; the rest is slack for a busy machine.
    let statuses = hammer(addr, 4, 2, 8_000).await;
    assert!(statuses.iter().all(|s| *s == 502), "{statuses:?}");
    eventually(10_000, "released", || released(addr)).await;
}

/// `clients` concurrent clients send `per_client` requests each; every answer must be an
/// OpenAI-shaped error within `answer_ms`. Returns the statuses.
async fn hammer(addr: SocketAddr, clients: usize, per_client: usize, answer_ms: u64) -> Vec<u16> {
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        tasks.spawn(async move {
            let mut statuses = Vec::new();
            for i in 0..per_client {
                let t0 = Instant::now();
                let a = post(addr, "/v1/chat/completions", &[], &chat(&format!("c{c} q{i}"))).await;
                let took = t0.elapsed();
                assert!(took < Duration::from_millis(answer_ms), "answered after {took:?}: {}", a.text());
                assert_openai_error(&a);
                statuses.push(a.status.as_u16());
            }
            statuses
        });
    }
    within(30_000, tasks.join_all()).await.concat()
}

/// Addresses that accept no connection: listeners with a one-slot accept queue, already
/// filled, so further SYNs are dropped and connects hang until their timeout. Keep the
/// second value alive for as long as the addresses should stay black holes.
async fn blackholes(n: usize) -> (Vec<SocketAddr>, Vec<impl Sized>) {
    let mut addrs = Vec::new();
    let mut held: Vec<(tokio::net::TcpListener, Vec<tokio::net::TcpStream>)> = Vec::new();
    for _ in 0..n {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = sock.listen(0).unwrap();
        let a = listener.local_addr().unwrap();
        let mut fill = Vec::new();
        // The queue takes backlog + 1 connections; a few more make sure it is full.
        for _ in 0..4 {
            if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_millis(100), tokio::net::TcpStream::connect(a)).await
            {
                fill.push(s);
            }
        }
        assert!(
            tokio::time::timeout(Duration::from_millis(300), tokio::net::TcpStream::connect(a)).await.is_err(),
            "the accept queue of {a} is full"
        );
        addrs.push(a);
        held.push((listener, fill));
    }
    (addrs, held)
}
