//! Bugs the seeded simulation and the `router_ops` fuzz target found in the `Router`
//! façade, each reduced to a scenario on the public API and kept as a named regression
//! test now that it is fixed. The simulation faces all of them; `SIM_AVOID_BUGS=<bug>`
//! steers around one again for triage (see `sim::ops::Bug`).

use router_core::{Decision, Request, Router, RouterConfig, WorkerUpdate};
use router_core::{Draw, Instant, Phase, RequestId, WorkerId};
use router_core::{WorkerRole, WorkerSpec};

const T0: Instant = Instant::ZERO;

fn router(cfg: RouterConfig, workers: u64) -> Router {
    let mut r = Router::new(cfg);
    for w in 0..workers {
        let spec = WorkerSpec::new(WorkerId(w), WorkerRole::Aggregated);
        r.handle_worker_update(T0, WorkerUpdate::Upsert(spec)).expect("valid worker");
    }
    r
}

fn session_request(id: u64, session: &str) -> Request {
    Request { id: RequestId(id), session: Some(session.as_bytes().to_vec()), isl_tokens: 64, ..Request::default() }
}

#[track_caller]
fn decision(r: &mut Router, req: Request) -> Decision {
    r.handle_request(T0, req, Draw(1)).expect("routable")
}

#[track_caller]
fn invariants(r: &Router) {
    if let Err(v) = r.check_invariants() {
        panic!("invariant violated: {}", v.0);
    }
}

/// Found by the simulation (`leaked_init`, seed 33, knobs `leases_max: 2`: the final
/// settle finds a request waiting forever).
///
/// When `handle_dispatched` commits a session's first binding and the affinity table
/// refuses the commit (`TooManyLeases`), the façade sets `Hold::None` and drops the
/// `InitToken` without `abort`. The session's entry stays `Initializing` forever: its
/// waiters are never woken (they stay tracked and count against `requests_max`), and
/// the entry holds a session slot that can never be evicted.
///
/// Fix (core/src/router/mod.rs, `handle_dispatched`): abort the token when the commit
/// fails, then drain, e.g.
/// `Err(_) => { let _ = self.affinity.abort(token); Hold::None }`
/// (the `drain_affinity` call below it already wakes the waiters).
#[test]
fn refused_session_commit_wakes_waiters() {
    let mut cfg = RouterConfig::default();
    cfg.affinity.leases_max = 1;
    let mut r = router(cfg, 2);
    // Session "a" takes the only lease.
    let Decision::Routed(a) = decision(&mut r, session_request(1, "a")) else { panic!("routed") };
    r.handle_dispatched(T0, a.id, a.phase).expect("booked");
    // Session "b" starts; a second request of it waits for the first to commit.
    let Decision::Routed(b) = decision(&mut r, session_request(2, "b")) else { panic!("routed") };
    assert_eq!(decision(&mut r, session_request(3, "b")), Decision::Waiting);
    // The commit is refused (no lease left), but the request itself was dispatched.
    r.handle_dispatched(T0, b.id, b.phase).expect("booked");
    invariants(&r);
    for id in [1, 2] {
        r.handle_finished(T0, RequestId(id), Phase::Aggregated).expect("tracked");
        while r.poll_output().is_some() {}
    }
    // Far in the future every lease and binding has expired.
    let later = T0.add_ms(24 * 3_600_000);
    r.handle_timeout(later);
    while r.poll_output().is_some() {}
    assert_eq!(r.requests_in_flight(), 0, "request 3 still waits on an initialization nobody will finish");
    assert_eq!(r.counts().affinity_sessions, 0, "session b's entry is stuck initializing");
}

/// Found by reading `place`, then by the simulation (`busy_pin`, seed 14, step 214; the
/// check lives in `Driver::refusal`).
///
/// A request pinned to a worker that is only busy (over its prefill bound) fails with
/// `Pin(Ineligible { reason: Overloaded })` instead of queueing, while the same request
/// unpinned queues. `pin::check_pinned`'s doc says a façade that queues overloaded
/// requests must test `eligible::all_overloaded` first; `place` calls `check_pinned`
/// before it.
///
/// Fix (core/src/router/pipeline.rs, `place`): move the `eligible::all_overloaded`
/// block above the `pin::check_pinned` call (the scores it needs can be computed
/// before both).
#[test]
fn pinned_request_to_a_busy_worker_queues() {
    let mut cfg = RouterConfig::default();
    cfg.eligibility.prefill_tokens_max = Some(100);
    let mut r = router(cfg, 2);
    let busy = |id| Request { id: RequestId(id), isl_tokens: 640, ..Request::default() };
    // Both workers take one long prompt each and are then over the bound.
    for id in [1, 2] {
        let Decision::Routed(_) = decision(&mut r, busy(id)) else { panic!("routed") };
    }
    assert_eq!(decision(&mut r, busy(3)), Decision::Queued, "unpinned, the request queues");
    let mut pinned = busy(4);
    pinned.hints.backend_instance_id = Some(WorkerId(0));
    assert_eq!(r.handle_request(T0, pinned, Draw(1)), Ok(Decision::Queued), "pinned, it must queue too");
    invariants(&r);
}

/// Found by the simulation (`soft_binding`, seed 2, step 1566: a taint; with it,
/// seed 13 meets it through `same_label_as`, seed 112 through fewer ranks
/// (`Pin(RankOutOfRange)`), seed 180 with a queued request).
///
/// In `AffinityMode::Soft` a binding is "a preference, kept only while the worker stays
/// eligible", but `session_step` re-binds only when the worker is unhealthy or has the
/// wrong role (`can_serve`). A bound worker that carries a `NoSchedule` taint the
/// request does not tolerate is not eligible, yet the binding is kept as a pin and the
/// request fails with `Pin(Ineligible { reason: Tainted })`. The same happens when the
/// request's allow-list or `same_label_as` excludes the bound worker, and when the
/// worker comes back with fewer dp ranks than the bound one (`Pin(RankOutOfRange)`).
///
/// Fix (core/src/router/pipeline.rs): in soft mode, when `place` fails with
/// `RouteError::Pin(PinError::Ineligible { .. })` for a request whose pin came only from
/// its binding, invalidate the binding's revision and place again without it (or have
/// `can_serve` run the eligibility filter for the bound worker).
#[test]
fn soft_binding_to_a_tainted_worker_is_dropped() {
    use router_core::AffinityMode;
    use router_core::{Taint, TaintEffect};
    let mut cfg = RouterConfig::default();
    cfg.affinity.mode = AffinityMode::Soft;
    let mut r = router(cfg, 2);
    let Decision::Routed(first) = decision(&mut r, session_request(1, "s")) else { panic!("routed") };
    r.handle_dispatched(T0, first.id, first.phase).expect("booked");
    r.handle_finished(T0, first.id, first.phase).expect("dispatched");
    let taint = Taint { key: "maint".into(), value: String::new(), effect: TaintEffect::NoSchedule };
    r.handle_worker_update(T0, WorkerUpdate::Taints(first.target.worker, vec![taint])).expect("known worker");
    match r.handle_request(T0, session_request(2, "s"), Draw(1)) {
        Ok(Decision::Routed(d)) => assert_ne!(d.target.worker, first.target.worker),
        other => panic!("a soft binding must yield to a worker the request may use, got {other:?}"),
    }
    invariants(&r);
}

/// Found by reading the façade for inputs that free capacity, then by the simulation's
/// spurious-timeout check (`decode_progress`, seed 11, step 1703;
/// `Driver::check_settled`).
///
/// `handle_decode_progress` with `output_tokens > 0` clears the booking's prefill
/// tokens (any output means prefill is over), which can take a worker back under its
/// prefill bound, but it does not re-try the queue as the other capacity-freeing inputs
/// do. The queued request waits for some unrelated input (or times out); the next
/// spurious `handle_timeout` routes it.
///
/// Fix (core/src/router/mod.rs, `handle_decode_progress`): take `now` (it has `_now`)
/// and call `self.drain_queue(now)` after `decode_progress`, as `handle_prefill_done`
/// does.
#[test]
fn decode_progress_retries_the_queue() {
    let mut cfg = RouterConfig::default();
    cfg.eligibility.prefill_tokens_max = Some(100);
    let mut r = router(cfg, 1);
    let long = |id| Request { id: RequestId(id), isl_tokens: 640, ..Request::default() };
    let Decision::Routed(a) = decision(&mut r, long(1)) else { panic!("routed") };
    r.handle_dispatched(T0, a.id, a.phase).expect("booked");
    assert_eq!(decision(&mut r, long(2)), Decision::Queued);
    // The first token is out: request 1's prefill is over, the worker is idle again.
    r.handle_decode_progress(T0, a.id, a.phase, 1).expect("tracked");
    // Request 1's prompt no longer counts; request 2's, routed in its place, does.
    assert_eq!(r.local_load(a.target).active_prefill_tokens, 640);
    match r.poll_output() {
        Some(router_core::Output::Routed(d)) => assert_eq!(d.id, RequestId(2)),
        other => panic!("the queued request must be routed once capacity frees, got {other:?}"),
    }
    invariants(&r);
}

/// Found by reading `drop_flight`, then by the simulation's binding check
/// (`late_failure`, seed 688, step 553; see `Driver::lifecycle`).
///
/// `handle_dispatch_failed(.., DispatchFailure::Worker)` drops the session's binding
/// by peeking the *current* binding and invalidating its revision. When the failed
/// request held a lease on an older binding (its worker was ejected and the session
/// re-bound elsewhere meanwhile), the late failure breaks the new, healthy binding:
/// the revision check in `AffinityTable::invalidate` exists to stop exactly that.
///
/// Fix (core/src/router): remember the binding revision with the lease (`Hold::Lease`
/// gets the `Binding` from `Acquire::Bound` or `commit`), and pass that revision to
/// `invalidate` in `drop_flight` instead of peeking.
#[test]
fn late_worker_failure_keeps_a_newer_binding() {
    use router_core::AffinityMode;
    use router_core::DispatchFailure;
    use router_core::Health;
    let mut cfg = RouterConfig::default();
    cfg.affinity.mode = AffinityMode::Soft;
    let mut r = router(cfg, 2);
    let Decision::Routed(first) = decision(&mut r, session_request(1, "s")) else { panic!("routed") };
    r.handle_dispatched(T0, first.id, first.phase).expect("booked");
    // The first worker starts failing and is ejected; the session moves on.
    r.handle_worker_update(T0, WorkerUpdate::Health(first.target.worker, Health::Ejected)).expect("known");
    let Decision::Routed(second) = decision(&mut r, session_request(2, "s")) else { panic!("routed") };
    r.handle_dispatched(T0, second.id, second.phase).expect("booked");
    let moved = r.session_binding(b"s", Phase::Aggregated).expect("bound to the second worker");
    assert_ne!(moved.worker, first.target.worker);
    // Now the first request's stream breaks on the failing worker.
    r.handle_dispatch_failed(T0, first.id, first.phase, DispatchFailure::Worker).expect("tracked");
    invariants(&r);
    assert_eq!(r.session_binding(b"s", Phase::Aggregated), Some(moved), "the new binding must survive");
}

/// Found by reading `remove_worker` against the load tracker's contract ("because a
/// lost free would otherwise leak load forever, every booking expires"), then by the
/// simulation's deadline check (`orphan_expiry`, seed 2, step 451).
///
/// Removing a worker turns its bookings into `Orphaned` flights: their load and
/// expiry timer go with the worker, but the flight stays in the table until the
/// adapter reports the request's end. If that report is lost, nothing ever expires it
/// and it holds one of `requests_max` slots forever (bookings on live workers expire
/// after `request_age_max_ms`).
///
/// Fix (core/src/router): give orphaned flights a deadline (the booking's own, kept in
/// the flight, or `request_age_max_ms` from the removal) and drop them in
/// `handle_timeout` with an `Output::BookingExpired`.
#[test]
fn orphaned_request_expires() {
    let mut cfg = RouterConfig::default();
    cfg.load.request_age_max_ms = 1_000;
    let mut r = router(cfg, 2);
    let Decision::Routed(d) = decision(&mut r, Request { id: RequestId(1), ..Request::default() }) else {
        panic!("routed")
    };
    r.handle_dispatched(T0, d.id, d.phase).expect("booked");
    r.handle_worker_update(T0, WorkerUpdate::Removed(d.target.worker)).expect("removal");
    // The adapter never hears from the request again.
    let later = T0.add_ms(3_600_000);
    r.handle_timeout(later);
    while r.poll_output().is_some() {}
    assert_eq!(r.requests_in_flight(), 0, "the orphaned request still holds a slot an hour later");
}

/// Found by the simulation (seed 7743502432347645471, step 1373, once it also said
/// which workers tokenize otherwise; `Driver::check_settled`).
///
/// In `AffinityMode::Soft`, a request whose bound worker it may not use (its
/// `same_label_as` excludes it) drops the binding and is placed afresh. When it cannot
/// be placed at all, it fails, but the binding was already gone: the failed request
/// left a trace, and the session's next request lost its worker's cache for nothing.
///
/// Fix (core/src/router/pipeline.rs, `place_afresh`): drop the binding only once the
/// request can go elsewhere.
#[test]
fn a_request_that_fails_keeps_its_sessions_soft_binding() {
    use router_core::AffinityMode;
    let mut cfg = RouterConfig::default();
    cfg.affinity.mode = AffinityMode::Soft;
    let mut r = router(cfg, 2);
    let Decision::Routed(first) = decision(&mut r, session_request(1, "s")) else { panic!("routed") };
    r.handle_dispatched(T0, first.id, first.phase).expect("booked");
    let bound = r.session_binding(b"s", Phase::Aggregated).expect("bound");
    let nowhere = Request { same_label_as: Some(("zone".into(), "b".into())), ..session_request(2, "s") };
    assert!(r.handle_request(T0, nowhere, Draw(1)).is_err(), "no worker has the label");
    assert_eq!(r.session_binding(b"s", Phase::Aggregated), Some(bound), "the binding must outlive the failure");
    invariants(&r);
}

/// Found with the one above (the same seed, once it was fixed).
///
/// A request pinned to a worker of several ranks, without a rank, takes the rank from
/// its session's binding. Queued, it is placed again each time the queue is re-tried.
/// When another request of the session moved the (soft) binding elsewhere, the queued
/// one could no longer resolve its pin, yet nothing re-tried the queue: it failed only
/// at some later, unrelated input.
///
/// Fix (core/src/router): a handled request that invalidated a binding re-tries the
/// queue (`Router::unbound`).
#[test]
fn a_binding_moved_away_retries_the_queue() {
    use router_core::{AffinityMode, Output, PinError, RouteError};
    let mut cfg = RouterConfig::default();
    cfg.affinity.mode = AffinityMode::Soft;
    cfg.eligibility.prefill_tokens_max = Some(100);
    let mut r = Router::new(cfg);
    let ranked = WorkerSpec { dp_ranks: Some(2), ..WorkerSpec::new(WorkerId(0), WorkerRole::Aggregated) };
    let labelled = WorkerSpec {
        labels: vec![("zone".into(), "b".into())],
        ..WorkerSpec::new(WorkerId(1), WorkerRole::Aggregated)
    };
    for spec in [ranked, labelled] {
        r.handle_worker_update(T0, WorkerUpdate::Upsert(spec)).expect("valid worker");
    }
    let pinned = |id: u64, isl_tokens| {
        let mut q = Request { isl_tokens, ..session_request(id, "s") };
        q.hints.backend_instance_id = Some(WorkerId(0));
        q
    };
    // The session binds to a rank of worker 0, which its long prompt keeps busy.
    let mut first = pinned(1, 640);
    first.hints.dp_rank = Some(router_core::DpRank(1));
    let Decision::Routed(first) = decision(&mut r, first) else { panic!("routed") };
    r.handle_dispatched(T0, first.id, first.phase).expect("booked");
    assert_eq!(decision(&mut r, pinned(2, 64)), Decision::Queued, "pinned to a busy worker, it queues");
    // The next request may only use zone b: it goes to worker 1, and the binding goes.
    let elsewhere = Request { same_label_as: Some(("zone".into(), "b".into())), ..session_request(3, "s") };
    let Decision::Routed(moved) = decision(&mut r, elsewhere) else { panic!("routed") };
    assert_eq!(moved.target.worker, WorkerId(1));
    match r.poll_output() {
        Some(Output::Failed { id, error: RouteError::Pin(PinError::RankRequired { .. }), .. }) => {
            assert_eq!(id, RequestId(2))
        }
        other => panic!("the queued request's pin no longer resolves: it must fail now, got {other:?}"),
    }
    invariants(&r);
}
