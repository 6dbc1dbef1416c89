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
//! Every block some worker holds has one slot in an arena, in arrival order, storing its
//! sequence hash (8 bytes) and the id of its *holder set* (4 bytes): which worker slots
//! hold it, in which tiers. Holder sets are interned and shared, so a block held by a
//! hundred workers costs no more than one held by one. A hash table maps a sequence
//! hash to its slot with one 4-byte entry per block. A chain stored by one event sits
//! in consecutive slots, so walking along a chain is a sequential scan: a query or an
//! event probes the table only where the chain or its holders change.
//!
//! * Memory: about 12 bytes of arena plus 5 to 10 bytes of table per distinct block
//!   (the table is a power of two sized at most 8/7 of the blocks), growth slack up to
//!   twice that, plus one holder set per distinct set (tiny in practice). Per (worker,
//!   block) entry that is 18 bytes measured on the Mooncake conversation workload at 16
//!   workers, and less as more workers share blocks. It is bounded by
//!   [`IndexConfig::keys_max`] times [`IndexConfig::blocks_max_per_worker`] blocks.
//! * `Stored` and `Removed`: O(blocks in the event), plus one amortised compaction pass
//!   (see below). `Cleared`, [`PrefixIndex::clear_key`] and
//!   [`PrefixIndex::remove_worker`] scan the whole arena: O(blocks in the index). They
//!   are rare (a worker restart or departure), which is why the index keeps no
//!   per-worker list of blocks.
//! * A query is O(blocks of the query it walks) with a small constant (two sequential
//!   arrays), plus one table probe and O(workers / 64) word operations wherever the
//!   walk leaves a stored chain or the set of holders changes.
//! * When dead slots outnumber live ones, the next operation compacts the arena in one
//!   O(blocks) pass, so a single `apply` can take that long; it happens at most once per
//!   as many removals as there are live blocks.

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
use sets::{SetId, Sets, EMPTY};
use table::Vacant;

/// What a `Stored` event whose parent the key does not hold does.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum UnknownParentPolicy {
    /// Store the blocks anyway, as if the chain started there, and report it in
    /// [`ApplySummary::unknown_parent`]. The default: a missed event should cost cache
    /// hits, not the blocks that follow it. Overlap still counts only from block 0 of a
    /// query, so such blocks match only once their prefix is stored too.
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
                write!(
                    f,
                    "stored event names parent block {:#018x} the worker does not hold",
                    parent.0
                )
            }
            IndexError::KeysFull { key, keys_max } => {
                write!(
                    f,
                    "cannot track worker {key}: already tracking {keys_max} worker keys"
                )
            }
        }
    }
}

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

/// Exact prefix index over KV events; see the [module docs](self) for costs.
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

/// How far ahead a `Stored` event off its stored chain loads table lines.
const PRELOAD_BLOCKS: usize = 32;

/// A one-entry cache of what storing a block does to a holder set, for one event. Sets
/// are freed only at the end of an operation, so an entry stays right for the whole
/// operation, and blocks in a run share their set, so it mostly hits.
#[derive(Clone, Copy)]
struct Memo {
    from: SetId,
    /// The new set (equal to `from` if the key already held the block in that tier).
    to: SetId,
    /// Whether the change gives the key a block it held in no tier.
    new_entry: bool,
}

impl Memo {
    const NONE: Memo = Memo {
        from: SetId::MAX,
        to: EMPTY,
        new_entry: false,
    };
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
    pub fn apply(
        &mut self,
        key: WorkerKey,
        ev: IndexEvent<'_>,
    ) -> Result<ApplySummary, IndexError> {
        let mut sum = ApplySummary::default();
        let res = match ev {
            IndexEvent::Stored {
                parent,
                blocks,
                tier,
            } => self.store(key, parent, blocks, tier, &mut sum),
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

    /// Forgets every rank of `worker` and every block it held. O(blocks in the index).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let lo = WorkerKey {
            worker,
            rank: crate::types::DpRank(0),
        };
        let hi = WorkerKey {
            worker,
            rank: crate::types::DpRank(u32::MAX),
        };
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
        self.keys
            .get(&key)
            .map_or(0, |&w| self.slot_entries[w as usize])
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

    fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<SeqHash>,
        blocks: &[BlockHash],
        tier: Tier,
        sum: &mut ApplySummary,
    ) -> Result<(), IndexError> {
        let known = self.keys.get(&key).copied();
        if known.is_none() && self.keys.len() >= self.cfg.keys_max as usize {
            return Err(IndexError::KeysFull {
                key,
                keys_max: self.cfg.keys_max,
            });
        }
        let mut hint = None;
        if let Some(p) = parent {
            hint = self.blocks.locate(p.0);
            let held = matches!((known, hint), (Some(w), Some(s))
                if self.sets.holds(self.blocks.sets[s as usize], w));
            if !held {
                self.counters.unknown_parents += 1;
                if self.cfg.unknown_parent == UnknownParentPolicy::Reject {
                    return Err(IndexError::UnknownParent { parent: p });
                }
                sum.unknown_parent = true;
            }
        }
        if blocks.is_empty() {
            return Ok(());
        }
        let w = match known {
            Some(w) => w,
            None => self.add_key(key),
        };
        let cap = self.cfg.blocks_max_per_worker.unwrap_or(u32::MAX);
        let (mut memo, mut fresh, mut preloaded) = (Memo::NONE, None, 0);
        for (i, b) in blocks.iter().enumerate() {
            let seq = b.seq.0;
            let found = match self.blocks.follow(seq, hint) {
                Some(s) => Ok(s),
                None => {
                    // Off the stored chain: the blocks after this one will likely need
                    // the table too, so keep their lines loading well ahead.
                    if i + PRELOAD_BLOCKS > preloaded {
                        let from = preloaded.max(i);
                        preloaded = (i + 2 * PRELOAD_BLOCKS).min(blocks.len());
                        self.blocks
                            .preload(blocks[from..preloaded].iter().map(|b| b.seq.0));
                    }
                    self.blocks.lookup(seq)
                }
            };
            let stored = match found {
                Ok(slot) => self.store_held(w, tier, slot, cap, &mut memo),
                Err(at) => self.store_new(w, tier, seq, at, cap, &mut fresh),
            };
            match stored {
                Some((slot, added)) => {
                    sum.added += u32::from(added);
                    sum.duplicates += u32::from(!added);
                    hint = Some(slot);
                }
                None => {
                    sum.evicted += (blocks.len() - i) as u32;
                    break;
                }
            }
        }
        Ok(())
    }

    /// Adds `w in tier` to the live block at `slot`: `(slot, true)` if added, `(slot,
    /// false)` if already there, `None` if the key's bound refuses it.
    fn store_held(
        &mut self,
        w: u32,
        tier: Tier,
        slot: u32,
        cap: u32,
        memo: &mut Memo,
    ) -> Option<(u32, bool)> {
        let old = self.blocks.sets[slot as usize];
        if memo.from != old {
            let (to, new_entry) = if self.sets.contains(old, w, tier) {
                (old, false)
            } else {
                (self.sets.with(old, w, tier, true), !self.sets.holds(old, w))
            };
            *memo = Memo {
                from: old,
                to,
                new_entry,
            };
        }
        if memo.to == old {
            return Some((slot, false));
        }
        if memo.new_entry {
            if self.slot_entries[w as usize] >= cap {
                return None;
            }
            self.slot_entries[w as usize] += 1;
        }
        self.blocks.set_holders(slot as usize, memo.to);
        self.sets.acquire(memo.to, 1);
        self.sets.release(old, 1);
        Some((slot, true))
    }

    /// Adds a block no key holds, held by `w` alone; `None` if a bound refuses it.
    /// `fresh` caches the id of the set `{w in tier}` across one event.
    fn store_new(
        &mut self,
        w: u32,
        tier: Tier,
        seq: u64,
        at: Vacant,
        cap: u32,
        fresh: &mut Option<SetId>,
    ) -> Option<(u32, bool)> {
        if self.slot_entries[w as usize] >= cap {
            return None;
        }
        let set = *fresh.get_or_insert_with(|| self.sets.with(EMPTY, w, tier, true));
        let slot = self.blocks.push(seq, at, set)?;
        self.sets.acquire(set, 1);
        self.slot_entries[w as usize] += 1;
        Some((slot, true))
    }

    fn remove(&mut self, key: WorkerKey, blocks: &[SeqHash], tier: Tier, sum: &mut ApplySummary) {
        let Some(&w) = self.keys.get(&key) else {
            sum.absent = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
            return;
        };
        let (mut memo, mut hint) = (Memo::NONE, None);
        for seq in blocks {
            let Some(slot) = self.blocks.locate_near(seq.0, hint) else {
                sum.absent += 1;
                continue;
            };
            hint = Some(slot);
            let old = self.blocks.sets[slot as usize];
            if memo.from != old {
                let to = if self.sets.contains(old, w, tier) {
                    self.sets.with(old, w, tier, false)
                } else {
                    old
                };
                // Here `new_entry` means the key loses its last copy of the block.
                memo = Memo {
                    from: old,
                    to,
                    new_entry: !self.sets.holds(to, w),
                };
            }
            let new = memo.to;
            if new == old {
                sum.absent += 1;
                continue;
            }
            if memo.new_entry {
                self.slot_entries[w as usize] -= 1;
            }
            self.blocks.set_holders(slot as usize, new);
            self.sets.acquire(new, 1);
            self.sets.release(old, 1);
            if new == EMPTY {
                self.blocks.kill(slot);
            }
            sum.removed += 1;
        }
    }

    /// Removes worker slots `slots` from every block, in one scan of the arena.
    fn purge(&mut self, slots: &[u32]) {
        let mut mask = Vec::new();
        for &s in slots {
            let w = s as usize / 64;
            if mask.len() <= w {
                mask.resize(w + 1, 0u64);
            }
            mask[w] |= 1 << (s % 64);
            self.slot_entries[s as usize] = 0;
        }
        // Each live set's image, computed once; the scan then only reads this table.
        let ids: Vec<SetId> = self.sets.live_ids().collect();
        let mut image: Vec<SetId> = (0..self.sets.id_bound() as SetId).collect();
        for id in ids {
            let hit = self.sets.any(id).iter().zip(&mask).any(|(a, m)| a & m != 0);
            if hit {
                image[id as usize] = self.sets.without(id, &mask);
            }
        }
        for slot in 0..self.blocks.slots() {
            let old = self.blocks.sets[slot];
            let new = image[old as usize];
            if new != old {
                self.blocks.set_holders(slot, new);
                self.sets.acquire(new, 1);
                self.sets.release(old, 1);
                if new == EMPTY {
                    self.blocks.kill(slot as u32);
                }
            }
        }
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
