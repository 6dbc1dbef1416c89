//! The state every connection shares: configuration, fleet, upstream client, metrics,
//! limits and the shutdown signal.

use std::sync::Arc;

use http::HeaderName;
use tokio::sync::{watch, Semaphore};

use crate::config::ProxyConfig;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::outliers::Outliers;
use crate::tokenize::Tokenizers;
use crate::trust::Trust;
use crate::upstream::{RetryBudget, UpstreamClient};

/// Shared by every request.
pub struct State {
    /// The configuration the proxy started with.
    pub cfg: ProxyConfig,
    /// Who is trusted.
    pub trust: Trust,
    /// The tenants and their keys; empty when the gateway is open (see [`crate::auth`]).
    pub tenants: Arc<kvroute_frontend::tenants::Tenants>,
    /// The tenants' rate and concurrency limits.
    pub(crate) limits: crate::quota::TenantLimits,
    /// Pools and workers.
    pub fleet: Arc<Fleet>,
    /// Tokenizers by model.
    pub tokenizers: Tokenizers,
    /// The HTTP client to workers.
    pub client: UpstreamClient,
    /// Metrics.
    pub metrics: Metrics,
    /// Permits for `concurrent_requests_max`.
    pub concurrency: Arc<Semaphore>,
    /// Retries available.
    pub budget: RetryBudget,
    /// Consecutive failures and ejections per worker.
    pub outliers: Outliers,
    /// The session id header.
    pub session_header: HeaderName,
    /// The dp rank header sent to multi-rank workers.
    pub dp_rank_header: HeaderName,
    /// Becomes true when shutdown begins.
    pub shutdown: watch::Receiver<bool>,
    /// KV-event subscriptions of the workers that name an endpoint.
    pub subs: tokio::sync::Mutex<crate::events::Subscriptions>,
    /// The link to peer replicas, when `[replica]` is configured.
    pub replica: Option<Arc<kvroute_replica::ReplicaHandle>>,
    /// Engine-metrics scrape counters.
    pub scrapes: Arc<crate::scrape::ScrapeStats>,
    /// The tracer, when `[tracing]` is configured.
    pub tracing: Option<Arc<kvroute_frontend::otel::Tracing>>,
    /// The `/v1/models` listing, cached.
    pub models: crate::models::ModelsCache,
}

impl State {
    /// Whether shutdown has begun.
    pub fn shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// `connected` or `disconnected` for a replica, `None` for a proxy routing alone.
    pub fn nats_status(&self) -> Option<&'static str> {
        self.replica.as_ref().map(|r| if r.connected() { "connected" } else { "disconnected" })
    }
}
