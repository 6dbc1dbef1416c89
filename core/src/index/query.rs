//! [`PrefixIndex::find_matches`]: the leading-run walk.
//!
//! The walk moves along the query in *runs*: stretches of blocks that sit in
//! consecutive arena slots, each the parent of the next, with one holder set. A run is
//! one chain, and so is the query, so where the query matches a run's block it matches
//! every block of the run before it: the walk compares the run's last block first and
//! searches by halves only when that differs, reading a few cache lines of a long run
//! instead of all of it. At a run's end it finds the next block's slot (the next arena
//! slot, the slot's hint, or a table probe), intersects the still-matching workers with
//! that block's holders, and records where the others stopped.

use core::mem;

use super::scores::{OverlapScores, Scratch};
use super::PrefixIndex;
use crate::hash::SeqHash;
use crate::types::Overlap;

impl PrefixIndex {
    /// Overlaps of every worker key with `seq`, written to `out` (cleared first).
    ///
    /// A key's overlap is the number of leading blocks of `seq` it holds, in any tier,
    /// with no gap from block 0; each block counts under the best tier holding it. The
    /// walk stops where no key matches any more, so with `early_exit == false` every
    /// answer is exact. With `early_exit == true` it also stops once a single key still
    /// matches, whose answer is then a lower bound (the others stay exact).
    ///
    /// Work: per run walked, a few cache lines of hashes (O(log blocks) when the query
    /// leaves the run partway), one table probe at most and O(keys / 64) word
    /// operations; O(keys matched) to answer.
    pub fn find_matches(&self, seq: &[SeqHash], early_exit: bool, out: &mut OverlapScores) {
        out.clear();
        let Some(first) = seq.first() else { return };
        let Some(slot) = self.blocks.locate(first.0) else {
            out.set_touched(1);
            return;
        };
        let mut sc = mem::take(&mut out.scratch);
        let touched = self.walk(seq, slot, early_exit, &mut sc);
        out.set_touched(touched);
        self.answer(&sc, out);
        out.scratch = sc;
    }

    /// Walks `seq` from block 0 at `slot`; leaves each starting key's overlap in the
    /// scratch tables. Returns the number of query blocks examined.
    fn walk(&self, seq: &[SeqHash], mut slot: u32, early_exit: bool, sc: &mut Scratch) -> usize {
        let seqs = &self.blocks.seqs;
        let mut sid = self.blocks.sets[slot as usize];
        sc.active.clear();
        sc.active.extend_from_slice(self.sets.any(sid));
        sc.first.clear();
        sc.first.extend_from_slice(&sc.active);
        let slots = self.slot_key.len();
        if sc.raw.len() < slots {
            sc.raw.resize(slots, 0);
        }
        sc.lower_tiers = false;
        let mut pos = 0;
        loop {
            // Extend the run while the next slots continue the query with the same holders.
            let s = slot as usize + 1;
            let room = self.blocks.run_room(s, seq.len() - pos - 1);
            let ext = run_match(&seq[pos + 1..pos + 1 + room], &seqs[s..s + room]);
            let end = pos + 1 + ext;
            slot += ext as u32;
            if self.sets.lower_tiers(sid) {
                self.credit_lower_tiers(sid, (end - pos) as u32, sc);
            }
            let stop = |sc: &mut Scratch, at: usize| {
                for_each_bit(&sc.active, |w| sc.raw[w] = at as u32);
            };
            if end == seq.len() {
                stop(sc, end);
                return end;
            }
            let Some(next) = self.blocks.find_after(seq[end].0, Some(slot)) else {
                stop(sc, end);
                return end + 1;
            };
            sid = self.blocks.sets[next as usize];
            let left = self.narrow(sid, end, sc);
            if left == 0 {
                return end + 1;
            }
            if early_exit && left == 1 {
                stop(sc, end);
                return end + 1;
            }
            pos = end;
            slot = next;
        }
    }

    /// Keeps the active keys that hold a block of set `sid`; the others stopped at
    /// `at`. Returns how many remain.
    fn narrow(&self, sid: u32, at: usize, sc: &mut Scratch) -> u32 {
        let any = self.sets.any(sid);
        let mut left = 0;
        for (i, a) in sc.active.iter_mut().enumerate() {
            let keep = *a & any.get(i).copied().unwrap_or(0);
            let mut gone = *a & !keep;
            while gone != 0 {
                sc.raw[i * 64 + gone.trailing_zeros() as usize] = at as u32;
                gone &= gone - 1;
            }
            *a = keep;
            left += keep.count_ones();
        }
        left
    }

    /// Counts a run of `len` blocks of set `sid` under host or disk for the active keys
    /// whose best tier there is lower than device.
    fn credit_lower_tiers(&self, sid: u32, len: u32, sc: &mut Scratch) {
        if !sc.lower_tiers {
            // First run with lower tiers in this walk: start the counts at zero.
            sc.lower_tiers = true;
            let slots = self.slot_key.len();
            for t in [&mut sc.host, &mut sc.disk] {
                t.clear();
                t.resize(slots, 0);
            }
        }
        for i in 0..sc.active.len() {
            let (host, disk) = self.sets.lower_words(sid, i);
            let a = sc.active[i];
            for_each_bit(&[a & host], |w| sc.host[i * 64 + w] += len);
            for_each_bit(&[a & disk], |w| sc.disk[i * 64 + w] += len);
        }
    }

    /// Writes the overlap of every key that matched block 0, ascending by key.
    fn answer(&self, sc: &Scratch, out: &mut OverlapScores) {
        out.reserve(sc.first.iter().map(|w| w.count_ones() as usize).sum());
        for_each_bit(&sc.first, |w| {
            let raw = sc.raw[w];
            let o = if sc.lower_tiers {
                let (host, disk) = (sc.host[w], sc.disk[w]);
                Overlap { device: raw.saturating_sub(host + disk), host, disk }
            } else {
                Overlap { device: raw, host: 0, disk: 0 }
            };
            out.push(self.slot_key[w], o);
        });
        if !self.slots_in_key_order {
            out.sort();
        }
    }
}

/// Length of the common prefix of `q` and `h` (equal lengths), where `h` is one chain
/// continuing a block that `q` continues too: they agree up to some point and differ
/// from there on. Most runs match to their end, which the last pair shows at once;
/// otherwise the point is found by halves, and short stretches are scanned.
fn run_match(q: &[SeqHash], h: &[u64]) -> usize {
    // Tiny in tests, so that model tests search by halves.
    const SCAN_BLOCKS: usize = if cfg!(test) { 1 } else { 16 };
    let Some(last) = q.len().checked_sub(1).filter(|&l| l >= SCAN_BLOCKS) else {
        return common_prefix(q, h);
    };
    if q[last].0 == h[last] {
        return q.len();
    }
    // Every pair before `lo` matches; the pair at `hi` does not.
    let (mut lo, mut hi) = (0, last);
    while hi - lo > SCAN_BLOCKS {
        let mid = lo + (hi - lo) / 2;
        if q[mid].0 == h[mid] {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo + common_prefix(&q[lo..hi], &h[lo..hi])
}

/// Length of the common prefix of `q` and `h` (equal lengths), eight blocks at a time.
fn common_prefix(q: &[SeqHash], h: &[u64]) -> usize {
    const LANES: usize = 8;
    let mut n = 0;
    for (a, b) in q.chunks_exact(LANES).zip(h.chunks_exact(LANES)) {
        let same = a.iter().zip(b).fold(true, |acc, (x, y)| acc & (x.0 == *y));
        if !same {
            break;
        }
        n += LANES;
    }
    n + q[n..].iter().zip(&h[n..]).take_while(|(x, y)| x.0 == **y).count()
}

/// Calls `f` with the index of every set bit, ascending.
fn for_each_bit(words: &[u64], mut f: impl FnMut(usize)) {
    for (i, &word) in words.iter().enumerate() {
        let mut x = word;
        while x != 0 {
            f(i * 64 + x.trailing_zeros() as usize);
            x &= x - 1;
        }
    }
}
