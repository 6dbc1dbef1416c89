//! Session affinity: which worker a session's requests stick to, and for how long.
//!
//! An [`AffinityTable`] maps a client-supplied session id and a [`Phase`] to a
//! [`Binding`] (a worker and optional dp rank). The first request of a session gets an
//! [`InitToken`] and routes freely; requests arriving while it is in flight wait; once
//! the first dispatch is committed every later request is [`Acquire::Bound`] and holds a
//! lease for as long as its stream lives. A binding with no leases expires `lease_ttl_ms`
//! after its last lease was released. The table is bounded by `sessions_max`: when full it
//! evicts the idle binding due soonest, and refuses with [`AffinityError::TableFull`] when
//! nothing is idle.
//!
//! Several router replicas can share bindings: a binding another replica committed
//! arrives through [`AffinityTable::apply_remote`], and one it invalidated through
//! [`AffinityTable::unbind_remote`]. When two replicas bind the same new session at once,
//! the binding with the lowest [`BindStamp`] (commit time, then replica id) wins
//! everywhere; the losing replica's requests already sent stay where they went, and its
//! next request follows the winner.
//!
//! What it leaves to others: choosing the worker for an [`Acquire::Initialize`]
//! (selection), deciding whether a [`AffinityMode::Soft`] binding's worker is still
//! eligible (the façade does, then calls [`AffinityTable::invalidate`]), holding waiting
//! requests and turning errors into HTTP statuses (the proxy), and sleeping until
//! [`AffinityTable::poll_timeout`] (the adapter).

use core::fmt;

pub(crate) use crate::load::ReplicaId;
use crate::time::Instant;
use crate::types::{DpRank, Phase, WorkerId};

mod table;

pub use table::{AffinityTable, EXPIRE_PER_CALL_MAX};

/// How strongly a binding holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum AffinityMode {
    /// The binding is a pin: the session never moves while its worker is available. A
    /// worker that takes nothing new (ejected, draining, removed, or no longer serving
    /// the phase) has no cache to offer, so the façade re-binds such a session as in soft
    /// mode. A pinned request whose worker is merely busy queues; explicit pins in the
    /// request stay strict.
    #[default]
    Hard,
    /// The binding is a preference, kept only while the worker stays eligible. The table
    /// does not check eligibility; the façade reads [`AffinityTable::mode`], and when a
    /// [`Acquire::Bound`] names a worker it would not pick, releases that lease,
    /// invalidates the binding's revision and acquires again to initialize afresh.
    Soft,
    /// The binding places nothing: the selector weighs the session's worker like any
    /// other, whose cached prefix (and, in `kv` mode, the prefix it would leave behind)
    /// already counts. When another worker wins, the façade releases the binding, so
    /// the session follows its latest request. Concurrent requests of one session still
    /// wait for the first one's placement, as in the other modes.
    Cost,
}

/// Limits and knobs of an [`AffinityTable`].
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct AffinityConfig {
    /// Most (session, phase) entries held at once, bound or initializing. Default 65,536.
    pub sessions_max: usize,
    /// How long a binding with no leases survives, in milliseconds. Default 300,000.
    pub lease_ttl_ms: u64,
    /// Longest accepted session id, in bytes. Default 256.
    pub session_id_bytes_max: usize,
    /// Most requests waiting on one initialization. Default 1,024.
    pub waiters_max_per_session: usize,
    /// Hard pin or soft preference. Default [`AffinityMode::Hard`].
    pub mode: AffinityMode,
    /// Seed of the session-id hash. Session ids come from clients, so the adapter should
    /// draw this from a random source at startup; a known seed lets a client aim its ids
    /// at one hash bucket. Default 0.
    pub hash_seed: u64,
    /// Most leases outstanding at once, orphaned ones included. Default 1,048,576.
    pub leases_max: usize,
    /// This replica, stamped on the bindings it commits. Default `ReplicaId(0)`.
    pub replica: ReplicaId,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        AffinityConfig {
            sessions_max: 65_536,
            lease_ttl_ms: 300_000,
            session_id_bytes_max: 256,
            waiters_max_per_session: 1024,
            mode: AffinityMode::Hard,
            hash_seed: 0,
            leases_max: 1 << 20,
            replica: ReplicaId(0),
        }
    }
}

/// Where a session is bound.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Binding {
    /// The worker serving the session.
    pub worker: WorkerId,
    /// Its dp rank, when the session is bound to one.
    pub rank: Option<DpRank>,
    /// Changes every time a (session, phase) is bound anew; [`AffinityTable::invalidate`]
    /// takes it so a stale caller cannot break a newer binding.
    pub revision: u64,
}

/// When and where a binding was committed. Of two bindings of one session, the lower
/// stamp wins: the earlier commit, and on a tie the lower replica id. (Should two
/// replicas share an id by mistake, equal stamps fall to the lower worker, then rank.)
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct BindStamp {
    /// The commit time, on the clock every replica's adapter maps its own onto.
    pub committed_at: Instant,
    /// The replica that committed it.
    pub replica: ReplicaId,
}

/// A binding another replica committed (or re-announced).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RemoteBinding {
    /// The worker serving the session.
    pub worker: WorkerId,
    /// Its dp rank, when the session is bound to one.
    pub rank: Option<DpRank>,
    /// When and where it was committed.
    pub stamp: BindStamp,
}

/// What [`AffinityTable::apply_remote`] did with another replica's binding.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum RemoteApplied {
    /// The session was unknown here: it is now bound, idle, to the remote's worker.
    Inserted,
    /// The remote binding beat the one held here, which it replaced. Requests already
    /// sent keep their leases; the next acquire gets the remote's worker.
    Replaced,
    /// The binding held here names the same worker; only its stamp may have moved down.
    Same,
    /// A request here is initializing the session; its commit or abort settles which
    /// binding stays.
    Pending,
    /// The binding held here beat the remote one and stays. Announce it again so the
    /// other replica learns it lost.
    Kept(RemoteBinding),
}

/// The right to bind an initializing session: pass it to [`AffinityTable::commit`] or
/// [`AffinityTable::abort`] exactly once.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct InitToken {
    slot: u32,
    serial: u64,
}

/// One stream's hold on a binding: pass it to [`AffinityTable::release`] when the stream
/// ends.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct LeaseId {
    slot: u32,
    serial: u64,
}

/// A request parked behind an initialization; [`AffinityOutput::Woken`] names it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct WaitToken {
    slot: u32,
    serial: u64,
}

/// What [`AffinityTable::acquire`] decided.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Acquire {
    /// First request of the session: route it freely, then commit or abort the token.
    Initialize(InitToken),
    /// Another request is initializing the session: hold this one until
    /// [`AffinityOutput::Woken`] names the token, then acquire again.
    Wait(WaitToken),
    /// The session is bound; the request now holds `lease`.
    Bound {
        /// Where to send the request.
        binding: Binding,
        /// Release it when the request's stream ends.
        lease: LeaseId,
    },
}

/// Why an affinity operation was refused. No variant changes the table.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum AffinityError {
    /// The session id is empty.
    SessionIdEmpty,
    /// The session id is longer than `session_id_bytes_max`.
    SessionIdTooLong {
        /// Its length, in bytes.
        bytes: usize,
        /// The limit, in bytes.
        max: usize,
    },
    /// Every entry is leased or initializing, so none can be evicted.
    TableFull {
        /// The configured limit.
        sessions_max: usize,
    },
    /// The init or wait token was already used, cancelled, or never issued here.
    UnknownToken,
    /// The lease was already released or never issued here.
    UnknownLease,
    /// The initialization already has `waiters_max_per_session` waiters.
    TooManyWaiters {
        /// The configured limit.
        waiters_max_per_session: usize,
    },
    /// `leases_max` leases are outstanding. The token of a refused commit stays valid.
    TooManyLeases {
        /// The configured limit.
        leases_max: usize,
    },
}

impl fmt::Display for AffinityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AffinityError::SessionIdEmpty => f.write_str("session id is empty"),
            AffinityError::SessionIdTooLong { bytes, max } => {
                write!(f, "session id is {bytes} bytes, more than the {max} allowed")
            }
            AffinityError::TableFull { sessions_max } => {
                write!(f, "all {sessions_max} session slots are in use")
            }
            AffinityError::UnknownToken => f.write_str("unknown or already used session token"),
            AffinityError::UnknownLease => f.write_str("unknown or already released session lease"),
            AffinityError::TooManyWaiters { waiters_max_per_session } => {
                write!(f, "{waiters_max_per_session} requests already wait on this session")
            }
            AffinityError::TooManyLeases { leases_max } => {
                write!(f, "all {leases_max} session leases are in use")
            }
        }
    }
}

impl core::error::Error for AffinityError {}

/// Something the table reports; drain with [`AffinityTable::poll_output`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AffinityOutput {
    /// The initialization this request waited on was committed or aborted: acquire again.
    Woken(WaitToken),
    /// An idle binding reached its deadline and was dropped.
    Expired {
        /// The worker it was bound to.
        worker: WorkerId,
        /// Its phase.
        phase: Phase,
    },
    /// An idle binding was dropped before its deadline to make room.
    Evicted {
        /// Its phase.
        phase: Phase,
    },
}

/// Counters since the table was created.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct AffinityStats {
    /// Idle bindings dropped early to make room.
    pub evictions: u64,
    /// Idle bindings dropped at their deadline.
    pub expirations: u64,
    /// Acquires refused with [`AffinityError::TableFull`].
    pub refusals: u64,
    /// Bindings dropped by [`AffinityTable::invalidate`] or
    /// [`AffinityTable::invalidate_worker`].
    pub invalidations: u64,
    /// Other replicas' bindings stored for sessions unknown here.
    pub remote_inserted: u64,
    /// Other replicas' bindings that beat one held or being committed here.
    pub remote_won: u64,
    /// Other replicas' bindings that lost to the one held here.
    pub remote_lost: u64,
    /// Bindings dropped because the replica that committed them invalidated them.
    pub remote_unbound: u64,
    /// Other replicas' bindings not stored because every entry was leased or initializing.
    pub remote_refused: u64,
}

#[cfg(test)]
mod tests;
