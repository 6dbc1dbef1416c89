//! The load tracker: the work the router has sent to each worker and not yet seen finish.
//!
//! Every routed request is a *booking* named by its [`RequestId`] and [`Phase`] and held
//! on one [`WorkerKey`]. A booking carries the request's uncached prompt tokens until its
//! prefill is done, and (except for [`Phase::Prefill`] bookings) the KV blocks it keeps
//! alive while decoding: its prompt blocks, counted once per worker however many requests
//! share them, plus its output blocks. [`LoadTracker::load`] sums them per worker for
//! selection to weigh, and [`LoadTracker::prefill_progress`] says since when a worker has
//! been working through its prefill backlog, so selection can estimate how much of it is
//! already computed (the tracker only learns a prefill finished at its first token).
//!
//! What it leaves to others: choosing a worker (`select`), learning what a worker has
//! cached (`index`), and noticing that a request finished (the adapter calls
//! [`LoadTracker::free`]). Because a lost `free` would otherwise leak load forever, every
//! booking expires `request_age_max_ms` after it was made.
//!
//! Other replicas' bookings live in a [`RemoteLoad`] table, kept apart. A [`FleetLoad`]
//! owns a tracker and such a table together and tells the table each time a key's local
//! bookings start or stop holding a prompt block, so that [`RemoteLoad::combined`] counts
//! a block held on both sides once, in O(1) per key.
//!
//! Calling order, as for every sans-IO type in this crate: feed inputs (`add`,
//! `prefill_done`, `decode_progress`, `free`, `remove_worker`, `handle_timeout`), then
//! drain [`LoadTracker::poll_expired`] until `None`, then sleep until
//! [`LoadTracker::poll_timeout`]. An operation on an id the tracker does not hold is a
//! counted no-op that returns [`LoadError::UnknownRequest`], never a panic.

mod fleet;
pub(crate) mod hasher;
mod remote;

pub(crate) use fleet::FleetLoad;

pub(crate) use remote::RemoteLoad;
pub use remote::{RemoteLoadConfig, RemoteLoadError, RemoteLoadStats, ReplicaId, REMOTE_EXPIRE_PER_CALL_MAX};

use crate::hash::{BlockSize, SeqHash};
use crate::time::Instant;
use crate::types::{Phase, RequestId, WorkerId, WorkerKey, WorkerLoad};
use alloc::collections::{BTreeMap, VecDeque};
use alloc::vec::Vec;
use core::fmt;
use hashbrown::HashMap;
use hasher::SeededState;

/// Prompt blocks kept per booking; blocks past this many are ignored (and counted in
/// [`LoadStats::blocks_truncated`]). 65,536 blocks is four million tokens at 64 per block.
pub(crate) const BLOCKS_MAX_PER_REQUEST: usize = 1 << 16;

/// Bookings one [`LoadTracker::handle_timeout`] call expires at most. If more are due,
/// [`LoadTracker::poll_timeout`] returns a deadline already past, so the caller comes back.
pub const EXPIRE_PER_CALL_MAX: usize = 1024;

/// Expiry reports kept for [`LoadTracker::poll_expired`]; when the caller does not drain
/// them, the oldest are dropped and counted in [`LoadStats::expired_unreported`].
pub(crate) const EXPIRED_QUEUE_MAX: usize = 4096;

/// Limits and seeds of a [`LoadTracker`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadConfig {
    /// A booking older than this is dropped as if freed. Default 600,000 (ten minutes).
    pub request_age_max_ms: u64,
    /// Live bookings at most; [`LoadTracker::add`] refuses more. Default 1,048,576.
    pub requests_max: usize,
    /// Seed of the tracker's hash tables. Default 0; set a secret one in production.
    pub hash_seed: u64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig { request_age_max_ms: 600_000, requests_max: 1 << 20, hash_seed: 0 }
    }
}

/// Why a load-tracker operation changed nothing.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum LoadError {
    /// No booking with this id and phase (never added, already freed, or expired).
    UnknownRequest {
        /// The request named.
        req: RequestId,
        /// The phase named.
        phase: Phase,
    },
    /// A booking with this id and phase already exists; the first one stands.
    DuplicateRequest {
        /// The request named.
        req: RequestId,
        /// The phase named.
        phase: Phase,
    },
    /// The tracker already holds `requests_max` bookings.
    TableFull {
        /// The configured limit.
        requests_max: usize,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::UnknownRequest { req, phase } => {
                write!(f, "no {phase} booking for request {}", req.0)
            }
            LoadError::DuplicateRequest { req, phase } => {
                write!(f, "request {} already has a {phase} booking", req.0)
            }
            LoadError::TableFull { requests_max } => {
                write!(f, "load tracker full ({requests_max} bookings)")
            }
        }
    }
}

impl core::error::Error for LoadError {}

/// Counters of what the tracker refused or dropped, for metrics.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct LoadStats {
    /// Operations naming a booking the tracker does not hold.
    pub unknown_request: u64,
    /// `add` calls for a booking that already exists.
    pub duplicate_request: u64,
    /// `add` calls refused because the table was full.
    pub table_full: u64,
    /// Bookings dropped for age.
    pub expired: u64,
    /// Expiry reports dropped because nobody drained [`LoadTracker::poll_expired`].
    pub expired_unreported: u64,
    /// Prompt blocks ignored past `BLOCKS_MAX_PER_REQUEST` (65,536).
    pub blocks_truncated: u64,
}

/// How far a key has got through its prefill backlog; see [`LoadTracker::prefill_progress`].
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct PrefillProgress {
    /// Bookings on the key whose prefill has not finished.
    pub requests: u32,
    /// When the key's current stretch of outstanding prefill began: the time of the `add`
    /// that found no booking there prefilling. `None` while none is.
    pub busy_since: Option<Instant>,
    /// Prefill tokens of the bookings that finished their prefill within that stretch.
    pub done_tokens: u64,
}

/// One live booking.
struct Booking {
    key: WorkerKey,
    /// Prompt blocks (empty for prefill bookings, which hold no decode blocks).
    blocks: Vec<SeqHash>,
    /// Uncached prompt tokens still to prefill.
    prefill_tokens: u32,
    /// Its prefill has not finished (never true for decode bookings, which compute no
    /// prompt).
    prefilling: bool,
    expected_output_blocks: u32,
    /// Output blocks generated so far.
    output_blocks: u32,
    /// Key of this booking in the expiry table.
    expiry: (Instant, u64),
}

impl Booking {
    /// Output blocks this booking counts as decode load: the prediction until generation
    /// overtakes it. Zero for prefill bookings.
    fn output_load(&self, phase: Phase) -> u64 {
        if phase == Phase::Prefill {
            return 0;
        }
        u64::from(self.expected_output_blocks.max(self.output_blocks))
    }
}

/// The load on one worker key.
struct KeyLoad {
    /// Wider than [`WorkerLoad::active_requests`] so counting never saturates.
    requests: u64,
    prefill_tokens: u64,
    output_blocks: u64,
    /// Prompt block → number of bookings on this key holding it.
    blocks: HashMap<SeqHash, u32, SeededState>,
    /// Bookings whose prefill has not finished.
    prefill_requests: u64,
    /// Start of the current stretch of outstanding prefill (meaningless while
    /// `prefill_requests == 0`).
    busy_since: Instant,
    /// Prefill tokens finished within the stretch.
    done_tokens: u64,
}

impl KeyLoad {
    fn load(&self) -> WorkerLoad {
        WorkerLoad {
            active_prefill_tokens: self.prefill_tokens,
            active_decode_blocks: self.blocks.len() as u64 + self.output_blocks,
            active_requests: u32::try_from(self.requests).unwrap_or(u32::MAX),
        }
    }

    fn progress(&self) -> PrefillProgress {
        let busy = self.prefill_requests > 0;
        PrefillProgress {
            requests: u32::try_from(self.prefill_requests).unwrap_or(u32::MAX),
            busy_since: busy.then_some(self.busy_since),
            done_tokens: if busy { self.done_tokens } else { 0 },
        }
    }

    /// A booking stops prefilling: finished (`done`) or dropped.
    fn end_prefill(&mut self, b: &mut Booking, done: bool) {
        self.prefill_tokens -= u64::from(b.prefill_tokens);
        if b.prefilling {
            b.prefilling = false;
            self.prefill_requests -= 1;
            if done {
                self.done_tokens += u64::from(b.prefill_tokens);
            }
            if self.prefill_requests == 0 {
                self.done_tokens = 0;
            }
        }
        b.prefill_tokens = 0;
    }
}

/// Tracks in-flight load per worker key. Feed inputs, drain `poll_expired`, sleep until `poll_timeout`.
pub struct LoadTracker {
    cfg: LoadConfig,
    bookings: HashMap<(RequestId, Phase), Booking, SeededState>,
    keys: HashMap<WorkerKey, KeyLoad, SeededState>,
    /// (deadline, insertion number) → booking; ordered, so expiry order is deterministic.
    expiry: BTreeMap<(Instant, u64), (RequestId, Phase)>,
    next_seq: u64,
    expired: VecDeque<(RequestId, Phase)>,
    stats: LoadStats,
}

impl LoadTracker {
    /// An empty tracker.
    pub fn new(cfg: LoadConfig) -> Self {
        let state = SeededState(cfg.hash_seed);
        LoadTracker {
            cfg,
            bookings: HashMap::with_hasher(state),
            keys: HashMap::with_hasher(state),
            expiry: BTreeMap::new(),
            next_seq: 0,
            expired: VecDeque::new(),
            stats: LoadStats::default(),
        }
    }

    /// Books request `req` for `phase` on `key`.
    ///
    /// `prefill_tokens` is the prompt's uncached tokens. `blocks` are the prompt's
    /// full-block sequence hashes: they become decode blocks on `key`, a block held by
    /// several bookings on the same key counted once. `expected_output_blocks` is the
    /// predicted output length in blocks (0 if unknown); it counts as decode load until
    /// generation overtakes it. A [`Phase::Prefill`] booking holds prefill tokens and a
    /// request slot but no decode blocks. Work is linear in `blocks.len()`, capped at
    /// [`BLOCKS_MAX_PER_REQUEST`]. The booking expires `request_age_max_ms` after `now`.
    #[allow(clippy::too_many_arguments)] // Mirrors the booking's fields one to one.
    pub fn add(
        &mut self,
        now: Instant,
        req: RequestId,
        phase: Phase,
        key: WorkerKey,
        blocks: &[SeqHash],
        prefill_tokens: u32,
        expected_output_blocks: u32,
    ) -> Result<(), LoadError> {
        self.add_inner(now, req, phase, key, blocks, prefill_tokens, expected_output_blocks, None)
    }

    /// [`Self::add`], telling `remote` which blocks local bookings on `key` start to hold,
    /// so that [`RemoteLoad::combined`] counts a block held here and elsewhere once. Only
    /// [`FleetLoad`], the one owner of both tables, calls the `*_with_remote` methods.
    #[allow(clippy::too_many_arguments)] // Mirrors the booking's fields one to one.
    fn add_with_remote(
        &mut self,
        now: Instant,
        req: RequestId,
        phase: Phase,
        key: WorkerKey,
        blocks: &[SeqHash],
        prefill_tokens: u32,
        expected_output_blocks: u32,
        remote: &mut RemoteLoad,
    ) -> Result<(), LoadError> {
        self.add_inner(now, req, phase, key, blocks, prefill_tokens, expected_output_blocks, Some(remote))
    }

    #[allow(clippy::too_many_arguments)]
    fn add_inner(
        &mut self,
        now: Instant,
        req: RequestId,
        phase: Phase,
        key: WorkerKey,
        blocks: &[SeqHash],
        prefill_tokens: u32,
        expected_output_blocks: u32,
        mut remote: Option<&mut RemoteLoad>,
    ) -> Result<(), LoadError> {
        if self.bookings.contains_key(&(req, phase)) {
            self.stats.duplicate_request += 1;
            return Err(LoadError::DuplicateRequest { req, phase });
        }
        if self.bookings.len() >= self.cfg.requests_max {
            self.stats.table_full += 1;
            return Err(LoadError::TableFull { requests_max: self.cfg.requests_max });
        }
        let blocks = if phase == Phase::Prefill { &[][..] } else { self.capped(blocks) };
        let expiry = (now.add_ms(self.cfg.request_age_max_ms), self.next_seq);
        self.next_seq += 1;
        let booking = Booking {
            key,
            blocks: blocks.to_vec(),
            prefill_tokens,
            prefilling: phase != Phase::Decode,
            expected_output_blocks,
            output_blocks: 0,
            expiry,
        };
        let state = SeededState(self.cfg.hash_seed);
        let kl = self.keys.entry(key).or_insert_with(|| KeyLoad {
            requests: 0,
            prefill_tokens: 0,
            output_blocks: 0,
            blocks: HashMap::with_hasher(state),
            prefill_requests: 0,
            busy_since: now,
            done_tokens: 0,
        });
        if booking.prefilling {
            if kl.prefill_requests == 0 {
                kl.busy_since = now;
                kl.done_tokens = 0;
            }
            kl.prefill_requests += 1;
        }
        kl.requests += 1;
        kl.prefill_tokens += u64::from(prefill_tokens);
        kl.output_blocks += booking.output_load(phase);
        // One growth step instead of several while a prompt's blocks go in.
        kl.blocks.reserve(blocks.len());
        for &b in blocks {
            let n = kl.blocks.entry(b).or_insert(0);
            *n += 1;
            if let (1, Some(r)) = (*n, remote.as_deref_mut()) {
                r.local_held(key, b);
            }
        }
        self.expiry.insert(expiry, (req, phase));
        self.bookings.insert((req, phase), booking);
        Ok(())
    }

    /// The booking's prefill finished: its prefill tokens drop to zero.
    pub fn prefill_done(&mut self, req: RequestId, phase: Phase) -> Result<(), LoadError> {
        let Some(b) = self.bookings.get_mut(&(req, phase)) else {
            return Err(self.unknown(req, phase));
        };
        if let Some(kl) = self.keys.get_mut(&b.key) {
            kl.end_prefill(b, true);
        }
        Ok(())
    }

    /// The booking has generated `output_tokens` tokens in total so far.
    ///
    /// Output blocks are `ceil(output_tokens / block_size)`, since a partly filled block
    /// is allocated all the same; a count lower than one already seen is ignored. Any
    /// output implies the prefill finished, so a positive count also clears the prefill
    /// tokens, which keeps a lost `prefill_done` from inflating the load.
    pub fn decode_progress(
        &mut self,
        req: RequestId,
        phase: Phase,
        output_tokens: u32,
        block_size: BlockSize,
    ) -> Result<(), LoadError> {
        let Some(b) = self.bookings.get_mut(&(req, phase)) else {
            return Err(self.unknown(req, phase));
        };
        let Some(kl) = self.keys.get_mut(&b.key) else {
            return Ok(()); // Unreachable: every booking's key has a KeyLoad.
        };
        if output_tokens > 0 {
            kl.end_prefill(b, true);
        }
        let generated = output_tokens.div_ceil(block_size.tokens());
        if generated > b.output_blocks {
            kl.output_blocks -= b.output_load(phase);
            b.output_blocks = generated;
            kl.output_blocks += b.output_load(phase);
        }
        Ok(())
    }

    /// The request finished: drops the booking and everything it held.
    pub fn free(&mut self, req: RequestId, phase: Phase) -> Result<(), LoadError> {
        self.free_inner(req, phase, None)
    }

    /// [`Self::free`], telling `remote` which blocks no local booking holds any more.
    fn free_with_remote(&mut self, req: RequestId, phase: Phase, remote: &mut RemoteLoad) -> Result<(), LoadError> {
        self.free_inner(req, phase, Some(remote))
    }

    fn free_inner(&mut self, req: RequestId, phase: Phase, remote: Option<&mut RemoteLoad>) -> Result<(), LoadError> {
        let Some(mut b) = self.bookings.remove(&(req, phase)) else {
            return Err(self.unknown(req, phase));
        };
        self.expiry.remove(&b.expiry);
        self.unbook(phase, &mut b, remote);
        Ok(())
    }

    /// Drops every booking on any rank of `worker` and returns how many there were.
    /// Dropped bookings are not reported as expired. Work is linear in the live bookings.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        self.remove_worker_inner(worker, None)
    }

    /// [`Self::remove_worker`], telling `remote` which blocks no local booking holds any
    /// more.
    fn remove_worker_with_remote(&mut self, worker: WorkerId, remote: &mut RemoteLoad) -> usize {
        self.remove_worker_inner(worker, Some(remote))
    }

    fn remove_worker_inner(&mut self, worker: WorkerId, mut remote: Option<&mut RemoteLoad>) -> usize {
        // Hash order only changes the order of the per-block notices, not their result.
        let gone: Vec<_> = self.bookings.extract_if(|_, b| b.key.worker == worker).collect();
        let n = gone.len();
        for ((_, phase), mut b) in gone {
            self.expiry.remove(&b.expiry);
            self.unbook(phase, &mut b, remote.as_deref_mut());
        }
        n
    }

    /// Whether a booking on `key` holds `block` as a prompt block. O(1).
    pub fn holds(&self, key: WorkerKey, block: SeqHash) -> bool {
        self.keys.get(&key).is_some_and(|kl| kl.blocks.contains_key(&block))
    }

    /// The load on `key` (all zero for a key with no bookings).
    pub fn load(&self, key: WorkerKey) -> WorkerLoad {
        self.keys.get(&key).map(KeyLoad::load).unwrap_or_default()
    }

    /// How far `key` has got through its prefill backlog.
    ///
    /// A key's prefill stretch starts at the `add` of an aggregated or prefill booking
    /// that finds none of its bookings prefilling, and ends when the last one finishes
    /// (`prefill_done`, or any output in `decode_progress`) or is dropped. Engines compute
    /// prompts first come first served, so `now − busy_since` of computing has gone into
    /// `done_tokens` plus the front of the still-queued `active_prefill_tokens`.
    pub fn prefill_progress(&self, key: WorkerKey) -> PrefillProgress {
        self.keys.get(&key).map(KeyLoad::progress).unwrap_or_default()
    }

    /// How many of `blocks` are not already decode blocks on `key`: the decode blocks an
    /// aggregated or decode booking of them would add. Blocks are assumed distinct, as a
    /// prompt's sequence hashes are. Linear in `blocks.len()`, capped like [`Self::add`].
    pub fn new_blocks(&self, key: WorkerKey, blocks: &[SeqHash]) -> u32 {
        let blocks = &blocks[..blocks.len().min(BLOCKS_MAX_PER_REQUEST)];
        let fresh = match self.keys.get(&key) {
            None => blocks.len(),
            Some(kl) => blocks.iter().filter(|b| !kl.blocks.contains_key(*b)).count(),
        };
        // The cap keeps this within u32.
        fresh as u32
    }

    /// [`Self::new_blocks`] for `blocks` that are one prompt's sequence-hash chain, in
    /// O(log n) lookups instead of n.
    ///
    /// Sequence hashes chain, so a booking that holds block `i` of this prompt holds
    /// blocks `0..i` as well: the prompt's active blocks on a key are always a leading run,
    /// found by binary search. For blocks that are not one chain, use `new_blocks`.
    pub fn new_blocks_chain(&self, key: WorkerKey, blocks: &[SeqHash]) -> u32 {
        let blocks = &blocks[..blocks.len().min(BLOCKS_MAX_PER_REQUEST)];
        let active = match self.keys.get(&key) {
            None => 0,
            Some(kl) => blocks.partition_point(|b| kl.blocks.contains_key(b)),
        };
        // The cap keeps this within u32.
        (blocks.len() - active) as u32
    }

    /// How many leading `blocks` bookings on `key` hold as prompt blocks. Engines compute
    /// prompts first come first served, so a request routed there now finds them cached
    /// when it is admitted, even before the worker has announced them. Linear in the
    /// answer (capped like [`Self::add`]).
    pub fn held_prefix(&self, key: WorkerKey, blocks: &[SeqHash]) -> u32 {
        let Some(kl) = self.keys.get(&key) else {
            return 0;
        };
        let blocks = &blocks[..blocks.len().min(BLOCKS_MAX_PER_REQUEST)];
        // The cap keeps this within u32.
        blocks.iter().take_while(|b| kl.blocks.contains_key(*b)).count() as u32
    }

    /// Whether the booking's prefill is still outstanding (false for an unknown booking).
    pub fn prefilling(&self, req: RequestId, phase: Phase) -> bool {
        self.bookings.get(&(req, phase)).is_some_and(|b| b.prefilling)
    }

    /// The key a booking sits on, if the tracker holds it.
    pub fn booking(&self, req: RequestId, phase: Phase) -> Option<WorkerKey> {
        self.bookings.get(&(req, phase)).map(|b| b.key)
    }

    /// When the oldest booking expires; `None` when there are no bookings.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.expiry.first_key_value().map(|(&(deadline, _), _)| deadline)
    }

    /// Expires bookings whose deadline is at or before `now`, oldest first, at most
    /// [`EXPIRE_PER_CALL_MAX`] per call (call again while `poll_timeout() <= now`).
    /// Each expiry is reported through [`Self::poll_expired`]. Harmless when nothing is due
    /// or when `now` went backwards.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.handle_timeout_inner(now, None);
    }

    /// [`Self::handle_timeout`], telling `remote` which blocks no local booking holds any
    /// more.
    fn handle_timeout_with_remote(&mut self, now: Instant, remote: &mut RemoteLoad) {
        self.handle_timeout_inner(now, Some(remote));
    }

    fn handle_timeout_inner(&mut self, now: Instant, mut remote: Option<&mut RemoteLoad>) {
        for _ in 0..EXPIRE_PER_CALL_MAX {
            let Some(entry) = self.expiry.first_entry() else {
                return;
            };
            if entry.key().0 > now {
                return;
            }
            let (req, phase) = entry.remove();
            if let Some(mut b) = self.bookings.remove(&(req, phase)) {
                self.unbook(phase, &mut b, remote.as_deref_mut());
            }
            self.stats.expired += 1;
            if self.expired.len() >= EXPIRED_QUEUE_MAX {
                self.expired.pop_front();
                self.stats.expired_unreported += 1;
            }
            self.expired.push_back((req, phase));
        }
    }

    /// The next booking dropped for age, oldest first. Drain until `None`.
    #[must_use]
    pub fn poll_expired(&mut self) -> Option<(RequestId, Phase)> {
        self.expired.pop_front()
    }

    /// Live bookings.
    pub fn len(&self) -> usize {
        self.bookings.len()
    }

    /// Whether there are no live bookings.
    pub fn is_empty(&self) -> bool {
        self.bookings.is_empty()
    }

    /// The refusal and expiry counters.
    pub fn stats(&self) -> LoadStats {
        self.stats
    }

    /// The load summed over every key. Linear in the number of keys; meant for checks.
    pub fn total(&self) -> WorkerLoad {
        self.keys.values().map(KeyLoad::load).fold(WorkerLoad::default(), |acc, l| WorkerLoad {
            active_prefill_tokens: acc.active_prefill_tokens + l.active_prefill_tokens,
            active_decode_blocks: acc.active_decode_blocks + l.active_decode_blocks,
            active_requests: acc.active_requests.saturating_add(l.active_requests),
        })
    }

    fn capped<'a>(&mut self, blocks: &'a [SeqHash]) -> &'a [SeqHash] {
        let keep = blocks.len().min(BLOCKS_MAX_PER_REQUEST);
        self.stats.blocks_truncated += (blocks.len() - keep) as u64;
        &blocks[..keep]
    }

    fn unknown(&mut self, req: RequestId, phase: Phase) -> LoadError {
        self.stats.unknown_request += 1;
        LoadError::UnknownRequest { req, phase }
    }

    /// Takes a removed booking's load off its key, dropping the key when it empties, and
    /// tells `remote` of each block no booking on the key holds any more.
    fn unbook(&mut self, phase: Phase, b: &mut Booking, mut remote: Option<&mut RemoteLoad>) {
        let Some(kl) = self.keys.get_mut(&b.key) else {
            return;
        };
        kl.requests -= 1;
        kl.end_prefill(b, false);
        kl.output_blocks -= b.output_load(phase);
        for h in &b.blocks {
            if let Some(n) = kl.blocks.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    kl.blocks.remove(h);
                    if let Some(r) = remote.as_deref_mut() {
                        r.local_released(b.key, *h);
                    }
                }
            }
        }
        if kl.requests == 0 {
            self.keys.remove(&b.key);
        }
    }
}

#[cfg(test)]
mod tests;
