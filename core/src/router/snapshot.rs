//! Plain-data views of the router: what adapters export as metrics and admin pages, and
//! what tests compare with their models. Nothing here borrows the router's state
//! machines, so none of their methods is a promise to the router's users.

use alloc::vec::Vec;

use super::{DisaggStats, ReplicaStats, Router, RouterStats};
use crate::affinity::{AffinityStats, Binding};
use crate::index::{IndexStats, OverlapScores};
use crate::learn::LearnStats;
use crate::load::RemoteLoadStats;
use crate::worker::{Health, WorkerSpec};
use crate::{Phase, RequestId, WorkerKey, WorkerLoad};

/// One dp rank of a worker.
#[derive(Clone, Debug, PartialEq)]
pub struct KeySnapshot {
    /// The worker and rank.
    pub key: WorkerKey,
    /// Its in-flight load booked by this router.
    pub load: WorkerLoad,
    /// Its in-flight load other replicas reported.
    pub remote_load: WorkerLoad,
    /// What selection weighs: both summed, a prompt block booked on both sides once.
    pub fleet_load: WorkerLoad,
    /// Blocks the exact prefix index holds for it.
    pub index_entries: u32,
}

/// One worker.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerSnapshot {
    /// Its configuration.
    pub spec: WorkerSpec,
    /// Its health as the router sees it.
    pub health: Health,
    /// Whether it has published KV events (its overlap is exact, not predicted).
    pub publishes_events: bool,
    /// Its routable ranks, in rank order.
    pub keys: Vec<KeySnapshot>,
}

/// The router's sizes and counters at one instant. Cheap: no allocation, and linear only
/// in the replicas heard from.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct RouterCounts {
    /// Requests tracked: booked, dispatched, queued or waiting.
    pub requests_in_flight: usize,
    /// Bookings holding load (booked or dispatched requests).
    pub bookings: usize,
    /// This router's load summed over every worker key.
    pub load_total: WorkerLoad,
    /// Requests in the admission queue.
    pub queue_depth: usize,
    /// Session entries in the affinity table.
    pub affinity_sessions: usize,
    /// Session leases held by running requests.
    pub affinity_live_leases: usize,
    /// Affinity counters.
    pub affinity: AffinityStats,
    /// Prefix index sizes and counters.
    pub index: IndexStats,
    /// Requests other replicas reported in flight.
    pub remote_requests: usize,
    /// Other replicas heard from recently.
    pub remote_replicas: usize,
    /// Remote load counters.
    pub remote: RemoteLoadStats,
    /// Router counters.
    pub router: RouterStats,
    /// Replica counters.
    pub replica: ReplicaStats,
    /// Disaggregation counters.
    pub disagg: DisaggStats,
    /// Worker keys the cost learner holds an entry for.
    pub learned_keys: usize,
    /// Cost learner counters.
    pub learn: LearnStats,
}

/// The whole router at one instant, as plain data: every worker and key, and the counts.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RouterSnapshot {
    /// Every worker, in id order.
    pub workers: Vec<WorkerSnapshot>,
    /// Sizes and counters.
    pub counts: RouterCounts,
}

impl Router {
    /// Every worker and key with its load and index size, and the counts, as plain data.
    /// Linear in the worker keys; clones each worker's spec.
    pub fn snapshot(&self) -> RouterSnapshot {
        let workers = self.workers.iter().map(|(spec, health)| self.worker_snapshot(spec, health)).collect();
        RouterSnapshot { workers, counts: self.counts() }
    }

    /// The router's sizes and counters. No allocation.
    pub fn counts(&self) -> RouterCounts {
        let local = self.load.local();
        let remote = self.load.remote();
        RouterCounts {
            requests_in_flight: self.flights.len(),
            bookings: local.len(),
            load_total: local.total(),
            queue_depth: self.queue.len(),
            affinity_sessions: self.affinity.len(),
            affinity_live_leases: self.affinity.live_leases(),
            affinity: self.affinity.stats(),
            index: self.index.stats(),
            remote_requests: remote.len(),
            remote_replicas: remote.replicas().count(),
            remote: remote.stats(),
            router: self.stats,
            replica: self.replica_stats,
            disagg: self.disagg_stats,
            learned_keys: self.learn.len(),
            learn: self.learn.stats(),
        }
    }

    fn worker_snapshot(&self, spec: &WorkerSpec, health: Health) -> WorkerSnapshot {
        let keys = self
            .workers
            .keys()
            .filter(|k| k.worker == spec.id)
            .map(|key| KeySnapshot {
                key,
                load: self.local_load(key),
                remote_load: self.load.remote().load(key),
                fleet_load: self.load.combined(key),
                index_entries: self.index_entries(key),
            })
            .collect();
        WorkerSnapshot { spec: spec.clone(), health, publishes_events: self.publishes_events(spec.id), keys }
    }

    /// The session's binding for `phase`, if it has one; changes nothing (no lease, no
    /// idle-timer refresh).
    pub fn session_binding(&self, session: &[u8], phase: Phase) -> Option<Binding> {
        self.affinity.peek(session, phase)
    }

    /// The key the request's phase holds load on, while it is booked or dispatched.
    pub fn booking(&self, id: RequestId, phase: Phase) -> Option<WorkerKey> {
        self.load.local().booking(id, phase)
    }

    /// This router's own load on `key` (all zero when it books nothing there). O(1).
    pub fn local_load(&self, key: WorkerKey) -> WorkerLoad {
        self.load.local().load(key)
    }

    /// Blocks the exact prefix index holds for `key`. O(1).
    pub fn index_entries(&self, key: WorkerKey) -> u32 {
        self.index.worker_entries(key)
    }

    /// The exact prefix index's answer for a prompt's `blocks`: each key's overlap, in
    /// `out`, as [`crate::index::PrefixIndex::find_matches`] gives it. With `early_exit`
    /// the walk stops once a single key still matches, whose answer is then a lower
    /// bound. Changes nothing.
    pub fn find_matches(&self, blocks: &[crate::hash::SeqHash], early_exit: bool, out: &mut OverlapScores) {
        self.index.find_matches(blocks, early_exit, out);
    }
}

impl RouterSnapshot {
    /// The view of one worker key; `None` when no registered worker has it.
    pub fn key(&self, key: WorkerKey) -> Option<&KeySnapshot> {
        let w = self.workers.iter().find(|w| w.spec.id == key.worker)?;
        w.keys.iter().find(|k| k.key == key)
    }
}
