//! A sessionless request whose best prefix is short and held by several workers (a
//! system prompt every conversation starts with) is weighed without the keep term; a
//! conversation's own context, on one worker, keeps it.

use alloc::vec::Vec;

use super::*;

const PROMPT_BLOCKS: u64 = 4;

/// Three workers: the first `holders` hold a 4-block shared prompt and each decodes
/// `busy` requests pinned there (16 blocks each, 128 output tokens); the rest are empty.
fn fleet(holders: u64, busy: u64) -> Router {
    let mut r = router(RouterMode::Kv, 3);
    for w in 0..holders {
        store(&mut r, w, 1..=PROMPT_BLOCKS);
        for i in 0..busy {
            let own: Vec<u64> = (0..16).map(|b| 10_000 + w * 1_000 + i * 100 + b).collect();
            let mut q = req(1_000 + w * 100 + i, &own);
            q.hints.decode_worker_id = Some(WorkerId(w));
            q.expected_output_tokens = Some(128);
            let d = routed(r.handle_request(T0, q, Draw(0)));
            r.handle_dispatched(T0, d.id, d.phase).unwrap();
            r.handle_prefill_done(T0, d.id, d.phase).unwrap();
        }
    }
    r
}

/// Where a sessionless request of the shared prompt and `own` blocks of its own goes,
/// with the prompt on `holders` workers each decoding `busy` requests. The preview
/// must agree.
fn check(holders: u64, own: u64, busy: u64) -> u64 {
    let mut r = fleet(holders, busy);
    let blocks: Vec<u64> = (1..=PROMPT_BLOCKS).chain(500..500 + own).collect();
    let ask = |preview: bool| Request { preview, expected_output_tokens: Some(128), ..req(1, &blocks) };
    let seen = routed(r.handle_request(T0, ask(true), Draw(0))).target.worker.0;
    let placed = routed(r.handle_request(T0, ask(false), Draw(0))).target.worker.0;
    assert_eq!(seen, placed, "the preview disagrees: {holders} holders, {own} own blocks, {busy} busy");
    invariants(&r);
    placed
}

#[test]
fn a_short_prompt_on_several_busy_workers_does_not_hold_a_new_conversation() {
    // (holders, blocks of its own, requests decoding on each holder, where it goes:
    // `None` for any holder).
    let cases: [(u64, u64, u64, Option<u64>); 6] = [
        // Short and on two busy workers: shared text, so the empty worker.
        (2, 12, 2, Some(2)),
        // On one worker only: this conversation's context, so the keep term holds it.
        (1, 12, 2, Some(0)),
        // Most of the request: the holders keep it however many they are.
        (2, 2, 2, None),
        // Idle holders: the prompt's cache wins on its own.
        (2, 12, 0, None),
        // Busier still: the pair loses it, a single holder keeps it.
        (2, 12, 8, Some(2)),
        (1, 12, 8, Some(0)),
    ];
    for (holders, own, busy, want) in cases {
        let got = check(holders, own, busy);
        match want {
            Some(w) => assert_eq!(got, w, "{holders} holders, {own} own blocks, {busy} busy"),
            None => assert!(got < holders, "{holders} holders, {own} own blocks, {busy} busy: went to {got}"),
        }
    }
}
