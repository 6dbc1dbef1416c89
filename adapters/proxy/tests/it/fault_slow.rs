//! Fault injection, a worker gone slow (issue #8, scenario 3): timeouts count against
//! the worker, eject it, leave the other workers' sessions alone, and one probe after
//! the back-off readmits it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use router_core::AffinityMode;
use tokio::time::Instant;

use crate::fault_common::{health_of, metric};
use crate::*;

/// One request's fate, as a session saw it.
#[derive(Clone, Copy, Debug)]
struct Outcome {
    status: u16,
    worker: Option<u64>,
    took: Duration,
}

/// Sends requests for `session` one after another: `count` of them, or until `stop`.
async fn session_loop(
    addr: std::net::SocketAddr,
    session: String,
    count: usize,
    stop: Arc<AtomicBool>,
) -> Vec<Outcome> {
    let mut out = Vec::new();
    while out.len() < count && !stop.load(Ordering::Relaxed) {
        let t0 = Instant::now();
        let a = post(addr, "/v1/chat/completions", &[("x-session-id", &session)], &chat(&session)).await;
        out.push(Outcome { status: a.status.as_u16(), worker: a.worker(), took: t0.elapsed() });
    }
    out
}

/// Runs `sessions` session loops at once; the outcomes come back per session.
async fn run_sessions(
    addr: std::net::SocketAddr,
    sessions: usize,
    count: usize,
    stop: Arc<AtomicBool>,
) -> Vec<Vec<Outcome>> {
    let loops = (0..sessions).map(|s| tokio::spawn(session_loop(addr, format!("s{s}"), count, stop.clone())));
    let loops: Vec<_> = loops.collect();
    let mut out = Vec::new();
    for l in loops {
        out.push(within(30_000, l).await.unwrap());
    }
    out
}

/// The median time of the requests of `sessions`.
fn median(outcomes: &[Vec<Outcome>], sessions: &[usize]) -> Duration {
    let mut t: Vec<Duration> = sessions.iter().flat_map(|&s| outcomes[s].iter().map(|o| o.took)).collect();
    assert!(!t.is_empty(), "some requests were sent");
    t.sort();
    t[t.len() / 2]
}

/// Scenario 3. Three workers answer in 50 ms; worker 1 becomes 10x slow (500 ms) while
/// `request_timeout_ms` is 400 ms. Pass criteria:
/// * worker 1 is ejected after `consecutive_failures` (2) timeouts, once;
/// * requests served by the other workers all succeed, and their median time stays
///   within 3x (+100 ms of slack) of the median measured before the slow-down;
/// * no request reaches worker 1 while it is ejected;
/// * after the back-off exactly one probe reaches it, no sooner than the back-off after
///   the slow-down's first timeouts, and it readmits the worker.
#[tokio::test]
async fn f3_a_worker_gone_10x_slow_is_ejected_others_keep_their_latency_and_one_probe_readmits_it() {
    let (service_ms, timeout_ms, base_ms) = (50, 400, 2_000);
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    for f in &fakes {
        f.set(Behavior::Delayed { ms: service_ms, chunks: sse_chunks(2) });
    }
    let mut cfg = config(&[(1, fakes[0].addr), (2, fakes[1].addr), (3, fakes[2].addr)]);
    cfg.limits.request_timeout_ms = timeout_ms;
    cfg.ejection.consecutive_failures = 2;
    cfg.ejection.base_ms = base_ms;
    cfg.ejection.max_ms = 10_000;
    cfg.router.affinity_mode.0 = AffinityMode::Soft; // sessions of an ejected worker move
    let p = start(cfg).await;
    let addr = p.local_addr();
    let sessions = 6;

    let before = run_sessions(addr, sessions, 3, Arc::new(AtomicBool::new(false))).await;
    assert!(before.iter().flatten().all(|o| o.status == 200), "{before:?}");
    // Sessions stick: each lives on the worker of its first request.
    let home: Vec<u64> = before.iter().map(|o| o[0].worker.unwrap()).collect();
    assert!(before.iter().zip(&home).all(|(o, h)| o.iter().all(|o| o.worker == Some(*h))), "{before:?}");
    let elsewhere: Vec<usize> = (0..sessions).filter(|&s| home[s] != 1).collect();
    assert!(elsewhere.len() < sessions, "some sessions live on worker 1: {home:?}");
    let baseline = median(&before, &elsewhere);

    let slowed = Instant::now();
    fakes[0].set(Behavior::Delayed { ms: 10 * service_ms, chunks: sse_chunks(2) });
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = tokio::spawn(run_sessions(addr, sessions, 500, stop.clone()));
    eventually(10_000, "worker 1 is ejected", || async { health_of(addr, 1).await == "ejected" }).await;
    let ejected_seen = Instant::now();
    // The worker recovers; the probe after the back-off finds it well and readmits it.
    fakes[0].set(Behavior::Delayed { ms: service_ms, chunks: sse_chunks(2) });
    eventually(10_000, "one probe readmits worker 1", || async { health_of(addr, 1).await == "healthy" }).await;
    stop.store(true, Ordering::Relaxed);
    let during = within(10_000, traffic).await.unwrap();

    for &s in &elsewhere {
        assert!(during[s].iter().all(|o| o.status == 200), "sessions elsewhere never suffer: {:?}", during[s]);
    }
    let slowed_median = median(&during, &elsewhere);
    assert!(
        slowed_median <= baseline * 3 + Duration::from_millis(100),
        "other workers' latency went from {baseline:?} to {slowed_median:?}"
    );
    let m = get(addr, "/metrics").await.text();
    let timeouts = metric(&m, "kvroute_upstream_failures_total", &["worker=\"1\"", "kind=\"timeout\""]);
    assert!(timeouts >= 2.0, "the timeouts counted against worker 1: {timeouts}");
    assert_eq!(metric(&m, "kvroute_worker_ejections_total", &["worker=\"1\""]), 1.0);
    for (i, f) in fakes.iter().enumerate().skip(1) {
        assert_eq!(metric(&m, "kvroute_worker_ejections_total", &[&format!("worker=\"{}\"", i + 1)]), 0.0);
        assert!(f.probes().is_empty(), "healthy workers are not probed (active checks are off)");
    }

    let probes = fakes[0].probes();
    assert_eq!(probes.len(), 1, "exactly one probe after the back-off");
    // The ejecting timeouts end no sooner than `timeout_ms` after the slow-down.
    let earliest = slowed + Duration::from_millis(timeout_ms + base_ms);
    assert!(probes[0] >= earliest, "the probe came {:?} early", earliest - probes[0]);
    // Requests already on their way when the worker was ejected may still land (a busy
    // machine delays them); none after that slack, for the rest of the back-off.
    let quiet_from = ejected_seen + Duration::from_millis(500);
    let landed: Vec<_> = fakes[0].seen().iter().map(|s| s.at).filter(|&at| at > quiet_from && at < probes[0]).collect();
    assert!(landed.is_empty(), "{} requests reached worker 1 while it was ejected", landed.len());
    eventually(10_000, "released", || released(addr)).await;
}
