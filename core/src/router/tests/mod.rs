//! Façade scenarios. Each test drives the router through its public inputs and checks
//! the global invariants after every step.

mod contract;
mod session_start;
mod shared_prefix;
mod tokens;
mod warmth;

use alloc::vec;
use alloc::vec::Vec;

use super::*;
use crate::hash::SeqHash;
use crate::pin::RoutingHints;
use crate::worker::{WorkerRole, WorkerSpec};
use crate::WorkerLoad;

const T0: Instant = Instant::ZERO;

fn spec(id: u64, role: WorkerRole) -> WorkerSpec {
    WorkerSpec::new(WorkerId(id), role)
}

fn router(mode: RouterMode, workers: u64) -> Router {
    router_with(RouterConfig { mode, ..RouterConfig::default() }, workers)
}

/// A router on `cfg` with aggregated workers `0..workers`.
fn router_with(cfg: RouterConfig, workers: u64) -> Router {
    let mut r = Router::new(cfg);
    for w in 0..workers {
        r.handle_worker_update(T0, WorkerUpdate::Upsert(spec(w, WorkerRole::Aggregated))).unwrap();
    }
    r
}

fn req(id: u64, blocks: &[u64]) -> Request {
    Request {
        id: RequestId(id),
        blocks: blocks.iter().map(|&b| SeqHash(b)).collect(),
        isl_tokens: blocks.len() as u32 * 64,
        ..Request::default()
    }
}

/// A one-block request in session `session`.
fn session_req(id: u64, session: &[u8]) -> Request {
    Request { session: Some(session.to_vec()), ..req(id, &[1]) }
}

/// Worker `worker` (rank 0) reports storing blocks `seqs`, each block's local hash
/// equal to its sequence hash.
fn store(r: &mut Router, worker: u64, seqs: core::ops::RangeInclusive<u64>) {
    let blocks: Vec<BlockHash> = seqs.map(|b| BlockHash { seq: SeqHash(b), local: LocalHash(b) }).collect();
    let event = IndexEvent::Stored { parent: None, blocks: &blocks, tier: Tier::Device };
    r.handle_kv_event(T0, WorkerKey::new(worker, 0), event).unwrap();
}

#[track_caller]
fn routed(d: Result<Decision, RouteError>) -> Routed {
    match d {
        Ok(Decision::Routed(r)) => r,
        other => panic!("expected a routed decision, got {other:?}"),
    }
}

#[track_caller]
fn invariants(r: &Router) {
    if let Err(v) = r.check_invariants() {
        panic!("invariant violated: {}", v.0);
    }
}

/// Snapshot of everything a rolled-back or previewed decision must leave untouched.
fn fingerprint(r: &Router) -> (usize, usize, usize, usize, u64, Vec<WorkerLoad>) {
    let loads = r.workers.keys().map(|k| r.load.local().load(k)).collect();
    (r.requests_in_flight(), r.affinity.len(), r.queue.len(), r.load.local().len(), r.stats().dispatched, loads)
}

const MODES: [RouterMode; 6] = [
    RouterMode::Random,
    RouterMode::RoundRobin,
    RouterMode::PowerOfTwo,
    RouterMode::LeastLoaded,
    RouterMode::Weighted,
    RouterMode::Kv,
];

#[test]
fn rollback_leaves_no_trace_in_every_mode() {
    for mode in MODES.into_iter().chain([RouterMode::Direct]) {
        let mut r = router(mode, 3);
        let before = fingerprint(&r);
        let mut q = req(1, &[1, 2, 3]);
        q.session = Some(b"s1".to_vec());
        if mode == RouterMode::Direct {
            q.hints.backend_instance_id = Some(WorkerId(2));
        }
        let d = routed(r.handle_request(T0, q.clone(), Draw(7)));
        invariants(&r);
        // A prepare step (say, building transfer metadata) fails after selection.
        r.handle_dispatch_failed(T0, d.id, d.phase, DispatchFailure::Worker).unwrap();
        invariants(&r);
        assert_eq!(fingerprint(&r), before, "{mode:?}: rollback must restore every table");
        assert_eq!(r.affinity.peek(b"s1", Phase::Aggregated), None, "{mode:?}: no binding survives a rollback");
    }
}

#[test]
fn preview_changes_nothing() {
    for mode in MODES {
        let mut r = router(mode, 4);
        let _ = routed(r.handle_request(T0, req(1, &[1, 2]), Draw(1)));
        let before = fingerprint(&r);
        let mut p = req(2, &[1, 2, 3]);
        p.preview = true;
        p.session = Some(b"s".to_vec());
        let a = routed(r.handle_request(T0, p.clone(), Draw(5)));
        let b = routed(r.handle_request(T0, p, Draw(5)));
        assert!(a.preview);
        assert_eq!(a.target, b.target, "{mode:?}: a preview is repeatable (round-robin does not advance)");
        assert_eq!(fingerprint(&r), before, "{mode:?}");
        invariants(&r);
    }
}

#[test]
fn kv_mode_follows_the_cache() {
    let mut r = router(RouterMode::Kv, 4);
    store(&mut r, 2, 1..=8);
    let d = routed(r.handle_request(T0, req(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9]), Draw(0)));
    assert_eq!(d.target, WorkerKey::new(2, 0));
    assert_eq!(d.overlap.device, 8);
    assert_eq!(d.max_overlap_blocks, 8);
    assert_eq!(d.explanation.len(), 4, "every candidate is explained");
}

#[test]
fn finishing_releases_everything() {
    let mut r = router(RouterMode::Kv, 2);
    let mut q = req(1, &[1, 2]);
    q.session = Some(b"sess".to_vec());
    let d = routed(r.handle_request(T0, q.clone(), Draw(0)));
    r.handle_dispatched(T0, d.id, d.phase).unwrap();
    assert_eq!(r.affinity.peek(b"sess", Phase::Aggregated).map(|b| b.worker), Some(d.target.worker));
    assert_eq!(r.load.local().load(d.target).active_requests, 1);
    r.handle_prefill_done(T0, d.id, d.phase).unwrap();
    assert_eq!(r.load.local().load(d.target).active_prefill_tokens, 0);
    r.handle_finished(T0, d.id, d.phase).unwrap();
    invariants(&r);
    assert_eq!(r.load.local().load(d.target), WorkerLoad::default());
    assert_eq!(r.requests_in_flight(), 0);
    assert_eq!(r.affinity.live_leases(), 0);
    // The session stays bound after its stream ends, until the idle TTL.
    let d2 = routed(r.handle_request(
        T0,
        {
            let mut q = req(2, &[9]);
            q.session = Some(b"sess".to_vec());
            q
        },
        Draw(99),
    ));
    assert_eq!(d2.target, d.target);
    assert!(matches!(r.handle_finished(T0, RequestId(77), Phase::Aggregated), Err(InputError::UnknownRequest { .. })));
}

#[test]
fn second_request_of_a_new_session_waits_for_the_first() {
    let mut r = router(RouterMode::RoundRobin, 3);
    let s = |id| session_req(id, b"chat");
    let first = routed(r.handle_request(T0, s(1), Draw(0)));
    assert_eq!(r.handle_request(T0, s(2), Draw(0)), Ok(Decision::Waiting));
    invariants(&r);
    r.handle_dispatched(T0, first.id, first.phase).unwrap();
    match r.poll_output() {
        Some(Output::Routed(d)) => {
            assert_eq!(d.id, RequestId(2));
            assert_eq!(d.target, first.target, "the waiter follows the committed binding");
        }
        other => panic!("expected the waiter to be routed, got {other:?}"),
    }
    invariants(&r);
}

#[test]
fn removing_a_worker_rebinds_its_sessions() {
    let mut r = router(RouterMode::RoundRobin, 2);
    let s = |id| session_req(id, b"s");
    let d = routed(r.handle_request(T0, s(1), Draw(0)));
    r.handle_dispatched(T0, d.id, d.phase).unwrap();
    r.handle_worker_update(T0, WorkerUpdate::Removed(d.target.worker)).unwrap();
    invariants(&r);
    r.handle_finished(T0, d.id, d.phase).unwrap();
    let d2 = routed(r.handle_request(T0, s(2), Draw(0)));
    assert_ne!(d2.target.worker, d.target.worker);
    invariants(&r);
}

#[test]
fn direct_mode_requires_a_target() {
    let mut r = router(RouterMode::Direct, 2);
    let e = r.handle_request(T0, req(1, &[1]), Draw(0)).unwrap_err();
    assert_eq!(alloc::format!("{e}"), "worker ID required for aggregated request in Direct routing mode");
    assert_eq!(r.requests_in_flight(), 0);
}

#[test]
fn busy_fleet_queues_then_dequeues_when_load_drops() {
    let mut cfg = RouterConfig { mode: RouterMode::Kv, ..RouterConfig::default() };
    cfg.eligibility.prefill_tokens_max = Some(100);
    cfg.eligibility.prefill_tokens_frac_of_batch = None;
    let mut r = Router::new(cfg);
    r.handle_worker_update(T0, WorkerUpdate::Upsert(spec(0, WorkerRole::Aggregated))).unwrap();
    let a = routed(r.handle_request(T0, req(1, &[1, 2, 3]), Draw(0)));
    r.handle_dispatched(T0, a.id, a.phase).unwrap();
    assert_eq!(r.handle_request(T0, req(2, &[4, 5]), Draw(0)), Ok(Decision::Queued));
    invariants(&r);
    r.handle_prefill_done(T0, a.id, a.phase).unwrap();
    match r.poll_output() {
        Some(Output::Routed(d)) => assert_eq!(d.id, RequestId(2)),
        other => panic!("expected the queued request to be routed, got {other:?}"),
    }
    invariants(&r);
    // A queued request that is cancelled frees its slot.
    assert_eq!(r.handle_request(T0, req(3, &[6]), Draw(0)), Ok(Decision::Queued));
    r.handle_cancel(T0, RequestId(3), Phase::Aggregated).unwrap();
    assert_eq!(r.queue.len(), 0);
    invariants(&r);
    // And one that waits too long times out through handle_timeout.
    assert_eq!(r.handle_request(T0, req(4, &[7]), Draw(0)), Ok(Decision::Queued));
    let t = r.poll_timeout().expect("a queue deadline");
    r.handle_timeout(t);
    assert!(vec![r.poll_output()]
        .into_iter()
        .flatten()
        .any(|o| o == Output::TimedOut { id: RequestId(4), phase: Phase::Aggregated }));
    invariants(&r);
}

use crate::hash::{BlockHash, LocalHash};
use crate::index::IndexEvent;
use crate::Tier;

#[test]
fn duplicate_and_unknown_ids_are_typed() {
    let mut r = router(RouterMode::Kv, 1);
    let _ = routed(r.handle_request(T0, req(1, &[1]), Draw(0)));
    assert_eq!(
        r.handle_request(T0, req(1, &[1]), Draw(0)),
        Err(RouteError::DuplicateRequest { id: RequestId(1), phase: Phase::Aggregated })
    );
    assert!(matches!(r.handle_dispatched(T0, RequestId(9), Phase::Aggregated), Err(InputError::UnknownRequest { .. })));
    assert_eq!(r.stats().unknown_requests, 1);
    let _ = RoutingHints::default();
    invariants(&r);
}

#[test]
fn untrusted_overlap_earns_no_credit() {
    let mut r = router(RouterMode::Kv, 2);
    store(&mut r, 1, 1..=8);
    let hot = WorkerKey::new(1, 0);
    let q = |id| {
        let mut q = req(id, &[1, 2, 3, 4, 5, 6, 7, 8]);
        q.preview = true;
        q
    };
    assert_eq!(routed(r.handle_request(T0, q(1), Draw(0))).target, hot);
    r.handle_overlap_trust(hot, false);
    let d = routed(r.handle_request(T0, q(2), Draw(0)));
    let row = d.explanation.iter().find(|e| e.key == hot).unwrap();
    assert_eq!(row.score.unwrap().overlap_effective, 0.0, "a worker with a stream gap gets no prefix credit");
    r.handle_overlap_trust(hot, true);
    assert_eq!(routed(r.handle_request(T0, q(3), Draw(0))).target, hot);
    r.handle_kv_clear(hot);
    let d = routed(r.handle_request(T0, q(4), Draw(0)));
    assert_eq!(d.max_overlap_blocks, 0, "a cleared worker holds nothing");
}

/// A disaggregated fleet: prefill workers 10 and 11, decode workers 20 and 21; worker 11
/// and 21 share rack "b".
fn disagg_router() -> Router {
    let mut r = Router::new(RouterConfig { mode: RouterMode::Kv, ..RouterConfig::default() });
    for (id, role, rack) in [
        (10, WorkerRole::Prefill, "a"),
        (11, WorkerRole::Prefill, "b"),
        (20, WorkerRole::Decode, "a"),
        (21, WorkerRole::Decode, "b"),
    ] {
        let mut s = spec(id, role);
        s.labels = vec![("rack".into(), rack.into())];
        r.handle_worker_update(T0, WorkerUpdate::Upsert(s)).unwrap();
    }
    r
}

fn long_req(id: u64, blocks: u64) -> Request {
    req(id, &(1..=blocks).collect::<Vec<_>>())
}

#[test]
fn disagg_plans_split_and_bypass() {
    let mut r = disagg_router();
    // (prompt blocks, cached blocks on prefill worker 10, expected plan)
    let cases: &[(u64, u64, DisaggPlan)] = &[
        (64, 0, DisaggPlan::Split),
        (31, 0, DisaggPlan::Bypass(BypassReason::ShortPrompt { effective_isl_tokens: 31 * 64 })),
        (64, 40, DisaggPlan::Bypass(BypassReason::ShortPrompt { effective_isl_tokens: 24 * 64 })),
        (64, 32, DisaggPlan::Split),
    ];
    for (i, &(blocks, cached, want)) in cases.iter().enumerate() {
        let mut r2 = disagg_router();
        let stored: Vec<BlockHash> = (1..=cached).map(|b| BlockHash { seq: SeqHash(b), local: LocalHash(b) }).collect();
        r2.handle_kv_event(
            T0,
            WorkerKey::new(10, 0),
            IndexEvent::Stored { parent: None, blocks: &stored, tier: Tier::Device },
        )
        .unwrap();
        assert_eq!(r2.plan_disagg(&long_req(i as u64, blocks)), want, "case {i}");
    }
    assert_eq!(r.plan_disagg(&long_req(1, 64)), DisaggPlan::Split);
    r.handle_worker_update(T0, WorkerUpdate::Health(WorkerId(10), crate::worker::Health::Ejected)).unwrap();
    r.handle_worker_update(T0, WorkerUpdate::Health(WorkerId(11), crate::worker::Health::Draining)).unwrap();
    assert_eq!(r.plan_disagg(&long_req(2, 64)), DisaggPlan::Bypass(BypassReason::NoPrefillWorkers));
    let s = r.disagg_stats();
    assert_eq!((s.split, s.bypass_no_prefill_workers), (1, 1));
}

#[test]
fn disagg_prefill_busy_bypasses() {
    let mut cfg = RouterConfig::default();
    cfg.eligibility.prefill_tokens_max = Some(1000);
    let mut r = Router::new(cfg);
    r.handle_worker_update(T0, WorkerUpdate::Upsert(spec(10, WorkerRole::Prefill))).unwrap();
    r.handle_worker_update(T0, WorkerUpdate::Upsert(spec(20, WorkerRole::Decode))).unwrap();
    let mut p = long_req(1, 64);
    p.phase = PhaseField(Phase::Prefill);
    let _ = routed(r.handle_request(T0, p, Draw(0)));
    assert_eq!(r.plan_disagg(&long_req(2, 64)), DisaggPlan::Bypass(BypassReason::PrefillBusy));
    assert_eq!(r.disagg_stats().bypass_prefill_busy, 1);
}

#[test]
fn phases_use_their_own_pools_pins_and_bindings() {
    let mut r = disagg_router();
    let phase_req = |id, phase, session: &[u8]| {
        let mut q = long_req(id, 40);
        q.phase = PhaseField(phase);
        q.session = Some(session.to_vec());
        q
    };
    let p = routed(r.handle_request(T0, phase_req(1, Phase::Prefill, b"s"), Draw(1)));
    let d = routed(r.handle_request(T0, phase_req(1, Phase::Decode, b"s"), Draw(2)));
    assert!([10, 11].contains(&p.target.worker.0), "prefill goes to the prefill pool");
    assert!([20, 21].contains(&d.target.worker.0), "decode goes to the decode pool");
    for x in [&p, &d] {
        r.handle_dispatched(T0, x.id, x.phase).unwrap();
    }
    let bound = |r: &Router, ph| r.affinity.peek(b"s", ph).map(|b| b.worker.0);
    assert_eq!(bound(&r, Phase::Prefill), Some(p.target.worker.0));
    assert_eq!(bound(&r, Phase::Decode), Some(d.target.worker.0));
    // A bypassed request runs aggregated on a decode worker.
    let a = routed(r.handle_request(T0, long_req(5, 10), Draw(3)));
    assert!([20, 21].contains(&a.target.worker.0));
    // Per-phase pins are independent.
    let mut q = long_req(6, 40);
    q.phase = PhaseField(Phase::Prefill);
    q.hints.prefill_worker_id = Some(WorkerId(11));
    q.hints.decode_worker_id = Some(WorkerId(20));
    assert_eq!(routed(r.handle_request(T0, q.clone(), Draw(0))).target.worker.0, 11);
    q.phase = PhaseField(Phase::Decode);
    assert_eq!(routed(r.handle_request(T0, q, Draw(0))).target.worker.0, 20);
    invariants(&r);
}

#[test]
fn decode_gets_no_prefix_credit_and_honours_topology() {
    let mut r = disagg_router();
    let cached: Vec<BlockHash> = (1..=40).map(|b| BlockHash { seq: SeqHash(b), local: LocalHash(b) }).collect();
    // Decode worker 21 holds the prompt; decode selection must not care.
    r.handle_kv_event(
        T0,
        WorkerKey::new(21, 0),
        IndexEvent::Stored { parent: None, blocks: &cached, tier: Tier::Device },
    )
    .unwrap();
    let mut q = long_req(1, 40);
    q.phase = PhaseField(Phase::Decode);
    q.preview = true;
    let d = routed(r.handle_request(T0, q.clone(), Draw(0)));
    let costs: Vec<f64> = d.explanation.iter().filter_map(|e| e.score.map(|s| s.cost)).collect();
    assert_eq!(costs.len(), 2);
    assert_eq!(costs[0], costs[1], "decode costs ignore the cache");
    q.same_label_as = Some(("rack".into(), "a".into()));
    for draw in 0..8 {
        assert_eq!(routed(r.handle_request(T0, q.clone(), Draw(draw))).target.worker.0, 20, "only rack a");
    }
}

#[test]
fn failed_workers_are_excluded_until_none_are_left() {
    let mut r = router(RouterMode::RoundRobin, 2);
    let mut q = req(1, &[1]);
    q.failed_workers = vec![WorkerId(0)];
    for id in 1..5 {
        q.id = RequestId(id);
        q.preview = true;
        assert_eq!(routed(r.handle_request(T0, q.clone(), Draw(id))).target.worker, WorkerId(1));
    }
    q.failed_workers = vec![WorkerId(0), WorkerId(1)];
    let e = r.handle_request(T0, q.clone(), Draw(0)).unwrap_err();
    assert!(
        matches!(e, RouteError::Eligibility(crate::eligible::EligibilityError::MigrationExhausted { .. })),
        "{e:?}"
    );
    // An explicit pin overrides the failure record.
    q.hints.backend_instance_id = Some(WorkerId(0));
    assert_eq!(routed(r.handle_request(T0, q, Draw(0))).target.worker, WorkerId(0));
}

#[test]
fn approximate_mode_predicts_silent_workers_and_keeps_exact_ones() {
    let mut r = router_with(RouterConfig { mode: RouterMode::Kv, approximate: true, ..RouterConfig::default() }, 3);
    // Worker 2 publishes events and holds blocks 1..=4 exactly.
    let stored: Vec<BlockHash> = (1..=4).map(|b| BlockHash { seq: SeqHash(b), local: LocalHash(b) }).collect();
    r.handle_kv_event(
        T0,
        WorkerKey::new(2, 0),
        IndexEvent::Stored { parent: None, blocks: &stored, tier: Tier::Device },
    )
    .unwrap();
    // A request for blocks 10..=17 lands on silent worker 1 and is confirmed: a prediction.
    let mut pinned = req(1, &[10, 11, 12, 13, 14, 15, 16, 17]);
    pinned.hints.backend_instance_id = Some(WorkerId(1));
    let first = routed(r.handle_request(T0, pinned, Draw(0)));
    r.handle_dispatched(T0, first.id, first.phase).unwrap();
    r.handle_finished(T0, first.id, first.phase).unwrap();
    let mut q = req(2, &[10, 11, 12, 13, 14, 15, 16, 17]);
    q.preview = true;
    let d = routed(r.handle_request(T0, q, Draw(0)));
    assert_eq!(d.target, first.target, "the predicted cache attracts the repeat");
    assert_eq!(d.overlap.device, 8);
    let mut q = req(3, &[1, 2, 3, 4]);
    q.preview = true;
    let d = routed(r.handle_request(T0, q, Draw(0)));
    assert_eq!((d.target, d.overlap.device), (WorkerKey::new(2, 0), 4), "exact overlaps survive the merge");
}

#[test]
fn a_hard_binding_to_a_reshaped_worker_starts_over() {
    let mut r = router(RouterMode::RoundRobin, 2);
    let s = |id| session_req(id, b"s");
    let d = routed(r.handle_request(T0, s(1), Draw(0)));
    r.handle_dispatched(T0, d.id, d.phase).unwrap();
    r.handle_finished(T0, d.id, d.phase).unwrap();
    // The bound worker comes back as a prefill worker: it can never serve this session.
    r.handle_worker_update(T0, WorkerUpdate::Upsert(spec(d.target.worker.0, WorkerRole::Prefill))).unwrap();
    let d2 = routed(r.handle_request(T0, s(2), Draw(0)));
    assert_ne!(d2.target.worker, d.target.worker, "the session re-binds instead of failing forever");
    invariants(&r);
}

/// What happens to a session's bound worker before the session's next request.
#[derive(Clone, Copy, Debug)]
enum Gone {
    Ejected,
    Draining,
    Removed,
}

/// A session bound to worker 0 (of two) in `mode`; worker 0 is then `gone`. The next
/// request carries an explicit pin to worker 0 when `pinned`. `rebinds` says whether it
/// routes to worker 1 (and the session's binding follows), else it fails with a pin error
/// and the binding is left as it was.
#[track_caller]
fn check_gone_worker(mode: crate::affinity::AffinityMode, gone: Gone, pinned: bool, rebinds: bool) {
    let mut cfg = RouterConfig { mode: RouterMode::RoundRobin, ..RouterConfig::default() };
    cfg.affinity.mode = mode;
    let mut r = router_with(cfg, 2);
    let d = routed(r.handle_request(T0, session_req(1, b"s"), Draw(0)));
    assert_eq!(d.target.worker, WorkerId(0));
    r.handle_dispatched(T0, d.id, d.phase).unwrap();
    r.handle_finished(T0, d.id, d.phase).unwrap();
    let update = match gone {
        Gone::Ejected => WorkerUpdate::Health(WorkerId(0), crate::worker::Health::Ejected),
        Gone::Draining => WorkerUpdate::Health(WorkerId(0), crate::worker::Health::Draining),
        Gone::Removed => WorkerUpdate::Removed(WorkerId(0)),
    };
    r.handle_worker_update(T0, update).unwrap();
    let mut next = session_req(2, b"s");
    if pinned {
        next.hints.backend_instance_id = Some(WorkerId(0));
    }
    let out = r.handle_request(T0, next, Draw(0));
    let case = alloc::format!("{mode:?} {gone:?} pinned={pinned}");
    if rebinds {
        let d2 = routed(out);
        assert_eq!(d2.target.worker, WorkerId(1), "{case}");
        r.handle_dispatched(T0, d2.id, d2.phase).unwrap();
        assert_eq!(r.session_binding(b"s", Phase::Aggregated).map(|b| b.worker), Some(WorkerId(1)), "{case}");
    } else {
        assert!(matches!(out, Err(RouteError::Pin(_))), "{case}: {out:?}");
    }
    invariants(&r);
}

#[test]
fn a_session_whose_worker_is_gone_rebinds_in_both_modes_and_explicit_pins_stay_strict() {
    use crate::affinity::AffinityMode::{Hard, Soft};
    for mode in [Hard, Soft] {
        for gone in [Gone::Ejected, Gone::Draining, Gone::Removed] {
            check_gone_worker(mode, gone, false, true);
            check_gone_worker(mode, gone, true, false);
        }
    }
}

#[test]
fn a_request_that_fails_before_its_worker_does_not_renew_the_session() {
    let ttl_ms = RouterConfig::default().affinity.lease_ttl_ms;
    let mut r = router(RouterMode::RoundRobin, 2);
    let d = routed(r.handle_request(T0, session_req(1, b"s"), Draw(0)));
    r.handle_dispatched(T0, d.id, d.phase).unwrap();
    r.handle_finished(T0, d.id, d.phase).unwrap();
    // Half-way through the idle time, a request of the session pins a worker that is gone.
    let half = T0.add_ms(ttl_ms / 2);
    let other = WorkerId(1 - d.target.worker.0);
    r.handle_worker_update(half, WorkerUpdate::Health(other, crate::worker::Health::Ejected)).unwrap();
    let mut pinned = session_req(2, b"s");
    pinned.hints.backend_instance_id = Some(other);
    assert!(r.handle_request(half, pinned, Draw(0)).is_err());
    // A request it booked and then failed before the worker answered renews nothing either.
    let d3 = routed(r.handle_request(half, session_req(3, b"s"), Draw(0)));
    r.handle_dispatch_failed(half, d3.id, d3.phase, DispatchFailure::Cancelled).unwrap();
    assert_eq!(r.poll_timeout(), Some(T0.add_ms(ttl_ms)), "the binding keeps the deadline its last served request set");
    r.handle_timeout(T0.add_ms(ttl_ms));
    while r.poll_output().is_some() {}
    assert_eq!(r.session_binding(b"s", Phase::Aggregated), None);
    invariants(&r);
}

#[test]
fn direct_mode_refuses_a_pin_to_a_worker_that_is_gone() {
    // Deliberate (ARCHITECTURE.md): the caller chose the worker, so the caller re-picks.
    let mut r = router(RouterMode::Direct, 2);
    let pinned = |id| Request {
        hints: RoutingHints { backend_instance_id: Some(WorkerId(0)), ..RoutingHints::default() },
        ..req(id, &[1])
    };
    r.handle_worker_update(T0, WorkerUpdate::Health(WorkerId(0), crate::worker::Health::Ejected)).unwrap();
    let e = r.handle_request(T0, pinned(1), Draw(0)).unwrap_err();
    assert!(matches!(e, RouteError::Pin(crate::pin::PinError::Ineligible { .. })), "{e:?}");
    r.handle_worker_update(T0, WorkerUpdate::Removed(WorkerId(0))).unwrap();
    let e = r.handle_request(T0, pinned(2), Draw(0)).unwrap_err();
    assert!(matches!(e, RouteError::Pin(crate::pin::PinError::UnknownWorker { .. })), "{e:?}");
    assert_eq!(r.requests_in_flight(), 0);
    invariants(&r);
}

/// A session bound to worker 0 (of two) in `mode` sends a request that worker 0 fails
/// with `why`; its retry lists worker 0 as failed, goes to worker 1 and is served there.
/// `stays` says whether the session's next request still goes to worker 0.
#[track_caller]
fn check_refused(mode: crate::affinity::AffinityMode, why: DispatchFailure, stays: bool) {
    let mut cfg = RouterConfig { mode: RouterMode::RoundRobin, ..RouterConfig::default() };
    cfg.affinity.mode = mode;
    let mut r = router_with(cfg, 2);
    let serve = |r: &mut Router, q: Request| {
        let d = routed(r.handle_request(T0, q, Draw(0)));
        r.handle_dispatched(T0, d.id, d.phase).unwrap();
        r.handle_finished(T0, d.id, d.phase).unwrap();
        d.target.worker
    };
    assert_eq!(serve(&mut r, session_req(1, b"s")), WorkerId(0));
    let d = routed(r.handle_request(T0, session_req(2, b"s"), Draw(0)));
    assert_eq!(d.target.worker, WorkerId(0));
    r.handle_dispatch_failed(T0, d.id, d.phase, why).unwrap();
    let case = alloc::format!("{mode:?} {why:?}");
    let retry = Request { failed_workers: vec![WorkerId(0)], ..session_req(2, b"s") };
    assert_eq!(serve(&mut r, retry), WorkerId(1), "{case}: the retry goes elsewhere");
    let want = if stays { WorkerId(0) } else { WorkerId(1) };
    assert_eq!(r.session_binding(b"s", Phase::Aggregated).map(|b| b.worker), Some(want), "{case}");
    assert_eq!(serve(&mut r, session_req(3, b"s")), want, "{case}: the next request");
    invariants(&r);
}

#[test]
fn a_refusal_moves_one_request_and_keeps_the_binding_while_a_failure_moves_it() {
    use crate::affinity::AffinityMode::{Hard, Soft};
    for mode in [Hard, Soft] {
        check_refused(mode, DispatchFailure::Refused, true);
        check_refused(mode, DispatchFailure::Worker, false);
    }
}

/// A session's first request binds it to worker 0 (the only one then); worker 1 joins
/// holding all 8 blocks of the session's next prompt. Where the next request goes, and
/// where the session is bound afterwards, by affinity mode.
fn check_binding_mode(mode: crate::affinity::AffinityMode, want_target: u64, want_bound: u64) {
    let mut cfg = RouterConfig { mode: RouterMode::Kv, ..RouterConfig::default() };
    cfg.affinity.mode = mode;
    let mut r = Router::new(cfg);
    r.handle_worker_update(T0, WorkerUpdate::Upsert(spec(0, WorkerRole::Aggregated))).unwrap();
    let first = routed(r.handle_request(T0, Request { session: Some(b"s".to_vec()), ..req(1, &[1]) }, Draw(0)));
    r.handle_dispatched(T0, first.id, first.phase).unwrap();
    r.handle_finished(T0, first.id, first.phase).unwrap();
    r.handle_worker_update(T0, WorkerUpdate::Upsert(spec(1, WorkerRole::Aggregated))).unwrap();
    store(&mut r, 1, 1..=8);
    let next = Request { session: Some(b"s".to_vec()), ..req(2, &[1, 2, 3, 4, 5, 6, 7, 8, 9]) };
    let d = routed(r.handle_request(T0, next, Draw(0)));
    r.handle_dispatched(T0, d.id, d.phase).unwrap();
    assert_eq!(d.target.worker.0, want_target, "{mode:?}: the next request");
    // A released binding is bound again by the session's next request, where it goes.
    let then = routed(r.handle_request(T0, Request { session: Some(b"s".to_vec()), ..req(3, &[1, 2]) }, Draw(0)));
    r.handle_dispatched(T0, then.id, then.phase).unwrap();
    let bound = r.affinity.peek(b"s", Phase::Aggregated).map(|b| b.worker.0);
    assert_eq!(bound, Some(want_bound), "{mode:?}: the binding afterwards");
    invariants(&r);
}

#[test]
fn a_cost_binding_follows_the_cache_while_hard_and_soft_ones_stay() {
    use crate::affinity::AffinityMode::{Cost, Hard, Soft};
    check_binding_mode(Hard, 0, 0);
    check_binding_mode(Soft, 0, 0);
    check_binding_mode(Cost, 1, 1);
}
