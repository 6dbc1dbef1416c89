//! Worker health: passive outlier ejection and active health checks, both driving the
//! router's `Health` through the pool's driver.
//!
//! A worker that fails `consecutive_failures` times in a row (connect failures, 5xx
//! answers, broken streams, failed checks) is ejected: the router stops choosing it. A
//! probe task then waits out the back-off and sends one `GET` of the health-check path;
//! success readmits the worker, failure doubles the back-off up to `max_ms` and waits
//! again. A success anywhere resets the count and the back-off. There is one probe task
//! per ejected worker, so their number is bounded by the fleet's size. An ejection also
//! wakes the tries still waiting for that worker's first byte (see the `tries` module).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use router_core::{Health, WorkerId};

use crate::config::WorkerConfig;
pub use crate::outliers::{HealthView, Outliers};
use crate::state::State;

/// A request to `worker` failed in a way that is the worker's fault.
pub fn failure(state: &Arc<State>, worker: u64, kind: &'static str) {
    let Some(w) = state.fleet.worker(worker) else { return };
    state.metrics.failure(&w.model, worker, kind);
    if let Some(backoff_ms) = state.outliers.failure(worker) {
        match state.fleet.pool(&w.model) {
            Some(_) if state.outliers.is_draining(worker) => {}
            Some(pool) => {
                let _ = pool.driver.set_health(WorkerId(worker), Health::Ejected);
            }
            None => {}
        }
        state.metrics.ejected(&w.model, worker);
        tracing::warn!(worker, backoff_ms, last_failure = kind, "worker ejected after consecutive failures");
        tokio::spawn(probe_loop(state.clone(), worker, backoff_ms));
    }
}

/// A request to `worker` succeeded.
pub fn success(state: &State, worker: u64) {
    state.outliers.success(worker);
}

/// Waits out the back-off, probes once, and readmits or backs off further.
async fn probe_loop(state: Arc<State>, worker: u64, mut backoff_ms: u64) {
    let mut shutdown = state.shutdown.clone();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(backoff_ms)) => {}
            _ = shutdown.changed() => return,
        }
        let Some(w) = state.fleet.worker(worker) else {
            state.outliers.forget(worker);
            return;
        };
        if probe(&state, &w).await {
            state.outliers.readmit(worker);
            match state.fleet.pool(&w.model) {
                Some(_) if state.outliers.is_draining(worker) => {}
                Some(pool) => {
                    let _ = pool.driver.set_health(WorkerId(worker), Health::Healthy);
                }
                None => {}
            }
            tracing::info!(worker, "worker readmitted after a successful probe");
            return;
        }
        state.metrics.failure(&w.model, worker, "probe");
        backoff_ms = state.outliers.probe_failed(worker);
    }
}

/// One `GET` of the health-check path; true on a 2xx within the timeout.
pub async fn probe(state: &State, w: &WorkerConfig) -> bool {
    let Ok(uri) = w.url.join(&state.cfg.health_check.path) else { return false };
    let Ok(req) = http::Request::get(uri).body(Full::new(Bytes::new())) else { return false };
    let timeout = Duration::from_millis(state.cfg.health_check.timeout_ms);
    match tokio::time::timeout(timeout, state.client.request(req)).await {
        Ok(Ok(resp)) => resp.status().is_success(),
        _ => false,
    }
}

/// Checks every worker that is not ejected, every `interval_ms`, until shutdown.
pub async fn active_checks(state: Arc<State>) {
    let interval_ms = state.cfg.health_check.interval_ms;
    if interval_ms == 0 {
        return;
    }
    let mut shutdown = state.shutdown.clone();
    let mut tick = tokio::time::interval(Duration::from_millis(interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let mut checks = tokio::task::JoinSet::new();
        for w in state.fleet.workers() {
            if state.outliers.is_ejected(w.id) {
                continue;
            }
            let state = state.clone();
            checks.spawn(async move {
                if probe(&state, &w).await {
                    success(&state, w.id);
                } else {
                    failure(&state, w.id, "probe");
                }
            });
        }
        while checks.join_next().await.is_some() {}
    }
}
