//! Interned holder sets: for one block, which worker slots hold it in which tier.
//!
//! Most blocks share their holder set with their neighbours in a chain, so the index
//! stores one small [`SetId`] per block and each distinct set once, reference-counted.
//! Equal sets always get the same id, which lets a query compare two blocks' holders by
//! comparing two integers. Sets whose count drops to zero are freed at the end of each
//! index operation ([`Sets::collect`]), never in the middle of one, so an id stays valid
//! (and a memoised transition stays right) for the whole operation.

use alloc::vec::Vec;
use hashbrown::HashTable;

use crate::types::Tier;

/// Index of an interned set in [`Sets`]; [`EMPTY`] is the set nobody is in.
pub(crate) type SetId = u32;

/// The empty set: never freed, never counted.
pub(crate) const EMPTY: SetId = 0;

/// Dead pool words tolerated before compacting the pool (tiny in tests, so that model
/// tests compact often).
const POOL_DEAD_WORDS_MIN: usize = if cfg!(test) { 8 } else { 1024 };

/// Bit groups of a set's words, in order: any tier, then one group per tier.
const GROUPS: usize = 4;

/// All distinct holder sets in use.
pub(crate) struct Sets {
    recs: Vec<Rec>,
    /// Every set's words, back to back (a query reads a few sets; keeping them dense
    /// keeps them cached).
    pool: Vec<u64>,
    /// Words of freed sets still in `pool`.
    pool_dead: usize,
    free: Vec<SetId>,
    intern: HashTable<SetId>,
    seed: u64,
    /// Ids whose count reached zero during the current operation.
    pending: Vec<SetId>,
    scratch: Vec<u64>,
}

/// One interned set.
struct Rec {
    /// Its words are `pool[off..off + 4 * n]`: `n` words per group, groups `[any,
    /// device, host, disk]`; the last `any` word is non-zero (no trailing empty words),
    /// so equal sets have equal words.
    off: u32,
    n: u32,
    /// Blocks whose holder set this is.
    refs: u32,
    hash: u64,
    live: bool,
    /// Some slot holds a block in host or disk only (the query must count tiers).
    lower_tiers: bool,
}

const fn tier_group(tier: Tier) -> usize {
    match tier {
        Tier::Device => 1,
        Tier::Host => 2,
        Tier::Disk => 3,
    }
}

/// A seeded folded multiply: cheap, and with an unknown seed an outsider cannot aim
/// inputs at one bucket.
pub(crate) fn mix(seed: u64, x: u64) -> u64 {
    let m = u128::from(x ^ seed) * u128::from(0x9E37_79B9_7F4A_7C15_u64);
    (m as u64) ^ ((m >> 64) as u64)
}

impl Sets {
    pub(crate) fn new(seed: u64) -> Self {
        let empty = Rec { off: 0, n: 0, refs: 0, hash: 0, live: true, lower_tiers: false };
        Sets {
            recs: alloc::vec![empty],
            pool: Vec::new(),
            pool_dead: 0,
            free: Vec::new(),
            intern: HashTable::new(),
            seed,
            pending: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Words per group of set `id`.
    fn n(&self, id: SetId) -> usize {
        self.recs[id as usize].n as usize
    }

    /// All words of set `id`.
    fn words(&self, id: SetId) -> &[u64] {
        let rec = &self.recs[id as usize];
        let off = rec.off as usize;
        &self.pool[off..off + GROUPS * rec.n as usize]
    }

    fn bit(&self, id: SetId, group: usize, slot: u32) -> bool {
        let (n, w) = (self.n(id), slot as usize / 64);
        w < n && self.words(id)[group * n + w] & (1 << (slot % 64)) != 0
    }

    /// Whether `slot` holds the block in `tier`.
    pub(crate) fn contains(&self, id: SetId, slot: u32, tier: Tier) -> bool {
        self.bit(id, tier_group(tier), slot)
    }

    /// Whether `slot` holds the block in any tier.
    pub(crate) fn holds(&self, id: SetId, slot: u32) -> bool {
        self.bit(id, 0, slot)
    }

    /// The slots holding the block in any tier, one bit per slot.
    pub(crate) fn any(&self, id: SetId) -> &[u64] {
        &self.words(id)[..self.n(id)]
    }

    /// Whether some slot holds the block only below the device tier.
    pub(crate) fn lower_tiers(&self, id: SetId) -> bool {
        self.recs[id as usize].lower_tiers
    }

    /// Word `w` of the slots whose best tier is host, and of those whose best is disk.
    pub(crate) fn lower_words(&self, id: SetId, w: usize) -> (u64, u64) {
        let (n, words) = (self.n(id), self.words(id));
        if w >= n {
            return (0, 0);
        }
        let (dev, host, disk) = (words[n + w], words[2 * n + w], words[3 * n + w]);
        (host & !dev, disk & !dev & !host)
    }

    /// The set equal to `id` with `slot` added to (or removed from) `tier`.
    pub(crate) fn with(&mut self, id: SetId, slot: u32, tier: Tier, present: bool) -> SetId {
        let w = slot as usize / 64;
        let n = self.n(id).max(w + 1);
        self.load_scratch(id, n);
        let bit = 1u64 << (slot % 64);
        let g = tier_group(tier);
        if present {
            self.scratch[g * n + w] |= bit;
        } else {
            self.scratch[g * n + w] &= !bit;
        }
        self.intern_scratch(n)
    }

    /// The set equal to `id` without any slot of `mask`, in every tier.
    pub(crate) fn without(&mut self, id: SetId, mask: &[u64]) -> SetId {
        let n = self.n(id);
        self.load_scratch(id, n);
        for g in 1..GROUPS {
            for (word, m) in self.scratch[g * n..(g + 1) * n].iter_mut().zip(mask) {
                *word &= !m;
            }
        }
        self.intern_scratch(n)
    }

    /// Copies set `id` into the scratch buffer, widened to `n` words per group.
    fn load_scratch(&mut self, id: SetId, n: usize) {
        let old_n = self.n(id);
        let off = self.recs[id as usize].off as usize;
        let src = &self.pool[off..off + GROUPS * old_n];
        self.scratch.clear();
        self.scratch.resize(GROUPS * n, 0);
        for g in 0..GROUPS {
            self.scratch[g * n..g * n + old_n].copy_from_slice(&src[g * old_n..(g + 1) * old_n]);
        }
    }

    /// Recomputes `any`, trims empty trailing words, and returns the id of the set in
    /// the scratch buffer, interning it if new (with a count of zero).
    fn intern_scratch(&mut self, n: usize) -> SetId {
        let s = &mut self.scratch;
        for w in 0..n {
            s[w] = s[n + w] | s[2 * n + w] | s[3 * n + w];
        }
        let m = s[..n].iter().rposition(|&x| x != 0).map_or(0, |i| i + 1);
        if m == 0 {
            return EMPTY;
        }
        if m < n {
            for g in 1..GROUPS {
                s.copy_within(g * n..g * n + m, g * m);
            }
            s.truncate(GROUPS * m);
        }
        let words = &self.scratch[..];
        let hash = words.iter().fold(self.seed, |h, &x| mix(h, x));
        if let Some(&id) = self.intern.find(hash, |&i| self.words(i) == words) {
            return id;
        }
        let lower_tiers = (0..m).any(|w| {
            let (d, h, k) = (words[m + w], words[2 * m + w], words[3 * m + w]);
            (h | k) & !d != 0
        });
        // The pool stays far below u32::MAX words: sets are bounded by blocks, and
        // `collect` compacts it when half of it is dead.
        let off = self.pool.len() as u32;
        let rec = Rec { off, n: m as u32, refs: 0, hash, live: true, lower_tiers };
        self.pool.extend_from_slice(&self.scratch);
        let id = match self.free.pop() {
            Some(id) => {
                self.recs[id as usize] = rec;
                id
            }
            None => {
                self.recs.push(rec);
                // Ids stay below the block count plus one, which fits in u32 because
                // block slots do (see `blocks::SLOTS_MAX`).
                (self.recs.len() - 1) as SetId
            }
        };
        let recs = &self.recs;
        self.intern.insert_unique(hash, id, |&i| recs[i as usize].hash);
        // A new set with no blocks yet is freed at the end of the operation unless a
        // block takes it.
        self.pending.push(id);
        id
    }

    /// Counts `k` more blocks with holder set `id`.
    pub(crate) fn acquire(&mut self, id: SetId, k: u32) {
        if id != EMPTY {
            let r = &mut self.recs[id as usize];
            r.refs = r.refs.saturating_add(k);
        }
    }

    /// Counts `k` fewer blocks with holder set `id`; a set left with none is freed at
    /// the next [`Sets::collect`].
    pub(crate) fn release(&mut self, id: SetId, k: u32) {
        if id != EMPTY {
            let r = &mut self.recs[id as usize];
            r.refs = r.refs.saturating_sub(k);
            if r.refs == 0 {
                self.pending.push(id);
            }
        }
    }

    /// Frees every set no block uses any more. Call at the end of each operation.
    pub(crate) fn collect(&mut self) {
        while let Some(id) = self.pending.pop() {
            let rec = &mut self.recs[id as usize];
            if id == EMPTY || rec.refs != 0 || !rec.live {
                continue;
            }
            rec.live = false;
            self.pool_dead += GROUPS * rec.n as usize;
            let hash = rec.hash;
            if let Ok(e) = self.intern.find_entry(hash, |&i| i == id) {
                e.remove();
            }
            self.free.push(id);
        }
        if self.pool_dead > POOL_DEAD_WORDS_MIN && self.pool_dead * 2 > self.pool.len() {
            self.compact_pool();
        }
    }

    /// Drops the words of freed sets from the pool, keeping set order.
    fn compact_pool(&mut self) {
        let old = core::mem::take(&mut self.pool);
        for rec in self.recs.iter_mut().filter(|r| r.live) {
            let (off, len) = (rec.off as usize, GROUPS * rec.n as usize);
            rec.off = self.pool.len() as u32;
            self.pool.extend_from_slice(&old[off..off + len]);
        }
        self.pool_dead = 0;
    }

    /// Ids of the live sets, ascending (the empty set excluded).
    pub(crate) fn live_ids(&self) -> impl Iterator<Item = SetId> + '_ {
        self.recs.iter().enumerate().skip(1).filter(|(_, r)| r.live).map(|(i, _)| i as SetId)
    }

    /// One past the largest id ever handed out (for id-indexed side tables).
    pub(crate) fn id_bound(&self) -> usize {
        self.recs.len()
    }

    /// Number of live sets, the empty set excluded.
    pub(crate) fn len(&self) -> usize {
        self.recs.len() - 1 - self.free.len()
    }

    /// Heap bytes held (approximate: allocator overhead not counted).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.recs.capacity() * core::mem::size_of::<Rec>()
            + self.pool.capacity() * 8
            + self.intern.allocation_size()
            + (self.free.capacity() + self.pending.capacity()) * 4
            + self.scratch.capacity() * 8
    }
}
