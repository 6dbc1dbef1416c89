//! The block arena: every block some worker holds, in arrival order, with its holder
//! set, plus a [`SlotTable`] from sequence hash to arena slot.
//!
//! Blocks stored by one event land in consecutive slots, so a later walk along the same
//! chain (a query, or an event re-stating a prefix) finds the next block by comparing
//! the next slot's hash instead of probing the table. A walk reads 8 bytes per block
//! (the hash) plus one bit (where the holder set changes); the 4-byte holder set is read
//! only where a run starts.
//!
//! A block whose last holder leaves becomes a dead slot. When dead slots outnumber live
//! ones, [`Blocks::compact_if_sparse`] squeezes them out in one pass, keeping order.

use alloc::vec::Vec;

use super::sets::{mix, SetId, EMPTY};
use super::table::{SlotTable, Vacant, SLOT_MAX};

/// Marks a dead slot in the compaction map.
const GONE: u32 = u32::MAX;

/// Dead slots tolerated before compaction, whatever the live count (tiny in tests, so
/// that model tests compact often).
const DEAD_SLOTS_MIN: usize = if cfg!(test) { 2 } else { 4096 };

/// The arena, one entry per slot in each array, and the table.
pub(crate) struct Blocks {
    /// Sequence hash per slot (kept after death; a dead slot's set is [`EMPTY`]).
    pub(crate) seqs: Vec<u64>,
    /// Holder set per slot; [`EMPTY`] marks a dead slot.
    pub(crate) sets: Vec<SetId>,
    /// One bit per slot: set where a run of equal live holder sets starts (slot 0, a
    /// dead slot, or a set unlike the previous slot's), so a walk finds how far its run
    /// goes from the bits alone and compares only hashes inside it.
    cuts: Vec<u64>,
    table: SlotTable,
    seed: u64,
}

/// Where a block lives, or where to insert it.
pub(crate) type Located = Result<u32, Vacant>;

impl Blocks {
    pub(crate) fn new(seed: u64) -> Self {
        Blocks { seqs: Vec::new(), sets: Vec::new(), cuts: Vec::new(), table: SlotTable::new(), seed }
    }

    /// Arena slots, live or dead.
    pub(crate) fn slots(&self) -> usize {
        self.seqs.len()
    }

    /// Live blocks.
    pub(crate) fn live(&self) -> usize {
        self.table.len()
    }

    /// The table tag of `seq` (odd: the table marks unused ways with tag 0).
    pub(crate) fn tag(&self, seq: u64) -> u32 {
        (mix(self.seed, seq) >> 32) as u32 | 1
    }

    /// Loads the table lines of `seqs` all at once, so that the lookups that follow
    /// find them cached instead of waiting for each miss in turn.
    pub(crate) fn preload(&self, seqs: impl Iterator<Item = u64>) {
        let acc = seqs.fold(0, |acc, seq| acc ^ self.table.home_word(self.tag(seq)));
        core::hint::black_box(acc);
    }

    /// The live slot of `seq`, if any.
    pub(crate) fn locate(&self, seq: u64) -> Option<u32> {
        self.locate_tagged(seq, self.tag(seq))
    }

    fn locate_tagged(&self, seq: u64, tag: u32) -> Option<u32> {
        self.table.find(tag, |s| self.seqs[s as usize] == seq)
    }

    /// Whether slot `s` exists, is live, and holds `seq`.
    pub(crate) fn is_live_at(&self, s: u32, seq: u64) -> bool {
        let s = s as usize;
        s < self.seqs.len() && self.seqs[s] == seq && self.sets[s] != EMPTY
    }

    /// How many slots from `s` on (at most `max`) continue the run of slot `s - 1`:
    /// live, with the same holder set.
    pub(crate) fn run_room(&self, s: usize, max: usize) -> usize {
        let end = self.seqs.len().min(s.saturating_add(max));
        let mut i = s;
        while i < end {
            let w = i / 64;
            let bits = self.cuts[w] >> (i % 64);
            if bits != 0 {
                return (i + bits.trailing_zeros() as usize).min(end) - s;
            }
            i = (w + 1) * 64;
        }
        end.saturating_sub(s)
    }

    /// Sets the holder set of slot `s`, keeping the run bits right.
    pub(crate) fn set_holders(&mut self, s: usize, id: SetId) {
        self.sets[s] = id;
        self.update_cut(s);
        self.update_cut(s + 1);
    }

    fn update_cut(&mut self, s: usize) {
        if s >= self.sets.len() {
            return;
        }
        let cut = s == 0 || self.sets[s] == EMPTY || self.sets[s] != self.sets[s - 1];
        let bit = 1u64 << (s % 64);
        if cut {
            self.cuts[s / 64] |= bit;
        } else {
            self.cuts[s / 64] &= !bit;
        }
    }

    /// The live slot of `seq` for a walk that is at slot `prev`: tries the slot after
    /// it, then the table.
    pub(crate) fn find_after(&self, seq: u64, prev: Option<u32>) -> Option<u32> {
        self.follow(seq, prev).or_else(|| self.locate(seq))
    }

    /// The slot after `prev`, if it is `seq`'s live slot.
    pub(crate) fn follow(&self, seq: u64, prev: Option<u32>) -> Option<u32> {
        let after = prev?.wrapping_add(1);
        self.is_live_at(after, seq).then_some(after)
    }

    /// The live slot of `seq`, or where [`Blocks::push`] would record it.
    pub(crate) fn lookup(&mut self, seq: u64) -> Located {
        let tag = self.tag(seq);
        let seqs = &self.seqs;
        self.table.find_or_vacant(tag, |s| seqs[s as usize] == seq)
    }

    /// Like [`Blocks::find_after`], but also tries the slot before `near` (removals
    /// often list a chain last block first).
    pub(crate) fn locate_near(&self, seq: u64, near: Option<u32>) -> Option<u32> {
        if let Some(before) = near.and_then(|n| n.checked_sub(1)) {
            if self.is_live_at(before, seq) {
                return Some(before);
            }
        }
        self.find_after(seq, near)
    }

    /// Appends a block found absent by [`Blocks::lookup`] (with no change to the index
    /// since), as a new live slot with holder set `set`. `None` when the arena is full.
    pub(crate) fn push(&mut self, seq: u64, at: Vacant, set: SetId) -> Option<u32> {
        let slot = u32::try_from(self.seqs.len()).ok().filter(|&s| s <= SLOT_MAX)?;
        self.table.fill(at, slot);
        if self.seqs.len() == self.seqs.capacity() {
            // Grow by half rather than double: the arena is most of the index.
            let more = (self.seqs.len() / 2).max(64);
            self.seqs.reserve_exact(more);
            self.sets.reserve_exact(more);
        }
        self.seqs.push(seq);
        self.sets.push(set);
        // A new slot starts a run unless it continues the previous slot's set.
        let s = slot as usize;
        let cut = s == 0 || self.sets[s - 1] != set;
        if s == self.cuts.len() * 64 {
            self.cuts.push(0);
        }
        self.cuts[s / 64] |= u64::from(cut) << (s % 64);
        Some(slot)
    }

    /// Makes room for `more` new blocks: arena capacity and a table that will not
    /// need to grow for them.
    pub(crate) fn reserve(&mut self, more: usize) {
        self.seqs.reserve_exact(more);
        self.sets.reserve_exact(more);
        self.cuts.reserve_exact((self.seqs.len() + more).div_ceil(64).saturating_sub(self.cuts.len()));
        self.table.reserve(more);
    }

    /// Marks live slot `s` dead and drops it from the table.
    pub(crate) fn kill(&mut self, s: u32) {
        self.set_holders(s as usize, EMPTY);
        self.table.remove(self.tag(self.seqs[s as usize]), s);
    }

    /// Squeezes out dead slots once they outnumber live ones, keeping slot order (so
    /// chains stay consecutive). Work is linear in the arena; it runs at most once per
    /// `live` deaths, so it is amortised O(1) per removed block.
    pub(crate) fn compact_if_sparse(&mut self) {
        let dead = self.slots() - self.live();
        if dead < DEAD_SLOTS_MIN || dead <= self.live() {
            return;
        }
        // New slot of each old slot: its rank among live slots.
        let mut remap = Vec::with_capacity(self.slots());
        let mut w = 0;
        for r in 0..self.slots() {
            if self.sets[r] == EMPTY {
                remap.push(GONE);
                continue;
            }
            remap.push(w as u32);
            self.seqs[w] = self.seqs[r];
            self.sets[w] = self.sets[r];
            w += 1;
        }
        shorten(&mut self.seqs, w);
        shorten(&mut self.sets, w);
        self.cuts.clear();
        self.cuts.resize(w.div_ceil(64), 0);
        for s in 0..w {
            self.update_cut(s);
        }
        self.table.remap(|s| remap[s as usize]);
        self.table.shrink_if_sparse();
    }

    /// Heap bytes held by the arena and the table.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.seqs.capacity() * 8 + self.sets.capacity() * 4 + self.cuts.capacity() * 8 + self.table.heap_bytes()
    }
}

/// Truncates `v` to `len` and gives back most of the spare capacity.
fn shorten<T>(v: &mut Vec<T>, len: usize) {
    v.truncate(len);
    v.shrink_to(len + len / 4);
}
