//! Model-based test: random event sequences against a plain `BTreeMap` model of who
//! holds what, comparing every summary, every query answer and the sizes.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec;
use alloc::vec::Vec;

use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

use super::super::*;
use crate::hash::LocalHash;
use crate::types::Overlap;

/// Blocks are drawn from this many hashes, so events overlap and collide often.
const UNIVERSE: u64 = 16;

#[derive(Clone, Debug)]
enum Op {
    Store {
        key: WorkerKey,
        parent: Option<u64>,
        blocks: Vec<u64>,
        tier: Tier,
    },
    Remove {
        key: WorkerKey,
        blocks: Vec<u64>,
        tier: Tier,
    },
    Clear(WorkerKey),
    RemoveWorker(u64),
    Query(Vec<u64>),
    /// A capacity hint: changes no answer.
    Reserve(usize),
}

#[derive(Clone, Debug)]
struct Model {
    cfg: IndexConfig,
    keys: BTreeSet<WorkerKey>,
    held: BTreeMap<(WorkerKey, u64), BTreeSet<Tier>>,
    /// What the last `apply` should have returned.
    last: Option<Result<ApplySummary, IndexError>>,
}

impl Model {
    fn entries(&self, key: WorkerKey) -> u32 {
        self.held.keys().filter(|(k, _)| *k == key).count() as u32
    }

    fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<u64>,
        blocks: &[u64],
        tier: Tier,
    ) -> Result<ApplySummary, IndexError> {
        if !self.keys.contains(&key) && self.keys.len() >= self.cfg.keys_max as usize {
            return Err(IndexError::KeysFull { key, keys_max: self.cfg.keys_max });
        }
        let mut sum = ApplySummary::default();
        if let Some(p) = parent {
            if !self.held.contains_key(&(key, p)) {
                if self.cfg.unknown_parent == UnknownParentPolicy::Reject {
                    return Err(IndexError::UnknownParent { parent: SeqHash(p) });
                }
                sum.unknown_parent = true;
            }
        }
        if blocks.is_empty() {
            return Ok(sum);
        }
        self.keys.insert(key);
        let cap = self.cfg.blocks_max_per_worker.unwrap_or(u32::MAX);
        for (i, &b) in blocks.iter().enumerate() {
            let tiers = self.held.get(&(key, b)).cloned().unwrap_or_default();
            if tiers.contains(&tier) {
                sum.duplicates += 1;
                continue;
            }
            if tiers.is_empty() && self.entries(key) >= cap {
                sum.evicted += (blocks.len() - i) as u32;
                break;
            }
            self.held.entry((key, b)).or_default().insert(tier);
            sum.added += 1;
        }
        Ok(sum)
    }

    fn remove(&mut self, key: WorkerKey, blocks: &[u64], tier: Tier) -> ApplySummary {
        let mut sum = ApplySummary::default();
        for &b in blocks {
            let Some(tiers) = self.held.get_mut(&(key, b)).filter(|t| t.contains(&tier)) else {
                sum.absent += 1;
                continue;
            };
            tiers.remove(&tier);
            if tiers.is_empty() {
                self.held.remove(&(key, b));
            }
            sum.removed += 1;
        }
        sum
    }

    fn overlaps(&self, seq: &[u64]) -> Vec<(WorkerKey, Overlap)> {
        let mut out = Vec::new();
        for &key in &self.keys {
            let mut o = Overlap::default();
            for &b in seq {
                let Some(tiers) = self.held.get(&(key, b)) else {
                    break;
                };
                match tiers.first() {
                    Some(Tier::Device) => o.device += 1,
                    Some(Tier::Host) => o.host += 1,
                    Some(Tier::Disk) => o.disk += 1,
                    None => break,
                }
            }
            if o.raw() > 0 {
                out.push((key, o));
            }
        }
        out
    }
}

fn key() -> impl Strategy<Value = WorkerKey> {
    (0u64..3, 0u32..2).prop_map(|(w, r)| WorkerKey::new(w, r))
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![4 => Just(Tier::Device), 1 => Just(Tier::Host), 1 => Just(Tier::Disk)]
}

/// The parent of each hash of the universe: two trees, so that blocks are chains as
/// sequence hashes are (one parent per block), with branches that share a prefix:
/// 0-1-2-3-4-5-6-7, with 1-8-9-10 and 2-11 branching off, and 12-13-14-15 apart.
const PARENT: [Option<u64>; UNIVERSE as usize] = {
    const N: Option<u64> = None;
    const fn p(h: u64) -> Option<u64> {
        Some(h)
    }
    [N, p(0), p(1), p(2), p(3), p(4), p(5), p(6), p(1), p(8), p(9), p(2), N, p(12), p(13), p(14)]
};

/// Keys of this worker may store blocks in any order, breaking the one-parent rule:
/// their own answers are not checked, only everyone else's.
const LIAR: u64 = 2;

/// A path down the forest from any hash, mostly from a root, taking the branch each
/// choice picks.
fn chain() -> impl Strategy<Value = Vec<u64>> {
    let start = prop_oneof![2 => prop_oneof![Just(0u64), Just(12)], 1 => 0..UNIVERSE];
    (start, proptest::collection::vec(any::<u8>(), 0..8)).prop_map(|(start, choices)| {
        let mut path = vec![start];
        for c in choices {
            let last = path[path.len() - 1];
            let kids: Vec<u64> = (0..UNIVERSE).filter(|&h| PARENT[h as usize] == Some(last)).collect();
            let Some(&next) = kids.get(c as usize % kids.len().max(1)) else { break };
            path.push(next);
        }
        path
    })
}

/// A stored chain with the parent its event names: for honest keys the true one or
/// none; a liar's blocks and parent may be anything.
fn stored(key: WorkerKey) -> impl Strategy<Value = (Option<u64>, Vec<u64>)> {
    let honest = (chain(), any::<bool>())
        .prop_map(|(c, named)| (c.first().and_then(|&b| PARENT[b as usize]).filter(|_| named), c));
    if key.worker.0 != LIAR {
        return honest.boxed();
    }
    let any_parent = prop_oneof![2 => Just(None), 1 => (0..UNIVERSE).prop_map(Some)];
    let any = (any_parent, proptest::collection::vec(0..UNIVERSE, 0..6));
    prop_oneof![1 => honest, 2 => swapped().prop_map(|c| (None, c)), 1 => any].boxed()
}

/// A true chain with one block swapped for any other: the forgeries that matter, a
/// later block linked to the wrong parent.
fn swapped() -> impl Strategy<Value = Vec<u64>> {
    (chain(), any::<usize>(), 0..UNIVERSE).prop_map(|(mut c, at, h)| {
        let n = c.len();
        c[at % n] = h;
        c
    })
}

impl ReferenceStateMachine for Model {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        let cap = prop_oneof![3 => Just(None), 1 => (0u32..6).prop_map(Some)];
        let policy = prop_oneof![Just(UnknownParentPolicy::AcceptAsRoot), Just(UnknownParentPolicy::Reject)];
        let keys_max = prop_oneof![3 => Just(4096u32), 1 => 1u32..4];
        (cap, policy, keys_max, any::<u64>())
            .prop_map(|(cap, policy, keys_max, seed)| Model {
                cfg: IndexConfig { blocks_max_per_worker: cap, unknown_parent: policy, hash_seed: seed, keys_max },
                keys: BTreeSet::new(),
                held: BTreeMap::new(),
                last: None,
            })
            .boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Op> {
        prop_oneof![
            6 => (key(), tier()).prop_flat_map(|(key, tier)| {
                stored(key).prop_map(move |(parent, blocks)| Op::Store { key, parent, blocks, tier })
            }),
            3 => (key(), chain(), tier()).prop_map(|(key, mut blocks, tier)| {
                blocks.reverse();
                Op::Remove { key, blocks, tier }
            }),
            1 => key().prop_map(Op::Clear),
            1 => (0u64..3).prop_map(Op::RemoveWorker),
            4 => chain().prop_map(Op::Query),
            1 => (0usize..40).prop_map(Op::Reserve),
        ]
        .boxed()
    }

    fn apply(mut m: Model, op: &Op) -> Model {
        m.last = None;
        match op {
            Op::Store { key, parent, blocks, tier } => {
                m.last = Some(m.store(*key, *parent, blocks, *tier));
            }
            Op::Remove { key, blocks, tier } => {
                let sum = if m.keys.contains(key) {
                    m.remove(*key, blocks, *tier)
                } else {
                    ApplySummary { absent: blocks.len() as u32, ..Default::default() }
                };
                m.last = Some(Ok(sum));
            }
            Op::Clear(key) => {
                m.held.retain(|(k, _), _| k != key);
                m.last = Some(Ok(ApplySummary::default()));
            }
            Op::RemoveWorker(w) => {
                m.held.retain(|(k, _), _| k.worker.0 != *w);
                m.keys.retain(|k| k.worker.0 != *w);
            }
            Op::Query(_) | Op::Reserve(_) => {}
        }
        m
    }
}

struct IndexTest;

fn blocks_of(hashes: &[u64]) -> Vec<BlockHash> {
    hashes.iter().map(|&h| BlockHash { seq: SeqHash(h), local: LocalHash(h) }).collect()
}

impl StateMachineTest for IndexTest {
    type SystemUnderTest = PrefixIndex;
    type Reference = Model;

    fn init_test(m: &Model) -> PrefixIndex {
        PrefixIndex::new(m.cfg)
    }

    fn apply(mut index: PrefixIndex, m: &Model, op: Op) -> PrefixIndex {
        let got = match &op {
            Op::Store { key, parent, blocks, tier } => {
                let blocks = blocks_of(blocks);
                let ev = IndexEvent::Stored { parent: parent.map(SeqHash), blocks: &blocks, tier: *tier };
                Some(index.apply(*key, ev))
            }
            Op::Remove { key, blocks, tier } => {
                let seqs: Vec<SeqHash> = blocks.iter().map(|&h| SeqHash(h)).collect();
                Some(index.apply(*key, IndexEvent::Removed { blocks: &seqs, tier: *tier }))
            }
            Op::Clear(key) => Some(index.apply(*key, IndexEvent::Cleared)),
            Op::RemoveWorker(w) => {
                index.remove_worker(WorkerId(*w));
                None
            }
            Op::Reserve(n) => {
                index.reserve(*n);
                None
            }
            Op::Query(seq) => {
                let seqs: Vec<SeqHash> = seq.iter().map(|&h| SeqHash(h)).collect();
                let mut out = OverlapScores::new();
                index.find_matches(&seqs, false, &mut out);
                let all: Vec<_> = out.iter().collect();
                for (k, o) in &all {
                    assert_eq!(out.get(*k), *o);
                }
                assert_eq!(out.max_raw(), all.iter().map(|e| e.1.raw()).max().unwrap_or(0));
                let honest = |e: &(WorkerKey, Overlap)| e.0.worker.0 != LIAR;
                let got: Vec<_> = all.into_iter().filter(honest).collect();
                let want: Vec<_> = m.overlaps(seq).into_iter().filter(honest).collect();
                assert_eq!(got, want, "query {seq:?}");
                None
            }
        };
        assert_eq!(got, m.last, "{op:?}");
        index
    }

    fn check_invariants(index: &PrefixIndex, m: &Model) {
        let stats = index.stats();
        assert_eq!(stats.entries, m.held.len() as u64, "entries");
        let blocks: BTreeSet<u64> = m.held.keys().map(|(_, b)| *b).collect();
        assert_eq!(stats.blocks, blocks.len() as u64, "distinct blocks");
        assert_eq!(stats.workers, m.keys.len() as u32, "keys");
        for &k in &m.keys {
            assert_eq!(index.worker_entries(k), m.entries(k), "entries of {k}");
        }
    }
}

/// `PROPTEST_CASES` if set, else `default` (kept small so the suite stays fast).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: cases(96), ..ProptestConfig::default() })]
    #[test]
    fn index_agrees_with_model(sequential 1..60 => IndexTest);
}

/// One step of [`a_liar_never_changes_an_honest_answer`].
#[derive(Clone, Debug)]
enum Step {
    /// The liar stores a chain with one block swapped.
    Forge(Vec<u64>),
    /// The honest key stores a true chain.
    Store(Vec<u64>),
    /// The honest key drops a few blocks.
    Drop(Vec<u64>),
}

fn step() -> impl Strategy<Value = Step> {
    let forged = swapped().prop_map(Step::Forge);
    let dropped = proptest::collection::vec(0..UNIVERSE, 1..3).prop_map(Step::Drop);
    prop_oneof![forged, chain().prop_map(Step::Store), dropped]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(512), ..ProptestConfig::default() })]
    /// Whatever chains one key forges, another key's answers along true chains stay
    /// exact. Narrower than the state machine, so forgeries meet honest blocks often.
    #[test]
    fn a_liar_never_changes_an_honest_answer(steps in proptest::collection::vec(step(), 1..16)) {
        let (liar, honest) = (WorkerKey::new(LIAR, 0), WorkerKey::new(0, 0));
        let mut m = Model { cfg: IndexConfig::default(), keys: BTreeSet::new(), held: BTreeMap::new(), last: None };
        let mut index = PrefixIndex::new(m.cfg);
        for s in &steps {
            let (key, store, hashes) = match s {
                Step::Forge(c) => (liar, true, c),
                Step::Store(c) => (honest, true, c),
                Step::Drop(c) => (honest, false, c),
            };
            if store {
                let blocks = blocks_of(hashes);
                let _ = index.apply(key, IndexEvent::Stored { parent: None, blocks: &blocks, tier: Tier::Device });
                let _ = m.store(key, None, hashes, Tier::Device);
            } else {
                let seqs: Vec<SeqHash> = hashes.iter().map(|&h| SeqHash(h)).collect();
                let _ = index.apply(key, IndexEvent::Removed { blocks: &seqs, tier: Tier::Device });
                if m.keys.contains(&key) {
                    m.remove(key, hashes, Tier::Device);
                }
            }
        }
        // Every leaf's chain from its root.
        for leaf in 0..UNIVERSE {
            let mut q = vec![leaf];
            while let Some(p) = PARENT[q[q.len() - 1] as usize] {
                q.push(p);
            }
            q.reverse();
            let seqs: Vec<SeqHash> = q.iter().map(|&h| SeqHash(h)).collect();
            let mut out = OverlapScores::new();
            index.find_matches(&seqs, false, &mut out);
            let want = m.overlaps(&q).into_iter().find(|e| e.0 == honest).map(|e| e.1).unwrap_or_default();
            prop_assert_eq!(out.get(honest), want, "query {:?}", q);
        }
    }
}
