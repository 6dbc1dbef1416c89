//! Remote load: the in-flight requests *other* router replicas have booked on the same
//! fleet, so that this replica's selection weighs the whole fleet's traffic.
//!
//! Each replica tells the others, over whatever transport the adapter uses, when it
//! books a request on a worker key, when that request's prefill is done, and when it
//! finishes. A [`RemoteLoad`] table keeps one entry per (replica, request, phase) with
//! the entry's contribution: prefill tokens until its prefill is done, its prompt's
//! blocks (counted once per worker key however many entries share them, as the local
//! tracker counts its own) plus its predicted output blocks, and one request. The prompt
//! blocks also tell [`RemoteLoad::held_prefix`] which prefixes are already on their way
//! into a worker's cache.
//!
//! [`RemoteLoad::combined`] adds the per-key sums to the local [`WorkerLoad`], counting a
//! prompt block held on a key both by local bookings and by remote entries once: it is
//! one block in the worker's cache, and counting it twice would steer requests away from
//! exactly the workers that hold hot shared prefixes. To keep that O(1) per key, each
//! remote block remembers whether a local booking on its key holds it too, and each key
//! counts those ([`RemoteLoad::shared_blocks`]). The mark is set when a remote block
//! first appears on a key (looked up in the [`LoadTracker`] passed to
//! [`RemoteLoad::add`]), kept up to date by [`super::FleetLoad`], which owns both tables and reports each
//! block a key's local bookings start or stop holding, and goes with the block. [`RemoteLoad::combined_progress`] merges the keys' prefill backlogs the way the
//! local tracker follows its own (since when a key has had prefill outstanding, and how
//! much of it finished since), so that other replicas' backlog is discounted for the time
//! it has been computing, exactly as a local backlog is; it needs no such care, since a
//! request is booked on one side only and its tokens are its own.
//!
//! Updates are fire-and-forget, so the table assumes any of them may be lost. A replica
//! that says nothing (no update, no heartbeat) for `replica_silence_max_ms` is presumed
//! gone and its entries are dropped; an entry older than `request_age_max_ms` is
//! dropped even while its replica lives, so a lost "finished" cannot inflate a worker's
//! load for longer than that.
//!
//! What it leaves to others: the local bookings ([`LoadTracker`], whose accounting this
//! table never touches; it only learns which blocks they hold), the transport and its
//! encoding (the replica adapter), telling a replica's restart apart from its silence (the adapter calls
//! [`RemoteLoad::remove_replica`]), and deciding what to publish (the façade).
//!
//! Calling order: feed inputs (`heartbeat`, `add`, `prefill_done`, `finish`,
//! `remove_replica`, `remove_worker`), then sleep until `RemoteLoad::poll_timeout`
//! and call `RemoteLoad::handle_timeout`. A spurious `handle_timeout` is harmless;
//! time going backwards never moves a deadline earlier.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use hashbrown::HashMap;

use super::hasher::SeededState;
use super::{LoadTracker, PrefillProgress};
use crate::hash::SeqHash;
use crate::time::Instant;
use crate::types::{Phase, RequestId, WorkerId, WorkerKey, WorkerLoad};

/// Entries one `RemoteLoad::handle_timeout` call drops at most. When more are due,
/// `RemoteLoad::poll_timeout` returns a deadline already past, so the caller comes back.
pub const REMOTE_EXPIRE_PER_CALL_MAX: usize = 4096;

/// One router replica among several fronting the same fleet.
///
/// The adapter chooses the ids; every replica must derive the same id for the same
/// replica, because [`crate::affinity::BindStamp`] orders concurrent session bindings by
/// it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ReplicaId(pub u64);

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "replica {:016x}", self.0)
    }
}

/// Limits of the table of other replicas' load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteLoadConfig {
    /// A replica silent this long is presumed gone and its entries are dropped. Default
    /// 10,000.
    pub replica_silence_max_ms: u64,
    /// An entry older than this is dropped even while its replica lives. Default 600,000.
    pub request_age_max_ms: u64,
    /// Entries held at most, over all replicas; more are refused. Default 65,536.
    pub remote_requests_max: usize,
    /// Other replicas tracked at most; updates from more are refused. Default 64.
    pub replicas_max: usize,
    /// Prompt blocks kept per entry; past it they are ignored and counted. Default 4,096.
    pub blocks_max_per_request: usize,
    /// Prompt blocks kept over all entries; an entry that would pass it keeps none.
    /// Default 4,194,304.
    pub blocks_max: usize,
    /// Seed of the block tables' hash. Default 0; set a secret one in production.
    pub hash_seed: u64,
}

impl Default for RemoteLoadConfig {
    fn default() -> Self {
        RemoteLoadConfig {
            replica_silence_max_ms: 10_000,
            request_age_max_ms: 600_000,
            remote_requests_max: 65_536,
            replicas_max: 64,
            blocks_max_per_request: 4096,
            blocks_max: 1 << 22,
            hash_seed: 0,
        }
    }
}

/// Why a remote-load input changed nothing (beyond counting it).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum RemoteLoadError {
    /// The table already holds `remote_requests_max` entries.
    TableFull {
        /// The configured limit.
        remote_requests_max: usize,
    },
    /// `replicas_max` other replicas are already tracked; this one is not.
    TooManyReplicas {
        /// The configured limit.
        replicas_max: usize,
    },
    /// The replica already reported this request and phase; the first report stands.
    DuplicateRequest {
        /// The sending replica.
        replica: ReplicaId,
        /// Its request.
        req: RequestId,
        /// Its phase.
        phase: Phase,
    },
    /// No entry for this replica, request and phase (never added, lost, or expired).
    UnknownRequest {
        /// The sending replica.
        replica: ReplicaId,
        /// Its request.
        req: RequestId,
        /// Its phase.
        phase: Phase,
    },
}

impl fmt::Display for RemoteLoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteLoadError::TableFull { remote_requests_max } => {
                write!(f, "remote load table full ({remote_requests_max} entries)")
            }
            RemoteLoadError::TooManyReplicas { replicas_max } => {
                write!(f, "already tracking {replicas_max} other replicas")
            }
            RemoteLoadError::DuplicateRequest { replica, req, phase } => {
                write!(f, "{replica} already reported request {} ({phase})", req.0)
            }
            RemoteLoadError::UnknownRequest { replica, req, phase } => {
                write!(f, "no remote entry for request {} ({phase}) of {replica}", req.0)
            }
        }
    }
}

impl core::error::Error for RemoteLoadError {}

/// Counters of the remote table, for metrics.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct RemoteLoadStats {
    /// Entries accepted.
    pub added: u64,
    /// `add` refused because the entry already existed.
    pub duplicate_request: u64,
    /// `prefill_done` or `finish` naming no entry.
    pub unknown_request: u64,
    /// `add` refused because the table was full.
    pub table_full: u64,
    /// Inputs refused because `replicas_max` other replicas were tracked.
    pub replicas_refused: u64,
    /// Entries dropped for age.
    pub expired_requests: u64,
    /// Replicas dropped for silence.
    pub silent_replicas: u64,
    /// Entries dropped with a silent or removed replica, or with a removed worker.
    pub dropped_requests: u64,
    /// Prompt blocks not kept: past `blocks_max_per_request`, or over `blocks_max`.
    pub blocks_truncated: u64,
}

type EntryKey = (ReplicaId, RequestId, Phase);

#[derive(Clone, Debug)]
struct Entry {
    key: WorkerKey,
    prefill_tokens: u32,
    /// Prompt blocks (none for prefill entries, which hold no decode blocks).
    blocks: Vec<SeqHash>,
    output_blocks: u32,
    prefilling: bool,
    /// When it is dropped for age; with the entry key, its place in `ages`.
    age_deadline: Instant,
}

/// A prompt block held on a key by remote entries.
#[derive(Clone, Copy, Debug)]
struct Held {
    /// Entries on the key holding it.
    entries: u32,
    /// A local booking on the key holds it too (see [`RemoteLoad::local_held`]).
    local: bool,
}

#[derive(Clone, Debug)]
struct KeySum {
    requests: u64,
    prefill_tokens: u64,
    /// Prompt block → who holds it on this key.
    blocks: HashMap<SeqHash, Held, SeededState>,
    /// Blocks in `blocks` that local bookings hold too: counted by the local load.
    shared: u64,
    output_blocks: u64,
    /// Entries whose prefill has not finished.
    prefill_requests: u64,
    /// Start of the current stretch of outstanding prefill (meaningless while
    /// `prefill_requests == 0`).
    busy_since: Instant,
    /// Prefill tokens finished within the stretch.
    done_tokens: u64,
}

impl KeySum {
    fn new(seed: u64) -> Self {
        KeySum {
            requests: 0,
            prefill_tokens: 0,
            blocks: HashMap::with_hasher(SeededState(seed)),
            shared: 0,
            output_blocks: 0,
            prefill_requests: 0,
            busy_since: Instant::ZERO,
            done_tokens: 0,
        }
    }

    /// Decode blocks this key adds to the local load: its prompt blocks no local booking
    /// holds, plus its output blocks.
    fn remote_decode_blocks(&self) -> u64 {
        (self.blocks.len() as u64).saturating_sub(self.shared) + self.output_blocks
    }

    /// An entry stops prefilling: finished (`done`) or dropped.
    fn end_prefill(&mut self, tokens: u32, done: bool) {
        self.prefill_tokens -= u64::from(tokens);
        self.prefill_requests -= 1;
        self.done_tokens = match (self.prefill_requests, done) {
            (0, _) => 0,
            (_, true) => self.done_tokens + u64::from(tokens),
            (_, false) => self.done_tokens,
        };
    }
}

/// Other replicas' in-flight load per worker key, kept from what they say they book.
///
/// Work: every input is O(log n) in the entries, except `remove_replica` (linear in
/// that replica's entries) and `remove_worker` (linear in all entries).
#[derive(Clone, Debug)]
pub(crate) struct RemoteLoad {
    cfg: RemoteLoadConfig,
    entries: BTreeMap<EntryKey, Entry>,
    keys: BTreeMap<WorkerKey, KeySum>,
    /// Prompt blocks kept over all entries.
    blocks_held: usize,
    /// Replica → its silence deadline.
    replicas: BTreeMap<ReplicaId, Instant>,
    silence: BTreeSet<(Instant, ReplicaId)>,
    ages: BTreeSet<(Instant, EntryKey)>,
    stats: RemoteLoadStats,
}

impl RemoteLoad {
    /// An empty table.
    pub(crate) fn new(cfg: RemoteLoadConfig) -> Self {
        RemoteLoad {
            cfg,
            entries: BTreeMap::new(),
            keys: BTreeMap::new(),
            blocks_held: 0,
            replicas: BTreeMap::new(),
            silence: BTreeSet::new(),
            ages: BTreeSet::new(),
            stats: RemoteLoadStats::default(),
        }
    }

    /// `replica` is alive: its silence deadline moves to `now + replica_silence_max_ms`.
    /// Every other input from a replica counts as this too.
    pub(crate) fn heartbeat(&mut self, now: Instant, replica: ReplicaId) -> Result<(), RemoteLoadError> {
        let deadline = now.add_ms(self.cfg.replica_silence_max_ms);
        match self.replicas.get(&replica).copied() {
            // Time going backwards never moves a deadline earlier.
            Some(old) if old >= deadline => {}
            Some(old) => {
                self.silence.remove(&(old, replica));
                self.silence.insert((deadline, replica));
                self.replicas.insert(replica, deadline);
            }
            None if self.replicas.len() >= self.cfg.replicas_max => {
                self.stats.replicas_refused += 1;
                return Err(RemoteLoadError::TooManyReplicas { replicas_max: self.cfg.replicas_max });
            }
            None => {
                self.silence.insert((deadline, replica));
                self.replicas.insert(replica, deadline);
            }
        }
        Ok(())
    }

    /// `replica` booked request `req` for `phase` on `key`, contributing
    /// `prefill_tokens` until its prefill is done, and its prompt `blocks` (not for
    /// [`Phase::Prefill`]), `output_blocks` and one request until it finishes. Linear in
    /// `blocks`, capped at `blocks_max_per_request`.
    ///
    /// `local` is this replica's own tracker: a block that no other entry on `key` holds
    /// yet is looked up there once, so that [`Self::combined`] counts a block held on both
    /// sides once. [`super::FleetLoad`] keeps it told of the local side's changes.
    #[allow(clippy::too_many_arguments)] // One entry's fields, one to one, and the local side.
    pub(crate) fn add(
        &mut self,
        now: Instant,
        replica: ReplicaId,
        req: RequestId,
        phase: Phase,
        key: WorkerKey,
        prefill_tokens: u32,
        blocks: &[SeqHash],
        output_blocks: u32,
        local: &LoadTracker,
    ) -> Result<(), RemoteLoadError> {
        self.heartbeat(now, replica)?;
        let ek = (replica, req, phase);
        if self.entries.contains_key(&ek) {
            self.stats.duplicate_request += 1;
            return Err(RemoteLoadError::DuplicateRequest { replica, req, phase });
        }
        if self.entries.len() >= self.cfg.remote_requests_max {
            self.stats.table_full += 1;
            return Err(RemoteLoadError::TableFull { remote_requests_max: self.cfg.remote_requests_max });
        }
        let age_deadline = now.add_ms(self.cfg.request_age_max_ms);
        let prefilling = phase != Phase::Decode;
        let prefill_tokens = if prefilling { prefill_tokens } else { 0 };
        let output_blocks = if phase == Phase::Prefill { 0 } else { output_blocks };
        let blocks = if phase == Phase::Prefill { &[][..] } else { blocks };
        let keep = blocks.len().min(self.cfg.blocks_max_per_request);
        let keep = if self.blocks_held + keep > self.cfg.blocks_max { 0 } else { keep };
        self.stats.blocks_truncated += (blocks.len() - keep) as u64;
        self.blocks_held += keep;
        let blocks = blocks[..keep].to_vec();
        let seed = self.cfg.hash_seed;
        let sum = self.keys.entry(key).or_insert_with(|| KeySum::new(seed));
        sum.requests += 1;
        sum.prefill_tokens += u64::from(prefill_tokens);
        sum.output_blocks += u64::from(output_blocks);
        sum.blocks.reserve(blocks.len());
        for &b in &blocks {
            let h = sum.blocks.entry(b).or_insert(Held { entries: 0, local: false });
            if h.entries == 0 {
                h.local = local.holds(key, b);
                sum.shared += u64::from(h.local);
            }
            h.entries += 1;
        }
        if prefilling {
            if sum.prefill_requests == 0 {
                sum.busy_since = now;
                sum.done_tokens = 0;
            }
            sum.prefill_requests += 1;
        }
        self.entries.insert(ek, Entry { key, prefill_tokens, blocks, output_blocks, prefilling, age_deadline });
        self.ages.insert((age_deadline, ek));
        self.stats.added += 1;
        Ok(())
    }

    /// The entry's prefill finished: its prefill tokens stop counting. A second report
    /// is a no-op.
    pub(crate) fn prefill_done(
        &mut self,
        now: Instant,
        replica: ReplicaId,
        req: RequestId,
        phase: Phase,
    ) -> Result<(), RemoteLoadError> {
        self.heartbeat(now, replica)?;
        let Some(e) = self.entries.get_mut(&(replica, req, phase)) else {
            return Err(self.unknown(replica, req, phase));
        };
        if e.prefilling {
            e.prefilling = false;
            if let Some(sum) = self.keys.get_mut(&e.key) {
                sum.end_prefill(e.prefill_tokens, true);
            }
            e.prefill_tokens = 0;
        }
        Ok(())
    }

    /// The entry's request finished (or failed, or was cancelled): it stops counting.
    pub(crate) fn finish(
        &mut self,
        now: Instant,
        replica: ReplicaId,
        req: RequestId,
        phase: Phase,
    ) -> Result<(), RemoteLoadError> {
        self.heartbeat(now, replica)?;
        if !self.drop_entry((replica, req, phase)) {
            return Err(self.unknown(replica, req, phase));
        }
        Ok(())
    }

    /// Forgets `replica` and everything it reported (it restarted or said goodbye), and
    /// returns how many entries went. Linear in that replica's entries.
    pub(crate) fn remove_replica(&mut self, replica: ReplicaId) -> usize {
        if let Some(deadline) = self.replicas.remove(&replica) {
            self.silence.remove(&(deadline, replica));
        }
        let gone: Vec<EntryKey> = self.replica_entries(replica).collect();
        for &ek in &gone {
            self.drop_entry(ek);
        }
        self.stats.dropped_requests += gone.len() as u64;
        gone.len()
    }

    /// Drops every entry on any rank of `worker` (it left the fleet) and returns how
    /// many. Linear in the entries.
    pub(crate) fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let gone: Vec<EntryKey> =
            self.entries.iter().filter(|(_, e)| e.key.worker == worker).map(|(&ek, _)| ek).collect();
        for &ek in &gone {
            self.drop_entry(ek);
        }
        self.stats.dropped_requests += gone.len() as u64;
        gone.len()
    }

    /// Other replicas' load on `key` (all zero when none), on its own: prompt blocks that
    /// local bookings hold too are counted here; [`Self::combined`] leaves them out.
    pub(crate) fn load(&self, key: WorkerKey) -> WorkerLoad {
        self.keys.get(&key).map_or_else(WorkerLoad::default, |s| WorkerLoad {
            active_prefill_tokens: s.prefill_tokens,
            active_decode_blocks: s.blocks.len() as u64 + s.output_blocks,
            active_requests: u32::try_from(s.requests).unwrap_or(u32::MAX),
        })
    }

    /// `local` (this replica's [`LoadTracker::load`] of `key`) plus other replicas' load
    /// on `key`: what selection weighs. A prompt block held on `key` both here and
    /// elsewhere is in `local` already and is not added again. O(1); saturating.
    pub(crate) fn combined(&self, key: WorkerKey, local: WorkerLoad) -> WorkerLoad {
        let Some(s) = self.keys.get(&key) else {
            return local;
        };
        WorkerLoad {
            active_prefill_tokens: local.active_prefill_tokens.saturating_add(s.prefill_tokens),
            active_decode_blocks: local.active_decode_blocks.saturating_add(s.remote_decode_blocks()),
            active_requests: local.active_requests.saturating_add(u32::try_from(s.requests).unwrap_or(u32::MAX)),
        }
    }

    /// `local`'s prefill backlog merged with other replicas' on `key`: the stretch begins
    /// at the earlier of the two, and counts both sides' bookings and finished tokens.
    pub(crate) fn combined_progress(&self, key: WorkerKey, local: PrefillProgress) -> PrefillProgress {
        let Some(s) = self.keys.get(&key).filter(|s| s.prefill_requests > 0) else {
            return local;
        };
        PrefillProgress {
            requests: local.requests.saturating_add(u32::try_from(s.prefill_requests).unwrap_or(u32::MAX)),
            busy_since: Some(local.busy_since.map_or(s.busy_since, |t| t.min(s.busy_since))),
            done_tokens: local.done_tokens.saturating_add(s.done_tokens),
        }
    }

    /// How many leading `blocks` other replicas' entries on `key` hold as prompt blocks:
    /// a prefix on its way into that worker's cache. Linear in the answer.
    pub(crate) fn held_prefix(&self, key: WorkerKey, blocks: &[SeqHash]) -> u32 {
        let Some(s) = self.keys.get(&key) else {
            return 0;
        };
        let n = blocks.iter().take(self.cfg.blocks_max_per_request).take_while(|b| s.blocks.contains_key(*b)).count();
        // The cap keeps this within u32 for any sane configuration.
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Prompt blocks on `key` held both by other replicas' entries and by local bookings:
    /// the overlap [`Self::combined`] leaves out of the remote side.
    #[cfg(test)]
    pub(crate) fn shared_blocks(&self, key: WorkerKey) -> u64 {
        self.keys.get(&key).map_or(0, |s| s.shared)
    }

    /// A local booking on `key` is the first to hold `block` (its local count went from 0
    /// to 1). Called by [`LoadTracker`]; idempotent.
    pub(super) fn local_held(&mut self, key: WorkerKey, block: SeqHash) {
        let Some(s) = self.keys.get_mut(&key) else { return };
        if let Some(h) = s.blocks.get_mut(&block).filter(|h| !h.local) {
            h.local = true;
            s.shared += 1;
        }
    }

    /// The last local booking on `key` holding `block` went (its local count went from 1
    /// to 0). Called by [`LoadTracker`]; idempotent.
    pub(super) fn local_released(&mut self, key: WorkerKey, block: SeqHash) {
        let Some(s) = self.keys.get_mut(&key) else { return };
        if let Some(h) = s.blocks.get_mut(&block).filter(|h| h.local) {
            h.local = false;
            s.shared -= 1;
        }
    }

    /// The worker key a replica's entry sits on, if held.
    #[cfg(test)]
    pub(crate) fn entry(&self, replica: ReplicaId, req: RequestId, phase: Phase) -> Option<WorkerKey> {
        self.entries.get(&(replica, req, phase)).map(|e| e.key)
    }

    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Other replicas tracked (heard from within `replica_silence_max_ms`).
    pub(crate) fn replicas(&self) -> impl Iterator<Item = ReplicaId> + '_ {
        self.replicas.keys().copied()
    }

    /// Counters.
    pub(crate) fn stats(&self) -> RemoteLoadStats {
        self.stats
    }

    /// The earliest silence or age deadline.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let silent = self.silence.first().map(|&(t, _)| t);
        let aged = self.ages.first().map(|&(t, _)| t);
        match (silent, aged) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Drops silent replicas' entries and entries past their age, at most
    /// [`REMOTE_EXPIRE_PER_CALL_MAX`] entries per call. A silent replica is forgotten once
    /// its last entry is gone; an update from it meanwhile revives it with the entries it
    /// still has.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        let mut budget = REMOTE_EXPIRE_PER_CALL_MAX;
        while let Some(&(deadline, replica)) = self.silence.first() {
            if deadline > now {
                break;
            }
            let due: Vec<EntryKey> = self.replica_entries(replica).take(budget).collect();
            for &ek in &due {
                self.drop_entry(ek);
            }
            budget -= due.len();
            self.stats.dropped_requests += due.len() as u64;
            if self.replica_entries(replica).next().is_some() {
                return; // Out of budget; the deadline stays due.
            }
            self.silence.remove(&(deadline, replica));
            self.replicas.remove(&replica);
            self.stats.silent_replicas += 1;
        }
        while budget > 0 {
            match self.ages.first() {
                Some(&(deadline, ek)) if deadline <= now => {
                    self.drop_entry(ek);
                    self.stats.expired_requests += 1;
                    budget -= 1;
                }
                _ => break,
            }
        }
    }

    /// Recomputes every sum from the entries and compares; a difference is a bug. Linear.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut sums: BTreeMap<WorkerKey, KeySum> = BTreeMap::new();
        let mut held = 0;
        for (&(replica, ..), e) in &self.entries {
            if !self.replicas.contains_key(&replica) {
                return Err(format!("entry of untracked {replica}"));
            }
            let s = sums.entry(e.key).or_insert_with(|| KeySum::new(0));
            s.requests += 1;
            s.prefill_tokens += u64::from(e.prefill_tokens);
            s.output_blocks += u64::from(e.output_blocks);
            s.prefill_requests += u64::from(e.prefilling);
            for &b in &e.blocks {
                s.blocks.entry(b).or_insert(Held { entries: 0, local: false }).entries += 1;
            }
            held += e.blocks.len();
        }
        for (k, s) in &self.keys {
            let flagged = s.blocks.values().filter(|h| h.local).count() as u64;
            if flagged != s.shared {
                return Err(format!("{k}: {flagged} blocks held locally too, {} counted", s.shared));
            }
        }
        // The stretch's start and progress are history, not sums: compare the rest.
        let counts = |m: &BTreeMap<WorkerKey, KeySum>| -> Vec<(WorkerKey, u64, u64, u64, u64, usize)> {
            m.iter()
                .map(|(k, s)| (*k, s.requests, s.prefill_tokens, s.output_blocks, s.prefill_requests, s.blocks.len()))
                .collect()
        };
        if held != self.blocks_held || held > self.cfg.blocks_max {
            return Err(format!("{held} blocks in entries, {} counted", self.blocks_held));
        }
        if counts(&sums) != counts(&self.keys) {
            return Err(format!("remote sums {:?} differ from entries' {sums:?}", self.keys));
        }
        if self.ages.len() != self.entries.len() || self.silence.len() != self.replicas.len() {
            return Err(format!(
                "{} age timers for {} entries, {} silence timers for {} replicas",
                self.ages.len(),
                self.entries.len(),
                self.silence.len(),
                self.replicas.len()
            ));
        }
        if self.entries.len() > self.cfg.remote_requests_max || self.replicas.len() > self.cfg.replicas_max {
            return Err(format!("{} entries, {} replicas: over the limits", self.entries.len(), self.replicas.len()));
        }
        Ok(())
    }

    /// Checks that the blocks marked as held locally too are exactly those `local` holds:
    /// what [`super::FleetLoad`] keeps true. Linear in the blocks.
    pub(crate) fn check_shared(&self, local: &LoadTracker) -> Result<(), String> {
        for (&k, s) in &self.keys {
            let wrong = s.blocks.iter().filter(|&(&b, h)| h.local != local.holds(k, b)).count();
            if wrong > 0 {
                return Err(format!("{k}: {wrong} blocks marked wrongly as held locally or not"));
            }
        }
        Ok(())
    }

    fn replica_entries(&self, replica: ReplicaId) -> impl Iterator<Item = EntryKey> + '_ {
        self.entries
            .range((replica, RequestId(0), Phase::Aggregated)..)
            .take_while(move |(ek, _)| ek.0 == replica)
            .map(|(&ek, _)| ek)
    }

    /// Removes an entry and its contribution; false when there was none.
    fn drop_entry(&mut self, ek: EntryKey) -> bool {
        let Some(e) = self.entries.remove(&ek) else {
            return false;
        };
        self.ages.remove(&(e.age_deadline, ek));
        self.blocks_held -= e.blocks.len();
        if let Some(sum) = self.keys.get_mut(&e.key) {
            sum.requests -= 1;
            if e.prefilling {
                sum.end_prefill(e.prefill_tokens, false);
            }
            sum.output_blocks -= u64::from(e.output_blocks);
            for b in &e.blocks {
                if let Some(h) = sum.blocks.get_mut(b) {
                    h.entries -= 1;
                    if h.entries == 0 {
                        sum.shared -= u64::from(h.local);
                        sum.blocks.remove(b);
                    }
                }
            }
            if sum.requests == 0 {
                self.keys.remove(&e.key);
            }
        }
        true
    }

    fn unknown(&mut self, replica: ReplicaId, req: RequestId, phase: Phase) -> RemoteLoadError {
        self.stats.unknown_request += 1;
        RemoteLoadError::UnknownRequest { replica, req, phase }
    }
}

#[cfg(test)]
mod tests;
