//! The outlier table: consecutive failures, ejection and back-off per worker, as plain
//! data behind a lock. [`crate::health`] decides when to count and probes ejected
//! workers; the tries wait on [`Outliers::ejected`] to hear of an ejection.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::EjectionConfig;

#[derive(Clone, Copy, Debug, Default)]
struct Tracked {
    /// When the worker last sent a first byte or finished a stream.
    progress_at: Option<Instant>,
    consecutive: u32,
    ejected: bool,
    /// Drained by an operator: ejection and readmission leave its health alone.
    draining: bool,
    backoff_ms: u64,
    ejections: u64,
}

/// What `/workers` shows about a worker's health.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HealthView {
    /// Failures in a row.
    pub consecutive_failures: u32,
    /// Whether it is ejected now.
    pub ejected: bool,
    /// Times it was ejected.
    pub ejections: u64,
}

/// Consecutive failures and ejection state per worker.
pub struct Outliers {
    cfg: EjectionConfig,
    table: Mutex<BTreeMap<u64, Tracked>>,
    /// Ejections so far, for tries waiting on a worker to hear of its ejection.
    ejected: watch::Sender<u64>,
}

impl Outliers {
    /// An empty tracker.
    pub fn new(cfg: EjectionConfig) -> Self {
        Outliers { cfg, table: Mutex::new(BTreeMap::new()), ejected: watch::channel(0).0 }
    }

    fn with<R>(&self, id: u64, f: impl FnOnce(&mut Tracked, &EjectionConfig) -> R) -> R {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        f(t.entry(id).or_default(), &self.cfg)
    }

    /// Counts a failure; returns the back-off in ms when this failure ejects the worker.
    pub(crate) fn failure(&self, id: u64) -> Option<u64> {
        let ejected = self.count_failure(id);
        if ejected.is_some() {
            self.ejected.send_modify(|n| *n += 1);
        }
        ejected
    }

    fn count_failure(&self, id: u64) -> Option<u64> {
        self.with(id, |t, cfg| {
            t.consecutive = t.consecutive.saturating_add(1);
            if cfg.consecutive_failures == 0 || t.ejected || t.consecutive < cfg.consecutive_failures {
                return None;
            }
            t.ejected = true;
            t.ejections += 1;
            t.backoff_ms = if t.backoff_ms == 0 { cfg.base_ms } else { t.backoff_ms };
            Some(t.backoff_ms)
        })
    }

    /// A request succeeded: the worker made [`Outliers::progress`] too.
    pub(crate) fn success(&self, id: u64) {
        self.with(id, |t, _| {
            t.progress_at = Some(Instant::now());
            if !t.ejected {
                t.consecutive = 0;
                t.backoff_ms = 0;
            }
        });
    }

    /// The worker sent a try its first byte, or finished a stream: it is serving.
    pub(crate) fn progress(&self, id: u64) {
        self.with(id, |t, _| t.progress_at = Some(Instant::now()));
    }

    /// A disaggregated leg's head arrived: a success is [`Outliers::progress`], an error
    /// status is not (it may be retried, and a worker failing fast is not serving).
    pub(crate) fn head(&self, id: u64, status: http::StatusCode) {
        if status.is_success() {
            self.progress(id);
        }
    }

    /// Whether the worker made [`Outliers::progress`] after `since`: a worker that is
    /// busy, not wedged.
    pub(crate) fn progressed_since(&self, id: u64, since: Instant) -> bool {
        self.with(id, |t, _| t.progress_at.is_some_and(|at| at > since))
    }

    /// The probe failed: the next back-off, doubled up to the cap.
    pub(crate) fn probe_failed(&self, id: u64) -> u64 {
        self.with(id, |t, cfg| {
            t.backoff_ms = t.backoff_ms.max(1).saturating_mul(2).min(cfg.max_ms.max(cfg.base_ms));
            t.backoff_ms
        })
    }

    pub(crate) fn readmit(&self, id: u64) {
        self.with(id, |t, _| {
            t.ejected = false;
            t.consecutive = 0;
        });
    }

    pub(crate) fn is_ejected(&self, id: u64) -> bool {
        self.with(id, |t, _| t.ejected)
    }

    /// Resolves once worker `id` is ejected (at once if it is now).
    pub async fn ejected(&self, id: u64) {
        let mut changes = self.ejected.subscribe();
        // Subscribed before the look, so an ejection between the two still wakes us.
        while !self.is_ejected(id) {
            if changes.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// The worker is draining (see [`crate::drain`]) until it is forgotten.
    pub fn set_draining(&self, id: u64) {
        self.with(id, |t, _| t.draining = true);
    }

    /// Whether the worker is draining.
    pub fn is_draining(&self, id: u64) -> bool {
        self.with(id, |t, _| t.draining)
    }

    /// Forgets a removed worker.
    pub fn forget(&self, id: u64) {
        self.table.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
    }

    /// The worker's health as `/workers` shows it.
    pub fn view(&self, id: u64) -> HealthView {
        let t = self.table.lock().unwrap_or_else(PoisonError::into_inner).get(&id).copied().unwrap_or_default();
        HealthView { consecutive_failures: t.consecutive, ejected: t.ejected, ejections: t.ejections }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn ejection_backs_off_and_readmits() {
        let o = Outliers::new(EjectionConfig { consecutive_failures: 3, base_ms: 100, max_ms: 350 });
        assert_eq!((o.failure(1), o.failure(1)), (None, None));
        assert_eq!(o.failure(1), Some(100), "the third failure in a row ejects");
        assert_eq!(o.failure(1), None, "an ejected worker is not ejected again");
        assert_eq!([o.probe_failed(1), o.probe_failed(1), o.probe_failed(1)], [200, 350, 350]);
        o.readmit(1);
        assert!(!o.view(1).ejected);
        assert_eq!(
            (o.failure(1), o.failure(1), o.failure(1)),
            (None, None, Some(350)),
            "back-off survives readmission"
        );
        o.readmit(1);
        o.success(1);
        assert_eq!((o.failure(1), o.failure(1), o.failure(1)), (None, None, Some(100)), "a success resets it");
        assert_eq!(o.view(1).ejections, 3);
    }

    #[test]
    fn a_success_breaks_the_run() {
        let o = Outliers::new(EjectionConfig { consecutive_failures: 2, base_ms: 1, max_ms: 1 });
        assert_eq!(o.failure(7), None);
        o.success(7);
        assert_eq!(o.failure(7), None);
        assert_eq!(o.failure(7), Some(1));
    }

    #[test]
    fn only_a_successful_head_is_progress() {
        let o = Outliers::new(EjectionConfig { consecutive_failures: 2, base_ms: 1, max_ms: 1 });
        // A moment before, so that a clock that has not ticked since still counts.
        let since = Instant::now() - Duration::from_millis(1);
        o.head(1, http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(!o.progressed_since(1, since));
        o.head(1, http::StatusCode::OK);
        assert!(o.progressed_since(1, since));
    }

    #[tokio::test]
    async fn an_ejection_wakes_only_its_workers_waiters() {
        let o = Arc::new(Outliers::new(EjectionConfig { consecutive_failures: 2, base_ms: 1, max_ms: 1 }));
        let (w1, w2) = (tokio::spawn(watch_for(o.clone(), 1)), tokio::spawn(watch_for(o.clone(), 2)));
        tokio::task::yield_now().await;
        assert_eq!(o.failure(1), None);
        assert_eq!(o.failure(2), None);
        assert_eq!(o.failure(1), Some(1));
        tokio::time::timeout(Duration::from_secs(5), w1).await.expect("worker 1's waiter wakes").unwrap();
        tokio::task::yield_now().await;
        assert!(!w2.is_finished(), "worker 2 is not ejected");
        w2.abort();
        let now = tokio::time::timeout(Duration::from_secs(5), o.ejected(1));
        now.await.expect("an ejected worker resolves at once");
    }

    async fn watch_for(o: Arc<Outliers>, id: u64) {
        o.ejected(id).await;
    }

    #[test]
    fn zero_disables_ejection() {
        let o = Outliers::new(EjectionConfig { consecutive_failures: 0, base_ms: 1, max_ms: 1 });
        assert!((0..100).all(|_| o.failure(1).is_none()));
    }
}
