//! A plain model of the exact prefix index: per worker key, a `BTreeMap` from block to
//! the tiers holding it. It predicts every `apply` result and every query answer.

use std::collections::BTreeMap;

use router_core::{ApplySummary, IndexConfig, IndexError, UnknownParentPolicy};
use router_core::{BlockHash, SeqHash};
use router_core::{Overlap, Tier, WorkerId, WorkerKey};

/// Tiers holding one block: device, host, disk.
type Tiers = [bool; 3];

#[derive(Clone, Debug, Default)]
pub struct IndexModel {
    cfg: Option<IndexConfig>,
    /// Tracked keys; a cleared key stays tracked with no blocks, as in the index.
    keys: BTreeMap<WorkerKey, BTreeMap<SeqHash, Tiers>>,
}

fn tier_index(t: Tier) -> usize {
    match t {
        Tier::Device => 0,
        Tier::Host => 1,
        Tier::Disk => 2,
    }
}

impl IndexModel {
    pub fn new(cfg: IndexConfig) -> Self {
        IndexModel { cfg: Some(cfg), keys: BTreeMap::new() }
    }

    fn cfg(&self) -> IndexConfig {
        self.cfg.unwrap_or_default()
    }

    pub fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<SeqHash>,
        blocks: &[BlockHash],
        tier: Tier,
    ) -> Result<ApplySummary, IndexError> {
        let cfg = self.cfg();
        let known = self.keys.contains_key(&key);
        if !known && self.keys.len() >= cfg.keys_max as usize {
            return Err(IndexError::KeysFull { key, keys_max: cfg.keys_max });
        }
        let mut sum = ApplySummary::default();
        if let Some(p) = parent {
            let held = self.keys.get(&key).is_some_and(|m| m.contains_key(&p));
            if !held {
                if cfg.unknown_parent == UnknownParentPolicy::Reject {
                    return Err(IndexError::UnknownParent { parent: p });
                }
                sum.unknown_parent = true;
            }
        }
        if blocks.is_empty() {
            return Ok(sum);
        }
        let cap = cfg.blocks_max_per_worker.unwrap_or(u32::MAX) as usize;
        let held = self.keys.entry(key).or_default();
        let t = tier_index(tier);
        for (i, b) in blocks.iter().enumerate() {
            let full = held.len() >= cap;
            match held.get_mut(&b.seq) {
                Some(tiers) if tiers[t] => sum.duplicates += 1,
                Some(tiers) => {
                    tiers[t] = true;
                    sum.added += 1;
                }
                None if full => {
                    sum.evicted += (blocks.len() - i) as u32;
                    break;
                }
                None => {
                    let mut tiers = [false; 3];
                    tiers[t] = true;
                    held.insert(b.seq, tiers);
                    sum.added += 1;
                }
            }
        }
        Ok(sum)
    }

    pub fn remove(&mut self, key: WorkerKey, blocks: &[SeqHash], tier: Tier) -> ApplySummary {
        let mut sum = ApplySummary::default();
        let Some(held) = self.keys.get_mut(&key) else {
            sum.absent = blocks.len() as u32;
            return sum;
        };
        let t = tier_index(tier);
        for s in blocks {
            match held.get_mut(s) {
                Some(tiers) if tiers[t] => {
                    tiers[t] = false;
                    if tiers == &[false; 3] {
                        held.remove(s);
                    }
                    sum.removed += 1;
                }
                _ => sum.absent += 1,
            }
        }
        sum
    }

    pub fn clear_key(&mut self, key: WorkerKey) {
        if let Some(held) = self.keys.get_mut(&key) {
            held.clear();
        }
    }

    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.keys.retain(|k, _| k.worker != worker);
    }

    /// Blocks `key` holds, any tier.
    pub fn entries(&self, key: WorkerKey) -> u32 {
        self.keys.get(&key).map_or(0, |m| m.len() as u32)
    }

    pub fn total_entries(&self) -> u64 {
        self.keys.values().map(|m| m.len() as u64).sum()
    }

    pub fn keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.keys.keys().copied()
    }

    /// Every key's leading-run overlap with `query`, non-zero ones only, ascending.
    pub fn find_matches(&self, query: &[SeqHash]) -> Vec<(WorkerKey, Overlap)> {
        let mut out = Vec::new();
        for (&key, held) in &self.keys {
            let mut o = Overlap::default();
            for s in query {
                let Some(tiers) = held.get(s) else { break };
                if tiers[0] {
                    o.device += 1;
                } else if tiers[1] {
                    o.host += 1;
                } else {
                    o.disk += 1;
                }
            }
            if o.raw() > 0 {
                out.push((key, o));
            }
        }
        out
    }
}
