//! Scenario tests: a script of operations, then the load each key should show.

pub(super) mod keys;
mod model;
mod shared;

use super::*;
use alloc::vec;
use Phase::{Aggregated as Agg, Decode as Dec, Prefill as Pre};

const AGE_MS: u64 = 1000;
const BS4: BlockSize = match BlockSize::new(4) {
    Ok(bs) => bs,
    Err(_) => BlockSize::DEFAULT,
};

/// One step of a script. Keys are (worker, rank); blocks are raw sequence hashes.
#[derive(Clone, Copy, Debug)]
enum Op {
    /// req, phase, key, blocks, prefill tokens, expected output blocks.
    Add(u64, Phase, (u64, u32), &'static [u64], u32, u32),
    PrefillDone(u64, Phase),
    /// req, phase, output tokens so far (block size 4).
    Progress(u64, Phase, u32),
    Free(u64, Phase),
    RemoveWorker(u64),
    /// Moves the clock to this many ms and expires everything due.
    AtMs(u64),
}

fn key((w, r): (u64, u32)) -> WorkerKey {
    WorkerKey::new(w, r)
}

fn tracker() -> LoadTracker {
    LoadTracker::new(LoadConfig { request_age_max_ms: AGE_MS, requests_max: 8, hash_seed: 99 })
}

/// A key and its expected (prefill tokens, decode blocks, requests).
type Want = ((u64, u32), (u64, u64, u32));

/// Runs `ops` on a fresh tracker, expecting each to succeed.
#[track_caller]
fn run(ops: &[Op]) -> LoadTracker {
    let mut t = tracker();
    let mut now = Instant::ZERO;
    for op in ops {
        let r = match *op {
            Op::Add(req, phase, k, blocks, prefill, expected) => {
                let blocks: Vec<SeqHash> = blocks.iter().map(|&h| SeqHash(h)).collect();
                t.add(now, RequestId(req), phase, key(k), &blocks, prefill, expected)
            }
            Op::PrefillDone(req, phase) => t.prefill_done(RequestId(req), phase),
            Op::Progress(req, phase, out) => t.decode_progress(RequestId(req), phase, out, BS4),
            Op::Free(req, phase) => t.free(RequestId(req), phase),
            Op::RemoveWorker(w) => {
                t.remove_worker(WorkerId(w));
                Ok(())
            }
            Op::AtMs(ms) => {
                now = Instant::from_millis(ms);
                drain_timeouts(&mut t, now);
                Ok(())
            }
        };
        assert_eq!(r, Ok(()), "{op:?}");
    }
    t
}

/// Runs `ops`, expecting each to succeed, then checks every listed key's load and that
/// no other key holds any.
#[track_caller]
fn check(ops: &[Op], want: &[Want]) {
    let t = run(ops);
    let mut sum = WorkerLoad::default();
    for &(k, (prefill, decode, requests)) in want {
        let got = t.load(key(k));
        let want =
            WorkerLoad { active_prefill_tokens: prefill, active_decode_blocks: decode, active_requests: requests };
        assert_eq!(got, want, "load of {k:?}");
        sum.active_prefill_tokens += prefill;
        sum.active_decode_blocks += decode;
        sum.active_requests += requests;
    }
    assert_eq!(t.total(), sum, "load on keys not listed");
    assert_eq!(t.len(), sum.active_requests as usize, "bookings vs requests");
}

/// Calls `handle_timeout` until nothing is due, as an adapter would; returns the calls made.
fn drain_timeouts(t: &mut LoadTracker, now: Instant) -> usize {
    let mut calls = 0;
    while t.poll_timeout().is_some_and(|d| d <= now) {
        t.handle_timeout(now);
        calls += 1;
        assert!(calls < 10_000, "handle_timeout makes no progress");
    }
    while t.poll_expired().is_some() {}
    calls
}

#[test]
fn shared_prompt_blocks_count_once_per_key() {
    check(
        &[Op::Add(1, Agg, (0, 0), &[1, 2, 3], 10, 0), Op::Add(2, Agg, (0, 0), &[1, 2, 4], 7, 0)],
        &[((0, 0), (17, 4, 2))],
    );
    check(
        &[Op::Add(1, Agg, (0, 0), &[1, 2, 3], 10, 0), Op::Add(2, Agg, (0, 1), &[1, 2, 3], 7, 0)],
        &[((0, 0), (10, 3, 1)), ((0, 1), (7, 3, 1))],
    );
}

#[test]
fn phases_differ_in_what_they_hold() {
    // Prefill bookings hold tokens and a slot, never decode blocks; the same request may
    // hold a prefill and a decode booking at once.
    check(&[Op::Add(1, Pre, (0, 0), &[1, 2], 8, 5)], &[((0, 0), (8, 0, 1))]);
    check(&[Op::Add(1, Dec, (0, 0), &[1, 2], 0, 5)], &[((0, 0), (0, 7, 1))]);
    check(
        &[Op::Add(1, Pre, (0, 0), &[1, 2], 8, 0), Op::Add(1, Dec, (1, 0), &[1, 2], 0, 0)],
        &[((0, 0), (8, 0, 1)), ((1, 0), (0, 2, 1))],
    );
}

#[test]
fn prefill_tokens_drop_when_prefill_ends() {
    let add = Op::Add(1, Agg, (0, 0), &[1], 100, 0);
    check(&[add, Op::PrefillDone(1, Agg)], &[((0, 0), (0, 1, 1))]);
    // First output token implies the prefill ended, even if prefill_done was lost.
    check(&[add, Op::Progress(1, Agg, 1)], &[((0, 0), (0, 2, 1))]);
    check(&[add, Op::Progress(1, Agg, 0)], &[((0, 0), (100, 1, 1))]);
}

#[test]
fn expected_output_shrinks_as_decode_progresses() {
    let add = Op::Add(1, Agg, (0, 0), &[1, 2], 0, 3);
    check(&[add], &[((0, 0), (0, 5, 1))]);
    // 9 tokens at 4 per block = 3 blocks, exactly the prediction.
    check(&[add, Op::Progress(1, Agg, 9)], &[((0, 0), (0, 5, 1))]);
    // 13 tokens = 4 blocks: generation overtook the prediction.
    check(&[add, Op::Progress(1, Agg, 13)], &[((0, 0), (0, 6, 1))]);
    // A stale, lower count changes nothing.
    check(&[add, Op::Progress(1, Agg, 13), Op::Progress(1, Agg, 2)], &[((0, 0), (0, 6, 1))]);
    // Unknown prediction: output blocks join as they are generated.
    check(&[Op::Add(1, Agg, (0, 0), &[], 0, 0), Op::Progress(1, Agg, 5)], &[((0, 0), (0, 2, 1))]);
    // Prefill bookings never hold decode blocks, whatever the progress.
    check(&[Op::Add(1, Pre, (0, 0), &[1], 4, 2), Op::Progress(1, Pre, 40)], &[((0, 0), (0, 0, 1))]);
}

#[test]
fn free_and_remove_worker_return_load() {
    let a = Op::Add(1, Agg, (0, 0), &[1, 2], 5, 1);
    let b = Op::Add(2, Agg, (0, 0), &[2, 3], 5, 1);
    check(&[a, b, Op::Free(1, Agg)], &[((0, 0), (5, 3, 1))]);
    check(&[a, b, Op::Free(1, Agg), Op::Free(2, Agg)], &[]);
    check(
        &[a, Op::Add(2, Agg, (0, 3), &[1], 1, 0), Op::Add(3, Agg, (1, 0), &[1], 1, 0), Op::RemoveWorker(0)],
        &[((1, 0), (1, 1, 1))],
    );
}

#[test]
fn bookings_expire_with_age() {
    let a = Op::Add(1, Agg, (0, 0), &[1], 5, 0);
    check(&[a, Op::AtMs(AGE_MS - 1)], &[((0, 0), (5, 1, 1))]);
    check(&[a, Op::AtMs(AGE_MS)], &[]);
    // Re-adding after expiry is a fresh booking, aged from its own start.
    check(&[a, Op::AtMs(AGE_MS), a, Op::AtMs(2 * AGE_MS - 1)], &[((0, 0), (5, 1, 1))]);
    // The clock going backwards expires nothing and does not panic.
    check(&[Op::AtMs(5000), a, Op::AtMs(10)], &[((0, 0), (5, 1, 1))]);
}

#[test]
fn unknown_ids_and_duplicates_are_counted_no_ops() {
    let mut t = tracker();
    let (r, k) = (RequestId(1), WorkerKey::new(0, 0));
    let unknown = Err(LoadError::UnknownRequest { req: r, phase: Agg });
    assert_eq!(t.free(r, Agg), unknown);
    assert_eq!(t.prefill_done(r, Agg), unknown);
    assert_eq!(t.decode_progress(r, Agg, 3, BS4), unknown);
    assert_eq!(t.add(Instant::ZERO, r, Agg, k, &[SeqHash(1)], 3, 0), Ok(()));
    let dup = t.add(Instant::ZERO, r, Agg, k, &[SeqHash(2)], 9, 0);
    assert_eq!(dup, Err(LoadError::DuplicateRequest { req: r, phase: Agg }));
    assert_eq!(t.free(r, Dec), Err(LoadError::UnknownRequest { req: r, phase: Dec }));
    assert_eq!(t.load(k), WorkerLoad { active_prefill_tokens: 3, active_decode_blocks: 1, active_requests: 1 });
    let s = t.stats();
    assert_eq!((s.unknown_request, s.duplicate_request, s.table_full), (4, 1, 0));
    assert_eq!(t.remove_worker(WorkerId(7)), 0);
}

#[test]
fn table_full_refuses_and_counts() {
    let mut t = tracker();
    let k = WorkerKey::new(0, 0);
    for i in 0..8 {
        assert_eq!(t.add(Instant::ZERO, RequestId(i), Agg, k, &[], 1, 0), Ok(()));
    }
    assert_eq!(t.add(Instant::ZERO, RequestId(8), Agg, k, &[], 1, 0), Err(LoadError::TableFull { requests_max: 8 }));
    assert_eq!((t.len(), t.stats().table_full), (8, 1));
    assert_eq!(t.free(RequestId(0), Agg), Ok(()));
    assert_eq!(t.add(Instant::ZERO, RequestId(8), Agg, k, &[], 1, 0), Ok(()));
}

#[test]
fn new_blocks_counts_what_a_booking_would_add() {
    let mut t = tracker();
    let k = WorkerKey::new(0, 0);
    let hashes = |v: &[u64]| v.iter().map(|&h| SeqHash(h)).collect::<Vec<_>>();
    assert_eq!(t.new_blocks(k, &hashes(&[1, 2, 3])), 3);
    t.add(Instant::ZERO, RequestId(1), Agg, k, &hashes(&[1, 2]), 0, 0).unwrap();
    for (blocks, want) in [(vec![1, 2, 3], 1), (vec![1, 2], 0), (vec![4, 5], 2), (vec![], 0)] {
        let before = t.load(k).active_decode_blocks;
        assert_eq!(t.new_blocks(k, &hashes(&blocks)), want, "{blocks:?}");
        // The count must match what booking those blocks actually adds.
        t.add(Instant::ZERO, RequestId(2), Agg, k, &hashes(&blocks), 0, 0).unwrap();
        assert_eq!(t.load(k).active_decode_blocks - before, u64::from(want), "{blocks:?}");
        t.free(RequestId(2), Agg).unwrap();
    }
    assert_eq!(t.new_blocks(WorkerKey::new(0, 1), &hashes(&[1])), 1, "other rank");
}

/// Runs `ops`, then compares key (0, 0)'s prefill progress with (requests, ms the
/// stretch began, done tokens).
#[track_caller]
fn check_progress(ops: &[Op], want: (u32, Option<u64>, u64)) {
    let got = run(ops).prefill_progress(key((0, 0)));
    let want = PrefillProgress { requests: want.0, busy_since: want.1.map(Instant::from_millis), done_tokens: want.2 };
    assert_eq!(got, want, "{ops:?}");
}

#[test]
fn prefill_progress_follows_a_stretch_of_outstanding_prefill() {
    let a = Op::Add(1, Agg, (0, 0), &[1], 100, 0);
    let b = Op::Add(2, Agg, (0, 0), &[2], 50, 0);
    let c = Op::Add(3, Agg, (0, 0), &[3], 30, 0);
    check_progress(&[], (0, None, 0));
    check_progress(&[Op::AtMs(5), a], (1, Some(5), 0));
    // A second booking joins the stretch the first began.
    check_progress(&[a, Op::AtMs(10), b], (2, Some(0), 0));
    // Finished prefills count as done, by prefill_done or by any output.
    check_progress(&[a, Op::AtMs(10), b, Op::PrefillDone(1, Agg)], (1, Some(0), 100));
    check_progress(&[a, Op::AtMs(10), b, Op::Progress(1, Agg, 1)], (1, Some(0), 100));
    check_progress(&[a, b, Op::Progress(1, Agg, 0)], (2, Some(0), 0));
    check_progress(&[a, b, Op::PrefillDone(1, Agg), Op::PrefillDone(1, Agg)], (1, Some(0), 100));
    // The stretch ends with the last prefill; the next booking begins a new one.
    check_progress(&[a, b, Op::PrefillDone(1, Agg), Op::PrefillDone(2, Agg)], (0, None, 0));
    let done = [a, b, Op::PrefillDone(1, Agg), Op::PrefillDone(2, Agg), Op::AtMs(20), c];
    check_progress(&done, (1, Some(20), 0));
    // A decoding booking keeps the key but not the stretch.
    check_progress(&[a, Op::PrefillDone(1, Agg), Op::AtMs(20), c], (1, Some(20), 0));
    // Dropped bookings leave without counting as done.
    check_progress(&[a, b, Op::Free(1, Agg)], (1, Some(0), 0));
    check_progress(&[a, Op::AtMs(AGE_MS)], (0, None, 0));
    check_progress(&[a, b, Op::RemoveWorker(0)], (0, None, 0));
    // Prefill bookings prefill; decode bookings compute no prompt.
    check_progress(&[Op::Add(4, Pre, (0, 0), &[1], 10, 0)], (1, Some(0), 0));
    check_progress(&[Op::Add(4, Dec, (0, 0), &[1], 0, 0)], (0, None, 0));
    // A fully cached prompt is still a prefill to wait for.
    check_progress(&[Op::Add(5, Agg, (0, 0), &[1], 0, 0)], (1, Some(0), 0));
    // Other keys have their own.
    check_progress(&[Op::Add(6, Agg, (0, 1), &[1], 10, 0)], (0, None, 0));
}

#[test]
fn held_prefix_counts_leading_blocks_booked_on_the_key() {
    let hashes = |v: &[u64]| v.iter().map(|&h| SeqHash(h)).collect::<Vec<_>>();
    let t = run(&[
        Op::Add(1, Agg, (0, 0), &[1, 2, 3], 10, 0),
        Op::Add(2, Pre, (0, 0), &[7, 8], 10, 0),
        Op::Add(3, Agg, (0, 1), &[5], 10, 0),
    ]);
    for (k, blocks, want) in [
        ((0, 0), vec![1, 2, 3, 4], 3),
        ((0, 0), vec![1, 2], 2),
        ((0, 0), vec![1, 9, 3], 1),
        ((0, 0), vec![9, 1], 0),
        ((0, 0), vec![], 0),
        // Prefill bookings hold no blocks.
        ((0, 0), vec![7, 8], 0),
        ((0, 1), vec![5, 1], 1),
        ((1, 0), vec![1], 0),
    ] {
        assert_eq!(t.held_prefix(key(k), &hashes(&blocks)), want, "{k:?} {blocks:?}");
    }
}

#[test]
fn clock_jump_expires_everything_with_bounded_work() {
    let n = 2 * EXPIRE_PER_CALL_MAX + 10;
    let mut t = LoadTracker::new(LoadConfig { request_age_max_ms: AGE_MS, ..LoadConfig::default() });
    for i in 0..n as u64 {
        t.add(Instant::from_millis(i), RequestId(i), Agg, WorkerKey::new(i % 3, 0), &[SeqHash(i % 5)], 1, 0).unwrap();
    }
    assert_eq!(t.poll_timeout(), Some(Instant::from_millis(AGE_MS)));
    let now = Instant::from_millis(1 << 40);
    t.handle_timeout(now);
    assert_eq!(t.len(), n - EXPIRE_PER_CALL_MAX, "one call does bounded work");
    assert!(t.poll_timeout().is_some_and(|d| d <= now), "more is due, so poll_timeout says so");
    // The oldest expire first.
    assert_eq!(t.poll_expired(), Some((RequestId(0), Agg)));
    assert_eq!(drain_timeouts(&mut t, now), 2);
    assert_eq!((t.len(), t.total(), t.poll_timeout()), (0, WorkerLoad::default(), None));
    assert_eq!(t.stats().expired, n as u64);
}

#[test]
fn undrained_expiry_reports_are_bounded() {
    let n = EXPIRED_QUEUE_MAX + 100;
    let mut t = LoadTracker::new(LoadConfig { request_age_max_ms: 1, ..LoadConfig::default() });
    for i in 0..n as u64 {
        t.add(Instant::ZERO, RequestId(i), Dec, WorkerKey::new(0, 0), &[], 0, 0).unwrap();
    }
    let now = Instant::from_millis(1);
    for _ in 0..n.div_ceil(EXPIRE_PER_CALL_MAX) {
        t.handle_timeout(now);
    }
    assert_eq!(t.len(), 0);
    let mut reported = 0;
    while t.poll_expired().is_some() {
        reported += 1;
    }
    assert_eq!(reported, EXPIRED_QUEUE_MAX);
    assert_eq!(t.stats().expired_unreported, 100);
}

#[test]
fn overlong_prompts_are_capped() {
    let mut t = tracker();
    let blocks: Vec<SeqHash> = (0..BLOCKS_MAX_PER_REQUEST as u64 + 3).map(SeqHash).collect();
    let k = WorkerKey::new(0, 0);
    assert_eq!(t.new_blocks(k, &blocks), BLOCKS_MAX_PER_REQUEST as u32);
    t.add(Instant::ZERO, RequestId(1), Agg, k, &blocks, 0, 0).unwrap();
    assert_eq!(t.load(k).active_decode_blocks, BLOCKS_MAX_PER_REQUEST as u64);
    assert_eq!(t.stats().blocks_truncated, 3);
}

#[test]
fn errors_display() {
    let cases = [
        (LoadError::UnknownRequest { req: RequestId(4), phase: Dec }, "no decode booking for request 4"),
        (LoadError::DuplicateRequest { req: RequestId(4), phase: Pre }, "request 4 already has a prefill booking"),
        (LoadError::TableFull { requests_max: 8 }, "load tracker full (8 bookings)"),
    ];
    for (e, want) in cases {
        assert_eq!(alloc::format!("{e}"), want);
    }
}

proptest::proptest! {
    /// For real chains (prompts drawn from a small alphabet so prefixes are shared), the
    /// binary-search count always equals the linear one.
    #[test]
    fn new_blocks_chain_matches_new_blocks(
        prompts in proptest::collection::vec(proptest::collection::vec(0u64..3, 0..8), 1..6),
        booked in proptest::collection::vec(proptest::bool::ANY, 6),
        phases in proptest::collection::vec(proptest::sample::select(Phase::ALL.to_vec()), 6),
    ) {
        let chains: Vec<Vec<SeqHash>> = prompts
            .iter()
            .map(|locals| {
                let locals: Vec<_> = locals.iter().map(|&l| crate::hash::LocalHash(l)).collect();
                let mut out = Vec::new();
                crate::hash::chain_all(None, &locals, &mut out);
                out.into_iter().map(|b| b.seq).collect()
            })
            .collect();
        let mut t = tracker();
        let k = WorkerKey::new(0, 0);
        for (i, chain) in chains.iter().enumerate() {
            if booked[i] {
                t.add(Instant::ZERO, RequestId(i as u64), phases[i], k, chain, 0, 0).unwrap();
            }
        }
        for chain in &chains {
            proptest::prop_assert_eq!(t.new_blocks_chain(k, chain), t.new_blocks(k, chain));
        }
    }
}
