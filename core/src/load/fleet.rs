//! The fleet's load: this replica's bookings and other replicas' entries behind one
//! owner.
//!
//! [`RemoteLoad::combined`] counts a prompt block that both sides hold on a key once, and
//! stays O(1) per key only if the remote table hears of every block the local bookings
//! start or stop holding. [`FleetLoad`] owns both tables, so every change to the local
//! side goes through the one path that tells the remote side; no caller has to remember
//! to. Reads go to [`FleetLoad::local`], [`FleetLoad::remote`] or the combined views.
//!
//! Calling order: feed inputs, drain [`FleetLoad::poll_expired`] until `None`, sleep
//! until [`FleetLoad::poll_timeout`] and call [`FleetLoad::handle_timeout`].

use alloc::string::String;

use super::{
    LoadConfig, LoadError, LoadTracker, PrefillProgress, RemoteLoad, RemoteLoadConfig, RemoteLoadError, ReplicaId,
};
use crate::hash::{BlockSize, SeqHash};
use crate::time::Instant;
use crate::types::{Phase, RequestId, WorkerId, WorkerKey, WorkerLoad};

/// Local bookings and remote entries, kept consistent. See the [module docs](self).
pub(crate) struct FleetLoad {
    local: LoadTracker,
    remote: RemoteLoad,
}

impl FleetLoad {
    /// Empty tables.
    pub(crate) fn new(local: LoadConfig, remote: RemoteLoadConfig) -> Self {
        FleetLoad { local: LoadTracker::new(local), remote: RemoteLoad::new(remote) }
    }

    // ---- getters ----

    /// This replica's bookings.
    pub(crate) fn local(&self) -> &LoadTracker {
        &self.local
    }

    /// Other replicas' entries.
    pub(crate) fn remote(&self) -> &RemoteLoad {
        &self.remote
    }

    /// The whole fleet's load on `key`, a block held on both sides counted once. O(1).
    pub(crate) fn combined(&self, key: WorkerKey) -> WorkerLoad {
        self.remote.combined(key, self.local.load(key))
    }

    /// The whole fleet's prefill backlog on `key`. O(1).
    pub(crate) fn combined_progress(&self, key: WorkerKey) -> PrefillProgress {
        self.remote.combined_progress(key, self.local.prefill_progress(key))
    }

    // ---- local inputs ----

    /// Books a local request: [`LoadTracker::add`], telling the remote side which blocks
    /// the key's local bookings start to hold.
    #[allow(clippy::too_many_arguments)] // Mirrors the booking's fields one to one.
    pub(crate) fn add(
        &mut self,
        now: Instant,
        req: RequestId,
        phase: Phase,
        key: WorkerKey,
        blocks: &[SeqHash],
        prefill_tokens: u32,
        expected_output_blocks: u32,
    ) -> Result<(), LoadError> {
        let remote = &mut self.remote;
        self.local.add_with_remote(now, req, phase, key, blocks, prefill_tokens, expected_output_blocks, remote)
    }

    /// [`LoadTracker::prefill_done`].
    pub(crate) fn prefill_done(&mut self, req: RequestId, phase: Phase) -> Result<(), LoadError> {
        self.local.prefill_done(req, phase)
    }

    /// [`LoadTracker::decode_progress`].
    pub(crate) fn decode_progress(
        &mut self,
        req: RequestId,
        phase: Phase,
        output_tokens: u32,
        block_size: BlockSize,
    ) -> Result<(), LoadError> {
        self.local.decode_progress(req, phase, output_tokens, block_size)
    }

    /// Ends a local booking: [`LoadTracker::free`], telling the remote side which blocks
    /// no local booking holds any more.
    pub(crate) fn free(&mut self, req: RequestId, phase: Phase) -> Result<(), LoadError> {
        self.local.free_with_remote(req, phase, &mut self.remote)
    }

    /// Drops everything on any rank of `worker`, on both sides, and returns how many
    /// local bookings went. Linear in the bookings and entries.
    pub(crate) fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let n = self.local.remove_worker_with_remote(worker, &mut self.remote);
        self.remote.remove_worker(worker);
        n
    }

    // ---- remote inputs ----

    /// [`RemoteLoad::heartbeat`].
    pub(crate) fn heartbeat(&mut self, now: Instant, replica: ReplicaId) -> Result<(), RemoteLoadError> {
        self.remote.heartbeat(now, replica)
    }

    /// [`RemoteLoad::add`], looking shared blocks up in the local bookings.
    #[allow(clippy::too_many_arguments)] // One entry's fields, one to one.
    pub(crate) fn add_remote(
        &mut self,
        now: Instant,
        replica: ReplicaId,
        req: RequestId,
        phase: Phase,
        key: WorkerKey,
        prefill_tokens: u32,
        blocks: &[SeqHash],
        output_blocks: u32,
    ) -> Result<(), RemoteLoadError> {
        self.remote.add(now, replica, req, phase, key, prefill_tokens, blocks, output_blocks, &self.local)
    }

    /// [`RemoteLoad::prefill_done`].
    pub(crate) fn remote_prefill_done(
        &mut self,
        now: Instant,
        replica: ReplicaId,
        req: RequestId,
        phase: Phase,
    ) -> Result<(), RemoteLoadError> {
        self.remote.prefill_done(now, replica, req, phase)
    }

    /// [`RemoteLoad::finish`].
    pub(crate) fn remote_finish(
        &mut self,
        now: Instant,
        replica: ReplicaId,
        req: RequestId,
        phase: Phase,
    ) -> Result<(), RemoteLoadError> {
        self.remote.finish(now, replica, req, phase)
    }

    /// [`RemoteLoad::remove_replica`].
    pub(crate) fn remove_replica(&mut self, replica: ReplicaId) -> usize {
        self.remote.remove_replica(replica)
    }

    // ---- time ----

    /// Expires due local bookings (reported by [`Self::poll_expired`]) and due remote
    /// entries and replicas, each side bounded per call as its own `handle_timeout` is.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        self.local.handle_timeout_with_remote(now, &mut self.remote);
        self.remote.handle_timeout(now);
    }

    /// The next local booking dropped for age. Drain until `None`.
    #[must_use]
    pub(crate) fn poll_expired(&mut self) -> Option<(RequestId, Phase)> {
        self.local.poll_expired()
    }

    /// The earlier of both sides' next deadlines.
    #[must_use]
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        [self.local.poll_timeout(), self.remote.poll_timeout()].into_iter().flatten().min()
    }

    /// Recomputes the remote sums and the shared-block marks; a difference is a bug.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.remote.check()?;
        self.remote.check_shared(&self.local)
    }
}
