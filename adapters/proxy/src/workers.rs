//! The worker registry for discovery running beside the proxy (`kvroute serve`'s
//! Kubernetes watch): the same add, remove and drain as the admin API's
//! `POST /workers`, `DELETE /workers/{id}` and `POST /workers/{id}/drain?remove=true`.

use std::sync::Arc;

use crate::config::{ConfigError, WorkerConfig};
use crate::fleet::FleetError;
use crate::state::State;

/// A handle on the proxy's workers; cheap to clone.
#[derive(Clone)]
pub struct Workers {
    pub(crate) state: Arc<State>,
}

impl Workers {
    /// The proxy's metrics, for discovery to count its troubles.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.state.metrics
    }

    /// Adds a worker, or replaces the one with its id (a drained one takes requests
    /// again), and subscribes to its KV events. Returns whether it is new. A failed
    /// subscription leaves the worker routed on predictions and is logged, not returned.
    pub async fn upsert(&self, w: WorkerConfig) -> Result<bool, FleetError> {
        let state = &self.state;
        let invalid = |(key, message): (&str, String)| ConfigError::Invalid { key: key.into(), message };
        state.cfg.check_worker(&w).map_err(|e| FleetError::Invalid(invalid(e)))?;
        let new = state.fleet.add_worker(w.clone())?;
        crate::drain::readmit(state, &w);
        if let Err(e) = state.subs.lock().await.add(&state.cfg, &state.fleet, &w).await {
            tracing::warn!(worker = w.id, error = %e, "cannot subscribe to the worker's KV events");
        }
        Ok(new)
    }

    /// Removes a worker and its KV-event subscription; its sessions re-bind elsewhere
    /// and its in-flight streams run to completion. Returns whether it existed.
    pub async fn remove(&self, id: u64) -> bool {
        if !self.state.fleet.remove_worker(id) {
            return false;
        }
        crate::drain::forget(&self.state, id).await;
        true
    }

    /// Drains a worker: no new requests or sessions, in-flight ones finish; with
    /// `remove`, it is removed with its subscription once nothing is in flight. Returns
    /// whether it exists.
    pub fn drain(&self, id: u64, remove: bool) -> bool {
        crate::drain::start(&self.state, id, remove)
    }

    /// Every worker, in id order.
    pub fn list(&self) -> Vec<Arc<WorkerConfig>> {
        self.state.fleet.workers()
    }
}
