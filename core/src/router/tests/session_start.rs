//! A session's first request places every later one, so it weighs decode load more and a
//! shared prompt's holder less than a request that binds nothing.

use alloc::vec::Vec;

use super::*;

const SHARED_BLOCKS: u64 = 32;

/// Two workers: worker 0 holds a 32-block shared prompt and decodes `busy` requests
/// pinned there (16 blocks each, 128 output tokens); worker 1 is empty.
fn fleet(busy: u64) -> Router {
    let mut r = router(RouterMode::Kv, 2);
    store(&mut r, 0, 1..=SHARED_BLOCKS);
    for i in 0..busy {
        let own: Vec<u64> = (0..16).map(|b| 10_000 + i * 100 + b).collect();
        let mut q = req(1_000 + i, &own);
        q.hints.decode_worker_id = Some(WorkerId(0));
        q.expected_output_tokens = Some(128);
        let d = routed(r.handle_request(T0, q, Draw(0)));
        r.handle_dispatched(T0, d.id, d.phase).unwrap();
        r.handle_prefill_done(T0, d.id, d.phase).unwrap();
    }
    r
}

/// The shared prompt plus two blocks of its own, in `session` if one is given.
fn asking(id: u64, session: Option<&[u8]>) -> Request {
    let blocks: Vec<u64> = (1..=SHARED_BLOCKS + 2).collect();
    Request { session: session.map(<[u8]>::to_vec), expected_output_tokens: Some(128), ..req(id, &blocks) }
}

/// With `busy` requests decoding on the prompt's holder, where a request in a new
/// session goes (the preview agrees), and where one that binds nothing goes.
fn check(busy: u64, want_new_session: u64, want_no_session: u64) {
    let mut r = fleet(busy);
    let look = |q: Request| Request { preview: true, ..q };
    let preview = routed(r.handle_request(T0, look(asking(1, Some(b"new"))), Draw(0)));
    let plain = routed(r.handle_request(T0, look(asking(2, None)), Draw(0)));
    let started = routed(r.handle_request(T0, asking(1, Some(b"new")), Draw(0)));
    let got = (preview.target.worker.0, started.target.worker.0, plain.target.worker.0);
    assert_eq!(got, (want_new_session, want_new_session, want_no_session), "{busy} busy: (preview, new session, none)");
    invariants(&r);
}

#[test]
fn a_new_session_weighs_the_decode_it_brings_over_a_shared_prompt() {
    // Idle holder: the prompt's cache wins either way.
    check(0, 0, 0);
    check(1, 0, 0);
    // A holder decoding a couple more: a session's later requests would decode there
    // too, so it starts on the empty worker; a one-off request still takes the cache.
    check(2, 1, 0);
    check(40, 1, 0);
}

#[test]
fn a_bound_session_stays_where_its_start_put_it() {
    let mut r = fleet(2);
    let first = routed(r.handle_request(T0, asking(1, Some(b"s")), Draw(0)));
    r.handle_dispatched(T0, first.id, first.phase).unwrap();
    r.handle_finished(T0, first.id, first.phase).unwrap();
    let next = routed(r.handle_request(T0, asking(2, Some(b"s")), Draw(0)));
    assert_eq!((first.target.worker.0, next.target.worker.0), (1, 1));
    invariants(&r);
}

/// Three workers: the prompt's holder (worker 0) runs nothing, but `sessions` sessions
/// bound there ended their last requests at T0; worker 1 is empty; worker 2 decodes
/// `running` requests of other callers. Whether a new session starting `after_ms` later
/// goes to the holder.
fn start_after(sessions: u64, running: u64, after_ms: u64) -> bool {
    start_after_with(true, sessions, running, after_ms)
}

/// `start_after` with `session_return_scaled` as given.
fn start_after_with(scaled: bool, sessions: u64, running: u64, after_ms: u64) -> bool {
    let mut cfg = RouterConfig { mode: RouterMode::Kv, ..RouterConfig::default() };
    cfg.cost.ttft.session_return_scaled = scaled;
    let mut r = router_with(cfg, 3);
    store(&mut r, 0, 1..=SHARED_BLOCKS);
    let place = |r: &mut Router, id: u64, session: Option<Vec<u8>>, worker: u64, finish: bool| {
        let mut q = Request { session, expected_output_tokens: Some(128), ..req(id, &[id]) };
        q.hints.decode_worker_id = Some(WorkerId(worker));
        let d = routed(r.handle_request(T0, q, Draw(0)));
        r.handle_dispatched(T0, d.id, d.phase).unwrap();
        if finish {
            r.handle_finished(T0, d.id, d.phase).unwrap();
        }
    };
    for i in 0..sessions {
        place(&mut r, 500 + i, Some(alloc::format!("bound-{i}").into_bytes()), 0, true);
    }
    for i in 0..running {
        place(&mut r, 700 + i, None, 2, false);
    }
    let d = routed(r.handle_request(T0.add_ms(after_ms), asking(1, Some(b"new")), Draw(0)));
    invariants(&r);
    d.target.worker.0 == 0
}

#[test]
fn a_start_counts_the_sessions_due_back_as_the_fleet_load_says() {
    // (sessions bound to the idle holder, requests running elsewhere, ms since the
    // sessions' last requests ended, whether a new session starts on the holder). On a
    // busy fleet, sessions between calls will send their next calls to the holder soon
    // and run beside the new one; on an idle fleet they seldom overlap, and the
    // prompt's cache wins; past `session_return_ms` none count. Three due on the
    // holder move a start (see `unscaled_…`): 4 × 20 / 24 rounds down to 3, 3 × 20 /
    // 23 to 2.
    for (sessions, running, after_ms, on_holder) in [
        (0, 20, 1_000, true),
        (3, 20, 1_000, true),
        (4, 20, 1_000, false),
        (7, 20, 1_000, false),
        (7, 20, 11_000, true),
        (7, 0, 1_000, true),
        (7, 1, 1_000, true),
        (7, 4, 1_000, true),
        (7, 6, 1_000, false),
    ] {
        let got = start_after(sessions, running, after_ms);
        assert_eq!(got, on_holder, "{sessions} sessions, {running} running, {after_ms} ms after: on the holder?");
    }
}

#[test]
fn unscaled_a_start_counts_every_session_due_back() {
    // The old rule: each session between calls is a request on its worker, busy
    // fleet or not.
    for (sessions, on_holder) in [(2, true), (3, false), (7, false)] {
        assert_eq!(start_after_with(false, sessions, 0, 1_000), on_holder, "{sessions} sessions, unscaled");
    }
}
