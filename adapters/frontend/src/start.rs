//! Starting the front end: the one sequence both servers run before they bind a socket.

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use http::HeaderName;
use kvroute_replica::{ReplicaHandle, ReplicaStartError};

use crate::config::{ConfigError, ProxyConfig, ReplicaConfig};
use crate::events::{SubscribeError, Subscriptions};
use crate::fleet::{Fleet, FleetError};
use crate::metrics::Metrics;
use crate::otel::{Tracing, TracingError};
use crate::tenants::{TenantError, Tenants};
use crate::trust::Trust;

/// What a server holds once [`start`] returns: the configuration, the pools with the
/// configured workers, who is trusted, the metrics, the parsed header names, the
/// KV-event subscriptions and the link to peer replicas.
pub struct FrontEnd {
    /// The configuration it started with.
    pub cfg: ProxyConfig,
    /// Who is trusted.
    pub trust: Trust,
    /// The tenants and their keys; empty when the gateway is open.
    pub tenants: Arc<Tenants>,
    /// Pools and workers.
    pub fleet: Arc<Fleet>,
    /// Metrics of the pools, the decisions and (with `[replica]`) the peers.
    pub metrics: Metrics,
    /// The session id header.
    pub session_header: HeaderName,
    /// The dp rank header sent to multi-rank workers.
    pub dp_rank_header: HeaderName,
    /// KV-event subscriptions of the workers that name an endpoint.
    pub subs: tokio::sync::Mutex<Subscriptions>,
    /// The link to peer replicas, when `[replica]` is configured.
    pub replica: Option<Arc<ReplicaHandle>>,
    /// The tracer, when `[tracing]` is configured.
    pub tracing: Option<Arc<Tracing>>,
    /// The TLS client for `https` workers, verifying against `[upstream_tls]`.
    pub client_tls: Arc<rustls::ClientConfig>,
}

/// Checks `cfg`, seeds the process (from `cfg.seed`, else at random), builds a pool per
/// model, registers and subscribes to the configured workers, and joins the peer
/// replicas when `[replica]` is configured, and starts the OTLP exporter when
/// `[tracing]` is (call [`Tracing::shutdown`] to flush it). Must run inside a tokio runtime (drivers
/// and subscriptions spawn tasks).
pub async fn start(cfg: &ProxyConfig) -> Result<FrontEnd, StartError> {
    cfg.validate()?;
    let tenants = Arc::new(Tenants::load(&cfg.tenants).map_err(StartError::Tenants)?);
    if tenants.is_empty() {
        tracing::warn!("no [[tenants]] configured: the gateway is open (no authentication)");
    }
    let seed = cfg.seed.unwrap_or_else(random_seed);
    let fleet = Arc::new(Fleet::with_tenants(cfg, seed, &tenants));
    for w in &cfg.workers {
        fleet.add_worker(w.clone()).map_err(|source| StartError::Worker { id: w.id, source })?;
    }
    let session_header = header("session_header", &cfg.session_header)?;
    let dp_rank_header = header("dp_rank_header", &cfg.dp_rank_header)?;
    let subs = Subscriptions::start(cfg, &fleet).await.map_err(StartError::Subscribe)?;
    let replica = match &cfg.replica {
        Some(r) => Some(Arc::new(join_replicas(r, &fleet).await?)),
        None => None,
    };
    let client_tls = crate::tls::client_config(cfg.upstream_tls.ca_path.as_deref()).map_err(StartError::Tls)?;
    let tracing = match &cfg.tracing {
        Some(t) => Some(Arc::new(Tracing::start_with_tls(t, &client_tls).map_err(StartError::Tracing)?)),
        None => None,
    };
    let mut metrics = Metrics::new(fleet.clone());
    if let Some(r) = &replica {
        metrics.register_replica(r.clone(), fleet.clone());
    }
    if let Some(t) = &tracing {
        metrics.register_span_drops(t.drops());
    }
    Ok(FrontEnd {
        cfg: cfg.clone(),
        trust: Trust::new(&cfg.trust),
        tenants,
        fleet,
        metrics,
        session_header,
        dp_rank_header,
        subs: tokio::sync::Mutex::new(subs),
        replica,
        tracing,
        client_tls,
    })
}

/// Links every pool's driver to the peer replicas over NATS.
async fn join_replicas(r: &ReplicaConfig, fleet: &Fleet) -> Result<ReplicaHandle, StartError> {
    let pools =
        fleet.pools().map(|p| kvroute_replica::PoolLink { model: p.name.clone(), driver: p.driver.clone() }).collect();
    kvroute_replica::start(r.options(), pools).await.map_err(StartError::Replica)
}

/// A configured header name (checked by `validate`, so this does not fail after it).
fn header(key: &str, name: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|e| ConfigError::Invalid { key: key.into(), message: format!("{name:?}: {e}") })
}

/// A seed from the process's random hasher keys, so hash tables and draws differ per run.
fn random_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x6b76_726f_7574_6521);
    h.finish()
}

/// Why the front end could not start.
#[derive(Debug)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration was refused.
    Config(ConfigError),
    /// A configured worker was refused.
    Worker {
        /// The worker.
        id: u64,
        /// Why.
        source: FleetError,
    },
    /// A configured worker's KV-event streams could not be subscribed to.
    Subscribe(SubscribeError),
    /// The link to peer replicas could not start.
    Replica(ReplicaStartError),
    /// The tracer could not start.
    Tracing(TracingError),
    /// A tenant's keys could not be loaded.
    Tenants(TenantError),
    /// `upstream_tls.ca_path` could not be loaded.
    Tls(crate::tls::TlsError),
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartError::Config(e) => write!(f, "configuration: {e}"),
            StartError::Worker { id, source } => write!(f, "worker {id}: {source}"),
            StartError::Subscribe(e) => write!(f, "KV events: {e}"),
            StartError::Replica(e) => write!(f, "replica: {e}"),
            StartError::Tracing(e) => write!(f, "tracing: {e}"),
            StartError::Tenants(e) => write!(f, "tenants: {e}"),
            StartError::Tls(e) => write!(f, "upstream_tls: {e}"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StartError::Config(e) => Some(e),
            StartError::Worker { source, .. } => Some(source),
            StartError::Subscribe(e) => Some(e),
            StartError::Replica(e) => Some(e),
            StartError::Tracing(e) => Some(e),
            StartError::Tenants(e) => Some(e),
            StartError::Tls(e) => Some(e),
        }
    }
}

impl From<ConfigError> for StartError {
    fn from(e: ConfigError) -> Self {
        StartError::Config(e)
    }
}
