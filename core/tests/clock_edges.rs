//! Clock edge cases at the `Router` façade: time going backwards, standing still,
//! jumping hours or to the end of time. None may panic or break an invariant, and a
//! jump expires everything due with bounded work per `handle_timeout` call:
//!
//! * bookings: at most `BOOKINGS_EXPIRE_PER_CALL_MAX` per call;
//! * orphans (bookings whose worker left): at most `ORPHANS_PER_CALL_MAX` per call;
//! * idle session bindings: at most `SESSIONS_EXPIRE_PER_CALL_MAX` per call;
//! * queued requests: every one due, so at most `queued_max`;
//!
//! and while more is due, `poll_timeout()` stays at or before `now`, so an adapter that
//! sleeps until `poll_timeout` calls again at once.

use router_core::{
    limits::BOOKINGS_EXPIRE_PER_CALL_MAX, limits::ORPHANS_PER_CALL_MAX, limits::SESSIONS_EXPIRE_PER_CALL_MAX,
    AffinityConfig, Decision, Draw, Instant, LoadConfig, Output, Phase, QueueConfig, Request, RequestId, Router,
    RouterConfig, SeqHash, WorkerId, WorkerRole, WorkerSpec, WorkerUpdate,
};

const AGG: Phase = Phase::Aggregated;
const AGE_MS: u64 = 60_000;
const TTL_MS: u64 = 5_000;
const QUEUE_TIMEOUT_MS: u64 = 1_000;

fn config() -> RouterConfig {
    RouterConfig {
        requests_max: 1 << 20,
        load: LoadConfig { request_age_max_ms: AGE_MS, ..LoadConfig::default() },
        affinity: AffinityConfig { lease_ttl_ms: TTL_MS, sessions_max: 1 << 20, ..AffinityConfig::default() },
        queue: QueueConfig { queue_timeout_ms: QUEUE_TIMEOUT_MS, queued_max: 1 << 20, ..QueueConfig::default() },
        ..RouterConfig::default()
    }
}

/// A router with `workers` aggregated workers of ample capacity.
fn router(workers: u64) -> Router {
    let mut r = Router::new(config());
    for w in 0..workers {
        let mut spec = WorkerSpec::new(WorkerId(w), WorkerRole::Aggregated);
        spec.kv_blocks = u32::MAX;
        spec.max_batched_tokens = u32::MAX;
        r.handle_worker_update(Instant::ZERO, WorkerUpdate::Upsert(spec)).expect("fits");
    }
    r
}

fn req(id: u64, session: Option<&str>) -> Request {
    Request {
        id: RequestId(id),
        blocks: vec![SeqHash(id % 7), SeqHash(100 + id)],
        isl_tokens: 128,
        session: session.map(|s| s.as_bytes().to_vec()),
        ..Request::default()
    }
}

#[track_caller]
fn invariants(r: &Router) {
    if let Err(v) = r.check_invariants() {
        panic!("invariant violated: {}", v.0);
    }
}

/// Routes and dispatches `n` requests at `now` (session `s<i>` when `sessions`).
#[track_caller]
fn dispatch(r: &mut Router, now: Instant, ids: std::ops::Range<u64>, sessions: bool) {
    for id in ids {
        let session = sessions.then(|| format!("s{id}"));
        match r.handle_request(now, req(id, session.as_deref()), Draw(id)) {
            Ok(Decision::Routed(_)) => r.handle_dispatched(now, RequestId(id), AGG).expect("booked"),
            other => panic!("request {id}: {other:?}"),
        }
        while r.poll_output().is_some() {}
    }
    invariants(r);
}

/// What one `handle_timeout` call put out.
#[derive(Debug, Default, PartialEq)]
struct Drained {
    booking_expired: usize,
    lease_expired: usize,
    timed_out: usize,
    other: usize,
}

fn drain(r: &mut Router) -> Drained {
    let mut d = Drained::default();
    while let Some(o) = r.poll_output() {
        match o {
            Output::BookingExpired { .. } => d.booking_expired += 1,
            Output::LeaseExpired { .. } => d.lease_expired += 1,
            Output::TimedOut { .. } => d.timed_out += 1,
            _ => d.other += 1,
        }
    }
    d
}

/// Calls `handle_timeout(now)` until nothing is due: each call stays within `bound`
/// (applied to the call's outputs), `poll_timeout` says "due" exactly while more is
/// left, and the calls sum to `want`. Returns the calls made.
#[track_caller]
fn expire_all(r: &mut Router, now: Instant, bound: impl Fn(&Drained) -> bool, want: Drained) -> usize {
    let mut total = Drained::default();
    let mut calls = 0;
    while r.poll_timeout().is_some_and(|t| t <= now) {
        calls += 1;
        assert!(calls <= 10_000, "timers still due after 10,000 calls");
        r.handle_timeout(now);
        let d = drain(r);
        assert!(bound(&d), "call {calls} did too much work: {d:?}");
        invariants(r);
        total.booking_expired += d.booking_expired;
        total.lease_expired += d.lease_expired;
        total.timed_out += d.timed_out;
        total.other += d.other;
    }
    assert_eq!(total, want, "after {calls} calls");
    calls
}

#[test]
fn a_jump_of_hours_expires_bookings_in_bounded_batches() {
    let n = 2 * BOOKINGS_EXPIRE_PER_CALL_MAX + 100;
    let mut r = router(4);
    dispatch(&mut r, Instant::from_millis(1_000), 0..n as u64, false);
    let later = Instant::from_millis(1_000).add_ms(5 * 3_600_000);
    let calls = expire_all(
        &mut r,
        later,
        |d| d.booking_expired <= BOOKINGS_EXPIRE_PER_CALL_MAX,
        Drained { booking_expired: n, ..Drained::default() },
    );
    assert_eq!(calls, n.div_ceil(BOOKINGS_EXPIRE_PER_CALL_MAX));
    assert_eq!((r.requests_in_flight(), r.counts().bookings), (0, 0));
}

#[test]
fn a_jump_expires_orphans_in_bounded_batches() {
    let n = ORPHANS_PER_CALL_MAX + 300;
    let mut r = router(1);
    let t0 = Instant::from_millis(1_000);
    dispatch(&mut r, t0, 0..n as u64, false);
    r.handle_worker_update(t0, WorkerUpdate::Removed(WorkerId(0))).expect("removal");
    assert_eq!((r.counts().bookings, r.requests_in_flight()), (0, n), "orphans hold no load until they age out");
    expire_all(
        &mut r,
        t0.add_ms(3_600_000),
        |d| d.booking_expired <= ORPHANS_PER_CALL_MAX,
        Drained { booking_expired: n, ..Drained::default() },
    );
    assert_eq!(r.requests_in_flight(), 0);
}

#[test]
fn a_jump_expires_idle_sessions_in_bounded_batches() {
    let n = SESSIONS_EXPIRE_PER_CALL_MAX + 500;
    let mut r = router(2);
    let t0 = Instant::from_millis(1_000);
    dispatch(&mut r, t0, 0..n as u64, true);
    for id in 0..n as u64 {
        r.handle_finished(t0, RequestId(id), AGG).expect("tracked");
    }
    assert_eq!(drain(&mut r), Drained::default());
    assert_eq!((r.counts().affinity_sessions, r.counts().affinity_live_leases), (n, 0));
    expire_all(
        &mut r,
        t0.add_ms(24 * 3_600_000),
        |d| d.lease_expired <= SESSIONS_EXPIRE_PER_CALL_MAX,
        Drained { lease_expired: n, ..Drained::default() },
    );
    assert_eq!(r.counts().affinity_sessions, 0);
}

#[test]
fn a_jump_times_out_the_whole_queue_at_once() {
    let n = 3_000;
    let mut r = Router::new(config());
    let mut spec = WorkerSpec::new(WorkerId(0), WorkerRole::Aggregated);
    spec.max_batched_tokens = 16; // busy after one 128-token prompt: the rest queue
    r.handle_worker_update(Instant::ZERO, WorkerUpdate::Upsert(spec)).expect("fits");
    let t0 = Instant::from_millis(1_000);
    dispatch(&mut r, t0, 0..1, false);
    for id in 1..=n {
        let d = r.handle_request(t0, req(id, None), Draw(id));
        assert!(matches!(d, Ok(Decision::Queued)), "{d:?}");
    }
    assert_eq!(r.counts().queue_depth, n as usize);
    r.handle_finished(t0, RequestId(0), AGG).expect("tracked");
    let d = drain(&mut r);
    assert!(d.other > 0, "the freed worker takes queued requests: {d:?}");
    let n = r.counts().queue_depth as u64;
    assert!(n > BOOKINGS_EXPIRE_PER_CALL_MAX as u64, "{n} left queued");
    // Routed from the queue and not finished, they expire as bookings meanwhile.
    let booked = r.counts().bookings;
    let mut queued_left = n as usize;
    r.handle_timeout(t0.add_ms(10 * 3_600_000));
    let first = drain(&mut r);
    queued_left -= first.timed_out;
    assert_eq!(queued_left, 0, "every queued request due times out in one call: {first:?}");
    assert!(first.booking_expired <= BOOKINGS_EXPIRE_PER_CALL_MAX.min(booked));
    invariants(&r);
}

/// Time going backwards is no time passing: nothing expires early, nothing panics,
/// and inputs at an earlier time than the last one work as usual.
#[test]
fn time_going_backwards_expires_nothing() {
    let mut r = router(2);
    let t = Instant::from_millis(10 * 3_600_000);
    dispatch(&mut r, t, 0..10, true);
    for id in 0..5 {
        r.handle_finished(t, RequestId(id), AGG).expect("tracked");
    }
    let before = (r.requests_in_flight(), r.counts().affinity_sessions, r.counts().bookings, r.poll_timeout());
    for back in [Instant::ZERO, Instant::from_millis(1), Instant::from_millis(9 * 3_600_000)] {
        r.handle_timeout(back);
        assert_eq!(drain(&mut r), Drained::default(), "at {back:?}");
        assert_eq!(
            (r.requests_in_flight(), r.counts().affinity_sessions, r.counts().bookings, r.poll_timeout()),
            before
        );
        invariants(&r);
    }
    // Inputs from the past: a new session bound, an old one reused, a stream ended.
    let past = Instant::from_millis(5);
    dispatch(&mut r, past, 10..12, true);
    r.handle_finished(past, RequestId(7), AGG).expect("tracked");
    let d = r.handle_request(past, req(20, Some("s1")), Draw(20));
    assert!(matches!(d, Ok(Decision::Routed(_))), "{d:?}");
    r.handle_cancel(past, RequestId(20), AGG).expect("tracked");
    invariants(&r);
    assert_eq!(drain(&mut r), Drained::default());
}

/// A spurious call, with nothing due, changes nothing.
#[test]
fn a_spurious_timeout_changes_nothing() {
    let mut r = router(2);
    let t = Instant::from_millis(1_000);
    dispatch(&mut r, t, 0..20, true);
    for id in 0..10 {
        r.handle_finished(t, RequestId(id), AGG).expect("tracked");
    }
    let before =
        (r.requests_in_flight(), r.counts().affinity_sessions, r.counts().bookings, r.stats(), r.poll_timeout());
    for _ in 0..3 {
        r.handle_timeout(t.add_ms(1));
        assert_eq!(drain(&mut r), Drained::default());
        assert_eq!(
            (r.requests_in_flight(), r.counts().affinity_sessions, r.counts().bookings, r.stats(), r.poll_timeout()),
            before
        );
    }
}

/// At and near the end of time deadlines saturate: everything booked there is due at
/// once, and nothing overflows.
#[test]
fn the_end_of_time_never_panics() {
    for now in [Instant::MAX, Instant::from_micros(u64::MAX - 1), Instant::from_micros(u64::MAX - AGE_MS * 500)] {
        let mut r = router(2);
        dispatch(&mut r, now, 0..4, true);
        let d = r.handle_request(now, req(9, None), Draw(9));
        assert!(matches!(d, Ok(Decision::Routed(_))), "{d:?}");
        r.handle_finished(now, RequestId(0), AGG).expect("tracked");
        r.handle_cancel(now, RequestId(9), AGG).expect("tracked");
        while r.poll_timeout().is_some_and(|t| t <= now) {
            r.handle_timeout(now);
            drain(&mut r);
            invariants(&r);
        }
        // Then the clock comes back from the end of time: still no panic.
        r.handle_timeout(Instant::ZERO);
        dispatch(&mut r, Instant::from_millis(1), 100..102, true);
        drain(&mut r);
        invariants(&r);
    }
}

/// A booking made at a late time and reported at an early one, or the other way round,
/// releases exactly what it took.
#[test]
fn reports_from_another_time_release_exactly() {
    #[track_caller]
    fn check(book_at: Instant, end_at: Instant) {
        let mut r = router(1);
        dispatch(&mut r, book_at, 0..3, true);
        for id in 0..3 {
            r.handle_finished(end_at, RequestId(id), AGG).expect("tracked");
        }
        invariants(&r);
        assert_eq!((r.requests_in_flight(), r.counts().bookings, r.counts().affinity_live_leases), (0, 0, 0));
        let total = r.counts().load_total;
        assert_eq!((total.active_requests, total.active_prefill_tokens, total.active_decode_blocks), (0, 0, 0));
    }
    let hour = Instant::from_millis(3_600_000);
    check(hour, Instant::ZERO);
    check(Instant::ZERO, hour);
    check(Instant::MAX, Instant::ZERO);
    check(Instant::ZERO, Instant::MAX);
}
