//! The table behind [`AffinityTable`]: a slab of entries, a seeded hash index into it,
//! an ordered set of idle deadlines, and a slab of leases.

use alloc::collections::{BTreeSet, VecDeque};
use alloc::vec::Vec;
use core::mem;

use hashbrown::HashTable;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{
    Acquire, AffinityConfig, AffinityError, AffinityMode, AffinityOutput, AffinityStats, BindStamp, Binding, InitToken,
    LeaseId, RemoteBinding, WaitToken,
};
use crate::time::Instant;
use crate::types::{DpRank, Phase, WorkerId};

/// Most entries one [`AffinityTable::handle_timeout`] call expires.
pub const EXPIRE_PER_CALL_MAX: usize = 1024;

mod remote;

/// Mixed into the seed per phase, so one session id hashes apart in each phase.
const PHASE_SALT: [u64; 3] = [0x243F_6A88_85A3_08D3, 0x1319_8A2E_0370_7344, 0xA409_3822_299F_31D0];

/// Session-affinity bindings and their leases, per (session id, phase).
///
/// Sans-IO: the table reads no clock and sets no timers. Methods fall into four kinds:
///
/// * inputs that take `now`: [`acquire`](Self::acquire), [`commit`](Self::commit),
///   [`release`](Self::release), [`handle_timeout`](Self::handle_timeout);
/// * other mutators: [`abort`](Self::abort), [`cancel_wait`](Self::cancel_wait),
///   [`invalidate`](Self::invalidate), [`invalidate_worker`](Self::invalidate_worker);
/// * getters, which never change anything: [`peek`](Self::peek), [`len`](Self::len),
///   [`poll_timeout`](Self::poll_timeout), [`stats`](Self::stats) …;
/// * the output queue, [`poll_output`](Self::poll_output).
///
/// Calling order: after every mutation drain `poll_output` until `None`, then sleep until
/// `poll_timeout` and call `handle_timeout` with the time you woke at. A spurious or late
/// `handle_timeout` is harmless; an idle binding whose deadline passed is also treated as
/// expired by the next `acquire` of its session, so behaviour does not depend on timer
/// jitter. Time may go backwards: deadlines are compared, never subtracted.
///
/// Every (session, phase) has at most one entry, so at most one initializer. An entry
/// is dropped only by `abort`, by expiry or eviction once it has no leases, or by
/// invalidation. Invalidating a binding that still has leases orphans them: they stay
/// counted in [`live_leases`](Self::live_leases) and `release` accepts them, but they no
/// longer keep anything alive.
///
/// Work: `acquire`, `commit`, `abort`, `release`, `invalidate` and `peek` cost one hash of
/// the session id plus O(log n) in the idle set; `acquire` on a full table also evicts
/// one entry. `cancel_wait` is linear in that session's waiters. `invalidate_worker` scans
/// every slot. `handle_timeout` expires at most [`EXPIRE_PER_CALL_MAX`] entries per call;
/// when more are due `poll_timeout` returns a time already past, so call again.
///
/// DoS note: the output queue holds what callers have not drained; one call adds at most
/// `waiters_max_per_session` wakes or `EXPIRE_PER_CALL_MAX` expiries, so drain it after
/// every call. An [`InitToken`] that is neither committed nor aborted holds its slot
/// forever: the adapter must end each one (a drop guard that aborts does it).
#[derive(Debug)]
pub struct AffinityTable {
    cfg: AffinityConfig,
    /// Slot numbers, found by the seeded hash of (session id, phase).
    index: HashTable<u32>,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    /// Idle bindings as (deadline, entry serial, slot): the expiry timers, and the eviction
    /// order (soonest deadline first, oldest entry on ties).
    idle: BTreeSet<(Instant, u64, u32)>,
    leases: Vec<LeaseSlot>,
    free_leases: Vec<u32>,
    leases_live: usize,
    outputs: VecDeque<AffinityOutput>,
    stats: AffinityStats,
    /// Source of entry serials, waiter ids, lease ids and revisions; never 0 once used.
    serial: u64,
}

/// A slab slot. The key buffer outlives its entry so a reused slot does not allocate.
#[derive(Debug)]
struct Slot {
    key: Vec<u8>,
    entry: Option<Entry>,
}

#[derive(Debug)]
struct Entry {
    hash: u64,
    phase: Phase,
    /// Unique per entry; doubles as the serial of its [`InitToken`].
    serial: u64,
    state: State,
}

#[derive(Debug)]
enum State {
    /// Waiter ids in arrival order. `remote` is the earliest binding another replica
    /// committed meanwhile, with when it arrived; the commit or abort settles it.
    Initializing { waiters: Vec<u64>, remote: Option<(RemoteBinding, Instant)> },
    /// `idle_deadline` is set exactly when `leases == 0`, and then the entry is in `idle`.
    /// `stamp` orders it against another replica's binding of the same session.
    Bound { binding: Binding, leases: u32, idle_deadline: Option<Instant>, stamp: BindStamp },
}

/// `serial == 0` marks a free lease slot. `prior_idle` is the binding's idle deadline
/// when this lease was taken (none if other leases held it), restored by
/// [`AffinityTable::release_unserved`].
#[derive(Clone, Copy, Debug)]
struct LeaseSlot {
    serial: u64,
    slot: u32,
    entry_serial: u64,
    prior_idle: Option<Instant>,
}

impl AffinityTable {
    /// An empty table. `sessions_max` and `leases_max` are capped at `u32::MAX`.
    pub fn new(mut cfg: AffinityConfig) -> Self {
        cfg.sessions_max = cfg.sessions_max.min(u32::MAX as usize);
        cfg.leases_max = cfg.leases_max.min(u32::MAX as usize);
        // Sized up front so filling the table never pays for a rehash; capped so a huge
        // configured limit does not reserve memory it may never use.
        let index = HashTable::with_capacity(cfg.sessions_max.min(1 << 20));
        AffinityTable {
            cfg,
            index,
            slots: Vec::new(),
            free_slots: Vec::new(),
            idle: BTreeSet::new(),
            leases: Vec::new(),
            free_leases: Vec::new(),
            leases_live: 0,
            outputs: VecDeque::new(),
            stats: AffinityStats::default(),
            serial: 0,
        }
    }

    /// The configuration, as capped by [`new`](Self::new).
    pub fn config(&self) -> &AffinityConfig {
        &self.cfg
    }

    /// Hard pin or soft preference, for the façade.
    pub fn mode(&self) -> AffinityMode {
        self.cfg.mode
    }

    /// Starts, joins or waits for the binding of (`session`, `phase`).
    ///
    /// Returns [`Acquire::Initialize`] when there is no entry (making room by evicting the
    /// idle binding due soonest if the table is full), [`Acquire::Wait`] while another
    /// request initializes it, and [`Acquire::Bound`] with a new lease once bound.
    pub fn acquire(&mut self, now: Instant, session: &[u8], phase: Phase) -> Result<Acquire, AffinityError> {
        self.validate(session)?;
        let hash = self.hash(session, phase);
        if let Some(idx) = self.find(hash, session, phase) {
            if let Some(acquired) = self.acquire_existing(now, idx)? {
                return Ok(acquired);
            }
        }
        self.make_room(now)?;
        let serial = bump(&mut self.serial);
        let entry = Entry { hash, phase, serial, state: State::Initializing { waiters: Vec::new(), remote: None } };
        let slot = self.insert(session, entry);
        Ok(Acquire::Initialize(InitToken { slot, serial }))
    }

    /// Binds the session `token` initializes to `worker` (and `rank`), with one lease for
    /// the request that initialized it, and wakes its waiters.
    ///
    /// The binding is stamped (`now`, this replica). If another replica's binding of the
    /// session arrived during the initialization with a lower stamp, that one is kept
    /// instead: the returned binding names its worker, and [`Self::stamp`] its replica.
    pub fn commit(
        &mut self,
        now: Instant,
        token: InitToken,
        worker: WorkerId,
        rank: Option<DpRank>,
    ) -> Result<(Binding, LeaseId), AffinityError> {
        let entry = match entry_mut(&mut self.slots, token.slot) {
            Some(e) if e.serial == token.serial && matches!(e.state, State::Initializing { .. }) => e,
            _ => return Err(AffinityError::UnknownToken),
        };
        if self.leases_live >= self.cfg.leases_max {
            return Err(AffinityError::TooManyLeases { leases_max: self.cfg.leases_max });
        }
        let mut stamp = BindStamp { committed_at: now, replica: self.cfg.replica };
        let (mut worker, mut rank) = (worker, rank);
        if let State::Initializing { remote: Some((r, _)), .. } = &entry.state {
            if (r.stamp, r.worker, r.rank) < (stamp, worker, rank) {
                (worker, rank, stamp) = (r.worker, r.rank, r.stamp);
                self.stats.remote_won += 1;
            }
        }
        let binding = Binding { worker, rank, revision: bump(&mut self.serial) };
        let bound = State::Bound { binding, leases: 1, idle_deadline: None, stamp };
        if let State::Initializing { waiters, .. } = mem::replace(&mut entry.state, bound) {
            self.wake(token.slot, waiters);
        }
        Ok((binding, self.alloc_lease(token.slot, token.serial, None)))
    }

    /// Gives up an initialization: the entry is removed, as if it never existed, and its
    /// waiters are woken (one of them will initialize next). If another replica's binding
    /// arrived meanwhile, the session takes that one instead (idle, expiring
    /// `lease_ttl_ms` after it arrived), and the waiters find it bound.
    pub fn abort(&mut self, token: InitToken) -> Result<(), AffinityError> {
        let entry = match entry_mut(&mut self.slots, token.slot) {
            Some(e) if e.serial == token.serial && matches!(e.state, State::Initializing { .. }) => e,
            _ => return Err(AffinityError::UnknownToken),
        };
        if let State::Initializing { remote: Some((r, arrived)), .. } = entry.state {
            let deadline = arrived.add_ms(self.cfg.lease_ttl_ms);
            let binding = Binding { worker: r.worker, rank: r.rank, revision: bump(&mut self.serial) };
            let bound = State::Bound { binding, leases: 0, idle_deadline: Some(deadline), stamp: r.stamp };
            if let State::Initializing { waiters, .. } = mem::replace(&mut entry.state, bound) {
                self.idle.insert((deadline, entry.serial, token.slot));
                self.wake(token.slot, waiters);
            }
            return Ok(());
        }
        if let Some(Entry { state: State::Initializing { waiters, .. }, .. }) = self.remove(token.slot) {
            self.wake(token.slot, waiters);
        }
        Ok(())
    }

    /// Withdraws a waiting request. A token already woken is unknown.
    pub fn cancel_wait(&mut self, token: WaitToken) -> Result<(), AffinityError> {
        if let Some(Entry { state: State::Initializing { waiters, .. }, .. }) = entry_mut(&mut self.slots, token.slot) {
            if let Some(pos) = waiters.iter().position(|&w| w == token.serial) {
                waiters.remove(pos);
                return Ok(());
            }
        }
        Err(AffinityError::UnknownToken)
    }

    /// Ends one stream's lease. When it was the binding's last, the binding becomes idle
    /// and expires at `now + lease_ttl_ms` unless acquired again first. Releasing an
    /// orphaned lease (its binding was invalidated) just forgets it.
    pub fn release(&mut self, now: Instant, lease: LeaseId) -> Result<(), AffinityError> {
        self.release_with(now, lease, false)
    }

    /// Ends the lease of a request that was never served (it failed or was withdrawn
    /// before its worker answered). Like [`release`](Self::release), except that it does
    /// not renew the binding: when it was the last lease, the binding's idle deadline
    /// goes back to the one it had when this lease was taken (`now + lease_ttl_ms` if
    /// other leases held it then), so a client retrying a failing session does not keep
    /// the binding alive.
    pub fn release_unserved(&mut self, now: Instant, lease: LeaseId) -> Result<(), AffinityError> {
        self.release_with(now, lease, true)
    }

    fn release_with(&mut self, now: Instant, lease: LeaseId, unserved: bool) -> Result<(), AffinityError> {
        let rec = match self.leases.get_mut(lease.slot as usize) {
            Some(rec) if rec.serial != 0 && rec.serial == lease.serial => rec,
            _ => return Err(AffinityError::UnknownLease),
        };
        let LeaseSlot { slot, entry_serial, prior_idle, .. } = *rec;
        rec.serial = 0;
        self.free_leases.push(lease.slot);
        self.leases_live -= 1;
        let Some(entry) = entry_mut(&mut self.slots, slot).filter(|e| e.serial == entry_serial) else {
            return Ok(());
        };
        if let State::Bound { leases, idle_deadline, .. } = &mut entry.state {
            *leases = leases.saturating_sub(1);
            if *leases == 0 {
                let renewed = now.add_ms(self.cfg.lease_ttl_ms);
                let deadline = if unserved { prior_idle.unwrap_or(renewed) } else { renewed };
                *idle_deadline = Some(deadline);
                self.idle.insert((deadline, entry_serial, slot));
            }
        }
        Ok(())
    }

    /// Drops the binding of (`session`, `phase`) if its revision is `revision`, and says
    /// whether it did. Its leases become orphans (see the type's docs); the next acquire
    /// initializes afresh.
    pub fn invalidate(&mut self, session: &[u8], phase: Phase, revision: u64) -> bool {
        if self.validate(session).is_err() {
            return false;
        }
        let Some(idx) = self.find(self.hash(session, phase), session, phase) else {
            return false;
        };
        match entry_mut(&mut self.slots, idx).map(|e| &e.state) {
            Some(State::Bound { binding, .. }) if binding.revision == revision => {}
            _ => return false,
        }
        self.remove(idx);
        self.stats.invalidations += 1;
        true
    }

    /// Drops every binding to `worker` (it left the fleet) and returns how many. Linear in
    /// the number of slots.
    pub fn invalidate_worker(&mut self, worker: WorkerId) -> usize {
        let mut dropped = 0;
        for idx in 0..self.slots.len() as u32 {
            if let Some(State::Bound { binding, .. }) = entry_mut(&mut self.slots, idx).map(|e| &e.state) {
                if binding.worker == worker {
                    self.remove(idx);
                    dropped += 1;
                }
            }
        }
        self.stats.invalidations += dropped as u64;
        dropped
    }

    /// The binding of (`session`, `phase`), if bound. Changes nothing: no entry is made,
    /// no lease taken, no deadline moved, and a binding past its deadline that
    /// `handle_timeout` has not yet seen is still returned.
    pub fn peek(&self, session: &[u8], phase: Phase) -> Option<Binding> {
        self.validate(session).ok()?;
        let idx = self.find(self.hash(session, phase), session, phase)?;
        match self.slots.get(idx as usize)?.entry.as_ref()?.state {
            State::Bound { binding, .. } => Some(binding),
            State::Initializing { .. } => None,
        }
    }

    /// Counts, per worker, the bindings of `phase` whose last lease was released within
    /// `window_ms` before `now`: sessions between requests, likely to send the next one
    /// soon. `out` is cleared first. Visits only those bindings (the idle set is ordered
    /// by deadline, and a release sets the deadline `lease_ttl_ms` after it).
    pub fn returning(&self, now: Instant, phase: Phase, window_ms: u64, out: &mut Vec<(WorkerId, u32)>) {
        out.clear();
        let since_us =
            now.as_micros().saturating_add(self.cfg.lease_ttl_ms.saturating_sub(window_ms).saturating_mul(1000));
        for &(_, _, idx) in self.idle.range((Instant::from_micros(since_us), 0, 0)..) {
            let Some(Entry { phase: p, state: State::Bound { binding, .. }, .. }) =
                self.slots.get(idx as usize).and_then(|s| s.entry.as_ref())
            else {
                continue;
            };
            if *p != phase {
                continue;
            }
            match out.iter_mut().find(|(w, _)| *w == binding.worker) {
                Some((_, n)) => *n += 1,
                None => out.push((binding.worker, 1)),
            }
        }
    }

    /// When `handle_timeout` next has work: the soonest idle deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.idle.first().map(|&(deadline, _, _)| deadline)
    }

    /// Expires idle bindings whose deadline is at or before `now`, soonest first, at most
    /// [`EXPIRE_PER_CALL_MAX`] per call. Entries with leases are never idle, so never
    /// expire.
    pub fn handle_timeout(&mut self, now: Instant) {
        for _ in 0..EXPIRE_PER_CALL_MAX {
            match self.idle.first() {
                Some(&(deadline, _, idx)) if deadline <= now => self.expire(idx),
                _ => break,
            }
        }
    }

    /// The next thing to report, oldest first.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<AffinityOutput> {
        self.outputs.pop_front()
    }

    /// Entries held, bound or initializing.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Leases not yet released, orphaned ones included.
    pub fn live_leases(&self) -> usize {
        self.leases_live
    }

    /// Counters since creation.
    pub fn stats(&self) -> AffinityStats {
        self.stats
    }

    fn validate(&self, session: &[u8]) -> Result<(), AffinityError> {
        let max = self.cfg.session_id_bytes_max;
        match session.len() {
            0 => Err(AffinityError::SessionIdEmpty),
            bytes if bytes > max => Err(AffinityError::SessionIdTooLong { bytes, max }),
            _ => Ok(()),
        }
    }

    fn hash(&self, session: &[u8], phase: Phase) -> u64 {
        xxh3_64_with_seed(session, self.cfg.hash_seed ^ PHASE_SALT[phase.index()])
    }

    fn find(&self, hash: u64, session: &[u8], phase: Phase) -> Option<u32> {
        let slots = &self.slots;
        let found = self.index.find(hash, |&idx| {
            slots.get(idx as usize).is_some_and(|s| {
                s.entry.as_ref().is_some_and(|e| e.hash == hash && e.phase == phase) && s.key == session
            })
        });
        found.copied()
    }

    /// `Ok(None)` when the entry turned out to be expired and was dropped.
    fn acquire_existing(&mut self, now: Instant, idx: u32) -> Result<Option<Acquire>, AffinityError> {
        let waiters_max = self.cfg.waiters_max_per_session;
        let Some(entry) = entry_mut(&mut self.slots, idx) else {
            return Ok(None);
        };
        let entry_serial = entry.serial;
        let binding = match &mut entry.state {
            State::Initializing { waiters, .. } => {
                if waiters.len() >= waiters_max {
                    return Err(AffinityError::TooManyWaiters { waiters_max_per_session: waiters_max });
                }
                let serial = bump(&mut self.serial);
                waiters.push(serial);
                return Ok(Some(Acquire::Wait(WaitToken { slot: idx, serial })));
            }
            State::Bound { idle_deadline: Some(deadline), .. } if *deadline <= now => {
                self.expire(idx);
                return Ok(None);
            }
            State::Bound { .. } if self.leases_live >= self.cfg.leases_max => {
                return Err(AffinityError::TooManyLeases { leases_max: self.cfg.leases_max });
            }
            State::Bound { binding, leases, idle_deadline, .. } => {
                *leases = leases.saturating_add(1);
                let prior = idle_deadline.take();
                if let Some(deadline) = prior {
                    self.idle.remove(&(deadline, entry_serial, idx));
                }
                (*binding, prior)
            }
        };
        let (binding, prior_idle) = binding;
        let lease = self.alloc_lease(idx, entry_serial, prior_idle);
        Ok(Some(Acquire::Bound { binding, lease }))
    }

    /// Frees one slot if the table is full: expires the soonest idle binding if it is due,
    /// else evicts it; refuses when nothing is idle.
    fn make_room(&mut self, now: Instant) -> Result<(), AffinityError> {
        if self.index.len() < self.cfg.sessions_max {
            return Ok(());
        }
        match self.idle.first() {
            Some(&(deadline, _, idx)) if deadline <= now => self.expire(idx),
            Some(&(_, _, idx)) => {
                if let Some(entry) = self.remove(idx) {
                    self.stats.evictions += 1;
                    self.outputs.push_back(AffinityOutput::Evicted { phase: entry.phase });
                }
            }
            None => {
                self.stats.refusals += 1;
                return Err(AffinityError::TableFull { sessions_max: self.cfg.sessions_max });
            }
        }
        Ok(())
    }

    fn expire(&mut self, idx: u32) {
        if let Some(Entry { phase, state: State::Bound { binding, .. }, .. }) = self.remove(idx) {
            self.stats.expirations += 1;
            self.outputs.push_back(AffinityOutput::Expired { worker: binding.worker, phase });
        }
    }

    /// Stores `entry` under `session` in a free slot; the caller made room.
    fn insert(&mut self, session: &[u8], entry: Entry) -> u32 {
        let hash = entry.hash;
        let idx = match self.free_slots.pop().and_then(|i| self.slots.get_mut(i as usize).map(|s| (i, s))) {
            Some((i, slot)) => {
                slot.key.clear();
                slot.key.extend_from_slice(session);
                slot.entry = Some(entry);
                i
            }
            None => {
                self.slots.push(Slot { key: session.to_vec(), entry: Some(entry) });
                // Fits: there are at most `sessions_max <= u32::MAX` slots.
                (self.slots.len() - 1) as u32
            }
        };
        let slots = &self.slots;
        self.index.insert_unique(hash, idx, |&i| entry_hash(slots, i));
        idx
    }

    /// Takes the entry out of slot `idx` and out of the index and idle set.
    fn remove(&mut self, idx: u32) -> Option<Entry> {
        let entry = self.slots.get_mut(idx as usize)?.entry.take()?;
        if let Ok(found) = self.index.find_entry(entry.hash, |&i| i == idx) {
            found.remove();
        }
        if let State::Bound { idle_deadline: Some(deadline), .. } = entry.state {
            self.idle.remove(&(deadline, entry.serial, idx));
        }
        self.free_slots.push(idx);
        Some(entry)
    }

    fn wake(&mut self, slot: u32, waiters: Vec<u64>) {
        let woken = waiters.into_iter().map(|serial| AffinityOutput::Woken(WaitToken { slot, serial }));
        self.outputs.extend(woken);
    }

    /// Records a lease on the entry (`slot`, `entry_serial`); the caller checked
    /// `leases_max`.
    fn alloc_lease(&mut self, slot: u32, entry_serial: u64, prior_idle: Option<Instant>) -> LeaseId {
        let serial = bump(&mut self.serial);
        let rec = LeaseSlot { serial, slot, entry_serial, prior_idle };
        self.leases_live += 1;
        if let Some(i) = self.free_leases.pop() {
            if let Some(free) = self.leases.get_mut(i as usize) {
                *free = rec;
                return LeaseId { slot: i, serial };
            }
        }
        self.leases.push(rec);
        // Fits: there are at most `leases_max <= u32::MAX` lease slots.
        LeaseId { slot: (self.leases.len() - 1) as u32, serial }
    }
}

fn bump(serial: &mut u64) -> u64 {
    // A u64 bumped a few times per request does not wrap in the life of a process; if it
    // ever did, skipping 0 keeps "0 = free lease slot" true.
    *serial = serial.wrapping_add(1).max(1);
    *serial
}

fn entry_mut(slots: &mut [Slot], idx: u32) -> Option<&mut Entry> {
    slots.get_mut(idx as usize)?.entry.as_mut()
}

fn entry_hash(slots: &[Slot], idx: u32) -> u64 {
    slots.get(idx as usize).and_then(|s| s.entry.as_ref()).map_or(0, |e| e.hash)
}

#[cfg(test)]
impl AffinityTable {
    /// Everything the table holds, for tests that prove a call changed nothing.
    pub(crate) fn fingerprint(&self) -> alloc::string::String {
        alloc::format!("{self:?}")
    }
}
