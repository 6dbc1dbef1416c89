//! Point-in-time views of the router for admin endpoints and metrics.

use router_core::{AffinityStats, IndexStats, RemoteLoadStats, ReplicaStats, RouterStats, WorkerLoad};

/// One worker and one of its dp ranks, as the core reports them.
pub use router_core::{KeySnapshot, WorkerSnapshot};

/// The driver's own counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Requests awaiting an output now (queued or behind a session initialization).
    pub waiters: usize,
    /// Outputs whose waiter had gone; routed ones were rolled back.
    pub undelivered: u64,
    /// Idle session bindings that expired.
    pub leases_expired: u64,
    /// Bookings dropped by the router for age.
    pub bookings_expired: u64,
    /// Times the timer task ran `handle_timeout`.
    pub timeouts_fired: u64,
    /// Updates for other replicas dropped because the sink was full or closed.
    pub replica_updates_dropped: u64,
}

/// The whole router at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Every worker, in id order.
    pub workers: Vec<WorkerSnapshot>,
    /// Requests in the admission queue.
    pub queue_depth: usize,
    /// Requests tracked: booked, dispatched, queued or waiting.
    pub requests_in_flight: usize,
    /// Session entries in the affinity table.
    pub affinity_sessions: usize,
    /// Session leases held by running requests.
    pub affinity_live_leases: usize,
    /// Affinity counters.
    pub affinity: AffinityStats,
    /// Router counters.
    pub router: RouterStats,
    /// Prefix index sizes and counters.
    pub index: IndexStats,
    /// Load summed over every worker key.
    pub load_total: WorkerLoad,
    /// Requests other replicas reported in flight.
    pub remote_requests: usize,
    /// Other replicas heard from recently.
    pub remote_replicas: usize,
    /// Remote load counters.
    pub remote: RemoteLoadStats,
    /// Replica counters of the router.
    pub replica: ReplicaStats,
    /// The driver's counters.
    pub driver: DriverStats,
}
