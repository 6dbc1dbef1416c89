//! Cases for [`ApproxIndex`]: TTL expiry, the per-key LRU bound, bounded timeout work,
//! and time going backwards.

use alloc::vec::Vec;

use super::super::*;
use crate::time::Instant;
use crate::types::Overlap;

/// One step at a time in milliseconds.
#[derive(Clone, Copy, Debug)]
enum A {
    /// Record blocks for a worker (rank 0).
    Rec(u64, u64, &'static [u64]),
    /// `handle_timeout` until nothing is due.
    Tick(u64),
    Gone(u64),
}
use A::*;

fn k(w: u64) -> WorkerKey {
    WorkerKey::new(w, 0)
}

fn seqs(h: &[u64]) -> Vec<SeqHash> {
    h.iter().map(|&x| SeqHash(x)).collect()
}

fn t(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn run(index: &mut ApproxIndex, steps: &[A]) {
    for &s in steps {
        match s {
            Rec(at, w, b) => index.record(t(at), k(w), &seqs(b)),
            Tick(at) => {
                while index.poll_timeout().is_some_and(|d| d <= t(at)) {
                    index.handle_timeout(t(at));
                }
            }
            Gone(w) => index.remove_worker(WorkerId(w)),
        }
    }
}

/// Runs `steps`, then checks the answer to `q` at `at` ms: `(worker, device blocks)`.
#[track_caller]
fn check(cfg: ApproxConfig, steps: &[A], at: u64, q: &[u64], want: &[(u64, u32)]) {
    let mut index = ApproxIndex::new(cfg);
    run(&mut index, steps);
    let mut out = OverlapScores::new();
    index.find_matches(t(at), &seqs(q), &mut out);
    let got: Vec<_> = out.iter().map(|(key, o)| (key.worker.0, o.device)).collect();
    assert_eq!(got, want, "after {steps:?}, at {at} ms, query {q:?}");
    assert!(out.iter().all(|(_, o)| o.host == 0 && o.disk == 0));
}

#[test]
fn predictions() {
    let c = ApproxConfig { ttl_ms: 1000, ..ApproxConfig::default() };
    check(c, &[], 0, &[1, 2], &[]);
    check(c, &[Rec(0, 0, &[1, 2, 3])], 10, &[1, 2, 9], &[(0, 2)]);
    check(c, &[Rec(0, 2, &[1, 2]), Rec(0, 1, &[1])], 10, &[1, 2], &[(1, 1), (2, 2)]);
    check(c, &[Rec(0, 0, &[1, 2, 3])], 10, &[2, 3], &[(0, 2)]);
    check(c, &[Rec(0, 0, &[1, 3])], 10, &[1, 2, 3], &[(0, 1)]);
    check(c, &[Rec(0, 0, &[1, 2]), Gone(0)], 10, &[1, 2], &[]);
    check(c, &[Rec(0, 0, &[1, 2]), Rec(0, 1, &[1, 2]), Gone(0)], 10, &[1, 2], &[(1, 2)]);
}

#[test]
fn predictions_expire_after_the_ttl() {
    let c = ApproxConfig { ttl_ms: 1000, ..ApproxConfig::default() };
    check(c, &[Rec(0, 0, &[1, 2])], 999, &[1, 2], &[(0, 2)]);
    check(c, &[Rec(0, 0, &[1, 2])], 1000, &[1, 2], &[]);
    // Expired but not yet freed still never counts.
    check(c, &[Rec(0, 0, &[1, 2])], 5000, &[1, 2], &[]);
    // Re-recording extends the life of what it names only.
    check(c, &[Rec(0, 0, &[1, 2]), Rec(800, 0, &[1])], 1500, &[1, 2], &[(0, 1)]);
    check(c, &[Rec(0, 0, &[1, 2]), Rec(800, 0, &[1, 2]), Tick(1500)], 1500, &[1, 2], &[(0, 2)]);
    check(c, &[Rec(0, 0, &[1, 2]), Tick(1000), Rec(1000, 1, &[1])], 1000, &[1, 2], &[(1, 1)]);
}

#[test]
fn each_key_keeps_its_most_recent_predictions() {
    let c = ApproxConfig { blocks_max_per_worker: 4, ..ApproxConfig::default() };
    // A record longer than the bound keeps its prefix (leaves go first).
    check(c, &[Rec(0, 0, &[1, 2, 3, 4, 5, 6])], 1, &[1, 2, 3, 4, 5, 6], &[(0, 4)]);
    // Older records lose their deep ends to newer ones.
    check(c, &[Rec(0, 0, &[1, 2, 3]), Rec(1, 0, &[7, 8])], 2, &[1, 2, 3], &[(0, 2)]);
    check(c, &[Rec(0, 0, &[1, 2, 3]), Rec(1, 0, &[7, 8])], 2, &[7, 8], &[(0, 2)]);
    // Re-recording refreshes recency, so the other record is evicted instead.
    check(c, &[Rec(0, 0, &[1, 2]), Rec(1, 0, &[5, 6]), Rec(2, 0, &[1, 2]), Rec(3, 0, &[9])], 4, &[1, 2], &[(0, 2)]);
    check(c, &[Rec(0, 0, &[1, 2]), Rec(1, 0, &[5, 6]), Rec(2, 0, &[1, 2]), Rec(3, 0, &[9])], 4, &[5, 6], &[(0, 1)]);
    // The bound is per key.
    check(c, &[Rec(0, 0, &[1, 2, 3, 4]), Rec(1, 1, &[5, 6, 7, 8])], 2, &[1, 2, 3, 4], &[(0, 4)]);
    let none = ApproxConfig { blocks_max_per_worker: 0, ..c };
    check(none, &[Rec(0, 0, &[1, 2])], 1, &[1], &[]);
    let one_key = ApproxConfig { keys_max: 1, ..c };
    check(one_key, &[Rec(0, 0, &[1]), Rec(0, 1, &[1])], 1, &[1], &[(0, 1)]);
}

#[test]
fn handle_timeout_does_bounded_work() {
    let mut index =
        ApproxIndex::new(ApproxConfig { ttl_ms: 10, blocks_max_per_worker: 5000, ..ApproxConfig::default() });
    assert_eq!(index.poll_timeout(), None);
    index.handle_timeout(t(0));
    let blocks: Vec<u64> = (0..3000).collect();
    index.record(t(0), k(0), &seqs(&blocks));
    index.record(t(5), k(1), &seqs(&blocks[..10]));
    assert_eq!(index.entries(), 3010);
    assert_eq!(index.poll_timeout(), Some(t(10)));
    index.handle_timeout(t(9));
    assert_eq!(index.entries(), 3010, "nothing due yet");
    let mut calls = 0;
    while index.poll_timeout().is_some_and(|d| d <= t(12)) {
        let before = index.entries();
        index.handle_timeout(t(12));
        assert!(before - index.entries() <= EXPIRE_PER_CALL_MAX);
        calls += 1;
    }
    assert_eq!((calls, index.entries()), (3, 10));
    assert_eq!(index.poll_timeout(), Some(t(15)));
    index.handle_timeout(t(1_000_000));
    assert_eq!((index.entries(), index.poll_timeout()), (0, None));
}

#[test]
fn time_going_backwards_is_harmless() {
    let c = ApproxConfig { ttl_ms: 1000, ..ApproxConfig::default() };
    // A record stamped with an earlier time lives from the latest time seen.
    check(c, &[Rec(5000, 0, &[1]), Rec(100, 1, &[1])], 5500, &[1], &[(0, 1), (1, 1)]);
    check(c, &[Rec(5000, 0, &[1]), Tick(0), Rec(100, 1, &[1]), Tick(200)], 5999, &[1], &[(0, 1), (1, 1)]);
    // Querying in the past sees what was recorded later.
    check(c, &[Rec(5000, 0, &[1])], 0, &[1], &[(0, 1)]);
    let mut index = ApproxIndex::new(c);
    index.record(Instant::MAX, k(0), &seqs(&[1]));
    index.record(t(1), k(0), &seqs(&[2]));
    index.handle_timeout(Instant::MAX);
    assert_eq!(index.entries(), 0);
}

#[test]
fn merging_predictions_into_exact_scores() {
    let mut exact = PrefixIndex::new(IndexConfig::default());
    let b: Vec<BlockHash> =
        [1u64, 2].iter().map(|&h| BlockHash { seq: SeqHash(h), local: crate::hash::LocalHash(h) }).collect();
    exact.apply(k(1), IndexEvent::Stored { parent: None, blocks: &b, tier: Tier::Host }).expect("stored");
    let mut approx = ApproxIndex::new(ApproxConfig::default());
    approx.record(t(0), k(0), &seqs(&[1, 2, 3]));
    let (mut scores, mut predicted) = (OverlapScores::new(), OverlapScores::new());
    exact.find_matches(&seqs(&[1, 2, 3]), false, &mut scores);
    approx.find_matches(t(1), &seqs(&[1, 2, 3]), &mut predicted);
    for (key, o) in predicted.iter() {
        scores.add_device(key, o.device);
    }
    let got: Vec<_> = scores.iter().collect();
    assert_eq!(got, [(k(0), Overlap { device: 3, host: 0, disk: 0 }), (k(1), Overlap { device: 0, host: 2, disk: 0 })]);
}
