//! Driver scenarios on paused tokio time: nothing here sleeps for real.

mod lifecycle;
mod replicas;
mod timers;

use kvroute_driver::{Driver, DriverConfig, Request, RouterConfig};
use router_core::{RouterMode, SeqHash, WorkerId, WorkerRole, WorkerSpec};

/// A driver over `workers` aggregated workers; `tweak` adjusts the router config first.
pub fn driver(workers: u64, tweak: impl FnOnce(&mut RouterConfig)) -> Driver {
    let mut router = RouterConfig { mode: RouterMode::RoundRobin, ..RouterConfig::default() };
    tweak(&mut router);
    let d = Driver::new(DriverConfig { router, draw_seed: 7 });
    for w in 0..workers {
        d.upsert_worker(WorkerSpec::new(WorkerId(w), WorkerRole::Aggregated)).unwrap();
    }
    d
}

/// One worker that counts as busy once it has more than 100 prefill tokens queued.
pub fn tiny_fleet(tweak: impl FnOnce(&mut RouterConfig)) -> Driver {
    driver(1, |c| {
        c.eligibility.prefill_tokens_max = Some(100);
        c.eligibility.prefill_tokens_frac_of_batch = None;
        tweak(c);
    })
}

/// A request of `blocks` 64-token blocks, in `session` if given.
pub fn req(d: &Driver, blocks: u64, session: Option<&str>) -> Request {
    Request {
        id: d.next_request_id(),
        blocks: (0..blocks).map(|b| SeqHash(b + 1)).collect(),
        isl_tokens: blocks as u32 * 64,
        session: session.map(|s| s.as_bytes().to_vec()),
        ..Request::default()
    }
}

/// Lets spawned tasks run until `cond` holds; fails instead of hanging.
pub async fn settle(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never settled: {what}");
}

/// Nothing is held any more: no load, lease, queue slot or tracked request.
#[track_caller]
pub fn check_released(d: &Driver) {
    d.check_invariants().unwrap();
    let s = d.snapshot();
    assert_eq!(s.requests_in_flight, 0, "requests still tracked: {s:?}");
    assert_eq!(s.queue_depth, 0);
    assert_eq!(s.affinity_live_leases, 0);
    assert_eq!(s.load_total, router_core::WorkerLoad::default());
    assert_eq!(s.driver.waiters, 0);
}
