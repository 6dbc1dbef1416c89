//! Applying events to a [`PrefixIndex`]: `Stored`, `Removed`, and purging keys.
//!
//! Each walks the event's blocks along the arena (the next slot first, the table only
//! where the chain leaves the arena's order) and moves each block to its new holder
//! set, caching the set change across a run of blocks that share a set.
//!
//! Filling an index is mostly two kinds of run, and a `Stored` event handles each as a
//! whole: blocks already held that follow one another in the arena with one holder set
//! change sets as a range, and blocks no key holds are appended by
//! [`Blocks::push_run`](super::blocks::Blocks::push_run), which does only the table
//! lookup and insert per block. Both stay exact: the range is found by comparing
//! hashes, and every new block is still looked up.

use alloc::vec::Vec;

use super::blocks::{Preload, RunEnd};
use super::sets::{SetId, EMPTY};
use super::{ApplySummary, IndexError, PrefixIndex, UnknownParentPolicy};
use crate::hash::{BlockHash, SeqHash};
use crate::types::{Tier, WorkerKey};

/// A one-entry cache of what storing a block does to a holder set, for one event. Sets
/// are freed only at the end of an operation, so an entry stays right for the whole
/// operation, and blocks in a run share their set, so it mostly hits.
#[derive(Clone, Copy)]
struct Memo {
    from: SetId,
    /// The new set (equal to `from` if the key already held the block in that tier).
    to: SetId,
    /// Whether the change moves the key's entry count: storing its first copy of the
    /// block (in any tier), or removing its last.
    entry_changes: bool,
}

impl Memo {
    const NONE: Memo = Memo { from: SetId::MAX, to: EMPTY, entry_changes: false };
}

impl PrefixIndex {
    pub(super) fn store(
        &mut self,
        key: WorkerKey,
        parent: Option<SeqHash>,
        blocks: &[BlockHash],
        tier: Tier,
        sum: &mut ApplySummary,
    ) -> Result<(), IndexError> {
        let known = self.keys.get(&key).copied();
        if known.is_none() && self.keys.len() >= self.cfg.keys_max as usize {
            return Err(IndexError::KeysFull { key, keys_max: self.cfg.keys_max });
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
        let (mut memo, mut pre, mut fresh) = (Memo::NONE, Preload::default(), EMPTY);
        // Where the next block is, when a run of new blocks found it.
        let mut next = None;
        let mut i = 0;
        while i < blocks.len() {
            // The parent this event names for block `i`.
            let named = match i.checked_sub(1) {
                Some(p) => Some(blocks[p].seq.0),
                None => parent.map(|p| p.0),
            };
            let found = match next.take() {
                Some(slot) => Ok(slot),
                None => match self.blocks.follow(blocks[i].seq.0, hint) {
                    Some(slot) => Ok(slot),
                    None => {
                        let b = &self.blocks;
                        pre.ahead(|seq| b.home_word(seq), blocks, i);
                        self.blocks.lookup(blocks[i].seq.0)
                    }
                },
            };
            match found {
                Ok(slot) => {
                    self.blocks.note_parent(slot, named);
                    // The blocks after this one that follow it in the arena with the
                    // same holders change alike, so they are stored together.
                    let k = self.blocks.same_run(slot, &blocks[i..]);
                    let (n, changed) = self.store_held(w, tier, slot, k, cap, &mut memo);
                    // `n <= k`, and an event's length fits in u32.
                    if changed {
                        sum.added += n as u32;
                    } else {
                        sum.duplicates += n as u32;
                    }
                    i += n;
                    if n > 0 {
                        hint = Some(slot + (n - 1) as u32);
                    }
                    if n < k {
                        sum.evicted += (blocks.len() - i) as u32;
                        break;
                    }
                }
                Err(at) => {
                    if fresh == EMPTY {
                        fresh = self.sets.with(EMPTY, w, tier, true);
                    }
                    let room = cap.saturating_sub(self.slot_entries[w as usize]) as usize;
                    let first = self.blocks.slots() as u32;
                    let (n, end) = self.blocks.push_run(blocks, i, at, fresh, room, &mut pre);
                    if n > 0 {
                        self.blocks.link_new(first, named);
                    }
                    // A run never exceeds the event, whose length fits in u32.
                    let n32 = n as u32;
                    self.slot_entries[w as usize] += n32;
                    self.sets.acquire(fresh, n32);
                    sum.added += n32;
                    i += n;
                    if n > 0 {
                        hint = Some((self.blocks.slots() - 1) as u32);
                    }
                    match end {
                        RunEnd::Done => {}
                        RunEnd::Full => {
                            sum.evicted += (blocks.len() - i) as u32;
                            break;
                        }
                        RunEnd::Held(slot) => next = Some(slot),
                    }
                }
            }
        }
        Ok(())
    }

    /// Adds `w in tier` to the `k` live blocks from `slot` on, which share a holder
    /// set: `(n, true)` if it added the first `n` of them (fewer than `k` if the key's
    /// bound refused the next), `(k, false)` if all were already there.
    fn store_held(&mut self, w: u32, tier: Tier, slot: u32, k: usize, cap: u32, memo: &mut Memo) -> (usize, bool) {
        let old = self.blocks.sets[slot as usize];
        if memo.from != old {
            let (to, entry_changes) = if self.sets.contains(old, w, tier) {
                (old, false)
            } else {
                (self.sets.with(old, w, tier, true), !self.sets.holds(old, w))
            };
            *memo = Memo { from: old, to, entry_changes };
        }
        if memo.to == old {
            return (k, false);
        }
        let mut n = k;
        if memo.entry_changes {
            let entries = &mut self.slot_entries[w as usize];
            n = n.min(cap.saturating_sub(*entries) as usize);
            // `n <= cap - entries`, so this stays within u32.
            *entries += n as u32;
        }
        if n > 0 {
            self.blocks.set_holders_range(slot as usize, n, memo.to);
            self.sets.acquire(memo.to, n as u32);
            self.sets.release(old, n as u32);
        }
        (n, true)
    }

    pub(super) fn remove(&mut self, key: WorkerKey, blocks: &[SeqHash], tier: Tier, sum: &mut ApplySummary) {
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
                let to = if self.sets.contains(old, w, tier) { self.sets.with(old, w, tier, false) } else { old };
                memo = Memo { from: old, to, entry_changes: !self.sets.holds(to, w) };
            }
            let new = memo.to;
            if new == old {
                sum.absent += 1;
                continue;
            }
            if memo.entry_changes {
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
    pub(super) fn purge(&mut self, slots: &[u32]) {
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
}
