//! [`ApproxIndex`]: predicted cache contents for fleets that publish no KV events. It
//! leaves deciding what to record (and when) to the router.
//!
//! Every prediction sits on three lists: the chain of its sequence hash (to answer
//! queries), its key's recency list (for the per-key bound) and one global recency list.
//! Expiry times only grow along the global list (time is clamped to never go back), so
//! its head is always the next prediction to expire.

use alloc::collections::BTreeMap;
use alloc::vec::Vec;
use core::{fmt, mem};
use hashbrown::HashTable;

use super::scores::OverlapScores;
use super::sets::mix;
use super::HASH_SEED_DEFAULT;
use crate::hash::SeqHash;
use crate::time::Instant;
use crate::types::{DpRank, Overlap, WorkerId, WorkerKey};

/// Most predictions [`ApproxIndex::handle_timeout`] expires per call.
pub const EXPIRE_PER_CALL_MAX: usize = 1024;

/// Limits of an [`ApproxIndex`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ApproxConfig {
    /// How long a prediction lives after it was last recorded. Default 120,000 ms.
    pub ttl_ms: u64,
    /// Most predictions per worker key; the least recently recorded go first.
    /// Default 16,384.
    pub blocks_max_per_worker: u32,
    /// Seed of the hash table. Default [`HASH_SEED_DEFAULT`].
    pub hash_seed: u64,
    /// Most worker keys tracked; records for further keys are ignored. Default 1,024.
    pub keys_max: u32,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        ApproxConfig { ttl_ms: 120_000, blocks_max_per_worker: 16_384, hash_seed: HASH_SEED_DEFAULT, keys_max: 1024 }
    }
}

const NIL: u32 = u32::MAX;

/// Both ends of a doubly linked list of entries.
#[derive(Clone, Copy)]
struct Ends {
    head: u32,
    tail: u32,
}

const EMPTY_LIST: Ends = Ends { head: NIL, tail: NIL };

/// One key's predictions.
struct Lane {
    key: Option<WorkerKey>,
    list: Ends,
    len: u32,
}

/// One prediction: key `lane` holds block `seq` until `expires`.
#[derive(Clone, Copy)]
struct Entry {
    seq: u64,
    expires: Instant,
    lane: u32,
    /// Neighbours in the key's recency list and in the global one (index 0 and 1).
    prev: [u32; 2],
    next: [u32; 2],
    /// Next prediction of the same block (another key).
    same: u32,
}

/// Predicted prefix index with TTL and per-key LRU bounds.
///
/// After each routing decision the caller records the request's blocks as resident on
/// the chosen key. A prediction lives `ttl_ms` after it was last recorded, and each key
/// keeps at most `blocks_max_per_worker` of them, dropping its least recently recorded
/// first; a record's blocks are stamped leaf first, so a key at its bound loses the deep
/// ends of old chains before their shared prefixes. Memory: about 45 bytes per
/// prediction, at most `keys_max × blocks_max_per_worker` of them.
///
/// Calling order: `record` after each decision; `find_matches` to score a request;
/// sleep until [`ApproxIndex::poll_timeout`], then call
/// [`ApproxIndex::handle_timeout`]. Skipping `handle_timeout` never makes answers wrong
/// (expired predictions never count); it only delays freeing memory.
pub struct ApproxIndex {
    cfg: ApproxConfig,
    keys: BTreeMap<WorkerKey, u32>,
    lanes: Vec<Lane>,
    free_lanes: Vec<u32>,
    entries: Vec<Entry>,
    free_entries: Vec<u32>,
    /// Sequence hash to the first entry of its chain.
    table: HashTable<u32>,
    global: Ends,
    live: usize,
    /// The latest `now` seen; earlier times are treated as this one.
    now_max: Instant,
}

impl fmt::Debug for ApproxIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApproxIndex")
            .field("cfg", &self.cfg)
            .field("keys", &self.keys.len())
            .field("entries", &self.live)
            .finish()
    }
}

impl ApproxIndex {
    /// An empty index.
    pub fn new(cfg: ApproxConfig) -> Self {
        ApproxIndex {
            cfg,
            keys: BTreeMap::new(),
            lanes: Vec::new(),
            free_lanes: Vec::new(),
            entries: Vec::new(),
            free_entries: Vec::new(),
            table: HashTable::new(),
            global: EMPTY_LIST,
            live: 0,
            now_max: Instant::ZERO,
        }
    }

    /// Predicts that `key` now holds every block of `seq`, until `now + ttl_ms`.
    /// O(blocks × keys holding each block).
    pub fn record(&mut self, now: Instant, key: WorkerKey, seq: &[SeqHash]) {
        self.now_max = self.now_max.max(now);
        let Some(lane) = self.lane_for(key) else {
            return;
        };
        if self.cfg.blocks_max_per_worker == 0 {
            return;
        }
        let expires = self.now_max.add_ms(self.cfg.ttl_ms);
        for s in seq.iter().rev() {
            match self.find(lane, s.0) {
                Some(e) => {
                    self.entries[e as usize].expires = expires;
                    self.unlink_recency(e);
                    self.push_recency(e);
                }
                None => {
                    if self.lanes[lane as usize].len >= self.cfg.blocks_max_per_worker {
                        let oldest = self.lanes[lane as usize].list.head;
                        self.drop_entry(oldest);
                    }
                    self.add_entry(lane, s.0, expires);
                }
            }
        }
    }

    /// Forgets every rank of `worker` and its predictions. O(its predictions).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let lo = WorkerKey { worker, rank: DpRank(0) };
        let hi = WorkerKey { worker, rank: DpRank(u32::MAX) };
        let gone: Vec<(WorkerKey, u32)> = self.keys.range(lo..=hi).map(|(&k, &l)| (k, l)).collect();
        for (key, lane) in gone {
            while self.lanes[lane as usize].list.head != NIL {
                self.drop_entry(self.lanes[lane as usize].list.head);
            }
            self.lanes[lane as usize].key = None;
            self.keys.remove(&key);
            self.free_lanes.push(lane);
        }
    }

    /// Predicted overlaps with `seq`, as device blocks, written to `out` (cleared
    /// first). Predictions expired at `now` never count. O(blocks walked × keys
    /// predicted per block) plus O(keys tracked).
    pub fn find_matches(&self, now: Instant, seq: &[SeqHash], out: &mut OverlapScores) {
        out.clear();
        let mut sc = mem::take(&mut out.scratch);
        sc.raw.clear();
        sc.raw.resize(self.lanes.len(), 0);
        sc.slots.clear();
        let mut touched = 0;
        for (i, s) in seq.iter().enumerate() {
            touched = i + 1;
            let mut matched = 0;
            let mut e = self.chain_head(s.0);
            while e != NIL {
                let en = &self.entries[e as usize];
                let l = en.lane as usize;
                if en.expires > now && sc.raw[l] == i as u32 {
                    sc.raw[l] = i as u32 + 1;
                    matched += 1;
                    if i == 0 {
                        sc.slots.push(en.lane);
                    }
                }
                e = en.same;
            }
            if matched == 0 {
                break;
            }
        }
        out.set_touched(touched);
        for &l in &sc.slots {
            if let Some(key) = self.lanes[l as usize].key {
                out.push(key, Overlap { device: sc.raw[l as usize], host: 0, disk: 0 });
            }
        }
        out.sort();
        out.scratch = sc;
    }

    /// When the next prediction expires, if any.
    pub fn poll_timeout(&self) -> Option<Instant> {
        (self.global.head != NIL).then(|| self.entries[self.global.head as usize].expires)
    }

    /// Frees predictions expired at `now`, at most [`EXPIRE_PER_CALL_MAX`] per call; if
    /// more are due, [`ApproxIndex::poll_timeout`] returns a time not after `now`.
    /// Harmless when nothing is due.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.now_max = self.now_max.max(now);
        for _ in 0..EXPIRE_PER_CALL_MAX {
            let head = self.global.head;
            if head == NIL || self.entries[head as usize].expires > now {
                return;
            }
            self.drop_entry(head);
        }
    }

    /// Live predictions (expired ones not yet freed included).
    pub fn entries(&self) -> usize {
        self.live
    }

    fn lane_for(&mut self, key: WorkerKey) -> Option<u32> {
        if let Some(&l) = self.keys.get(&key) {
            return Some(l);
        }
        if self.keys.len() >= self.cfg.keys_max as usize {
            return None;
        }
        let lane = Lane { key: Some(key), list: EMPTY_LIST, len: 0 };
        let l = match self.free_lanes.pop() {
            Some(l) => {
                self.lanes[l as usize] = lane;
                l
            }
            None => {
                self.lanes.push(lane);
                // At most `keys_max` (a u32) lanes exist.
                (self.lanes.len() - 1) as u32
            }
        };
        self.keys.insert(key, l);
        Some(l)
    }

    fn hash(&self, seq: u64) -> u64 {
        mix(self.cfg.hash_seed, seq)
    }

    fn chain_head(&self, seq: u64) -> u32 {
        let entries = &self.entries;
        let found = self.table.find(self.hash(seq), |&e| entries[e as usize].seq == seq);
        found.copied().unwrap_or(NIL)
    }

    fn find(&self, lane: u32, seq: u64) -> Option<u32> {
        let mut e = self.chain_head(seq);
        while e != NIL {
            let en = &self.entries[e as usize];
            if en.lane == lane {
                return Some(e);
            }
            e = en.same;
        }
        None
    }

    fn add_entry(&mut self, lane: u32, seq: u64, expires: Instant) {
        if self.free_entries.is_empty() && self.entries.len() >= NIL as usize {
            return;
        }
        let head = self.chain_head(seq);
        let en = Entry { seq, expires, lane, prev: [NIL; 2], next: [NIL; 2], same: head };
        let e = match self.free_entries.pop() {
            Some(e) => {
                self.entries[e as usize] = en;
                e
            }
            None => {
                self.entries.push(en);
                // Bounded below NIL just above.
                (self.entries.len() - 1) as u32
            }
        };
        self.set_chain_head(seq, head, e);
        self.push_recency(e);
        self.lanes[lane as usize].len += 1;
        self.live += 1;
    }

    /// Points the table at `new` as the chain head of `seq` (was `old`; `NIL` = none).
    fn set_chain_head(&mut self, seq: u64, old: u32, new: u32) {
        let hash = self.hash(seq);
        let (entries, seed) = (&self.entries, self.cfg.hash_seed);
        match (old, new) {
            (NIL, NIL) => {}
            (NIL, _) => {
                self.table.insert_unique(hash, new, |&e| mix(seed, entries[e as usize].seq));
            }
            _ => {
                if let Ok(slot) = self.table.find_entry(hash, |&e| e == old) {
                    if new == NIL {
                        slot.remove();
                    } else {
                        *slot.into_mut() = new;
                    }
                }
            }
        }
    }

    fn drop_entry(&mut self, e: u32) {
        let en = self.entries[e as usize];
        self.unlink_recency(e);
        let head = self.chain_head(en.seq);
        if head == e {
            self.set_chain_head(en.seq, e, en.same);
        } else {
            let mut p = head;
            while p != NIL && self.entries[p as usize].same != e {
                p = self.entries[p as usize].same;
            }
            if p != NIL {
                self.entries[p as usize].same = en.same;
            }
        }
        let lane = &mut self.lanes[en.lane as usize];
        lane.len = lane.len.saturating_sub(1);
        self.free_entries.push(e);
        self.live -= 1;
    }

    /// Appends `e` to the tail of its key's list and of the global list.
    fn push_recency(&mut self, e: u32) {
        let lane = self.entries[e as usize].lane as usize;
        for k in 0..2 {
            let list = if k == 0 { self.lanes[lane].list } else { self.global };
            self.entries[e as usize].prev[k] = list.tail;
            self.entries[e as usize].next[k] = NIL;
            if list.tail != NIL {
                self.entries[list.tail as usize].next[k] = e;
            }
            let ends = Ends { head: if list.head == NIL { e } else { list.head }, tail: e };
            self.set_ends(k, lane, ends);
        }
    }

    fn unlink_recency(&mut self, e: u32) {
        let lane = self.entries[e as usize].lane as usize;
        for k in 0..2 {
            let (p, n) = (self.entries[e as usize].prev[k], self.entries[e as usize].next[k]);
            let mut ends = if k == 0 { self.lanes[lane].list } else { self.global };
            if p == NIL {
                ends.head = n;
            } else {
                self.entries[p as usize].next[k] = n;
            }
            if n == NIL {
                ends.tail = p;
            } else {
                self.entries[n as usize].prev[k] = p;
            }
            self.set_ends(k, lane, ends);
        }
    }

    fn set_ends(&mut self, k: usize, lane: usize, ends: Ends) {
        if k == 0 {
            self.lanes[lane].list = ends;
        } else {
            self.global = ends;
        }
    }
}
