//! The driver: the router behind a mutex, the clock, the timer task and output delivery.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use router_core::{
    ApplySummary, Decision, DisaggPlan, DisaggStats, DispatchFailure, Draw, EngineLoad, Health, IndexEvent, Instant,
    LearnError, Learned, Output, Phase, ReplicaUpdate, Request, RequestId, Routed, Router, RouterConfig,
    RouterSnapshot, Taint, WorkerId, WorkerKey, WorkerSpec, WorkerUpdate,
};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant as TokioInstant;

use crate::booking::{Booking, Pending};
use crate::error::DriveError;
use crate::snapshot::{DriverStats, Snapshot};

pub(crate) type FlightKey = (RequestId, Phase);

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

pub(crate) struct Shared {
    inner: Mutex<Inner>,
    notify: Notify,
    start: TokioInstant,
    /// Wall-clock microseconds since the Unix epoch when `start` was taken.
    pub(crate) start_unix_us: u64,
    next_id: AtomicU64,
    draws: AtomicU64,
}

pub(crate) struct Inner {
    pub(crate) router: Router,
    pub(crate) waiters: BTreeMap<FlightKey, oneshot::Sender<Output>>,
    /// The deadline the timer task last slept towards.
    armed: Option<Instant>,
    pub(crate) stats: DriverStats,
    pub(crate) replica_sink: Option<mpsc::Sender<ReplicaUpdate>>,
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
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                router: Router::new(cfg.router),
                waiters: BTreeMap::new(),
                armed: None,
                stats: DriverStats::default(),
                replica_sink: None,
            }),
            notify: Notify::new(),
            start: TokioInstant::now(),
            start_unix_us: crate::replica::unix_now_us(),
            next_id: AtomicU64::new(1),
            draws: AtomicU64::new(cfg.draw_seed),
        });
        let timer = tokio::spawn(run_timer(shared.clone()));
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

impl Shared {
    pub(crate) fn now(&self) -> Instant {
        let us = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX);
        Instant::from_micros(us)
    }

    /// Runs `f` on the router under the lock, then drains outputs and wakes the timer if
    /// the next deadline moved earlier.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Inner, Instant) -> R) -> R {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        // Read the clock under the lock so that inputs reach the router in time order.
        let now = self.now();
        let r = f(&mut g, now);
        g.drain(now);
        let wake = g.rearm();
        drop(g);
        if wake {
            self.notify.notify_one();
        }
        r
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Inner {
    /// Hands every output to its waiter. A routed output nobody awaits any more is rolled
    /// back at once, so its load never lingers.
    fn drain(&mut self, now: Instant) {
        while let Some(out) = self.router.poll_output() {
            let key = match &out {
                Output::Routed(r) => (r.id, r.phase),
                Output::Failed { id, phase, .. }
                | Output::TimedOut { id, phase }
                | Output::Rejected { id, phase, .. } => (*id, *phase),
                Output::LeaseExpired { .. } => {
                    self.stats.leases_expired += 1;
                    continue;
                }
                Output::BookingExpired { .. } => {
                    self.stats.bookings_expired += 1;
                    continue;
                }
                _ => continue,
            };
            let undelivered = match self.waiters.remove(&key) {
                Some(tx) => tx.send(out).err(),
                None => Some(out),
            };
            if let Some(out) = undelivered {
                self.stats.undelivered += 1;
                if let Output::Routed(r) = out {
                    let _ = self.router.handle_dispatch_failed(now, r.id, r.phase, DispatchFailure::Cancelled);
                }
            }
        }
        self.drain_replica_updates();
    }

    /// Whether the timer task must wake because the next deadline is now earlier than the
    /// one it sleeps towards.
    fn rearm(&mut self) -> bool {
        let next = self.router.poll_timeout();
        let earlier = match (next, self.armed) {
            (Some(n), Some(a)) => n < a,
            (Some(_), None) => true,
            _ => false,
        };
        if earlier {
            self.armed = next;
        }
        earlier
    }
}

/// The one timer of the driver: sleeps until the router's next deadline, runs it, repeats.
async fn run_timer(shared: Arc<Shared>) {
    let mut last_fired: Option<Instant> = None;
    loop {
        let deadline = {
            let mut g = shared.lock();
            g.armed = g.router.poll_timeout();
            g.armed
        };
        let when = deadline.and_then(|t| shared.start.checked_add(Duration::from_micros(t.as_micros())));
        let Some(mut when) = when else {
            shared.notify.notified().await;
            continue;
        };
        // A deadline that handle_timeout did not move would spin; give it a millisecond.
        if last_fired == deadline {
            when = when.max(TokioInstant::now() + Duration::from_millis(1));
        }
        tokio::select! {
            _ = tokio::time::sleep_until(when) => {
                last_fired = deadline;
                shared.with(|inner, now| {
                    inner.router.handle_timeout(now);
                    inner.stats.timeouts_fired += 1;
                });
            }
            _ = shared.notify.notified() => {}
        }
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
