//! One engine's KV block pool: resident full blocks keyed by sequence hash, an intrusive
//! LRU list of inactive ones, and a count of private (partial) blocks.
//!
//! A resident block is *active* (held by at least one running request) or *inactive*
//! (kept for prefix reuse, evictable). Private blocks are the partial trailing block of
//! a running request: they take capacity but have no hash. The pool only does the
//! bookkeeping; deciding what to pin, evict or announce is the engine's job.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use router_core::SeqHash;

/// "No slot" in the intrusive list.
pub(crate) const NIL: u32 = u32::MAX;

/// Hashes a `SeqHash` (already an xxh3 output) with one seeded multiply-fold: cheap, and
/// the seed keeps the table layout out of a trace author's hands.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeqHashBuild {
    seed: u64,
}

pub(crate) struct SeqHasher {
    seed: u64,
    h: u64,
}

impl Hasher for SeqHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.h = (self.h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.h ^= v;
    }
    fn finish(&self) -> u64 {
        let x = (self.h ^ self.seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^ (x >> 29)
    }
}

impl BuildHasher for SeqHashBuild {
    type Hasher = SeqHasher;
    fn build_hasher(&self) -> SeqHasher {
        SeqHasher { seed: self.seed, h: 0 }
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot {
    pub(crate) hash: SeqHash,
    pub(crate) refs: u32,
    prev: u32,
    next: u32,
}

/// The block pool. Capacity counts resident (active + inactive) and private blocks.
#[derive(Clone)]
pub(crate) struct Pool {
    capacity: u32,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    map: HashMap<SeqHash, u32, SeqHashBuild>,
    lru_head: u32,
    lru_tail: u32,
    active: u32,
    inactive: u32,
    private: u32,
}

impl Pool {
    pub(crate) fn new(capacity: u32, seed: u64) -> Self {
        Pool {
            capacity,
            slots: Vec::new(),
            free_slots: Vec::new(),
            // Reserve up front for an engine-sized pool; an "unbounded" one grows as needed.
            map: HashMap::with_capacity_and_hasher(capacity.min(1 << 16) as usize, SeqHashBuild { seed }),
            lru_head: NIL,
            lru_tail: NIL,
            active: 0,
            inactive: 0,
            private: 0,
        }
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }
    pub(crate) fn active(&self) -> u32 {
        self.active
    }
    pub(crate) fn inactive(&self) -> u32 {
        self.inactive
    }
    pub(crate) fn private(&self) -> u32 {
        self.private
    }
    pub(crate) fn used(&self) -> u32 {
        self.active + self.inactive + self.private
    }

    pub(crate) fn lookup(&self, hash: SeqHash) -> Option<u32> {
        self.map.get(&hash).copied()
    }

    pub(crate) fn slot(&self, slot: u32) -> &Slot {
        &self.slots[slot as usize]
    }

    /// Adds a reference; an inactive block leaves the LRU and becomes active.
    pub(crate) fn pin(&mut self, slot: u32) {
        if self.slots[slot as usize].refs == 0 {
            self.unlink(slot);
            self.inactive -= 1;
            self.active += 1;
        }
        self.slots[slot as usize].refs += 1;
    }

    /// Drops a reference; the last one sends the block to the LRU's most-recent end.
    pub(crate) fn unpin(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        debug_assert!(s.refs > 0, "unpin of an unreferenced block");
        s.refs = s.refs.saturating_sub(1);
        if s.refs == 0 {
            self.push_tail(slot);
            self.active -= 1;
            self.inactive += 1;
        }
    }

    /// Inserts a new resident block with one reference. The caller made room.
    pub(crate) fn insert(&mut self, hash: SeqHash) -> u32 {
        debug_assert!(self.used() < self.capacity, "insert into a full pool");
        let slot = Slot { hash, refs: 1, prev: NIL, next: NIL };
        let idx = match self.free_slots.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.map.insert(hash, idx);
        self.active += 1;
        idx
    }

    /// Evicts the least recently released inactive block, returning its hash.
    pub(crate) fn evict_lru(&mut self) -> Option<SeqHash> {
        let slot = self.lru_head;
        if slot == NIL {
            return None;
        }
        self.unlink(slot);
        self.inactive -= 1;
        let hash = self.slots[slot as usize].hash;
        self.map.remove(&hash);
        self.free_slots.push(slot);
        Some(hash)
    }

    pub(crate) fn add_private(&mut self) {
        self.private += 1;
    }
    pub(crate) fn remove_private(&mut self) {
        debug_assert!(self.private > 0);
        self.private = self.private.saturating_sub(1);
    }

    /// Resident hashes, sorted (for checkers; linear in the pool size).
    pub(crate) fn resident_sorted(&self) -> Vec<SeqHash> {
        let mut v: Vec<SeqHash> = self.map.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Inactive slots from least to most recently released (for checkers).
    pub(crate) fn lru_order(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.inactive as usize);
        let mut s = self.lru_head;
        while s != NIL && out.len() <= self.slots.len() {
            out.push(s);
            s = self.slots[s as usize].next;
        }
        out
    }

    /// Every live slot with its hash (for checkers).
    pub(crate) fn live_slots(&self) -> impl Iterator<Item = (u32, &Slot)> + '_ {
        self.map.values().map(move |&i| (i, &self.slots[i as usize]))
    }

    fn unlink(&mut self, slot: u32) {
        let Slot { prev, next, .. } = self.slots[slot as usize];
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        let s = &mut self.slots[slot as usize];
        s.prev = NIL;
        s.next = NIL;
    }

    fn push_tail(&mut self, slot: u32) {
        let tail = self.lru_tail;
        {
            let s = &mut self.slots[slot as usize];
            s.prev = tail;
            s.next = NIL;
        }
        if tail == NIL {
            self.lru_head = slot;
        } else {
            self.slots[tail as usize].next = slot;
        }
        self.lru_tail = slot;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_least_recently_released_and_skips_pinned() {
        let mut p = Pool::new(4, 1);
        let s: Vec<u32> = (1..=4).map(|h| p.insert(SeqHash(h))).collect();
        assert_eq!((p.active(), p.inactive(), p.used()), (4, 0, 4));
        // Release leaf first, as a finishing request does: 4, 3, 2, 1.
        for &x in s.iter().rev() {
            p.unpin(x);
        }
        assert_eq!((p.active(), p.inactive()), (0, 4));
        // Re-pin 4 (a prefix hit): it leaves the LRU and is never the victim.
        p.pin(s[3]);
        assert_eq!(p.evict_lru(), Some(SeqHash(3)));
        assert_eq!(p.evict_lru(), Some(SeqHash(2)));
        p.unpin(s[3]);
        assert_eq!(p.evict_lru(), Some(SeqHash(1)));
        assert_eq!(p.evict_lru(), Some(SeqHash(4)));
        assert_eq!(p.evict_lru(), None);
        assert_eq!(p.lookup(SeqHash(4)), None);
        assert_eq!(p.used(), 0);
    }
}
