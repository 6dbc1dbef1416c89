//! [`SlotTable`]: an open-addressing hash table from a block's hash to its arena slot,
//! built so that a lookup costs one cache miss.
//!
//! A bucket is one 64-byte cache line of eight `(tag, slot)` pairs. The tag is the top
//! 32 bits of the block's seeded hash and the home bucket is the tag's top bits, so a
//! lookup reads one line (rarely the next: linear probing over buckets) and the caller
//! confirms a tag match against the arena, which it reads next anyway. Because the home
//! bucket is a prefix of the tag, growing the table reads the old buckets in order and
//! never touches the arena. Keys are never stored here; false tag matches are filtered
//! by the caller's `eq`.
//!
//! Deleted entries become tombstones unless their bucket was never full (then no probe
//! sequence runs through it and the entry can simply be emptied); tombstones are
//! dropped at the next rebuild.

use alloc::vec::Vec;

const WAYS: usize = 8;
const FREE: u32 = u32::MAX;
const TOMB: u32 = u32::MAX - 1;

/// The largest slot value the table stores (two values are markers).
pub(crate) const SLOT_MAX: u32 = TOMB - 1;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bucket {
    tags: [u32; WAYS],
    slots: [u32; WAYS],
}

const EMPTY_BUCKET: Bucket = Bucket { tags: [0; WAYS], slots: [FREE; WAYS] };

pub(crate) struct SlotTable {
    buckets: Vec<Bucket>,
    /// `buckets.len() == 1 << bits`.
    bits: u32,
    live: usize,
    tombs: usize,
}

impl SlotTable {
    pub(crate) fn new() -> Self {
        SlotTable { buckets: Vec::new(), bits: 0, live: 0, tombs: 0 }
    }

    pub(crate) fn len(&self) -> usize {
        self.live
    }

    fn home(&self, tag: u32) -> usize {
        if self.bits == 0 {
            0
        } else {
            (tag >> (32 - self.bits)) as usize
        }
    }

    /// A word of `tag`'s home bucket, for the caller to load early (it cannot fault and
    /// its value means nothing).
    pub(crate) fn home_word(&self, tag: u32) -> u32 {
        self.buckets.get(self.home(tag)).map_or(0, |b| b.slots[0])
    }

    /// The slot stored under `tag` for which `eq` holds.
    pub(crate) fn find(&self, tag: u32, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let mask = self.buckets.len().wrapping_sub(1);
        let mut b = self.home(tag);
        for _ in 0..self.buckets.len() {
            let bucket = &self.buckets[b];
            for i in 0..WAYS {
                let s = bucket.slots[i];
                if bucket.tags[i] == tag && s < TOMB && eq(s) {
                    return Some(s);
                }
            }
            if bucket.slots.contains(&FREE) {
                return None;
            }
            b = (b + 1) & mask;
        }
        None
    }

    /// Stores `slot` under `tag`; the caller knows the key is absent. `slot` must not
    /// exceed [`SLOT_MAX`].
    pub(crate) fn insert(&mut self, tag: u32, slot: u32) {
        debug_assert!(slot <= SLOT_MAX);
        if (self.live + self.tombs + 1) * 8 > self.buckets.len() * WAYS * 7 {
            self.rebuild(self.live + 1);
        }
        let tombs = self.place(tag, slot);
        self.tombs -= tombs;
        self.live += 1;
    }

    /// Puts the pair in the first free or dead way from its home bucket; returns 1 if
    /// that way was a tombstone.
    fn place(&mut self, tag: u32, slot: u32) -> usize {
        let mask = self.buckets.len() - 1;
        let mut b = self.home(tag);
        // The load bound leaves free ways, so this finds one within the table.
        loop {
            let bucket = &mut self.buckets[b];
            if let Some(i) = bucket.slots.iter().position(|&s| s >= TOMB) {
                let was_tomb = usize::from(bucket.slots[i] == TOMB);
                bucket.tags[i] = tag;
                bucket.slots[i] = slot;
                return was_tomb;
            }
            b = (b + 1) & mask;
        }
    }

    /// Removes the pair `(tag, slot)` if present.
    pub(crate) fn remove(&mut self, tag: u32, slot: u32) {
        let mask = self.buckets.len().wrapping_sub(1);
        let mut b = self.home(tag);
        for _ in 0..self.buckets.len() {
            let bucket = &mut self.buckets[b];
            let never_full = bucket.slots.contains(&FREE);
            if let Some(i) = (0..WAYS).find(|&i| bucket.slots[i] == slot && bucket.tags[i] == tag) {
                if never_full {
                    bucket.slots[i] = FREE;
                } else {
                    bucket.slots[i] = TOMB;
                    self.tombs += 1;
                }
                self.live -= 1;
                return;
            }
            if never_full {
                return;
            }
            b = (b + 1) & mask;
        }
    }

    /// Rewrites every live slot through `f` (arena compaction).
    pub(crate) fn remap(&mut self, mut f: impl FnMut(u32) -> u32) {
        for bucket in &mut self.buckets {
            for s in &mut bucket.slots {
                if *s < TOMB {
                    *s = f(*s);
                }
            }
        }
    }

    /// Rebuilds with room for `want` entries at most half full, dropping tombstones.
    /// Reads the old buckets in order; no arena access.
    fn rebuild(&mut self, want: usize) {
        let need_buckets = (want * 2).div_ceil(WAYS).max(1).next_power_of_two();
        let bits = need_buckets.trailing_zeros();
        let old = core::mem::replace(&mut self.buckets, alloc::vec![EMPTY_BUCKET; need_buckets]);
        self.bits = bits;
        self.tombs = 0;
        for bucket in &old {
            for i in 0..WAYS {
                if bucket.slots[i] < TOMB {
                    self.place(bucket.tags[i], bucket.slots[i]);
                }
            }
        }
    }

    /// Shrinks when at most a quarter full (after compaction).
    pub(crate) fn shrink_if_sparse(&mut self) {
        if self.buckets.len() > 1 && self.live * 4 <= self.buckets.len() * WAYS {
            self.rebuild(self.live.max(1));
        }
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.buckets.capacity() * core::mem::size_of::<Bucket>()
    }
}
