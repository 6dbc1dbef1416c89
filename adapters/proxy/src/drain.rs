//! Draining a worker: `POST /workers/{id}/drain` (trusted) stops new requests and new
//! sessions from reaching it while its in-flight requests finish; `?remove=true` also
//! removes it from the fleet once nothing is in flight. Its sessions re-bind on their
//! next request (the core re-binds a session whose worker takes nothing new).
//!
//! A draining worker stays draining: outlier ejection and readmission probes leave its
//! health alone (see [`crate::health`]). Re-adding it through `POST /workers` makes it
//! a new, healthy worker (`readmit`); a removed worker leaves nothing behind (`forget`).

use std::sync::Arc;
use std::time::Duration;

use http::{Response, StatusCode};
use router_core::Health;
use router_core::{WorkerId, WorkerKey};
use serde_json::json;

use crate::body::ProxyBody;
use crate::config::WorkerConfig;
use crate::error::{json_response, ApiError};
use crate::state::State;

/// How often a drain with `remove` looks at the worker's in-flight count.
const REMOVE_POLL_MS: u64 = 20;

/// `POST /workers/{id}/drain[?remove=true]`.
pub fn drain(state: &Arc<State>, id: &str, query: Option<&str>) -> Result<Response<ProxyBody>, ApiError> {
    let id: u64 = id.parse().map_err(|_| ApiError::bad_request(format!("{id:?} is not a worker id")))?;
    let remove = match query.unwrap_or("") {
        "" | "remove=false" => false,
        "remove=true" => true,
        q => return Err(ApiError::bad_request(format!("unknown query {q:?}; the only one is remove=true"))),
    };
    if !start(state, id, remove) {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            code: "worker_not_found",
            ..ApiError::bad_request(format!("no worker {id}"))
        });
    }
    let body = json!({"id": id, "health": "draining", "in_flight": in_flight(state, id), "remove": remove});
    Ok(json_response(StatusCode::ACCEPTED, &body))
}

/// Drains `id`, and with `remove` removes it once idle. Returns whether it exists.
pub(crate) fn start(state: &Arc<State>, id: u64, remove: bool) -> bool {
    let Some(pool) = state.fleet.worker(id).and_then(|w| state.fleet.pool(&w.model).cloned()) else {
        return false;
    };
    state.outliers.set_draining(id);
    let _ = pool.driver.set_health(WorkerId(id), Health::Draining);
    tracing::info!(worker = id, remove, "worker draining");
    if remove {
        tokio::spawn(remove_when_idle(state.clone(), id));
    }
    true
}

/// Requests the router holds on `id`, over all its ranks.
pub fn in_flight(state: &State, id: u64) -> u64 {
    let Some(w) = state.fleet.worker(id) else { return 0 };
    let Some(pool) = state.fleet.pool(&w.model) else { return 0 };
    // Per rank, not a snapshot: this runs every poll while a drained worker winds down.
    pool.driver.with_router(|r| {
        (0..w.dp_ranks).map(|rank| u64::from(r.local_load(WorkerKey::new(id, rank)).active_requests)).sum()
    })
}

/// Removes `id` once nothing is in flight on it, unless it stopped draining (re-added)
/// or the proxy shuts down first.
async fn remove_when_idle(state: Arc<State>, id: u64) {
    let mut shutdown = state.shutdown.clone();
    loop {
        if !state.outliers.is_draining(id) {
            return;
        }
        if in_flight(&state, id) == 0 {
            if state.fleet.remove_worker(id) {
                forget(&state, id).await;
                tracing::info!(worker = id, "drained worker removed");
            }
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(REMOVE_POLL_MS)) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// A drained worker added again is a new worker: it takes requests again.
pub(crate) fn readmit(state: &State, w: &WorkerConfig) {
    if state.outliers.is_draining(w.id) {
        state.outliers.forget(w.id);
        if let Some(pool) = state.fleet.pool(&w.model) {
            let _ = pool.driver.set_health(WorkerId(w.id), Health::Healthy);
        }
    }
}

/// What a removed worker leaves: its outlier state and its KV-event subscription.
pub(crate) async fn forget(state: &State, id: u64) {
    state.outliers.forget(id);
    state.subs.lock().await.remove(id).await;
}
