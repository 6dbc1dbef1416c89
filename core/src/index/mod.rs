//! The prefix index: which worker holds which KV-cache blocks, and how long a leading
//! run of a request's blocks each worker already holds.
//!
//! [`PrefixIndex`] is exact with respect to the KV events it is given (`Stored`,
//! `Removed`, `Cleared`, per worker and dp rank). [`ApproxIndex`] serves fleets that
//! publish no events: it remembers where the router sent each prefix and forgets it
//! after a TTL. Both answer into an [`OverlapScores`], sorted by [`WorkerKey`].
//! Decoding events, ordering them per worker, and deciding what an overlap is worth are
//! left to the adapters and to selection.
//!
//! # Layout and cost
//!
//! Every block some worker holds has one slot in an arena, in arrival order: its
//! sequence hash (8 bytes), the id of its *holder set* (4 bytes: which worker keys hold
//! it, in which tiers) and one bit marking where a run of equal holder sets starts.
//! Holder sets are interned and shared, so a block held by a hundred workers costs no
//! more than one held by one. A hash table maps a sequence hash to its slot through
//! 8-byte entries packed eight to a cache line, so a probe costs one cache miss. A chain
//! stored by one event sits in consecutive slots, marked by a bit per slot as linked to
//! its parent before it: an event re-stating a chain scans its hashes, and a query
//! compares only the ends of each linked stretch with one holder set (a hash names its
//! prefix). Both probe the table only where the chain leaves the arena's order, and
//! look at holder sets only where they change.
//!
//! * Memory per distinct block: 12.3 bytes of arena plus 9 to 18 bytes of table (it
//!   doubles when 7/8 full; under 8 MiB it quadruples, so up to 37 bytes just after
//!   such a growth), plus up to half again of the arena as growth slack. Per
//!   (worker key, block) entry that is the per-block figure divided by the keys sharing
//!   a block: measured on the Mooncake conversation workload, 17.0 bytes of heap per
//!   entry at 16 workers and 16.6 at 128. Each distinct holder set costs about 60 bytes
//!   plus 32 bytes per 64 worker keys; real fleets have a few thousand (1,305 and 3,818
//!   in that workload), and there are never more than live blocks. The total is bounded
//!   by [`IndexConfig::keys_max`] × [`IndexConfig::blocks_max_per_worker`] entries (and
//!   by 2³² − 2 arena slots).
//! * `Stored` and `Removed`: O(blocks in the event), plus the occasional table growth
//!   or arena compaction (below). `Cleared`, [`PrefixIndex::clear_key`] and
//!   [`PrefixIndex::remove_worker`] scan the whole arena: O(blocks in the index). They
//!   are rare (a worker restart or departure), which is why the index keeps no
//!   per-worker list of blocks.
//! * A query costs, per stretch of linked slots with one holder set that it walks, two
//!   or three cache lines (O(log blocks) when it leaves the stretch partway), one table
//!   probe and O(keys / 64) word operations, plus O(keys matched) to write the answer.
//!   The bits that mark stretches are read at one bit per block.
//! * The table grows by rebuilding (O(blocks), reading its own lines in order), and
//!   when dead slots outnumber live ones the arena is compacted in one O(blocks) pass.
//!   Either makes a single `apply` that long; both are amortised O(1) per block.
//!   Growing is a large share of filling an empty index (the rebuilds, and the page
//!   faults of tables later dropped): [`PrefixIndex::reserve`] sizes the arena and the
//!   table once when the number of blocks is known ahead, as `Vec::reserve` does.

mod apply;
mod approx;
mod blocks;
mod query;
mod scores;
mod sets;
mod table;

#[cfg(test)]
mod tests;

pub use approx::{ApproxConfig, ApproxIndex, EXPIRE_PER_CALL_MAX};
pub use scores::OverlapScores;

use alloc::collections::BTreeMap;
use alloc::vec::Vec;
use core::fmt;

use crate::hash::{BlockHash, SeqHash};
use crate::types::{Tier, WorkerId, WorkerKey};
use blocks::Blocks;
use sets::Sets;

/// What a `Stored` event whose parent the key does not hold does.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum UnknownParentPolicy {
    /// Store the blocks anyway, as if the chain started there, and report it in
    /// [`ApplySummary::unknown_parent`]. The default: a missed event should cost cache
    /// hits, not the blocks that follow it. Overlap counts from a query's first block,
    /// so such blocks lengthen an overlap only once the blocks before them are held.
    #[default]
    AcceptAsRoot,
    /// Refuse the whole event with [`IndexError::UnknownParent`].
    Reject,
}

/// The default [`IndexConfig::hash_seed`]. Adapters should pass a random seed instead.
pub const HASH_SEED_DEFAULT: u64 = 0x243F_6A88_85A3_08D3;

/// Limits and policies of a [`PrefixIndex`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct IndexConfig {
    /// Most blocks one worker key may hold (any tier); `None` for no bound. Default
    /// `None`. A `Stored` block that would exceed it is refused, together with the rest
    /// of its event, and counted in [`ApplySummary::evicted`]; blocks already held stay.
    pub blocks_max_per_worker: Option<u32>,
    /// What to do with a `Stored` event whose parent is unknown. Default
    /// [`UnknownParentPolicy::AcceptAsRoot`].
    pub unknown_parent: UnknownParentPolicy,
    /// Seed of the index's hash tables, so outsiders cannot aim blocks at one bucket.
    /// Default [`HASH_SEED_DEFAULT`].
    pub hash_seed: u64,
    /// Most worker keys tracked at once. Default 4,096. A `Stored` event for a new key
    /// beyond it fails with [`IndexError::KeysFull`].
    pub keys_max: u32,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            blocks_max_per_worker: None,
            unknown_parent: UnknownParentPolicy::AcceptAsRoot,
            hash_seed: HASH_SEED_DEFAULT,
            keys_max: 4096,
        }
    }
}

/// One KV event of one worker key.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum IndexEvent<'a> {
    /// The key now holds `blocks` in `tier`, a chain continuing after `parent` (or
    /// starting a sequence when `None`). Only the sequence hashes are used.
    Stored {
        /// The block before `blocks[0]`, if the chain does not start at the root.
        parent: Option<SeqHash>,
        /// The chain, in order.
        blocks: &'a [BlockHash],
        /// Where the blocks now live.
        tier: Tier,
    },
    /// The key no longer holds `blocks` in `tier` (other tiers keep their copies).
    Removed {
        /// Sequence hashes, in any order.
        blocks: &'a [SeqHash],
        /// The tier that dropped them.
        tier: Tier,
    },
    /// The key dropped every block in every tier.
    Cleared,
}

/// What one [`PrefixIndex::apply`] did.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ApplySummary {
    /// (block, tier) copies newly recorded.
    pub added: u32,
    /// Stored blocks the key already held in that tier (ignored).
    pub duplicates: u32,
    /// (block, tier) copies dropped.
    pub removed: u32,
    /// Removed blocks the key did not hold in that tier (ignored).
    pub absent: u32,
    /// The event's parent was not held by the key (see [`UnknownParentPolicy`]).
    pub unknown_parent: bool,
    /// Stored blocks turned away on arrival because the key was at
    /// [`IndexConfig::blocks_max_per_worker`] (or the arena was full); the index never
    /// drops a block it already holds to make room.
    pub evicted: u32,
}

/// Why [`PrefixIndex::apply`] refused an event. Nothing was applied.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum IndexError {
    /// A `Stored` event's parent is not held by the key, under
    /// [`UnknownParentPolicy::Reject`].
    UnknownParent {
        /// The parent named by the event.
        parent: SeqHash,
    },
    /// A `Stored` event for a new key, with [`IndexConfig::keys_max`] keys tracked.
    KeysFull {
        /// The key refused.
        key: WorkerKey,
        /// The bound.
        keys_max: u32,
    },
}

impl fmt::Display for IndexError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IndexError::UnknownParent { parent } => {
                write!(f, "stored event names parent block {:#018x} the worker does not hold", parent.0)
            }
            IndexError::KeysFull { key, keys_max } => {
                write!(f, "cannot track worker {key}: already tracking {keys_max} worker keys")
            }
        }
    }
}

impl core::error::Error for IndexError {}

/// Sizes and cumulative counters of a [`PrefixIndex`].
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct IndexStats {
    /// (worker key, block) pairs held, any tier.
    pub entries: u64,
    /// Distinct blocks held by some key.
    pub blocks: u64,
    /// Worker keys tracked.
    pub workers: u32,
    /// Distinct holder sets in use.
    pub holder_sets: u32,
    /// Approximate heap bytes held (allocator overhead excluded).
    pub heap_bytes: u64,
    /// Stored blocks already held, since creation.
    pub duplicates: u64,
    /// Removed blocks not held, since creation.
    pub absent_removes: u64,
    /// Stored events with an unknown parent, accepted or rejected, since creation.
    pub unknown_parents: u64,
    /// Stored blocks refused by a bound, since creation.
    pub evictions: u64,
}

/// Exact prefix index over KV events; each method states its cost.
///
/// Deterministic: the answer depends only on the events applied, never on hash seeds or
/// table order.
pub struct PrefixIndex {
    cfg: IndexConfig,
    keys: BTreeMap<WorkerKey, u32>,
    /// Per worker slot: its key (stale if the slot is free) and how many blocks it
    /// holds.
    slot_key: Vec<WorkerKey>,
    slot_entries: Vec<u32>,
    /// Free worker slots, descending, so the smallest is reused first.
    free_slots: Vec<u32>,
    /// Whether worker slots ascend with their keys (answers need no sort then).
    slots_in_key_order: bool,
    blocks: Blocks,
    sets: Sets,
    counters: IndexStats,
}

impl fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixIndex").field("cfg", &self.cfg).field("stats", &self.stats()).finish()
    }
}

impl PrefixIndex {
    /// An empty index.
    pub fn new(cfg: IndexConfig) -> Self {
        PrefixIndex {
            cfg,
            keys: BTreeMap::new(),
            slot_key: Vec::new(),
            slot_entries: Vec::new(),
            free_slots: Vec::new(),
            slots_in_key_order: true,
            blocks: Blocks::new(cfg.hash_seed),
            sets: Sets::new(cfg.hash_seed.rotate_left(32)),
            counters: IndexStats::default(),
        }
    }

    /// Applies one event of `key`. Work is O(blocks in the event), except `Cleared`
    /// (O(blocks in the index)) and the occasional compaction (see the module docs).
    pub fn apply(&mut self, key: WorkerKey, ev: IndexEvent<'_>) -> Result<ApplySummary, IndexError> {
        let mut sum = ApplySummary::default();
        let res = match ev {
            IndexEvent::Stored { parent, blocks, tier } => self.store(key, parent, blocks, tier, &mut sum),
            IndexEvent::Removed { blocks, tier } => {
                self.remove(key, blocks, tier, &mut sum);
                Ok(())
            }
            IndexEvent::Cleared => {
                self.clear_key(key);
                Ok(())
            }
        };
        self.finish_op();
        self.counters.duplicates += u64::from(sum.duplicates);
        self.counters.absent_removes += u64::from(sum.absent);
        self.counters.evictions += u64::from(sum.evicted);
        res.map(|()| sum)
    }

    /// Makes room for `blocks` more distinct blocks, so that storing them will not
    /// grow the arena or rebuild the table on the way (like `Vec::reserve`). Only an
    /// optimisation: the index grows on its own without it. Costs the memory at once:
    /// about 12 bytes of arena and 9 to 18 bytes of table per block.
    pub fn reserve(&mut self, blocks: usize) {
        self.blocks.reserve(blocks);
    }

    /// Forgets every rank of `worker` and every block it held. O(blocks in the index).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let lo = WorkerKey { worker, rank: crate::types::DpRank(0) };
        let hi = WorkerKey { worker, rank: crate::types::DpRank(u32::MAX) };
        let slots: Vec<u32> = self.keys.range(lo..=hi).map(|(_, &s)| s).collect();
        if slots.is_empty() {
            return;
        }
        self.purge(&slots);
        for &s in &slots {
            self.keys.remove(&self.slot_key[s as usize]);
            self.free_slots.push(s);
        }
        self.free_slots.sort_unstable_by(|a, b| b.cmp(a));
        self.refresh_key_order();
        self.finish_op();
    }

    /// Drops every block `key` holds, as a `Cleared` event does; the key stays
    /// tracked. O(blocks in the index).
    pub fn clear_key(&mut self, key: WorkerKey) {
        if let Some(&w) = self.keys.get(&key) {
            self.purge(&[w]);
            self.finish_op();
        }
    }

    /// Blocks `key` holds, in any tier.
    pub fn worker_entries(&self, key: WorkerKey) -> u32 {
        self.keys.get(&key).map_or(0, |&w| self.slot_entries[w as usize])
    }

    /// Sizes and cumulative counters.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            entries: self.slot_entries.iter().map(|&n| u64::from(n)).sum(),
            blocks: self.blocks.live() as u64,
            workers: self.keys.len() as u32,
            holder_sets: self.sets.len() as u32,
            heap_bytes: self.heap_bytes() as u64,
            ..self.counters
        }
    }

    fn heap_bytes(&self) -> usize {
        self.blocks.heap_bytes()
            + self.sets.heap_bytes()
            + self.slot_key.capacity() * core::mem::size_of::<WorkerKey>()
            + (self.slot_entries.capacity() + self.free_slots.capacity()) * 4
            + self.keys.len() * (core::mem::size_of::<(WorkerKey, u32)>() + 16)
    }

    fn finish_op(&mut self) {
        self.sets.collect();
        self.blocks.compact_if_sparse();
    }

    /// Gives `key` the smallest free worker slot.
    fn add_key(&mut self, key: WorkerKey) -> u32 {
        let w = match self.free_slots.pop() {
            Some(w) => w,
            None => {
                self.slot_key.push(key);
                self.slot_entries.push(0);
                // At most `keys_max` (a u32) slots exist.
                (self.slot_key.len() - 1) as u32
            }
        };
        self.slot_key[w as usize] = key;
        self.slot_entries[w as usize] = 0;
        self.keys.insert(key, w);
        self.refresh_key_order();
        w
    }

    fn refresh_key_order(&mut self) {
        let mut prev = None;
        self.slots_in_key_order = self.keys.values().all(|&s| {
            let ok = prev.is_none_or(|p| p < s);
            prev = Some(s);
            ok
        });
    }
}
