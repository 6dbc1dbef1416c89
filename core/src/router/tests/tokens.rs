//! Where request blocks get their tokens, and whether a worker's KV events can match
//! them: a pool with estimated tokens, or one worker whose engine tokenizes otherwise
//! (`handle_worker_tokens`), is routed on predictions from the router's own decisions.

use super::*;

/// What the caller has said of worker 1's tokens.
#[derive(Clone, Copy, Debug)]
enum Said {
    /// Nothing: it agrees.
    Nothing,
    /// It tokenizes otherwise.
    Differs,
    /// It tokenized otherwise, then agreed again (the operator mended its tokenizer).
    DiffersThenAgrees,
}

/// Workers 1 and 2 both publish events; worker 2's match the requests' tokens (blocks
/// 1..=4), worker 1's never do. A request for blocks 10..=17 is served by worker 1; then
/// previews ask where blocks 10..=17 and 1..=4 go, and with what overlap. Worker 0
/// publishes nothing and serves blocks 20..=23: its repeat shows what it predicts.
#[track_caller]
fn check(
    (tokens, approximate, said): (RequestTokens, bool, Said),
    want_repeat: (u64, u32),
    want_exact: (u64, u32),
    want_silent_repeat: (u64, u32),
) {
    let cfg = RouterConfig { mode: RouterMode::Kv, approximate, request_tokens: tokens, ..RouterConfig::default() };
    let mut r = router_with(cfg, 3);
    store(&mut r, 2, 1..=4);
    store(&mut r, 1, 900..=903);
    if matches!(said, Said::Differs | Said::DiffersThenAgrees) {
        r.handle_worker_tokens(WorkerId(1), false);
    }
    let mut pinned = req(1, &[10, 11, 12, 13, 14, 15, 16, 17]);
    pinned.hints.backend_instance_id = Some(WorkerId(1));
    let first = routed(r.handle_request(T0, pinned, Draw(0)));
    r.handle_dispatched(T0, first.id, first.phase).unwrap();
    r.handle_finished(T0, first.id, first.phase).unwrap();
    let mut silent = req(4, &[20, 21, 22, 23]);
    silent.hints.backend_instance_id = Some(WorkerId(0));
    let served = routed(r.handle_request(T0, silent, Draw(0)));
    r.handle_dispatched(T0, served.id, served.phase).unwrap();
    r.handle_finished(T0, served.id, served.phase).unwrap();
    // The worker's own events for that request, hashed from other tokens.
    store(&mut r, 1, 910..=917);
    if matches!(said, Said::DiffersThenAgrees) {
        r.handle_worker_tokens(WorkerId(1), true);
    }
    let preview = |r: &mut Router, id, blocks: &[u64]| {
        let mut q = req(id, blocks);
        q.preview = true;
        let d = routed(r.handle_request(T0, q, Draw(0)));
        (d.target.worker.0, d.overlap.device)
    };
    let case = alloc::format!("{tokens:?}, approximate {approximate}, worker 1: {said:?}");
    assert_eq!(preview(&mut r, 2, &[10, 11, 12, 13, 14, 15, 16, 17]), want_repeat, "the repeat; {case}");
    assert_eq!(preview(&mut r, 3, &[1, 2, 3, 4]), want_exact, "matching events; {case}");
    let silent_repeat = preview(&mut r, 5, &[20, 21, 22, 23]);
    if want_silent_repeat.1 == 0 {
        assert_eq!(silent_repeat.1, 0, "the silent worker's repeat: {silent_repeat:?}; {case}");
    } else {
        assert_eq!(silent_repeat, want_silent_repeat, "the silent worker's repeat; {case}");
    }
    invariants(&r);
}

#[test]
fn estimated_tokens_predict_workers_whose_events_cannot_match() {
    use RequestTokens::{Engine, Estimated};
    // With the engines' tokens, worker 1's events make it exact: nothing matches there,
    // and the draw picks among equals.
    check((Engine, true, Said::Nothing), (2, 0), (2, 4), (0, 4));
    // With estimated tokens, its predictions stay and attract the repeat; worker 2's
    // matching events still count exactly.
    check((Estimated, true, Said::Nothing), (1, 8), (2, 4), (0, 4));
    // With `approximate` off, estimated tokens still predict the workers that publish
    // events (a model without a tokenizer in front of real engines), and only those.
    check((Estimated, false, Said::Nothing), (1, 8), (2, 4), (0, 0));
    check((Engine, false, Said::Nothing), (2, 0), (2, 4), (0, 0));
}

#[test]
fn a_worker_that_tokenizes_otherwise_is_predicted_until_it_agrees() {
    use RequestTokens::Engine;
    // Worker 1 alone is routed as estimated tokens route every worker: its predictions
    // attract the repeat, worker 2 stays exact, and the silent worker 0 is predicted only
    // in approximate mode.
    check((Engine, false, Said::Differs), (1, 8), (2, 4), (0, 0));
    check((Engine, true, Said::Differs), (1, 8), (2, 4), (0, 4));
    // Once it agrees, its events alone describe it, and its predictions are gone.
    check((Engine, false, Said::DiffersThenAgrees), (2, 0), (2, 4), (0, 0));
    check((Engine, true, Said::DiffersThenAgrees), (2, 0), (2, 4), (0, 4));
}

#[test]
fn what_is_said_of_an_unknown_or_removed_worker_is_not_kept() {
    let mut r = router(RouterMode::Kv, 2);
    r.handle_worker_tokens(WorkerId(7), false);
    r.handle_worker_tokens(WorkerId(1), false);
    r.handle_worker_update(T0, WorkerUpdate::Removed(WorkerId(1))).unwrap();
    // Back under the same id, it starts agreeing: its events alone describe it.
    r.handle_worker_update(T0, WorkerUpdate::Upsert(spec(1, WorkerRole::Aggregated))).unwrap();
    store(&mut r, 1, 900..=903);
    let mut pinned = req(1, &[10, 11, 12, 13]);
    pinned.hints.backend_instance_id = Some(WorkerId(1));
    let first = routed(r.handle_request(T0, pinned, Draw(0)));
    r.handle_dispatched(T0, first.id, first.phase).unwrap();
    r.handle_finished(T0, first.id, first.phase).unwrap();
    let mut q = req(2, &[10, 11, 12, 13]);
    q.preview = true;
    let d = routed(r.handle_request(T0, q, Draw(0)));
    assert_eq!(d.overlap.device, 0, "no prediction kept for worker 1: {d:?}");
    invariants(&r);
}
