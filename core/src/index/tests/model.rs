//! Model-based test: random event sequences against a plain `BTreeMap` model of who
//! holds what, comparing every summary, every query answer and the sizes.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

use super::super::*;
use crate::hash::LocalHash;
use crate::types::Overlap;

/// Blocks are drawn from this many hashes, so events overlap and collide often.
const UNIVERSE: u64 = 12;

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

/// Mostly stretches of a few fixed chains (so prefixes get re-stated and extended),
/// sometimes arbitrary hashes.
fn chain() -> impl Strategy<Value = Vec<u64>> {
    const CHAINS: [[u64; 8]; 3] = [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 8, 9, 10, 11, 2, 3], [5, 6, 7, 0, 1, 2, 11, 10]];
    prop_oneof![
        3 => (0usize..3, 0usize..8, 0usize..8).prop_map(|(c, a, n)| {
            let start = if a < 5 { 0 } else { a - 4 };
            CHAINS[c][start..(start + n).min(8)].to_vec()
        }),
        1 => proptest::collection::vec(0..UNIVERSE, 0..6),
    ]
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
        let parent = prop_oneof![2 => Just(None), 1 => (0..UNIVERSE).prop_map(Some)];
        prop_oneof![
            6 => (key(), parent, chain(), tier())
                .prop_map(|(key, parent, blocks, tier)| Op::Store { key, parent, blocks, tier }),
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
                let got: Vec<_> = out.iter().collect();
                assert_eq!(got, m.overlaps(seq), "query {seq:?}");
                for (k, o) in &got {
                    assert_eq!(out.get(*k), *o);
                }
                assert_eq!(out.max_raw(), got.iter().map(|e| e.1.raw()).max().unwrap_or(0));
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
