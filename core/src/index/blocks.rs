//! The block arena: every block some worker holds, in arrival order, with its holder
//! set, plus a [`SlotTable`] from sequence hash to arena slot.
//!
//! Blocks stored by one event land in consecutive slots, so a later walk along the same
//! chain (a query, or an event re-stating a prefix) finds the next block by comparing
//! the next slot's hash instead of probing the table. A bit per slot marks where a
//! *run* starts: where the holder set changes or the slot does not follow its parent.
//! An event reads 8 bytes per block of a run (the hash); a query reads a run's ends;
//! the 4-byte holder set is read only where a run starts.
//!
//! A block whose last holder leaves becomes a dead slot. When dead slots outnumber live
//! ones, [`Blocks::compact_if_sparse`] squeezes them out in one pass, keeping order.

use alloc::vec::Vec;

use super::sets::{mix, SetId, EMPTY};
use super::table::{SlotTable, Vacant, SLOT_MAX};
use crate::hash::BlockHash;

/// Marks a dead slot in the compaction map.
const GONE: u32 = u32::MAX;

/// Dead slots tolerated before compaction, whatever the live count (tiny in tests, so
/// that model tests compact often).
const DEAD_SLOTS_MIN: usize = if cfg!(test) { 2 } else { 4096 };

/// How far ahead a walk off its stored chain loads table lines.
const PRELOAD_BLOCKS: usize = 32;

/// How a [`Blocks::push_run`] ended.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum RunEnd {
    /// The chain ended.
    Done,
    /// The bound (or the arena) refused the next block.
    Full,
    /// The next block is live at this slot.
    Held(u32),
}

/// Loads table lines well ahead of a walk that has left its stored chain: the blocks
/// after such a block likely need the table too, and their misses overlap when issued
/// together.
#[derive(Clone, Copy, Default)]
pub(crate) struct Preload {
    /// Blocks of the chain before this index are loaded or passed.
    upto: usize,
}

impl Preload {
    /// Called before looking up `chain[i]` in the table; `word` loads a word of a
    /// hash's home bucket.
    #[inline(always)]
    pub(crate) fn ahead(&mut self, word: impl Fn(u64) -> u32, chain: &[BlockHash], i: usize) {
        if i + PRELOAD_BLOCKS > self.upto {
            let from = self.upto.max(i);
            self.upto = (i + 2 * PRELOAD_BLOCKS).min(chain.len());
            if let Some(next) = chain.get(from..self.upto) {
                let acc = next.iter().fold(0, |acc, b| acc ^ word(b.seq.0));
                core::hint::black_box(acc);
            }
        }
    }
}

/// The arena, one entry per slot in each array, and the table.
pub(crate) struct Blocks {
    /// Sequence hash per slot (kept after death; a dead slot's set is [`EMPTY`]).
    pub(crate) seqs: Vec<u64>,
    /// Holder set per slot; [`EMPTY`] marks a dead slot.
    pub(crate) sets: Vec<SetId>,
    /// One bit per slot: set where a run starts (slot 0, a dead slot, a slot not
    /// linked to the previous one, or a holder set unlike the previous slot's), so a
    /// walk finds how far its run goes from the bits alone.
    cuts: Vec<u64>,
    /// One bit per slot: set while the previous slot holds the block's parent, as every
    /// event that stored the block has said. Set when a chain is appended, cleared when
    /// an event names another parent or none, or compaction drops the previous slot. Inside a run the slots are therefore one chain, and a walk that matches a
    /// run's first and last block has matched the blocks between (see
    /// [`PrefixIndex::find_matches`](super::PrefixIndex::find_matches)).
    links: Vec<u64>,
    table: SlotTable,
    seed: u64,
}

/// Where a block lives, or where to insert it.
pub(crate) type Located = Result<u32, Vacant>;

impl Blocks {
    pub(crate) fn new(seed: u64) -> Self {
        Blocks {
            seqs: Vec::new(),
            sets: Vec::new(),
            cuts: Vec::new(),
            links: Vec::new(),
            table: SlotTable::new(),
            seed,
        }
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
        tag_of(self.seed, seq)
    }

    /// A word of the table line where `seq` lives or would go, for [`Preload`] to load
    /// early (its value means nothing).
    pub(crate) fn home_word(&self, seq: u64) -> u32 {
        self.table.home_word(self.tag(seq))
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

    /// Sets the holder set of the `n` slots from `s` on, which are one run (no cut
    /// inside, as [`Blocks::same_run`] finds them), keeping the run bits right.
    pub(crate) fn set_holders_range(&mut self, s: usize, n: usize, id: SetId) {
        if let Some(sets) = self.sets.get_mut(s..s + n) {
            sets.fill(id);
        }
        self.update_cut(s);
        self.update_cut(s + n);
    }

    /// How many blocks of `chain` (at least one) sit from live slot `s` on in the
    /// arena, in order, with the holder set of slot `s`.
    pub(crate) fn same_run(&self, s: u32, chain: &[BlockHash]) -> usize {
        let s = s as usize;
        let room = self.run_room(s + 1, chain.len().saturating_sub(1));
        let (Some(seqs), Some(rest)) = (self.seqs.get(s + 1..s + 1 + room), chain.get(1..1 + room)) else {
            return 1;
        };
        1 + seqs.iter().zip(rest).take_while(|(&a, b)| a == b.seq.0).count()
    }

    /// Whether slot `s` is linked to slot `s - 1` (see [`Blocks::links`]).
    fn linked(&self, s: usize) -> bool {
        self.links.get(s / 64).is_some_and(|w| w >> (s % 64) & 1 == 1)
    }

    /// Records that an event names `parent` as the parent of live slot `s`'s block:
    /// a parent other than the previous slot's block unlinks them. `None` says the
    /// block is a root, as engines mean it, and unlinks too: were it to say nothing, a
    /// key could hold a block behind a forged link without ever contradicting it.
    pub(crate) fn note_parent(&mut self, s: u32, parent: Option<u64>) {
        let s = s as usize;
        if self.linked(s) && parent != Some(self.seqs[s - 1]) {
            self.links[s / 64] &= !(1 << (s % 64));
            self.update_cut(s);
        }
    }

    /// Links slot `s`, just appended, to the slot before it if that holds `parent`.
    pub(crate) fn link_new(&mut self, s: u32, parent: Option<u64>) {
        let s = s as usize;
        if s > 0 && parent == Some(self.seqs[s - 1]) {
            set_bits(&mut self.links, s, s + 1);
            self.update_cut(s);
        }
    }

    fn update_cut(&mut self, s: usize) {
        if s >= self.sets.len() {
            return;
        }
        let cut = s == 0 || self.sets[s] == EMPTY || self.sets[s] != self.sets[s - 1] || !self.linked(s);
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

    /// Appends the leading blocks of `chain[start..]` that no key holds, as new live
    /// slots with holder set `set`, at most `max` of them. `at` is where
    /// [`Blocks::lookup`] placed `chain[start]`, found absent with no change to the
    /// index since. Returns how many it appended and why it stopped. The appended
    /// slots are linked one to the next; [`Blocks::link_new`] links the first.
    ///
    /// This is most of filling an index, so it is a tighter loop than a `lookup` and
    /// an append per block: after an append the next slot does not exist yet, so only
    /// the table can hold the next block; the arena grows once for the run; and the
    /// holder sets and run bits are written once at the end, since the run shares
    /// `set`. Each block is still looked up, so a chain that rejoins stored blocks (or
    /// repeats one of its own) is caught exactly.
    pub(crate) fn push_run(
        &mut self,
        chain: &[BlockHash],
        start: usize,
        mut at: Vacant,
        set: SetId,
        max: usize,
        pre: &mut Preload,
    ) -> (usize, RunEnd) {
        let first = self.seqs.len();
        let run = chain.get(start..).unwrap_or_default();
        // Slot numbers stay within what the table stores.
        let max = max.min((SLOT_MAX as usize + 1).saturating_sub(first));
        if run.is_empty() {
            return (0, RunEnd::Done);
        }
        if max == 0 {
            return (0, RunEnd::Full);
        }
        let (mut p, seed) = (*pre, self.seed);
        let mut j = 0;
        let end = loop {
            let seqs = &self.seqs;
            // Whether slot `s` holds `seq`. The run's own hashes join the arena after
            // the loop (one copy), so its slots are compared against the chain.
            let held = |s: u32, seq: u64| {
                let s = s as usize;
                if s < first {
                    seqs[s] == seq
                } else {
                    run[s - first].seq.0 == seq
                }
            };
            let step = self.table.with_cursor(|c| loop {
                // `j < max` and `first + max - 1 <= SLOT_MAX`, so the slot fits.
                c.fill(at, (first + j) as u32);
                j += 1;
                if j == run.len() {
                    return Some(RunEnd::Done);
                }
                if c.room() == 0 {
                    return None;
                }
                p.ahead(|seq| c.home_word(tag_of(seed, seq)), chain, start + j);
                let seq = run[j].seq.0;
                match c.find_or_vacant(tag_of(seed, seq), |s| held(s, seq)) {
                    Ok(s) => return Some(RunEnd::Held(s)),
                    // A held block needs no room, so the bound is checked only here.
                    Err(_) if j == max => return Some(RunEnd::Full),
                    Err(next) => at = next,
                }
            });
            if let Some(end) = step {
                break end;
            }
            // The table is at its load bound: the lookup grows it.
            let seq = run[j].seq.0;
            match self.table.find_or_vacant(tag_of(seed, seq), |s| held(s, seq)) {
                Ok(s) => break RunEnd::Held(s),
                Err(_) if j == max => break RunEnd::Full,
                Err(next) => at = next,
            }
        };
        *pre = p;
        self.grow_arena(first + j);
        self.seqs.extend(run[..j].iter().map(|b| b.seq.0));
        let n = j;
        self.sets.resize(first + n, set);
        // Each appended block follows its parent, except perhaps the first.
        set_bits(&mut self.links, first + 1, first + n);
        // Bits past the last slot are clear; the first slot starts a run until linked.
        self.cuts.resize((first + n).div_ceil(64), 0);
        self.cuts[first / 64] |= 1 << (first % 64);
        (n, end)
    }

    /// Makes the arena's capacity at least `len` slots, growing it as appending one
    /// slot at a time would: by half when full (rather than double: the arena is most
    /// of the index).
    fn grow_arena(&mut self, len: usize) {
        let mut cap = self.seqs.capacity();
        if cap >= len {
            return;
        }
        while cap < len {
            cap += (cap / 2).max(64);
        }
        let more = cap - self.seqs.len();
        self.seqs.reserve_exact(more);
        self.sets.reserve_exact(more);
    }

    /// Makes room for `more` new blocks: arena capacity and a table that will not
    /// need to grow for them.
    pub(crate) fn reserve(&mut self, more: usize) {
        self.seqs.reserve_exact(more);
        self.sets.reserve_exact(more);
        let words = (self.seqs.len() + more).div_ceil(64);
        self.cuts.reserve_exact(words.saturating_sub(self.cuts.len()));
        self.links.reserve_exact(words.saturating_sub(self.links.len()));
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
        let mut links = Vec::with_capacity(self.links.len());
        let (mut w, mut prev_live) = (0, false);
        for r in 0..self.slots() {
            if self.sets[r] == EMPTY {
                remap.push(GONE);
                prev_live = false;
                continue;
            }
            remap.push(w as u32);
            self.seqs[w] = self.seqs[r];
            self.sets[w] = self.sets[r];
            // A link survives only if the previous slot does.
            if prev_live && self.linked(r) {
                set_bits(&mut links, w, w + 1);
            }
            prev_live = true;
            w += 1;
        }
        links.resize(w.div_ceil(64), 0);
        self.links = links;
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
        self.seqs.capacity() * 8
            + self.sets.capacity() * 4
            + (self.cuts.capacity() + self.links.capacity()) * 8
            + self.table.heap_bytes()
    }
}

/// The table tag of `seq` under `seed` (odd: the table marks unused ways with tag 0).
fn tag_of(seed: u64, seq: u64) -> u32 {
    (mix(seed, seq) >> 32) as u32 | 1
}

/// Sets bits `from..to` of `bits`, growing it as needed.
fn set_bits(bits: &mut Vec<u64>, from: usize, to: usize) {
    if bits.len() < to.div_ceil(64) {
        bits.resize(to.div_ceil(64), 0);
    }
    let mut i = from;
    while i < to {
        let (w, lo) = (i / 64, i % 64);
        let n = (64 - lo).min(to - i);
        bits[w] |= (u64::MAX >> (64 - n)) << lo;
        i += n;
    }
}

/// Truncates `v` to `len` and gives back most of the spare capacity.
fn shorten<T>(v: &mut Vec<T>, len: usize) {
    v.truncate(len);
    v.shrink_to(len + len / 4);
}
