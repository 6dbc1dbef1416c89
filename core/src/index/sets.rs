//! Interned holder sets: for one block, which worker slots hold it in which tier.
//!
//! Most blocks share their holder set with their neighbours in a chain, so the index
//! stores one small [`SetId`] per block and each distinct set once, reference-counted.
//! Equal sets always get the same id, which lets a query compare two blocks' holders by
//! comparing two integers. Sets whose count drops to zero are freed at the end of each
//! index operation ([`Sets::collect`]), never in the middle of one, so an id stays valid
//! (and a memoised transition stays right) for the whole operation.

use alloc::boxed::Box;
use alloc::vec::Vec;
use hashbrown::HashTable;

use crate::types::Tier;

/// Index of an interned set in [`Sets`]; [`EMPTY`] is the set nobody is in.
pub(crate) type SetId = u32;

/// The empty set: never freed, never counted.
pub(crate) const EMPTY: SetId = 0;

/// Bit groups of a set's words, in order: any tier, then one group per tier.
const GROUPS: usize = 4;

/// All distinct holder sets in use.
pub(crate) struct Sets {
    recs: Vec<Rec>,
    free: Vec<SetId>,
    intern: HashTable<SetId>,
    seed: u64,
    /// Ids whose count reached zero during the current operation.
    pending: Vec<SetId>,
    scratch: Vec<u64>,
}

/// One interned set.
struct Rec {
    /// `n` words per group, groups `[any, device, host, disk]`; the last `any` word is
    /// non-zero (no trailing empty words), so equal sets have equal words.
    words: Box<[u64]>,
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
    let m = u128::from(x ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
    (m as u64) ^ ((m >> 64) as u64)
}

impl Sets {
    pub(crate) fn new(seed: u64) -> Self {
        let empty = Rec { words: Box::new([]), refs: 0, hash: 0, live: true, lower_tiers: false };
        Sets {
            recs: alloc::vec![empty],
            free: Vec::new(),
            intern: HashTable::new(),
            seed,
            pending: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Words per group of set `id`.
    fn n(&self, id: SetId) -> usize {
        self.recs[id as usize].words.len() / GROUPS
    }

    fn bit(&self, id: SetId, group: usize, slot: u32) -> bool {
        let rec = &self.recs[id as usize];
        let n = rec.words.len() / GROUPS;
        let w = slot as usize / 64;
        w < n && rec.words[group * n + w] & (1 << (slot % 64)) != 0
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
        let rec = &self.recs[id as usize];
        &rec.words[..rec.words.len() / GROUPS]
    }

    /// Whether some slot holds the block only below the device tier.
    pub(crate) fn lower_tiers(&self, id: SetId) -> bool {
        self.recs[id as usize].lower_tiers
    }

    /// Word `w` of the slots whose best tier is host, and of those whose best is disk.
    pub(crate) fn lower_words(&self, id: SetId, w: usize) -> (u64, u64) {
        let rec = &self.recs[id as usize];
        let n = rec.words.len() / GROUPS;
        if w >= n {
            return (0, 0);
        }
        let (dev, host, disk) = (rec.words[n + w], rec.words[2 * n + w], rec.words[3 * n + w]);
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
        let src = &self.recs[id as usize].words;
        let old_n = src.len() / GROUPS;
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
        let recs = &self.recs;
        if let Some(&id) = self.intern.find(hash, |&i| recs[i as usize].words[..] == *words) {
            return id;
        }
        let lower_tiers = (0..m).any(|w| {
            let (d, h, k) = (words[m + w], words[2 * m + w], words[3 * m + w]);
            (h | k) & !d != 0
        });
        let rec = Rec { words: words.into(), refs: 0, hash, live: true, lower_tiers };
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
            rec.words = Box::new([]);
            let hash = rec.hash;
            if let Ok(e) = self.intern.find_entry(hash, |&i| i == id) {
                e.remove();
            }
            self.free.push(id);
        }
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
        let words: usize = self.recs.iter().map(|r| r.words.len() * 8).sum();
        self.recs.capacity() * core::mem::size_of::<Rec>()
            + words
            + self.intern.allocation_size()
            + (self.free.capacity() + self.pending.capacity()) * 4
            + self.scratch.capacity() * 8
    }
}
