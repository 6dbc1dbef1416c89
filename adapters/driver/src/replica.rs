//! The driver's replica side: handing the router's updates to a sink, applying other
//! replicas' updates, and mapping the router's clock to wall time and back.

use router_core::{Instant, ReplicaId, ReplicaUpdate};
use tokio::sync::mpsc;

use crate::driver::Driver;
use crate::error::DriveError;

impl Driver {
    /// Sends the router's updates for other replicas to `sink` from now on. Sending
    /// never waits: when `sink` is full or closed an update is dropped and counted in
    /// [`crate::DriverStats::replica_updates_dropped`] (updates are fire-and-forget, and
    /// other replicas expire what they miss).
    pub fn set_replica_sink(&self, sink: mpsc::Sender<ReplicaUpdate>) {
        self.shared.with(|inner, _| inner.replica_sink = Some(sink));
    }

    /// Applies an update other replica `from` published.
    pub fn apply_replica_update(&self, from: ReplicaId, update: ReplicaUpdate) -> Result<(), DriveError> {
        self.shared
            .with(|inner, now| inner.router.handle_replica_update(now, from, update))
            .map_err(DriveError::Replica)
    }

    /// Other replica `from` is alive.
    pub fn replica_heartbeat(&self, from: ReplicaId) -> Result<(), DriveError> {
        self.shared.with(|inner, now| inner.router.handle_replica_heartbeat(now, from)).map_err(DriveError::Replica)
    }

    /// Other replica `from` restarted or left: drops what it reported; returns how many
    /// of its requests went.
    pub fn replica_gone(&self, from: ReplicaId) -> Result<usize, DriveError> {
        self.shared.with(|inner, now| inner.router.handle_replica_gone(now, from)).map_err(DriveError::Replica)
    }

    /// Wall-clock microseconds since the Unix epoch at the router's instant `t`, on this
    /// process's clock. Publish stamps in this form.
    pub fn unix_us(&self, t: Instant) -> u64 {
        self.shared.start_unix_us.saturating_add(t.as_micros())
    }

    /// The router's instant at wall-clock `unix_us`. A time before this driver started
    /// maps to the router's epoch, so two such stamps compare by replica id alone.
    pub fn instant_at_unix_us(&self, unix_us: u64) -> Instant {
        Instant::from_micros(unix_us.saturating_sub(self.shared.start_unix_us))
    }
}
