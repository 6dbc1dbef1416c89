//! Replicas: the façade's side of sharing in-flight load and session bindings with other
//! router replicas that front the same fleet.
//!
//! Each replica follows the workers' KV events itself, so the prefix index is never
//! shared. What is shared is what only the router that made a decision knows:
//!
//! * **Load.** Every booking made here is announced ([`ReplicaUpdate::Added`]), and so
//!   are its prefill's end and its own end. Other replicas' announcements go into a
//!   [`RemoteLoad`] table, kept apart from the local [`crate::load::LoadTracker`];
//!   eligibility and selection weigh the sum of both.
//! * **Session bindings.** A binding committed here is announced
//!   ([`ReplicaUpdate::Bound`]), and so is its invalidation (a worker failed it, or it no
//!   longer fits). Other replicas' bindings go into the affinity table, where the lowest
//!   [`BindStamp`] wins (see [`crate::affinity`]).
//!
//! # Calling contract
//!
//! With [`ReplicaConfig::id`] set, after every input (including the remote ones below
//! and `handle_timeout`) drain [`Router::poll_replica_update`] until `None` and hand each
//! update to the transport, fire-and-forget; the queue is bounded by `updates_max` and
//! drops its oldest update when full. Feed other replicas' updates to
//! [`Router::handle_replica_update`] with the sender's id, their heartbeats to
//! [`Router::handle_replica_heartbeat`], and a sender's restart or goodbye to
//! [`Router::handle_replica_gone`]. Then drain `poll_output` as after any input, since
//! freed remote load can release queued requests.
//!
//! Stamps carry commit times: the adapter maps this router's `now` onto a clock all
//! replicas share (wall time) when it publishes, and back when it receives.
//!
//! Without an id the router is alone: it queues no updates and refuses remote ones with
//! [`ReplicaError::Disabled`].

use alloc::vec::Vec;
use core::fmt;

use super::{FlightKey, Router};
use crate::affinity::{AffinityError, BindStamp, RemoteApplied, RemoteBinding};
use crate::hash::SeqHash;
use crate::load::{RemoteLoadConfig, RemoteLoadError, ReplicaId};
use crate::{DpRank, Instant, Phase, RequestId, WorkerId, WorkerKey, WorkerLoad};

/// How this router shares state with other replicas.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// This replica's id; `None` (default) makes a lone router.
    pub id: Option<ReplicaId>,
    /// Limits of the table of other replicas' load.
    pub remote: RemoteLoadConfig,
    /// Updates queued for [`Router::poll_replica_update`]; when full the oldest is
    /// dropped and counted. Default 65,536.
    pub updates_max: usize,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        ReplicaConfig { id: None, remote: RemoteLoadConfig::default(), updates_max: 65_536 }
    }
}

/// Something one replica tells the others. The same type goes both ways: drained from
/// [`Router::poll_replica_update`] here, fed to [`Router::handle_replica_update`] there.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplicaUpdate {
    /// A request was booked on `key`.
    Added {
        /// The sender's request id.
        id: RequestId,
        /// Its phase.
        phase: Phase,
        /// Where it went.
        key: WorkerKey,
        /// Uncached prompt tokens it adds until its prefill is done.
        prefill_tokens: u32,
        /// Its prompt's full-block sequence hashes: decode blocks on `key` until it
        /// finishes, and a prefix on its way into that worker's cache.
        blocks: Vec<SeqHash>,
        /// Its predicted output, in blocks.
        output_blocks: u32,
    },
    /// The request's prefill is done.
    PrefillDone {
        /// The sender's request id.
        id: RequestId,
        /// Its phase.
        phase: Phase,
    },
    /// The request ended, however it ended.
    Finished {
        /// The sender's request id.
        id: RequestId,
        /// Its phase.
        phase: Phase,
    },
    /// A session is bound (committed by `stamp.replica`, possibly announced again by
    /// another replica that holds it).
    Bound {
        /// The session id.
        session: Vec<u8>,
        /// Its phase.
        phase: Phase,
        /// Its worker.
        worker: WorkerId,
        /// Its dp rank, when bound to one.
        rank: Option<DpRank>,
        /// When and where it was committed.
        stamp: BindStamp,
    },
    /// The binding stamped `stamp` was invalidated; a newer one survives.
    Unbound {
        /// The session id.
        session: Vec<u8>,
        /// Its phase.
        phase: Phase,
        /// The stamp of the binding dropped.
        stamp: BindStamp,
    },
}

/// Why a remote input changed nothing (beyond counting it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplicaError {
    /// This router has no replica id, so it shares nothing.
    Disabled,
    /// The update names this replica as its sender (a transport echo).
    OwnReplica,
    /// The remote load table refused it.
    Load(RemoteLoadError),
    /// The affinity table refused the binding (bad session id, or full of live sessions).
    Affinity(AffinityError),
}

impl fmt::Display for ReplicaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplicaError::Disabled => f.write_str("this router has no replica id"),
            ReplicaError::OwnReplica => f.write_str("update from this replica itself"),
            ReplicaError::Load(e) => write!(f, "remote load: {e}"),
            ReplicaError::Affinity(e) => write!(f, "remote binding: {e}"),
        }
    }
}

/// The wrapped error of a variant that wraps one is its source.
impl core::error::Error for ReplicaError {
    fn source(&self) -> Option<&(dyn core::error::Error + 'static)> {
        match self {
            ReplicaError::Load(e) => Some(e),
            ReplicaError::Affinity(e) => Some(e),
            _ => None,
        }
    }
}

/// Counters of the replica side, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplicaStats {
    /// Updates queued for other replicas.
    pub updates_queued: u64,
    /// Updates dropped because nobody drained `poll_replica_update` in time.
    pub updates_dropped: u64,
    /// Remote updates applied.
    pub remote_applied: u64,
    /// Remote updates refused (see [`ReplicaError`]).
    pub remote_refused: u64,
}

impl Router {
    /// Applies another replica's update. `from` is the sender; any update counts as a
    /// sign of its life, as a heartbeat does.
    pub fn handle_replica_update(
        &mut self,
        now: Instant,
        from: ReplicaId,
        update: ReplicaUpdate,
    ) -> Result<(), ReplicaError> {
        let out = self.apply_replica_update(now, from, update);
        match out {
            Ok(()) => self.replica_stats.remote_applied += 1,
            Err(_) => self.replica_stats.remote_refused += 1,
        }
        self.drain_affinity(now);
        self.drain_queue(now);
        out
    }

    /// Another replica is alive. Without this (or any update) for
    /// `replica_silence_max_ms`, its load is dropped.
    pub fn handle_replica_heartbeat(&mut self, now: Instant, from: ReplicaId) -> Result<(), ReplicaError> {
        self.check_sender(from)?;
        self.load.heartbeat(now, from).map_err(ReplicaError::Load)
    }

    /// Another replica restarted or left: everything it reported is dropped at once.
    /// Returns how many of its requests went. Linear in them.
    pub fn handle_replica_gone(&mut self, now: Instant, from: ReplicaId) -> Result<usize, ReplicaError> {
        self.check_sender(from)?;
        let n = self.load.remove_replica(from);
        self.drain_queue(now);
        Ok(n)
    }

    /// The next update for other replicas. Drain until `None` after every input.
    #[must_use]
    pub fn poll_replica_update(&mut self) -> Option<ReplicaUpdate> {
        self.replica_out.pop_front()
    }

    /// Replica counters.
    pub fn replica_stats(&self) -> ReplicaStats {
        self.replica_stats
    }

    /// Local plus remote load on `key`: what eligibility and selection weigh.
    pub fn combined_load(&self, key: WorkerKey) -> WorkerLoad {
        self.load.combined(key)
    }

    fn check_sender(&self, from: ReplicaId) -> Result<(), ReplicaError> {
        match self.cfg.replica.id {
            None => Err(ReplicaError::Disabled),
            Some(me) if me == from => Err(ReplicaError::OwnReplica),
            Some(_) => Ok(()),
        }
    }

    fn apply_replica_update(&mut self, now: Instant, from: ReplicaId, u: ReplicaUpdate) -> Result<(), ReplicaError> {
        self.check_sender(from)?;
        let load = |e: Result<(), RemoteLoadError>| e.map_err(ReplicaError::Load);
        match u {
            ReplicaUpdate::Added { id, phase, key, prefill_tokens, blocks, output_blocks } => {
                load(self.load.add_remote(now, from, id, phase, key, prefill_tokens, &blocks, output_blocks))
            }
            ReplicaUpdate::PrefillDone { id, phase } => load(self.load.remote_prefill_done(now, from, id, phase)),
            ReplicaUpdate::Finished { id, phase } => load(self.load.remote_finish(now, from, id, phase)),
            ReplicaUpdate::Bound { session, phase, worker, rank, stamp } => {
                // A binding is a sign of life too, but it is stored even from a replica
                // the load table has no room for.
                let _ = self.load.heartbeat(now, from);
                let remote = RemoteBinding { worker, rank, stamp };
                match self.affinity.apply_remote(now, &session, phase, remote) {
                    Ok(RemoteApplied::Kept(b)) => {
                        let (worker, rank, stamp) = (b.worker, b.rank, b.stamp);
                        self.publish(ReplicaUpdate::Bound { session, phase, worker, rank, stamp });
                        Ok(())
                    }
                    Ok(_) => Ok(()),
                    Err(e) => Err(ReplicaError::Affinity(e)),
                }
            }
            ReplicaUpdate::Unbound { session, phase, stamp } => {
                // As for `Bound`: refused only when the load table has no room for the
                // sender, and the unbinding applies all the same.
                let _ = self.load.heartbeat(now, from);
                self.affinity.unbind_remote(&session, phase, stamp);
                Ok(())
            }
        }
    }

    /// Queues an update for other replicas, if this router has any.
    pub(super) fn publish(&mut self, u: ReplicaUpdate) {
        if self.cfg.replica.id.is_none() {
            return;
        }
        if self.replica_out.len() >= self.cfg.replica.updates_max {
            self.replica_out.pop_front();
            self.replica_stats.updates_dropped += 1;
        }
        self.replica_out.push_back(u);
        self.replica_stats.updates_queued += 1;
    }

    /// Announces the booking just made of flight `fk` on `key`.
    pub(super) fn publish_added(&mut self, fk: FlightKey, key: WorkerKey, prefill_tokens: u32, output: u32) {
        if self.cfg.replica.id.is_none() {
            return; // Spare the copy of the prompt's blocks.
        }
        let blocks = self.flights.get(&fk).map(|f| f.req.blocks.clone()).unwrap_or_default();
        let FlightKey { id, phase } = fk;
        self.publish(ReplicaUpdate::Added { id, phase, key, prefill_tokens, blocks, output_blocks: output });
    }

    /// For a request of prompt `blocks` on `key`: the decode blocks it would add (those
    /// no booking here or elsewhere holds) and the leading blocks a booking here or
    /// elsewhere is already bringing into the worker's cache.
    ///
    /// A prompt's blocks held on a key by either side are a leading run (sequence hashes
    /// chain), so the union of both sides' is the longer run: the new blocks are those
    /// past it, each counted once, matching [`crate::load::RemoteLoad::combined`], which counts a
    /// block held on both sides once.
    pub(super) fn inflight_blocks(&self, key: WorkerKey, blocks: &[SeqHash]) -> (u32, u32) {
        let remote = self.load.remote().held_prefix(key, blocks);
        let fresh = self.load.local().new_blocks_chain(key, blocks);
        let len = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
        (fresh.min(len.saturating_sub(remote)), self.load.local().held_prefix(key, blocks).max(remote))
    }

    /// Announces the end of a booking's prefill if the tracker still counts it; call
    /// before telling the tracker.
    pub(super) fn publish_prefill_done(&mut self, id: RequestId, phase: Phase) {
        if self.load.local().prefilling(id, phase) {
            self.publish(ReplicaUpdate::PrefillDone { id, phase });
        }
    }

    /// Announces the binding of the flight's session just committed here, unless another
    /// replica's earlier binding won the commit (that one was announced by its owner).
    pub(super) fn publish_commit(&mut self, fk: FlightKey) {
        let Some(me) = self.cfg.replica.id else { return };
        let Some(session) = self.flights.get(&fk).and_then(|f| f.req.session.clone()) else { return };
        let (Some(b), Some(stamp)) = (self.affinity.peek(&session, fk.phase), self.affinity.stamp(&session, fk.phase))
        else {
            return;
        };
        if stamp.replica == me {
            self.publish(ReplicaUpdate::Bound { session, phase: fk.phase, worker: b.worker, rank: b.rank, stamp });
        }
    }

    /// Invalidates the session's binding taken at `revision` and announces it.
    pub(super) fn invalidate_session(&mut self, session: &[u8], phase: Phase, revision: u64) {
        let stamp = self.affinity.stamp(session, phase);
        if self.affinity.invalidate(session, phase, revision) {
            self.unbound = true;
            if let Some(stamp) = stamp {
                self.publish(ReplicaUpdate::Unbound { session: session.to_vec(), phase, stamp });
            }
        }
    }
}

#[cfg(test)]
mod tests;
