//! A sessionless request whose best prefix is short and is shared text (held by several
//! workers, or by one where no earlier prompt ended: a system prompt every conversation
//! starts with) is weighed without the keep term; a conversation's own context, where its
//! last prompt ended, keeps it.

use alloc::format;
use alloc::vec::Vec;

use super::*;

const PROMPT_BLOCKS: u64 = 4;

/// Three workers: the first `holders` hold a 4-block shared prompt and each decodes
/// `busy` requests pinned there (16 blocks each, 128 output tokens); the rest are empty.
/// With `ended`, an earlier request of just that prompt went to worker 0 and finished.
fn fleet(holders: u64, busy: u64, ended: bool) -> Router {
    let mut r = router(RouterMode::Kv, 3);
    if ended {
        let prompt: Vec<u64> = (1..=PROMPT_BLOCKS).collect();
        let mut q = req(900, &prompt);
        q.hints.decode_worker_id = Some(WorkerId(0));
        let d = routed(r.handle_request(T0, q, Draw(0)));
        r.handle_dispatched(T0, d.id, d.phase).unwrap();
        r.handle_finished(T0, d.id, d.phase).unwrap();
    }
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
/// with the prompt on `holders` workers each decoding `busy` requests, and with or
/// without an earlier prompt that `ended` at it. The preview must agree.
fn check(holders: u64, own: u64, busy: u64, ended: bool) -> u64 {
    let mut r = fleet(holders, busy, ended);
    let blocks: Vec<u64> = (1..=PROMPT_BLOCKS).chain(500..500 + own).collect();
    let ask = |preview: bool| Request { preview, expected_output_tokens: Some(128), ..req(1, &blocks) };
    let seen = routed(r.handle_request(T0, ask(true), Draw(0))).target.worker.0;
    let placed = routed(r.handle_request(T0, ask(false), Draw(0))).target.worker.0;
    assert_eq!(seen, placed, "the preview disagrees: {holders} holders, {own} own blocks, {busy} busy");
    invariants(&r);
    placed
}

#[test]
fn a_short_shared_prompt_does_not_hold_a_new_conversation() {
    // (holders, blocks of its own, requests decoding on each holder, whether an earlier
    // prompt ended at the shared one, where it goes: `None` for any holder).
    let cases: [(u64, u64, u64, bool, Option<u64>); 9] = [
        // Short and on two busy workers: shared text, so the empty worker.
        (2, 12, 2, false, Some(2)),
        // On one worker, where the last prompt ended: this conversation's context, so
        // the keep term holds it.
        (1, 12, 2, true, Some(0)),
        // On one worker, but no prompt ended there: a system prompt's first holder.
        (1, 12, 2, false, Some(2)),
        // Most of the request: the holders keep it however many they are.
        (2, 2, 2, false, None),
        (1, 2, 2, false, Some(0)),
        // Idle holders: the prompt's cache wins on its own.
        (2, 12, 0, false, None),
        (1, 12, 0, false, Some(0)),
        // Busier still: the pair loses it even where a prompt ended; a single holder
        // where one ended keeps it.
        (2, 12, 8, true, Some(2)),
        (1, 12, 8, true, Some(0)),
    ];
    for (holders, own, busy, ended, want) in cases {
        let got = check(holders, own, busy, ended);
        let case = format!("{holders} holders, {own} own blocks, {busy} busy, ended {ended}");
        match want {
            Some(w) => assert_eq!(got, w, "{case}"),
            None => assert!(got < holders, "{case}: went to {got}"),
        }
    }
}
