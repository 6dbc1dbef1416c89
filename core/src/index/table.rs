//! [`SlotTable`]: an open-addressing hash table from a block's hash to its arena slot,
//! built so that a lookup costs one cache miss.
//!
//! A bucket is one 64-byte cache line of eight `(tag, slot)` pairs. The tag is the top
//! 32 bits of the block's seeded hash with the lowest bit set (a free or dead way has
//! tag 0), and the home bucket is the tag's top bits, so a lookup reads one line
//! (rarely the next: linear probing over buckets) and the caller confirms a tag match
//! against the arena, which it reads next anyway. Because the home bucket is a prefix
//! of the tag, growing the table reads the old buckets in order and never touches the
//! arena. Keys are never stored here; false tag matches are filtered by the caller's
//! `eq`. The table grows when 7/8 of its ways are used: to a quarter full while it is
//! under 8 MiB (half the rebuilds, and half the short-lived tables to fault in, for at
//! most a few MiB of slack), to half full beyond.
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

impl Bucket {
    /// Whether some way was never used (written so it compiles to one vector compare).
    #[inline(always)]
    fn has_free(&self) -> bool {
        self.slots.iter().fold(false, |free, &s| free | (s == FREE))
    }

    /// Whether some way has tag `tag` (one vector compare).
    #[inline(always)]
    fn has_tag(&self, tag: u32) -> bool {
        self.tags.iter().fold(false, |hit, &t| hit | (t == tag))
    }

    /// The slot under `tag` for which `eq` holds, if any.
    #[inline(always)]
    fn find_in(&self, tag: u32, eq: &mut impl FnMut(u32) -> bool) -> Option<u32> {
        if self.has_tag(tag) {
            for i in 0..WAYS {
                if self.tags[i] == tag && eq(self.slots[i]) {
                    return Some(self.slots[i]);
                }
            }
        }
        None
    }

    /// A way free or dead (tag 0), if any. Ways are taken in order and a fresh table
    /// fills them in order, so the used ones are nearly always a prefix: the way after
    /// them (found by a branch-free binary search) is tried first, then a scan.
    #[inline(always)]
    fn open_way(&self) -> Option<usize> {
        let t = &self.tags;
        let mut k = 4 * usize::from(t[3] != 0);
        k += 2 * usize::from(t[k + 1] != 0);
        k += usize::from(t[k] != 0);
        // `k` is the used prefix's length, unless it is 7 with the last way used too.
        if t[k] == 0 {
            return Some(k);
        }
        t.iter().position(|&x| x == 0)
    }
}

/// Where an absent key would go in a [`SlotTable`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Vacant {
    bucket: u32,
    way: u32,
    tag: u32,
}

/// [`SlotTable::find_or_vacant`] on the buckets of a table of `1 << bits` buckets,
/// which the load bound leaves with a never-used way somewhere.
///
/// One pass over the probed buckets notes the first open way on the way, so the common
/// case (the home bucket, absent key) reads one line once. Inlined: it runs once per
/// block an event adds, and its answer should stay in registers.
#[inline(always)]
fn probe(buckets: &[Bucket], bits: u32, tag: u32, mut eq: impl FnMut(u32) -> bool) -> Result<u32, Vacant> {
    let mask = buckets.len().wrapping_sub(1);
    let mut b = home(bits, tag);
    let mut open = None;
    // The load bound leaves never-used ways, so this ends within the table.
    loop {
        let bucket = &buckets[b & mask];
        if let Some(s) = bucket.find_in(tag, &mut eq) {
            return Ok(s);
        }
        if open.is_none() {
            // Bucket counts stay far below 2^32 (slots are u32, eight per bucket).
            open = bucket.open_way().map(|way| Vacant { bucket: b as u32, way: way as u32, tag });
        }
        // A never-used way has tag 0, so `open` is set by now.
        if let (true, Some(at)) = (bucket.has_free(), open) {
            return Err(at);
        }
        b = (b + 1) & mask;
    }
}

/// The home bucket of `tag` in a table of `1 << bits` buckets.
fn home(bits: u32, tag: u32) -> usize {
    // A 64-bit shift by 32 - bits is defined for every table size, 0 bits included.
    (u64::from(tag) >> (32 - bits)) as usize
}

/// Lookups and inserts into a [`SlotTable`] that will not grow meanwhile (see
/// [`SlotTable::with_cursor`]).
pub(crate) struct Cursor<'a> {
    buckets: &'a mut [Bucket],
    bits: u32,
    /// Inserts left before the table must grow.
    room: usize,
    added: usize,
    tombs_reused: usize,
}

impl Cursor<'_> {
    /// Inserts left before the table must grow; [`Cursor::find_or_vacant`] needs one.
    pub(crate) fn room(&self) -> usize {
        self.room
    }

    /// [`SlotTable::find_or_vacant`], with room for the insert (see [`Cursor::room`]).
    #[inline(always)]
    pub(crate) fn find_or_vacant(&self, tag: u32, eq: impl FnMut(u32) -> bool) -> Result<u32, Vacant> {
        debug_assert!(self.room > 0);
        probe(self.buckets, self.bits, tag, eq)
    }

    /// Stores `slot` where [`Cursor::find_or_vacant`] (or [`SlotTable::find_or_vacant`],
    /// with no change since) said. `slot` must not exceed [`SLOT_MAX`].
    #[inline(always)]
    pub(crate) fn fill(&mut self, at: Vacant, slot: u32) {
        debug_assert!(slot <= SLOT_MAX);
        let (bucket, way) = (&mut self.buckets[at.bucket as usize], at.way as usize);
        debug_assert!(bucket.tags[way] == 0);
        self.tombs_reused += usize::from(bucket.slots[way] == TOMB);
        bucket.tags[way] = at.tag;
        bucket.slots[way] = slot;
        self.added += 1;
        self.room = self.room.saturating_sub(1);
    }

    /// [`SlotTable::home_word`].
    pub(crate) fn home_word(&self, tag: u32) -> u32 {
        self.buckets.get(home(self.bits, tag)).map_or(0, |b| b.slots[0])
    }
}

/// Below this many buckets (8 MiB) the table grows fourfold rather than twofold
/// (small in tests, so that they see both).
#[cfg(not(test))]
const QUADRUPLE_BELOW_BUCKETS: usize = 1 << 17;
#[cfg(test)]
const QUADRUPLE_BELOW_BUCKETS: usize = 1 << 4;

const EMPTY_BUCKET: Bucket = Bucket { tags: [0; WAYS], slots: [FREE; WAYS] };

pub(crate) struct SlotTable {
    buckets: Vec<Bucket>,
    /// `buckets.len() == 1 << bits`.
    bits: u32,
    live: usize,
    tombs: usize,
    /// Entries (live or dead) allowed before a rebuild: 7/8 of the ways.
    used_max: usize,
}

impl SlotTable {
    pub(crate) fn new() -> Self {
        SlotTable { buckets: Vec::new(), bits: 0, live: 0, tombs: 0, used_max: 0 }
    }

    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// Buckets (of eight ways) in the table.
    #[cfg(test)]
    pub(crate) fn buckets(&self) -> usize {
        self.buckets.len()
    }

    fn home(&self, tag: u32) -> usize {
        home(self.bits, tag)
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
            if let Some(s) = bucket.find_in(tag, &mut eq) {
                return Some(s);
            }
            if bucket.has_free() {
                return None;
            }
            b = (b + 1) & mask;
        }
        None
    }

    /// Like [`SlotTable::find`], but when nothing matches, returns where `tag` would go,
    /// for [`Cursor::fill`] (valid until the table next changes). Grows the table
    /// first if one more entry would pass the load bound.
    #[inline]
    pub(crate) fn find_or_vacant(&mut self, tag: u32, eq: impl FnMut(u32) -> bool) -> Result<u32, Vacant> {
        if self.live + self.tombs >= self.used_max {
            self.grow();
        }
        probe(&self.buckets, self.bits, tag, eq)
    }

    /// Runs `f` with a [`Cursor`]: lookups and inserts for as many entries as the load
    /// bound allows before the table must grow, with the table's shape held in locals
    /// (a loop over `self` reloads it after every store to a bucket).
    #[inline]
    pub(crate) fn with_cursor<R>(&mut self, f: impl FnOnce(&mut Cursor<'_>) -> R) -> R {
        let room = self.used_max.saturating_sub(self.live + self.tombs);
        let mut c = Cursor { buckets: &mut self.buckets, bits: self.bits, room, added: 0, tombs_reused: 0 };
        let r = f(&mut c);
        let (added, tombs_reused) = (c.added, c.tombs_reused);
        self.live += added;
        self.tombs -= tombs_reused;
        r
    }

    /// Makes room for one more entry (see [`SlotTable::find_or_vacant`]).
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        let want = self.live + 1;
        if self.buckets.len() < QUADRUPLE_BELOW_BUCKETS {
            // Quarter full: half as many rebuilds (and dropped tables to fault in)
            // while the table is small enough that the slack is a few MiB at most.
            self.rebuild_to((want * 4).div_ceil(WAYS).next_power_of_two());
        } else {
            self.rebuild(want);
        }
    }

    /// Stores `slot` under `tag`; the caller knows the key is absent.
    #[cfg(test)]
    pub(crate) fn insert(&mut self, tag: u32, slot: u32) {
        if let Err(at) = self.find_or_vacant(tag, |_| false) {
            self.with_cursor(|c| c.fill(at, slot));
        }
    }

    /// Grows, if needed, so that `more` entries beyond the live ones fit without a
    /// rebuild (at most 7/8 full). Never shrinks.
    pub(crate) fn reserve(&mut self, more: usize) {
        // `find_or_vacant` rebuilds once the entries reach `used_max`.
        let want = self.live.saturating_add(more).saturating_add(1);
        if self.live + self.tombs + more >= self.used_max {
            // The fewest buckets (a power of two) whose 7/8 holds `want`.
            self.rebuild_to(want.div_ceil(WAYS * 7 / 8).next_power_of_two());
        }
    }

    /// Removes the pair `(tag, slot)` if present.
    pub(crate) fn remove(&mut self, tag: u32, slot: u32) {
        let mask = self.buckets.len().wrapping_sub(1);
        let mut b = self.home(tag);
        for _ in 0..self.buckets.len() {
            let bucket = &mut self.buckets[b];
            let never_full = bucket.has_free();
            if let Some(i) = (0..WAYS).find(|&i| bucket.slots[i] == slot && bucket.tags[i] == tag) {
                bucket.tags[i] = 0;
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
    /// Reads the old buckets in order and never touches the arena. A fresh table fills
    /// each bucket's ways in order, so a count per bucket replaces the search for a
    /// free way.
    fn rebuild(&mut self, want: usize) {
        self.rebuild_to((want * 2).div_ceil(WAYS).max(1).next_power_of_two());
    }

    /// Rebuilds into `need_buckets` buckets (a power of two, holding every live entry).
    fn rebuild_to(&mut self, need_buckets: usize) {
        let old = core::mem::replace(&mut self.buckets, alloc::vec![EMPTY_BUCKET; need_buckets]);
        self.bits = need_buckets.trailing_zeros();
        self.tombs = 0;
        self.used_max = need_buckets * WAYS / 8 * 7;
        let mut fill = alloc::vec![0u8; need_buckets];
        let mask = need_buckets - 1;
        for bucket in &old {
            for i in 0..WAYS {
                let (tag, slot) = (bucket.tags[i], bucket.slots[i]);
                if slot >= TOMB {
                    continue;
                }
                // At most half full, so a bucket with room is near.
                let mut b = self.home(tag);
                while fill[b] as usize == WAYS {
                    b = (b + 1) & mask;
                }
                let way = fill[b] as usize;
                self.buckets[b].tags[way] = tag;
                self.buckets[b].slots[way] = slot;
                fill[b] += 1;
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
