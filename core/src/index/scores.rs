//! [`OverlapScores`]: the answer to a prefix query, and a buffer reused across queries.

use alloc::vec::Vec;

use crate::types::{Overlap, WorkerKey};

/// Per-worker prefix overlaps of one query, sorted by [`WorkerKey`].
///
/// Reuse one value across queries: `find_matches` clears it first, and its buffers keep
/// their capacity, so a warmed-up query allocates nothing.
#[derive(Clone, Debug, Default)]
pub struct OverlapScores {
    /// Keys with a non-zero overlap, ascending.
    entries: Vec<(WorkerKey, Overlap)>,
    touched: usize,
    /// Query scratch, indexed by the index's worker slots.
    pub(crate) scratch: Scratch,
}

/// Per-query work space of the indexes (kept here so queries can take `&self`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Scratch {
    /// Slots still matching, one bit each.
    pub(crate) active: Vec<u64>,
    /// Slots that matched block 0.
    pub(crate) first: Vec<u64>,
    /// Per slot: overlap length once the slot stopped matching.
    pub(crate) raw: Vec<u32>,
    /// Per slot: blocks of the run whose best tier was host / disk (valid only when
    /// `lower_tiers`).
    pub(crate) host: Vec<u32>,
    pub(crate) disk: Vec<u32>,
    /// Whether the walk met a block held below the device tier.
    pub(crate) lower_tiers: bool,
    /// Approximate index: candidate slots.
    pub(crate) slots: Vec<u32>,
}

impl OverlapScores {
    /// An empty answer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets the previous answer (keeps the buffers).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.touched = 0;
    }

    /// The overlap of `key`, or [`Overlap::default`] if it matched nothing.
    pub fn get(&self, key: WorkerKey) -> Overlap {
        match self.entries.binary_search_by_key(&key, |e| e.0) {
            Ok(i) => self.entries[i].1,
            Err(_) => Overlap::default(),
        }
    }

    /// Every key with a non-zero overlap, ascending by key.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerKey, Overlap)> + '_ {
        self.entries.iter().copied()
    }

    /// Number of keys with a non-zero overlap.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no key matched.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Query blocks the last query examined: the figure that bounds its work.
    pub fn blocks_touched(&self) -> usize {
        self.touched
    }

    /// The largest overlap length of any key (0 if none).
    pub fn max_raw(&self) -> u32 {
        self.entries.iter().map(|e| e.1.raw()).max().unwrap_or(0)
    }

    /// Keeps the longer of `key`'s overlap and a run of `blocks` device blocks (merging
    /// a prediction with an exact answer). Zero blocks change nothing.
    pub fn raise_device(&mut self, key: WorkerKey, blocks: u32) {
        if blocks == 0 {
            return;
        }
        match self.entries.binary_search_by_key(&key, |e| e.0) {
            Ok(i) => {
                let o = &mut self.entries[i].1;
                if blocks > o.raw() {
                    *o = Overlap { device: blocks, host: 0, disk: 0 };
                }
            }
            Err(i) => self.entries.insert(i, (key, Overlap { device: blocks, host: 0, disk: 0 })),
        }
    }

    /// Adds `blocks` device blocks to `key`'s overlap (used to merge the approximate
    /// index's predictions into an exact answer). Zero blocks change nothing.
    pub fn add_device(&mut self, key: WorkerKey, blocks: u32) {
        if blocks == 0 {
            return;
        }
        match self.entries.binary_search_by_key(&key, |e| e.0) {
            Ok(i) => {
                let d = &mut self.entries[i].1.device;
                *d = d.saturating_add(blocks);
            }
            Err(i) => self.entries.insert(i, (key, Overlap { device: blocks, host: 0, disk: 0 })),
        }
    }

    /// Appends `key` if its overlap is non-zero; call [`OverlapScores::sort`] afterwards
    /// unless keys were pushed in ascending order.
    pub(crate) fn push(&mut self, key: WorkerKey, overlap: Overlap) {
        if overlap.raw() > 0 {
            self.entries.push((key, overlap));
        }
    }

    pub(crate) fn reserve(&mut self, n: usize) {
        self.entries.reserve(n);
    }

    /// Sorts the entries by key (after out-of-order pushes).
    pub(crate) fn sort(&mut self) {
        self.entries.sort_unstable_by_key(|e| e.0);
    }

    pub(crate) fn set_touched(&mut self, n: usize) {
        self.touched = n;
    }
}
