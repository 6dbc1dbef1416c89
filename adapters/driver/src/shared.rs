//! What every part of the driver shares: the router behind its mutex, the clock, the
//! waiters of routed outputs, the timer task, and the hand-off of replica updates. The
//! driver's handle and the booking guards build on it; it names neither.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use router_core::{DispatchFailure, Instant, Output, Phase, ReplicaUpdate, RequestId, Router};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant as TokioInstant;

use crate::snapshot::DriverStats;

/// A routed output's waiter: the request and the phase it waits for.
pub(crate) type FlightKey = (RequestId, Phase);

/// What every `Driver` clone and every booking holds: the lock, the clock and the timer's bell.
pub(crate) struct Shared {
    inner: Mutex<Inner>,
    notify: Notify,
    start: TokioInstant,
    /// Wall-clock microseconds since the Unix epoch when `start` was taken.
    pub(crate) start_unix_us: u64,
    pub(crate) next_id: AtomicU64,
    pub(crate) draws: AtomicU64,
}

/// What the lock guards: the router, and who awaits which of its outputs.
pub(crate) struct Inner {
    pub(crate) router: Router,
    pub(crate) waiters: BTreeMap<FlightKey, oneshot::Sender<Output>>,
    /// The deadline the timer task last slept towards.
    armed: Option<Instant>,
    pub(crate) stats: DriverStats,
    pub(crate) replica_sink: Option<mpsc::Sender<ReplicaUpdate>>,
}

impl Shared {
    pub(crate) fn new(router: Router, draw_seed: u64) -> Self {
        Shared {
            inner: Mutex::new(Inner {
                router,
                waiters: BTreeMap::new(),
                armed: None,
                stats: DriverStats::default(),
                replica_sink: None,
            }),
            notify: Notify::new(),
            start: TokioInstant::now(),
            start_unix_us: unix_now_us(),
            next_id: AtomicU64::new(1),
            draws: AtomicU64::new(draw_seed),
        }
    }

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
pub(crate) async fn run_timer(shared: Arc<Shared>) {
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

impl Inner {
    /// Hands every queued replica update to the sink, or discards it when there is none.
    pub(crate) fn drain_replica_updates(&mut self) {
        while let Some(u) = self.router.poll_replica_update() {
            let Some(sink) = &self.replica_sink else { continue };
            match sink.try_send(u) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Closed(_)) => self.stats.replica_updates_dropped += 1,
            }
        }
    }
}

/// Wall-clock microseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}
