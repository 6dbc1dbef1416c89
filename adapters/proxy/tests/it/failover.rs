//! Failures before the first byte (issue #16, part 1) and workers that go away under
//! their sessions (part 3), against sim-workers with injected faults: 5xx and 429 are
//! retried elsewhere, `Retry-After` is honoured, the retry budget runs out, a wedged
//! worker is found by the first-byte timeout and ejected, a hard session re-binds when
//! its worker is ejected, and a drained worker finishes what it holds and takes nothing
//! new.

use std::time::Duration;

use http::Method;
use kvroute_sim_server::EngineConfig;
use tokio::time::Instant;

use crate::fault_common::{health_of, outlier};
use crate::sims::*;
use crate::*;

const RETRIES: &str = "kvroute_retries_total";

/// Worker 1 of two answers every request `status` (with `Retry-After: retry_after_s`);
/// `n` requests alternate between the workers. Every request succeeds on worker 2, and
/// each that met worker 1 first was retried once, counted under `reason`.
async fn check_retried_status(status: u16, retry_after_s: Option<u64>, reason: &str) {
    let sims = Sims::start(2).await;
    sims.of(1).set_status(Some(status), retry_after_s);
    let mut cfg = sims.config();
    cfg.retry.retry_after_max_ms = 50;
    cfg.ejection.consecutive_failures = 0;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let n = 6;
    let t0 = Instant::now();
    for i in 0..n {
        let r = stream_all(addr, "/v1/completions", &completion(&format!("q{i}"), 4)).await;
        assert!(r.done && r.error.is_none(), "{status}: request {i}: {r:?}");
    }
    if retry_after_s.is_some() {
        let waited = Duration::from_millis(50) * worker_requests(&sims, 1).await as u32;
        assert!(t0.elapsed() >= waited, "each Retry-After (capped at 50 ms) was waited out: {:?}", t0.elapsed());
    }
    let m = get(addr, "/metrics").await.text();
    let met = worker_requests(&sims, 1).await;
    assert!(met >= 1.0, "round-robin sent some requests to worker 1");
    assert_eq!(counted(&m, RETRIES, &[&format!("reason=\"{reason}\"")]), met, "{status}: one retry per refusal\n{m}");
    assert_eq!(counted(&m, RETRIES, &[]), met, "no other retries");
    let ok2 = counted(&m, "kvroute_requests_total", &["worker=\"2\"", "outcome=\"ok\""]);
    assert_eq!(ok2, f64::from(n), "worker 2 served everything");
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_5xx_and_429_are_retried_on_another_worker_and_retry_after_is_honoured() {
    check_retried_status(500, None, "status_5xx").await;
    check_retried_status(503, Some(1), "status_5xx").await;
    check_retried_status(429, Some(1), "status_429").await;
    check_retried_status(429, None, "status_429").await;
}

/// Generation requests sim-worker `id` received, from its own metrics.
async fn worker_requests(sims: &Sims, id: u64) -> f64 {
    let m = get(sims.workers[id as usize - 1].http_addr(), "/metrics").await.text();
    counted(&m, "kvroute_sim:requests_total", &[])
}

/// Every worker answers 503; the budget holds `budget` retries. The client gets the
/// last worker's 503 as it was, after `min(budget, retries_max)` retries.
async fn check_budget(budget: u32, want_retries: u32) {
    let sims = Sims::start(3).await;
    for id in 1..=3 {
        sims.of(id).set_status(Some(503), None);
    }
    let mut cfg = sims.config();
    cfg.retry.budget_initial = budget;
    cfg.retry.budget_ratio = 0.0;
    cfg.ejection.consecutive_failures = 0;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let a = post(addr, "/v1/completions", &[], &completion("x", 4)).await;
    assert_eq!(a.status, 503, "{}", a.text());
    assert_eq!(a.json()["error"]["message"], "injected failure", "the worker's own answer reaches the client");
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, RETRIES, &[]), f64::from(want_retries), "budget {budget}");
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r2_an_exhausted_budget_returns_the_workers_answer() {
    check_budget(0, 0).await;
    check_budget(1, 1).await;
    check_budget(10, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r3_a_4xx_other_than_429_is_never_retried() {
    let sims = Sims::start(2).await;
    let p = proxy(sims.config()).await;
    let addr = p.local_addr();
    // The sim-worker refuses n > 1 with a 400.
    let mut body = completion("x", 4);
    body["n"] = 2.into();
    let a = post(addr, "/v1/completions", &[], &body).await;
    assert_eq!(a.status, 400, "{}", a.text());
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, RETRIES, &[]), 0.0);
    assert_eq!(counted(&m, "kvroute_upstream_failures_total", &[]), 0.0, "a 400 is not the worker's fault");
    sims.stop().await;
}

/// Scenario from the issue: one wedged worker (accepts, never answers) and one healthy
/// one in round-robin. No request waits for the request timeout: each that met the
/// wedged worker is retried after the first-byte timeout, and the wedged worker is
/// ejected after `consecutive_failures` of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_a_wedged_worker_is_found_by_the_first_byte_timeout_and_ejected() {
    let sims = Sims::start(2).await;
    sims.of(1).set_wedged(true);
    let mut cfg = sims.config();
    cfg.retry.first_byte_timeout_base_ms = 80;
    cfg.retry.first_byte_timeout_per_token_us = 0;
    cfg.retry.budget_initial = 100;
    cfg.ejection.consecutive_failures = 2;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let t0 = Instant::now();
    for i in 0..10 {
        let t = Instant::now();
        let r = stream_all(addr, "/v1/completions", &completion(&format!("w{i}"), 4)).await;
        assert!(r.done && r.error.is_none(), "request {i}: {r:?}");
        assert!(t.elapsed() < Duration::from_secs(2), "request {i} took {:?}", t.elapsed());
    }
    let m = get(addr, "/metrics").await.text();
    assert_eq!(counted(&m, RETRIES, &["reason=\"first_byte_timeout\""]), 2.0, "{m}");
    assert_eq!(health_of(addr, 1).await, "ejected");
    assert_eq!(outlier(addr, 1).await["ejections"], 1);
    eprintln!("10 requests with a wedged worker took {:.0} ms", ms(t0.elapsed()));
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

/// A worker that is only busy is not wedged. One worker runs one request at a time, so
/// a burst queues there and most first bytes come after the first-byte timeout, while the
/// worker keeps serving the ones ahead. Every request is served where it is: no retry,
/// no failure counted, no ejection (which once took out every healthy worker of a fleet
/// overloaded as a whole, and failed nearly all its requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r5_a_busy_worker_past_the_first_byte_timeout_is_waited_for_not_ejected() {
    let engine = EngineConfig { speedup: 1.0, block_size: 16, max_num_seqs: 1, ..EngineConfig::default() };
    let sims = Sims::start_with(1, engine).await;
    let mut cfg = sims.config();
    cfg.retry.first_byte_timeout_base_ms = 150;
    cfg.retry.first_byte_timeout_per_token_us = 0;
    cfg.ejection.consecutive_failures = 2;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let t0 = Instant::now();
    let burst: Vec<_> = (0..6)
        .map(|i| {
            tokio::spawn(async move { stream_all(addr, "/v1/completions", &completion(&format!("b{i}"), 12)).await })
        })
        .collect();
    for (i, h) in burst.into_iter().enumerate() {
        let r = h.await.expect("the client task");
        assert!(r.done && r.error.is_none(), "request {i}: {r:?}");
    }
    let m = get(addr, "/metrics").await.text();
    let extended = counted(&m, "kvroute_first_byte_waits_extended_total", &[]);
    assert!(extended >= 1.0, "the burst outlived the first-byte timeout only if some wait was extended: {m}");
    assert_eq!(counted(&m, RETRIES, &["reason=\"first_byte_timeout\""]), 0.0, "{m}");
    assert_eq!(health_of(addr, 1).await, "healthy");
    assert_eq!(outlier(addr, 1).await["ejections"], 0);
    eprintln!("a burst of 6 on a one-at-a-time worker took {:.0} ms, {extended} waits extended", ms(t0.elapsed()));
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

/// The bug: with hard affinity (the default), a session bound to a worker that
/// ejection took out failed every request. It re-binds, and all its requests succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_hard_session_whose_worker_is_ejected_rebinds_and_succeeds() {
    let sims = Sims::start(2).await;
    let mut cfg = sims.config();
    cfg.ejection.consecutive_failures = 1;
    cfg.retry.budget_initial = 0; // a failure is seen, not retried away
    cfg.retry.budget_ratio = 0.0;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    let session = [("x-session-id", "s")];
    let bound = post(addr, "/v1/completions", &session, &completion("hi", 2)).await;
    assert_eq!(bound.status, 200);
    let home = bound.worker().unwrap();
    // Another client's request meets the worker's failure, which ejects it.
    sims.of(home).set_status(Some(500), None);
    let mut ejected = false;
    for i in 0..2 {
        let a = post(addr, "/v1/completions", &[], &completion(&format!("o{i}"), 2)).await;
        ejected |= a.status == 500;
    }
    assert!(ejected && health_of(addr, home).await == "ejected");
    for i in 0..20 {
        let a = post(addr, "/v1/completions", &session, &completion(&format!("s{i}"), 2)).await;
        assert_eq!(a.status, 200, "request {i} of the session: {}", a.text());
        assert_ne!(a.worker(), Some(home));
    }
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

/// `POST /workers/{id}/drain`: the in-flight stream finishes, `/workers` shows the
/// worker draining with its in-flight count, new requests and the worker's session go
/// elsewhere; with `remove=true` the worker leaves once idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_a_drained_worker_finishes_its_streams_and_takes_nothing_new() {
    let sims = Sims::start(2).await;
    let p = proxy(sims.config()).await;
    let addr = p.local_addr();
    let session = [("x-session-id", "d")];
    // Long enough (about 12 MB of events) that a client reading nothing holds it in
    // flight: the proxy reads from the worker only as fast as the client takes.
    let mut held = Events::open(addr, "/v1/completions", &session, &completion("held", 60_000)).await;
    let home = held.worker.unwrap();
    assert!(held.next().await.is_some(), "the stream started");

    let d = post_empty(addr, &format!("/workers/{home}/drain")).await;
    assert_eq!(d.status, 202, "{}", d.text());
    let w = get(addr, "/workers").await.json();
    let row = w["workers"].as_array().unwrap().iter().find(|w| w["id"] == home).unwrap().clone();
    assert_eq!((row["health"].as_str(), row["in_flight"].as_u64()), (Some("draining"), Some(1)), "{row}");
    for i in 0..4 {
        let a = post(addr, "/v1/completions", &[], &completion(&format!("n{i}"), 2)).await;
        assert_eq!((a.status.as_u16(), a.worker().is_some_and(|w| w != home)), (200, true), "{}", a.text());
    }
    let moved = post(addr, "/v1/completions", &session, &completion("again", 2)).await;
    let other = 3 - home;
    assert_eq!(
        (moved.status.as_u16(), moved.worker()),
        (200, Some(other)),
        "re-bound away from the drain: {}",
        moved.text()
    );
    let rest = read(&held.rest().await);
    assert!(rest.done && rest.error.is_none(), "the in-flight stream finished: {rest:?}");

    let again = post_empty(addr, &format!("/workers/{home}/drain?remove=true")).await;
    assert_eq!(again.status, 202);
    eventually(5_000, "the drained worker is removed", || async move {
        let w = get(addr, "/workers").await.json();
        w["workers"].as_array().unwrap().iter().all(|w| w["id"] != home)
    })
    .await;
    assert_eq!(post_empty(addr, "/workers/99/drain").await.status, 404);
    assert_eq!(post_empty(addr, "/workers/1/drain?remove=maybe").await.status, 400);
    eventually(5_000, "released", || released(addr)).await;
    sims.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_drain_is_for_trusted_clients_only() {
    let sims = Sims::start(1).await;
    let mut cfg = sims.config();
    cfg.trust.cidrs.clear();
    let p = proxy(cfg).await;
    let a = call(p.local_addr(), Method::POST, "/workers/1/drain", &[], None).await;
    assert_eq!(a.status, 403);
    sims.stop().await;
}

/// A draining worker that fails, is ejected, and then passes its readmission probe and
/// the active health checks stays draining: it takes nothing new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_a_draining_worker_stays_draining_through_passing_health_probes() {
    let fake = Fake::start(&[MODEL]).await;
    let sims = Sims::start(1).await;
    let mut cfg = config(&[(1, fake.addr), (2, sims.workers[0].http_addr())]);
    cfg.health_check.interval_ms = 30;
    cfg.ejection.consecutive_failures = 1;
    cfg.ejection.base_ms = 30;
    cfg.ejection.max_ms = 30;
    let p = proxy(cfg).await;
    let addr = p.local_addr();
    assert_eq!(post_empty(addr, "/workers/1/drain").await.status, 202);
    // A failed check ejects it; the readmission probe and the checks then pass.
    fake.set_healthy(false);
    eventually(5_000, "the draining worker is ejected", || async { outlier(addr, 1).await["ejections"] == 1 }).await;
    fake.set_healthy(true);
    let probed = fake.probes().len();
    eventually(5_000, "readmitted by a passing probe, then checked again", || async {
        fake.probes().len() >= probed + 3 && outlier(addr, 1).await["ejected"] == false
    })
    .await;
    assert_eq!(health_of(addr, 1).await, "draining", "a passing probe does not end a drain");
    for i in 0..4 {
        let a = post(addr, "/v1/completions", &[], &completion(&format!("d{i}"), 2)).await;
        assert_eq!((a.status.as_u16(), a.worker()), (200, Some(2)), "{}", a.text());
    }
    assert!(fake.seen().is_empty(), "the draining worker got no request");
    sims.stop().await;
}
