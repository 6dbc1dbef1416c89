//! The worker registry the picker routes over: adding and removing workers keeps the
//! pools' routers, the worker table and the KV-event subscriptions in step, and readiness
//! says whether the registry can be trusted yet.

use std::sync::Arc;

use kvroute_frontend::config::WorkerConfig;
use kvroute_frontend::FleetError;
use tonic_health::ServingStatus;

use crate::{health_names, Shared};

/// A handle on the picker's workers; cheap to clone.
#[derive(Clone)]
pub struct Workers {
    shared: Arc<Shared>,
}

impl Workers {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Workers { shared }
    }

    /// The picker's metrics, for discovery to count its troubles.
    pub(crate) fn metrics(&self) -> &kvroute_frontend::metrics::Metrics {
        &self.shared.metrics
    }

    /// Adds a worker, or replaces the one with the same id; subscribes to its KV events
    /// if it names an endpoint. Returns whether it is new. A failed subscription leaves
    /// the worker routed on predictions and is logged, not returned.
    pub async fn upsert(&self, w: WorkerConfig) -> Result<bool, FleetError> {
        let new = self.shared.fleet.add_worker(w.clone())?;
        let mut subs = self.shared.subs.lock().await;
        if let Err(e) = subs.add(&self.shared.cfg.proxy, &self.shared.fleet, &w).await {
            tracing::warn!(worker = w.id, error = %e, "cannot subscribe to the worker's KV events");
        }
        Ok(new)
    }

    /// Removes a worker; its sessions re-bind elsewhere and requests it holds finish
    /// without it. Returns whether it existed.
    pub async fn remove(&self, id: u64) -> bool {
        self.shared.subs.lock().await.remove(id).await;
        self.shared.fleet.remove_worker(id)
    }

    /// Drains a worker (its pod is being deleted): it takes no new requests or sessions,
    /// its sessions re-bind on their next request, and it stays known until removed.
    /// Returns whether it existed.
    pub fn drain(&self, id: u64) -> bool {
        let fleet = &self.shared.fleet;
        let Some(pool) = fleet.worker(id).and_then(|w| fleet.pool(&w.model)) else { return false };
        pool.driver.set_health(router_core::WorkerId(id), router_core::Health::Draining).is_ok()
    }

    /// Every worker, in id order.
    pub fn list(&self) -> Vec<Arc<WorkerConfig>> {
        self.shared.fleet.workers()
    }

    /// Sets readiness and the ext_proc service's health: a discovery source reports
    /// `false` until it has listed its endpoints once.
    pub async fn set_ready(&self, ready: bool) {
        let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
        let h = &self.shared.health;
        h.set_service_status(health_names::READINESS, status).await;
        h.set_service_status(health_names::EXT_PROC, status).await;
        h.set_service_status("", status).await;
    }
}
