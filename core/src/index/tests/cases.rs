//! Table-style cases for [`PrefixIndex`]: what each event does, and what queries see.

use alloc::vec::Vec;

use super::super::*;
use crate::hash::LocalHash;
use crate::types::Overlap;

/// One step of a case. Workers are numbers (rank 0) unless a key is spelled out.
#[derive(Clone, Copy, Debug)]
enum Ev {
    /// Stored, no parent, device tier.
    St(u64, &'static [u64]),
    /// Stored with a parent and a tier.
    StP(u64, Option<u64>, &'static [u64], Tier),
    /// Removed from the device tier.
    Rm(u64, &'static [u64]),
    /// Removed from a tier.
    RmT(u64, &'static [u64], Tier),
    Clr(u64),
    Gone(u64),
}
use Ev::*;

fn k(w: u64) -> WorkerKey {
    WorkerKey::new(w, 0)
}

fn blocks(hashes: &[u64]) -> Vec<BlockHash> {
    hashes.iter().map(|&h| BlockHash { seq: SeqHash(h), local: LocalHash(h ^ 1) }).collect()
}

fn run(index: &mut PrefixIndex, ev: Ev) -> Result<ApplySummary, IndexError> {
    match ev {
        St(w, b) => run(index, StP(w, None, b, Tier::Device)),
        StP(w, parent, b, tier) => {
            let b = blocks(b);
            index.apply(k(w), IndexEvent::Stored { parent: parent.map(SeqHash), blocks: &b, tier })
        }
        Rm(w, b) => run(index, RmT(w, b, Tier::Device)),
        RmT(w, b, tier) => {
            let b: Vec<SeqHash> = b.iter().map(|&h| SeqHash(h)).collect();
            index.apply(k(w), IndexEvent::Removed { blocks: &b, tier })
        }
        Clr(w) => index.apply(k(w), IndexEvent::Cleared),
        Gone(w) => {
            index.remove_worker(WorkerId(w));
            Ok(ApplySummary::default())
        }
    }
}

fn query(index: &PrefixIndex, q: &[u64]) -> Vec<(u64, [u32; 3])> {
    let q: Vec<SeqHash> = q.iter().map(|&h| SeqHash(h)).collect();
    let mut out = OverlapScores::new();
    index.find_matches(&q, false, &mut out);
    out.iter().map(|(key, o)| (key.worker.0, [o.device, o.host, o.disk])).collect()
}

/// Applies `evs` to a default index, then checks the answer to `q`:
/// `(worker, [device, host, disk])` for every worker with a non-zero overlap.
#[track_caller]
fn check(evs: &[Ev], q: &[u64], want: &[(u64, [u32; 3])]) {
    let mut index = PrefixIndex::new(IndexConfig::default());
    for &ev in evs {
        let _ = run(&mut index, ev);
    }
    assert_eq!(query(&index, q), want, "after {evs:?}, query {q:?}");
}

#[test]
fn overlaps() {
    const D: Tier = Tier::Device;
    const H: Tier = Tier::Host;
    const K: Tier = Tier::Disk;
    check(&[], &[1, 2], &[]);
    check(&[St(0, &[1, 2, 3])], &[], &[]);
    check(&[St(0, &[1, 2, 3])], &[1, 2, 3, 4], &[(0, [3, 0, 0])]);
    check(&[St(0, &[1, 2, 3])], &[1, 2], &[(0, [2, 0, 0])]);
    // The index knows hashes, not positions: a query may start anywhere in a chain.
    check(&[St(0, &[1, 2, 3])], &[2, 3], &[(0, [2, 0, 0])]);
    check(&[St(0, &[1, 2, 3])], &[9, 1], &[]);
    check(&[St(0, &[1, 2, 3])], &[1, 9, 10], &[(0, [1, 0, 0])]);
    // Two workers share a prefix; answers are sorted by key.
    check(&[St(1, &[1, 2, 3]), St(0, &[1, 2])], &[1, 2, 3], &[(0, [2, 0, 0]), (1, [3, 0, 0])]);
    // A gap stops the run even if later blocks are held.
    check(&[St(0, &[1, 2, 3]), Rm(0, &[2])], &[1, 2, 3], &[(0, [1, 0, 0])]);
    check(&[St(0, &[1]), St(0, &[3])], &[1, 2, 3], &[(0, [1, 0, 0])]);
    // Blocks of one chain stored by separate events, out of order.
    check(&[St(0, &[3, 4]), St(0, &[1, 2])], &[1, 2, 3, 4], &[(0, [4, 0, 0])]);
    // Re-stating a prefix then extending it.
    check(&[St(0, &[1, 2]), St(0, &[1, 2, 3, 4])], &[1, 2, 3, 4, 5], &[(0, [4, 0, 0])]);
    // Clearing or removing a worker forgets it only.
    check(&[St(0, &[1, 2]), St(1, &[1]), Clr(0)], &[1, 2], &[(1, [1, 0, 0])]);
    check(&[St(0, &[1, 2]), St(1, &[1]), Gone(1)], &[1, 2], &[(0, [2, 0, 0])]);
    check(&[St(0, &[1, 2]), Gone(0), St(0, &[1])], &[1, 2], &[(0, [1, 0, 0])]);
    // Tiers: each block counts under its best tier; the run spans all tiers.
    check(&[StP(0, None, &[1, 2], D), StP(0, None, &[3, 4], H)], &[1, 2, 3, 4], &[(0, [2, 2, 0])]);
    check(&[StP(0, None, &[1, 2], K), StP(0, None, &[1], H)], &[1, 2], &[(0, [0, 1, 1])]);
    check(&[StP(0, None, &[1, 2], H), StP(0, None, &[1, 2], D)], &[1, 2], &[(0, [2, 0, 0])]);
    // Removing the host copy leaves the device copy, and vice versa.
    check(&[StP(0, None, &[1, 2], H), St(0, &[1, 2]), RmT(0, &[2], H)], &[1, 2], &[(0, [2, 0, 0])]);
    check(&[StP(0, None, &[1, 2], H), St(0, &[1, 2]), Rm(0, &[2])], &[1, 2], &[(0, [1, 1, 0])]);
    check(&[StP(0, None, &[1, 2], H), RmT(0, &[1], Tier::Disk)], &[1, 2], &[(0, [0, 2, 0])]);
    // Removing the only copy in the only tier leaves a gap.
    check(&[StP(0, None, &[1, 2, 3], H), RmT(0, &[2], H)], &[1, 2, 3], &[(0, [0, 1, 0])]);
    // An accepted unknown parent stores the blocks, which match only from the root.
    check(&[StP(0, Some(7), &[2, 3], D)], &[2, 3], &[(0, [2, 0, 0])]);
    check(&[StP(0, Some(1), &[2, 3], D), St(0, &[1])], &[1, 2, 3], &[(0, [3, 0, 0])]);
    // A block repeated inside a query or an event.
    check(&[St(0, &[1, 1, 2])], &[1, 1, 2], &[(0, [3, 0, 0])]);
    // 4 (child of 2) lands right after 3 (a sibling of 2), behind 1: a query along
    // 1-2-4 must not take the run 1-3-4 for its own once 2 is gone.
    let evs = [St(0, &[1, 2]), Rm(0, &[1]), St(0, &[1, 3]), St(0, &[1, 2, 4]), Rm(0, &[2])];
    check(&evs, &[1, 2, 4], &[(0, [1, 0, 0])]);
}

/// Worker 0 stores 3 after 9, though 3's parent is 2. Worker 1, storing the true chain,
/// unlinks 3 from 9, so a query along the true chain does not take 1-9-3 for 1-2-3.
#[test]
fn an_event_naming_another_parent_unlinks_the_block() {
    let forged = St(0, &[1, 9, 3]);
    let want = [(0, [1, 0, 0]), (1, [1, 0, 0])];
    // Worker 1 also holds 1-9, and has dropped 2: every slot from 1 to 3 has holders {0, 1}.
    check(&[forged, St(1, &[1, 9]), St(1, &[1, 2, 3]), Rm(1, &[2])], &[1, 2, 3], &want);
    // A parent named by the event itself (not by the block before) unlinks too.
    check(
        &[forged, St(1, &[1, 9]), St(1, &[1, 2]), StP(1, Some(2), &[3], Tier::Device), Rm(1, &[2])],
        &[1, 2, 3],
        &want,
    );
    // An event that names no parent unlinks a true link too (it says the block is a
    // root), which costs a run, never an answer.
    check(&[St(0, &[1, 2, 3]), St(1, &[1, 2]), St(1, &[3])], &[1, 2, 3], &[(0, [3, 0, 0]), (1, [3, 0, 0])]);
}

/// The proptest case that found it (`a_liar_never_changes_an_honest_answer`): worker 2
/// forges 1-8-3; worker 0 stores 3 naming no parent, then 0-1-8. Every slot from 1 to 3
/// then has holders {0, 2}, and while 3 stayed linked to 8 the walk took 1-8-3 for
/// 1-2-3, matching its last block, and answered 4 for worker 0, which lacks 2.
#[test]
fn an_event_naming_no_parent_unlinks_a_forged_link() {
    let evs = [St(2, &[0, 1, 8, 3, 10]), St(0, &[3]), St(0, &[0, 1, 8])];
    check(&evs, &[0, 1, 2, 3], &[(0, [2, 0, 0]), (2, [2, 0, 0])]);
    // Named as a root outright, the same.
    let evs = [St(2, &[0, 1, 8, 3, 10]), StP(0, None, &[3], Tier::Host), St(0, &[0, 1, 8])];
    check(&evs, &[0, 1, 2, 3], &[(0, [2, 0, 0]), (2, [2, 0, 0])]);
}

#[test]
fn answers_are_sorted_whatever_the_arrival_order() {
    let mut index = PrefixIndex::new(IndexConfig::default());
    for w in [9u64, 3, 7, 1] {
        let b = blocks(&[10, 20, 30][..(w as usize % 3) + 1]);
        let ev = IndexEvent::Stored { parent: None, blocks: &b, tier: Tier::Device };
        index.apply(WorkerKey::new(w, 1), ev).expect("stored");
    }
    let want = [(1, [2, 0, 0]), (3, [1, 0, 0]), (7, [2, 0, 0]), (9, [1, 0, 0])];
    assert_eq!(query(&index, &[10, 20, 30]), want);
}

#[test]
fn many_workers_span_several_words() {
    let mut index = PrefixIndex::new(IndexConfig::default());
    // Worker w holds the first w % 5 + 1 blocks; 150 workers need three bit words.
    for w in 0..150u64 {
        let b = blocks(&[1, 2, 3, 4, 5][..(w as usize % 5) + 1]);
        let ev = IndexEvent::Stored { parent: None, blocks: &b, tier: Tier::Device };
        index.apply(k(w), ev).expect("stored");
    }
    let got = query(&index, &[1, 2, 3, 4, 5, 6]);
    let want: Vec<_> = (0..150u64).map(|w| (w, [w as u32 % 5 + 1, 0, 0])).collect();
    assert_eq!(got, want);
    // Worker 149 alone keeps block 3; the others lose it.
    for w in 0..149u64 {
        let b = [SeqHash(3)];
        index.apply(k(w), IndexEvent::Removed { blocks: &b, tier: Tier::Device }).expect("removed");
    }
    let got = query(&index, &[1, 2, 3, 4, 5]);
    let want: Vec<_> = (0..150u64).map(|w| (w, [(w as u32 % 5 + 1).min(2), 0, 0])).collect();
    let want: Vec<_> = want.into_iter().map(|(w, o)| if w == 149 { (w, [5, 0, 0]) } else { (w, o) }).collect();
    assert_eq!(got, want);
}

#[test]
fn early_exit_stops_at_one_worker_with_a_lower_bound() {
    let mut index = PrefixIndex::new(IndexConfig::default());
    for (w, b) in [(0u64, &[1u64, 2, 3, 4][..]), (1, &[1][..])] {
        let b = blocks(b);
        index.apply(k(w), IndexEvent::Stored { parent: None, blocks: &b, tier: Tier::Device }).expect("stored");
    }
    let q: Vec<SeqHash> = [1, 2, 3, 4].iter().map(|&h| SeqHash(h)).collect();
    let mut out = OverlapScores::new();
    index.find_matches(&q, true, &mut out);
    assert_eq!(out.get(k(1)).raw(), 1, "others stay exact");
    let lone = out.get(k(0)).raw();
    assert!((1..=4).contains(&lone), "a lower bound of 4, got {lone}");
    assert!(out.blocks_touched() < 4);
    index.find_matches(&q, false, &mut out);
    assert_eq!(out.get(k(0)).raw(), 4);
    assert_eq!(out.blocks_touched(), 4);
}

/// Applies `setup`, then `ev` under `cfg`; checks what `ev` returned and how many
/// blocks worker 0 holds afterwards.
#[track_caller]
fn check_apply(cfg: IndexConfig, setup: &[Ev], ev: Ev, want: Result<ApplySummary, IndexError>, entries: u32) {
    let mut index = PrefixIndex::new(cfg);
    for &s in setup {
        let _ = run(&mut index, s);
    }
    assert_eq!(run(&mut index, ev), want, "{ev:?} after {setup:?}");
    assert_eq!(index.worker_entries(k(0)), entries, "entries after {ev:?}");
}

fn sum(added: u32, duplicates: u32, removed: u32, absent: u32) -> ApplySummary {
    ApplySummary { added, duplicates, removed, absent, ..ApplySummary::default() }
}

#[test]
fn summaries() {
    let dflt = IndexConfig::default();
    let reject = IndexConfig { unknown_parent: UnknownParentPolicy::Reject, ..dflt };
    let cap3 = IndexConfig { blocks_max_per_worker: Some(3), ..dflt };
    let keys1 = IndexConfig { keys_max: 1, ..dflt };
    let h = Tier::Host;
    check_apply(dflt, &[], St(0, &[1, 2, 3]), Ok(sum(3, 0, 0, 0)), 3);
    check_apply(dflt, &[St(0, &[1, 2])], St(0, &[1, 2, 3]), Ok(sum(1, 2, 0, 0)), 3);
    check_apply(dflt, &[St(1, &[1, 2])], St(0, &[1, 2, 3]), Ok(sum(3, 0, 0, 0)), 3);
    check_apply(dflt, &[St(0, &[1, 2])], StP(0, None, &[2], h), Ok(sum(1, 0, 0, 0)), 2);
    check_apply(dflt, &[St(0, &[1, 2])], Rm(0, &[2, 9, 2]), Ok(sum(0, 0, 1, 2)), 1);
    check_apply(dflt, &[St(0, &[1, 2])], RmT(0, &[2], h), Ok(sum(0, 0, 0, 1)), 2);
    check_apply(dflt, &[], Rm(0, &[1, 2]), Ok(sum(0, 0, 0, 2)), 0);
    check_apply(dflt, &[St(0, &[1, 2])], Clr(0), Ok(sum(0, 0, 0, 0)), 0);
    // Parents: known, unknown and accepted, unknown and rejected.
    check_apply(dflt, &[St(0, &[1])], StP(0, Some(1), &[2], Tier::Device), Ok(sum(1, 0, 0, 0)), 2);
    let unknown = ApplySummary { unknown_parent: true, ..sum(1, 0, 0, 0) };
    check_apply(dflt, &[St(1, &[1])], StP(0, Some(1), &[2], Tier::Device), Ok(unknown), 1);
    let err = Err(IndexError::UnknownParent { parent: SeqHash(1) });
    check_apply(reject, &[St(1, &[1])], StP(0, Some(1), &[2], Tier::Device), err, 0);
    check_apply(reject, &[St(0, &[1])], StP(0, Some(1), &[2], Tier::Device), Ok(sum(1, 0, 0, 0)), 2);
    // The per-worker bound refuses the rest of the event; held blocks stay duplicates.
    let capped = ApplySummary { evicted: 2, ..sum(3, 0, 0, 0) };
    check_apply(cap3, &[], St(0, &[1, 2, 3, 4, 5]), Ok(capped), 3);
    let capped = ApplySummary { evicted: 1, ..sum(0, 3, 0, 0) };
    check_apply(cap3, &[St(0, &[1, 2, 3])], St(0, &[1, 2, 3, 4]), Ok(capped), 3);
    check_apply(cap3, &[St(0, &[1, 2, 3])], StP(0, None, &[3], h), Ok(sum(1, 0, 0, 0)), 3);
    check_apply(
        cap3,
        &[St(0, &[1, 2, 3]), Rm(0, &[3])],
        St(0, &[4, 5]),
        Ok(ApplySummary { evicted: 1, ..sum(1, 0, 0, 0) }),
        3,
    );
    // Runs: a new block repeated in its own event, a new run ending on the bound just
    // before a block it repeats, and a held range (same holders, arena order) cut by
    // the bound.
    check_apply(dflt, &[], St(0, &[1, 2, 1, 2, 3]), Ok(sum(3, 2, 0, 0)), 3);
    let cap1 = IndexConfig { blocks_max_per_worker: Some(1), ..dflt };
    check_apply(cap1, &[], St(0, &[4, 4]), Ok(sum(1, 1, 0, 0)), 1);
    check_apply(cap1, &[], St(0, &[4, 4, 5]), Ok(ApplySummary { evicted: 1, ..sum(1, 1, 0, 0) }), 1);
    let capped = ApplySummary { evicted: 2, ..sum(3, 0, 0, 0) };
    check_apply(cap3, &[St(1, &[1, 2, 3, 4, 5])], St(0, &[1, 2, 3, 4, 5]), Ok(capped), 3);
    let capped = ApplySummary { evicted: 3, ..sum(2, 1, 0, 0) };
    check_apply(cap3, &[St(1, &[1, 2, 3, 4, 5]), St(0, &[3])], St(0, &[1, 2, 3, 4, 5, 6]), Ok(capped), 3);
    // The key bound refuses new keys, not known ones.
    let full = Err(IndexError::KeysFull { key: k(0), keys_max: 1 });
    check_apply(keys1, &[St(1, &[1])], St(0, &[1]), full, 0);
    check_apply(keys1, &[St(0, &[1])], St(0, &[2]), Ok(sum(1, 0, 0, 0)), 2);
    check_apply(keys1, &[St(1, &[1]), Gone(1)], St(0, &[2]), Ok(sum(1, 0, 0, 0)), 1);
}

#[test]
fn stats_count_sizes_and_history() {
    let mut index = PrefixIndex::new(IndexConfig { blocks_max_per_worker: Some(4), ..IndexConfig::default() });
    for ev in [St(0, &[1, 2, 3]), St(1, &[1, 2]), St(0, &[1, 2]), Rm(1, &[2, 5]), St(1, &[1, 6, 7, 8, 9])] {
        let _ = run(&mut index, ev);
    }
    let _ = run(&mut index, StP(0, Some(42), &[], Tier::Device));
    let s = index.stats();
    assert_eq!((s.entries, s.blocks, s.workers), (7, 6, 2));
    assert_eq!((s.duplicates, s.absent_removes, s.unknown_parents, s.evictions), (3, 1, 1, 1));
    assert!(s.heap_bytes > 0);
    index.remove_worker(WorkerId(0));
    let s = index.stats();
    assert_eq!((s.entries, s.blocks, s.workers), (4, 4, 1));
}

#[test]
fn mass_removal_compacts_and_keeps_answers() {
    let mut index = PrefixIndex::new(IndexConfig::default());
    let chains: Vec<Vec<u64>> = (0..64u64).map(|c| (0..200u64).map(|i| c * 1000 + i).collect()).collect();
    for (c, chain) in chains.iter().enumerate() {
        let b = blocks(chain);
        index
            .apply(k(c as u64 % 4), IndexEvent::Stored { parent: None, blocks: &b, tier: Tier::Device })
            .expect("stored");
    }
    // Drop the tails of all chains but the last: most slots die.
    for (c, chain) in chains.iter().enumerate().take(63) {
        let tail: Vec<SeqHash> = chain[10..].iter().rev().map(|&h| SeqHash(h)).collect();
        let s = index.apply(k(c as u64 % 4), IndexEvent::Removed { blocks: &tail, tier: Tier::Device });
        assert_eq!(s.map(|s| s.removed), Ok(190));
    }
    assert_eq!(index.stats().blocks, 63 * 10 + 200);
    assert_eq!(query(&index, &chains[5]), [(1, [10, 0, 0])]);
    assert_eq!(query(&index, &chains[63]), [(3, [200, 0, 0])]);
    // New chains after compaction still work, including extending a surviving prefix.
    let ext: Vec<u64> = chains[5][..10].iter().copied().chain([7, 8, 9]).collect();
    let b = blocks(&ext);
    index.apply(k(1), IndexEvent::Stored { parent: None, blocks: &b, tier: Tier::Device }).expect("stored");
    assert_eq!(query(&index, &ext), [(1, [13, 0, 0])]);
}

#[test]
fn errors_display() {
    let e = IndexError::UnknownParent { parent: SeqHash(0xab) };
    assert_eq!(alloc::format!("{e}"), "stored event names parent block 0x00000000000000ab the worker does not hold");
    let e = IndexError::KeysFull { key: WorkerKey::new(3, 1), keys_max: 2 };
    assert_eq!(alloc::format!("{e}"), "cannot track worker 3/1: already tracking 2 worker keys");
}

#[test]
fn scores_merge_and_reuse() {
    let mut out = OverlapScores::new();
    out.add_device(k(5), 3);
    out.add_device(k(2), 1);
    out.add_device(k(5), 2);
    out.add_device(k(9), 0);
    let got: Vec<_> = out.iter().collect();
    assert_eq!(got, [(k(2), Overlap { device: 1, host: 0, disk: 0 }), (k(5), Overlap { device: 5, host: 0, disk: 0 })]);
    assert_eq!((out.max_raw(), out.get(k(9))), (5, Overlap::default()));
    out.clear();
    assert!(out.is_empty());
    assert_eq!(out.max_raw(), 0);
}

#[test]
fn raising_keeps_the_longer_run() {
    let mut out = OverlapScores::new();
    out.push(k(5), Overlap { device: 2, host: 3, disk: 0 });
    out.raise_device(k(5), 4); // shorter than 2 + 3: the exact answer stays
    out.raise_device(k(2), 1);
    out.raise_device(k(9), 0);
    let got: Vec<_> = out.iter().collect();
    assert_eq!(got, [(k(2), Overlap { device: 1, host: 0, disk: 0 }), (k(5), Overlap { device: 2, host: 3, disk: 0 })]);
    out.raise_device(k(5), 6);
    assert_eq!(out.get(k(5)), Overlap { device: 6, host: 0, disk: 0 });
}
