//! The driver: the public handle to one router, and its methods (routing, fleet changes,
//! KV events, snapshots). The lock, clock, timer and output delivery are `shared`'s.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use router_core::{
    ApplySummary, Decision, DisaggPlan, DisaggStats, Draw, EngineLoad, Health, IndexEvent, Instant, LearnError,
    Learned, Request, RequestId, Routed, Router, RouterConfig, RouterSnapshot, Taint, WorkerId, WorkerKey, WorkerSpec,
    WorkerUpdate,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::booking::{Booking, Pending};
use crate::error::DriveError;
use crate::shared::{self, Inner, Shared};
use crate::snapshot::{DriverStats, Snapshot};

/// How to build a [`Driver`].
#[derive(Clone, Debug, Default)]
pub struct DriverConfig {
    /// The router's configuration.
    pub router: RouterConfig,
    /// Seed of the draws [`Driver::draw`] hands out (default 0). Give each process a
    /// different one; a fixed one makes a run reproducible.
    pub draw_seed: u64,
}

/// A cloneable handle to one router, its clock and its timer. See the crate docs.
///
/// Every method takes the router's lock for one short synchronous section; none awaits
/// while holding it. Creating a driver spawns its timer task, so it needs a tokio
/// runtime; the task ends when the last `Driver` clone is dropped.
#[derive(Clone)]
pub struct Driver {
    pub(crate) shared: Arc<Shared>,
    _timer: Arc<TimerGuard>,
}

struct TimerGuard(JoinHandle<()>);

impl Drop for TimerGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Driver {
    /// A driver over a new router. Must be called inside a tokio runtime.
    pub fn new(cfg: DriverConfig) -> Self {
        let shared = Arc::new(Shared::new(Router::new(cfg.router), cfg.draw_seed));
        let timer = tokio::spawn(shared::run_timer(shared.clone()));
        Driver { shared, _timer: Arc::new(TimerGuard(timer)) }
    }

    /// The core's current time: microseconds since the driver was created.
    pub fn now(&self) -> Instant {
        self.shared.now()
    }

    /// A request id no other call of this driver has returned.
    pub fn next_request_id(&self) -> RequestId {
        RequestId(self.shared.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// A fresh draw from the driver's seeded sequence.
    pub fn draw(&self) -> Draw {
        let mut d = Draw(self.shared.draws.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed));
        Draw(d.next_u64())
    }

    /// Routes one phase of a request, waiting in the admission queue or behind a session's
    /// first request as long as the router says, and returns the booking.
    ///
    /// `request.id` with its phase must be unique among requests in flight (use
    /// [`Driver::next_request_id`]); `request.preview` is ignored (see
    /// [`Driver::preview`]). Dropping the returned future releases the queue slot or the
    /// session wait; dropping the [`Booking`] releases the load and lease.
    pub async fn route(&self, mut request: Request, draw: Draw) -> Result<Booking, DriveError> {
        request.preview = false;
        let key = (request.id, request.phase.0);
        let isl_tokens = request.isl_tokens;
        let (decision, rx) = self.shared.with(|inner, now| match inner.router.handle_request(now, request, draw) {
            Ok(d @ (Decision::Queued | Decision::Waiting)) => {
                let (tx, rx) = oneshot::channel();
                inner.waiters.insert(key, tx);
                (Ok(d), Some(rx))
            }
            other => (other, None),
        });
        match decision {
            Ok(Decision::Routed(r)) => Ok(Booking::new(self.shared.clone(), r, false, isl_tokens)),
            Ok(Decision::Rejected(rej)) => Err(DriveError::Rejected(rej)),
            Err(e) => Err(DriveError::Route(e)),
            Ok(_) => match rx {
                Some(rx) => Pending::new(self.shared.clone(), key, rx, isl_tokens).wait().await,
                None => Err(DriveError::Closed),
            },
        }
    }

    /// The decision the router would make now, with its per-worker explanation. Changes
    /// no state at all.
    pub fn preview(&self, mut request: Request, draw: Draw) -> Result<Routed, DriveError> {
        request.preview = true;
        self.shared.with(|inner, now| match inner.router.handle_request(now, request, draw) {
            Ok(Decision::Routed(r)) => Ok(r),
            Ok(Decision::Rejected(rej)) => Err(DriveError::Rejected(rej)),
            Ok(_) => Err(DriveError::Closed),
            Err(e) => Err(DriveError::Route(e)),
        })
    }

    /// Whether a request runs split across a prefill and a decode worker, or aggregated
    /// on a decode worker, and why; the outcome is counted in [`Driver::disagg_stats`].
    /// Books nothing: route the phases the plan names with [`Driver::route`].
    pub fn plan_disagg(&self, request: &Request) -> DisaggPlan {
        self.shared.with(|inner, _| inner.router.plan_disagg(request))
    }

    /// [`Driver::plan_disagg`] without counting it (for previews).
    pub fn plan_disagg_query(&self, request: &Request) -> DisaggPlan {
        self.shared.with(|inner, _| inner.router.plan_disagg_query(request))
    }

    /// The router's split and bypass counters.
    pub fn disagg_stats(&self) -> DisaggStats {
        self.with_router(|r| r.disagg_stats())
    }

    /// Applies a fleet change. Removing a worker re-routes nothing in flight: its
    /// bookings stay with their holders, who should fail or finish them.
    pub fn update_worker(&self, update: WorkerUpdate) -> Result<(), DriveError> {
        self.shared.with(|inner, now| inner.router.handle_worker_update(now, update)).map_err(DriveError::Input)
    }

    /// Adds a worker or changes its configuration.
    pub fn upsert_worker(&self, spec: WorkerSpec) -> Result<(), DriveError> {
        self.update_worker(WorkerUpdate::Upsert(spec))
    }

    /// Removes a worker: its index entries, load and session bindings go.
    pub fn remove_worker(&self, id: WorkerId) -> Result<(), DriveError> {
        self.update_worker(WorkerUpdate::Removed(id))
    }

    /// Sets a worker's health (ejection, draining, recovery).
    pub fn set_health(&self, id: WorkerId, health: Health) -> Result<(), DriveError> {
        self.update_worker(WorkerUpdate::Health(id, health))
    }

    /// Replaces a worker's taints.
    pub fn set_taints(&self, id: WorkerId, taints: Vec<Taint>) -> Result<(), DriveError> {
        self.update_worker(WorkerUpdate::Taints(id, taints))
    }

    /// Applies one KV event published by `key`'s worker.
    pub fn apply_kv_event(&self, key: WorkerKey, event: IndexEvent<'_>) -> Result<ApplySummary, DriveError> {
        self.shared.with(|inner, now| inner.router.handle_kv_event(now, key, event)).map_err(DriveError::Input)
    }

    /// Forgets everything the index holds for `key` (its worker restarted, or its event
    /// stream could not be replayed).
    pub fn clear_kv(&self, key: WorkerKey) {
        self.shared.with(|inner, _| inner.router.handle_kv_clear(key))
    }

    /// Trusts or distrusts `key`'s overlap while its event stream has a gap.
    pub fn set_overlap_trust(&self, key: WorkerKey, trusted: bool) {
        self.shared.with(|inner, _| inner.router.handle_overlap_trust(key, trusted))
    }

    /// Says whether `id`'s engine tokenizes as the router does; one that does not is
    /// routed on predictions as well as its events until it agrees again.
    pub fn set_worker_tokens(&self, id: WorkerId, agrees: bool) {
        self.shared.with(|inner, _| inner.router.handle_worker_tokens(id, agrees))
    }

    /// Everything `/workers` and `/metrics` show. Linear in the number of worker keys.
    pub fn snapshot(&self) -> Snapshot {
        self.shared.with(|inner, _| snapshot(inner))
    }

    /// Read-only access to the router, under the lock. Keep `f` short.
    pub fn with_router<R>(&self, f: impl FnOnce(&Router) -> R) -> R {
        self.shared.with(|inner, _| f(&inner.router))
    }

    /// Hands the router the load `key`'s engine reports about itself.
    pub fn engine_load(&self, key: WorkerKey, load: EngineLoad) -> Result<(), LearnError> {
        self.shared.with(|inner, now| inner.router.handle_engine_load(now, key, load))
    }

    /// What the router's cost learner knows about `key` now.
    pub fn learned(&self, key: WorkerKey) -> Option<Learned> {
        self.shared.with(|inner, now| inner.router.learned(now, key))
    }

    /// The router's invariants, for tests and debugging. Linear in requests in flight.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.with_router(|r| r.check_invariants().map_err(|v| v.0))
    }
}

fn snapshot(inner: &Inner) -> Snapshot {
    let RouterSnapshot { workers, counts, .. } = inner.router.snapshot();
    Snapshot {
        workers,
        queue_depth: counts.queue_depth,
        requests_in_flight: counts.requests_in_flight,
        affinity_sessions: counts.affinity_sessions,
        affinity_live_leases: counts.affinity_live_leases,
        affinity: counts.affinity,
        router: counts.router,
        index: counts.index,
        load_total: counts.load_total,
        remote_requests: counts.remote_requests,
        remote_replicas: counts.remote_replicas,
        remote: counts.remote,
        replica: counts.replica,
        driver: DriverStats { waiters: inner.waiters.len(), ..inner.stats },
    }
}
