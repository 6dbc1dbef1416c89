//! The prefix index against a plain set model on real chains: the first 1,500 requests of
//! the Mooncake conversation trace (the slice the repository ships), hashed as the index
//! workload hashes them, with the index's real thresholds (not the tiny ones its unit
//! tests use). Queries follow stored chains, leave them partway (so a walk searches a
//! run by halves) and run past their end; removals cut dead tails and drop blocks from
//! the middle of chains.

use std::collections::HashSet;

use kvroute_benches::{hash_requests, load_trace};
use router_core::{
    chain, BlockHash, Draw, IndexConfig, IndexEvent, LocalHash, OverlapScores, PrefixIndex, SeqHash, Tier, WorkerKey,
};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../adapters/sim/fixtures/mooncake_conversation_head.jsonl");

/// The index and a set of (worker, block) pairs, fed the same events.
struct Pair {
    index: PrefixIndex,
    model: HashSet<(u64, u64)>,
    workers: u64,
}

impl Pair {
    fn new(workers: u64) -> Self {
        Pair { index: PrefixIndex::new(IndexConfig::default()), model: HashSet::new(), workers }
    }

    fn store(&mut self, w: u64, blocks: &[BlockHash]) {
        let ev = IndexEvent::Stored { parent: None, blocks, tier: Tier::Device };
        self.index.apply(WorkerKey::new(w, 0), ev).expect("stored");
        self.model.extend(blocks.iter().map(|b| (w, b.seq.0)));
    }

    fn remove(&mut self, w: u64, blocks: &[SeqHash]) {
        let ev = IndexEvent::Removed { blocks, tier: Tier::Device };
        self.index.apply(WorkerKey::new(w, 0), ev).expect("removed");
        for b in blocks {
            self.model.remove(&(w, b.0));
        }
    }

    /// Compares the index's answer to `q` with the model's; returns the model's
    /// overlaps, summed.
    #[track_caller]
    fn check(&self, q: &[SeqHash], what: &str) -> u64 {
        let mut out = OverlapScores::new();
        self.index.find_matches(q, false, &mut out);
        let got: Vec<(u64, u32)> = out.iter().map(|(k, o)| (k.worker.0, o.raw())).collect();
        let want: Vec<(u64, u32)> = (0..self.workers)
            .map(|w| (w, q.iter().take_while(|b| self.model.contains(&(w, b.0))).count() as u32))
            .filter(|&(_, n)| n > 0)
            .collect();
        assert_eq!(got, want, "{what}: query of {} blocks", q.len());
        want.iter().map(|&(_, n)| u64::from(n)).sum()
    }
}

fn seqs(blocks: &[BlockHash]) -> Vec<SeqHash> {
    blocks.iter().map(|b| b.seq).collect()
}

/// `q` cut at `at`, continued by `n` blocks no request holds (a real chain still).
fn diverge(q: &[SeqHash], at: usize, n: usize, d: &mut Draw) -> Vec<SeqHash> {
    let mut out = q[..at].to_vec();
    for _ in 0..n {
        let local = LocalHash(d.next_u64());
        let next = match out.last() {
            Some(&p) => chain(p, local),
            None => SeqHash(local.0),
        };
        out.push(next);
    }
    out
}

#[track_caller]
fn check(workers: u64, seed: u64) {
    let reqs = load_trace(FIXTURE).expect("the shipped trace slice");
    let chains = hash_requests(&reqs);
    let mut p = Pair::new(workers);
    for (i, c) in chains.iter().enumerate() {
        p.store(i as u64 % workers, c);
    }
    let mut d = Draw(seed);
    let mut matched = 0;
    for (i, c) in chains.iter().enumerate() {
        let q = seqs(c);
        matched += p.check(&q, &format!("request {i}, seed {seed}"));
        let at = d.below(q.len() + 1);
        p.check(&diverge(&q, at, 1 + d.below(200), &mut d), &format!("request {i} left at {at}"));
    }
    assert!(matched >= chains.iter().map(|c| c.len() as u64).sum::<u64>(), "each worker holds its own requests");
    // Drop a random stretch from the middle of every third chain, then the tail of
    // every fifth, and ask again.
    for (i, c) in chains.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
        let q = seqs(c);
        let from = d.below(q.len());
        let to = (from + 1 + d.below(64)).min(q.len());
        p.remove(i as u64 % workers, &q[from..to]);
    }
    for (i, c) in chains.iter().enumerate().filter(|(i, _)| i % 5 == 0) {
        let q = seqs(c);
        let from = q.len() / 2;
        p.remove(i as u64 % workers, &q[from..]);
    }
    for (i, c) in chains.iter().enumerate() {
        p.check(&seqs(c), &format!("after removals, request {i}, seed {seed}"));
    }
    // Restore half of the chains: stretches return in new arena slots.
    for (i, c) in chains.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        p.store(i as u64 % workers, c);
    }
    for (i, c) in chains.iter().enumerate() {
        p.check(&seqs(c), &format!("after restoring, request {i}, seed {seed}"));
    }
}

#[test]
fn the_index_agrees_with_a_set_model_on_real_chains() {
    check(1, 1);
    check(4, 2);
    check(16, 3);
    check(70, 4);
}
