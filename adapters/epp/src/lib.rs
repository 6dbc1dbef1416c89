//! `kvroute-epp` runs kvroute as an endpoint picker for the Kubernetes Gateway API
//! Inference Extension: a gateway (Envoy Gateway, Istio, kgateway) asks it over Envoy's
//! external-processing gRPC protocol which model server should take each request, and
//! it answers with the worker the same router core as `kvroute serve` picks.
//!
//! Per request the gateway opens one `envoy.service.ext_proc.v3.ExternalProcessor/Process`
//! stream. The picker reads the request headers and the whole body (buffered, or
//! full-duplex in chunks), turns them into the router's question with the same parsing
//! and tokenization as the proxy ([`kvroute_frontend::ask::question`]), waits in the
//! admission queue if the fleet is busy, and answers with the chosen `ip:port` in the
//! `x-gateway-destination-endpoint` header and in the dynamic metadata `envoy.lb`. It
//! then follows the response on the same stream: the response headers confirm the
//! booking, the end of the response body finishes it, and a stream that closes early
//! cancels it, so load, leases and queue slots never outlive the request. Refusals are
//! local replies in the OpenAI error shape (429 when the queue is full, 503 when no
//! worker can serve, 400 for a bad body). The standard gRPC health service reports
//! `liveness`, `readiness` and the ext_proc service.
//!
//! Endpoints come from the configuration, from [`Workers`] calls, or from the Kubernetes
//! API through [`k8s::watch`], which follows the pods an `InferencePool` selects.
//!
//! The gateway's connections are plaintext HTTP/2, or TLS with a given or self-signed
//! certificate (the `tls` feature, which also lets [`k8s::client`] reach a real API
//! server over HTTPS).
//!
//! With `[learn] scrape_interval_ms`, it reads each worker's metrics page for engine load
//! as `kvroute serve` does ([`kvroute_frontend::scrape`]), shown by
//! [`EppHandle::engine_scrapes`] and the router's learned view.
//!
//! What it leaves to others: proxying the bytes (the gateway does), and serving metrics
//! over HTTP (the binary does, from [`EppHandle::metrics_handle`]).
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod config;
mod decide;
mod exchange;
pub mod k8s;
pub mod pb;
pub mod reply;
mod scrape;
mod service;
mod workers;

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use kvroute_driver::Driver;
use kvroute_frontend::events::Subscriptions;
use kvroute_frontend::fleet::Fleet;
use kvroute_frontend::metrics::Metrics;
use kvroute_frontend::scrape::{scrape_loop, ScrapeStats, Scraper};
use kvroute_frontend::trust::Trust;
use kvroute_frontend::{FrontEnd, StartError, Tokenizers};
use kvroute_replica::ReplicaHandle;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;
use tonic_health::server::HealthReporter;

pub use config::{BodyMode, EppConfig, TlsIdentity, REFUSED_KEYS};
pub use workers::Workers;

/// The health-check service names, as the Inference Extension's picker reports them.
pub mod health_names {
    /// The process answers.
    pub const LIVENESS: &str = "liveness";
    /// The picker knows its endpoints and takes requests.
    pub const READINESS: &str = "readiness";
    /// The ext_proc service itself; follows readiness.
    pub const EXT_PROC: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
}

/// Shared by every stream.
pub(crate) struct Shared {
    pub cfg: EppConfig,
    pub trust: Trust,
    pub fleet: Arc<Fleet>,
    pub tokenizers: Tokenizers,
    pub metrics: Metrics,
    pub session_header: HeaderName,
    pub dp_rank_header: HeaderName,
    /// Permits for `limits.concurrent_requests_max` streams deciding or in flight.
    pub concurrency: Arc<Semaphore>,
    pub subs: tokio::sync::Mutex<Subscriptions>,
    /// The link to peer replicas, when `[replica]` is configured.
    pub replica: Option<Arc<ReplicaHandle>>,
    pub shutdown: watch::Receiver<bool>,
    pub health: HealthReporter,
    /// Engine-metrics scrape counters (`[learn]` scraping).
    pub scrapes: Arc<ScrapeStats>,
}

/// A running endpoint picker: its address, its pools, and the way to stop it.
///
/// Dropping the handle starts the same shutdown as [`EppHandle::shutdown`] without
/// waiting for it.
pub struct EppHandle {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// Starts the picker: starts the front end ([`kvroute_frontend::start`]: checks the
/// configuration, builds a pool per model, registers and subscribes to the configured
/// workers, joins the peer replicas when `[replica]` is configured), binds `cfg.listen`
/// and serves ext_proc and health checks until [`EppHandle::shutdown`]. Readiness starts
/// `SERVING`; a Kubernetes watch holds it at `NOT_SERVING` until its first listing (see
/// [`Workers::set_ready`]). Must run inside a tokio runtime.
pub async fn serve(cfg: EppConfig, tokenizers: Tokenizers) -> Result<EppHandle, EppError> {
    // The picker sees no client's key: tenants it cannot authenticate would be an open door.
    if !cfg.proxy.tenants.is_empty() {
        return Err(EppError::TenantsUnsupported);
    }
    let front = kvroute_frontend::start(&cfg.proxy).await.map_err(EppError::Start)?;
    let server = service::server(&cfg)?;
    let listener = TcpListener::bind(cfg.listen).await.map_err(EppError::Bind)?;
    let local_addr = listener.local_addr().map_err(EppError::Bind)?;
    let health_listener = match cfg.health_listen {
        Some(a) => Some(TcpListener::bind(a).await.map_err(EppError::Bind)?),
        None => None,
    };
    let (health, health_service) = tonic_health::server::health_reporter();
    let (shutdown, shutdown_rx) = watch::channel(false);
    let FrontEnd {
        cfg: _,
        trust,
        fleet,
        metrics,
        session_header,
        dp_rank_header,
        subs,
        replica,
        tracing: _,
        tenants: _,
        client_tls: _,
    } = front;
    let shared = Arc::new(Shared {
        trust,
        metrics,
        session_header,
        dp_rank_header,
        concurrency: Arc::new(Semaphore::new(cfg.proxy.limits.concurrent_requests_max)),
        subs,
        replica,
        shutdown: shutdown_rx.clone(),
        health,
        scrapes: Arc::default(),
        fleet,
        tokenizers,
        cfg,
    });
    let workers = Workers::new(shared.clone());
    shared.health.set_service_status(health_names::LIVENESS, tonic_health::ServingStatus::Serving).await;
    workers.set_ready(true).await;
    if let Some(l) = health_listener {
        tokio::spawn(service::run_health(l, health_service.clone(), shutdown_rx.clone()));
    }
    tokio::spawn(kvroute_frontend::events::watch_silent(Arc::downgrade(&shared), |s| (&s.subs, &s.metrics)));
    let scraper = Scraper {
        cfg: shared.cfg.proxy.learn.clone(),
        client: scrape::MetricsClient::new(),
        stats: shared.scrapes.clone(),
    };
    tokio::spawn(scrape_loop(scraper, Arc::downgrade(&shared.fleet), shutdown_rx.clone()));
    // The picker forwards text only; the checks warn of a worker whose events cannot match.
    let probes = kvroute_frontend::agree::probes(&shared.tokenizers);
    let fleet = Arc::downgrade(&shared.fleet);
    let checks = kvroute_frontend::agree::check_loop(
        scrape::MetricsClient::new(),
        shared.cfg.proxy.learn.clone(),
        probes,
        fleet,
        shutdown_rx.clone(),
    );
    tokio::spawn(checks);
    let task = tokio::spawn(service::run(server, listener, shared.clone(), health_service, shutdown_rx));
    Ok(EppHandle { local_addr, shared, shutdown, task })
}

impl EppHandle {
    /// The address the gateway connects to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The driver of `model`'s pool, to feed it KV events or inspect it.
    pub fn driver(&self, model: &str) -> Option<Driver> {
        self.shared.fleet.pool(model).map(|p| p.driver.clone())
    }

    /// The worker registry, for discovery (see [`k8s::watch`]).
    pub fn workers(&self) -> Workers {
        Workers::new(self.shared.clone())
    }

    /// Scrapes of the workers' metrics pages (`[learn]`): read and dropped.
    pub fn engine_scrapes(&self) -> Arc<ScrapeStats> {
        self.shared.scrapes.clone()
    }

    /// The Prometheus exposition of the pools and decisions, as `kvroute serve` serves it.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics.encode()
    }

    /// A handle that encodes the metrics, for an HTTP endpoint that outlives borrows.
    pub fn metrics_handle(&self) -> MetricsHandle {
        MetricsHandle(self.shared.clone())
    }

    /// Whether this replica's NATS link is up; `None` for a picker routing alone.
    pub fn nats_connected(&self) -> Option<bool> {
        self.shared.replica.as_ref().map(|r| r.connected())
    }

    /// Reports `NOT_SERVING`, stops accepting, lets open streams run for up to
    /// `limits.shutdown_grace_s`, then cuts the rest, and tells peer replicas it left.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let grace = Duration::from_secs(self.shared.cfg.proxy.limits.shutdown_grace_s);
        let mut task = self.task;
        if tokio::time::timeout(grace, &mut task).await.is_err() {
            task.abort();
            let _ = task.await;
        }
        // After the drain, so the ends of the last requests reach the peers first.
        if let Some(r) = &self.shared.replica {
            r.goodbye().await;
        }
    }
}

/// Encodes the picker's metrics; cheap to clone.
#[derive(Clone)]
pub struct MetricsHandle(Arc<Shared>);

impl MetricsHandle {
    /// The Prometheus exposition.
    pub fn encode(&self) -> String {
        self.0.metrics.encode()
    }
}

/// Why [`serve`] could not start.
#[derive(Debug)]
#[non_exhaustive]
pub enum EppError {
    /// The front end did not start (configuration, workers, KV events, replicas).
    Start(StartError),
    /// The gateway's certificate was refused.
    Tls(tonic::transport::Error),
    /// A certificate was given, but this build has no TLS support (the `tls` feature).
    TlsNotBuilt,
    /// A listening socket could not be bound.
    Bind(std::io::Error),
    /// `[[tenants]]` is configured, but the picker does not authenticate clients.
    TenantsUnsupported,
}

impl fmt::Display for EppError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EppError::Start(e) => write!(f, "{e}"),
            EppError::Tls(e) => write!(f, "tls: cannot serve with this certificate: {e}"),
            EppError::TlsNotBuilt => f.write_str("tls: this build has no TLS support (the `tls` feature)"),
            EppError::Bind(e) => write!(f, "cannot listen: {e}"),
            EppError::TenantsUnsupported => f.write_str(
                "[[tenants]] is not supported by the endpoint picker: it does not authenticate clients; \
                 put authentication in the gateway, or serve with the proxy",
            ),
        }
    }
}

impl std::error::Error for EppError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            EppError::Start(e) => Some(e),
            EppError::Tls(e) => Some(e),
            EppError::TlsNotBuilt => None,
            EppError::Bind(e) => Some(e),
            EppError::TenantsUnsupported => None,
        }
    }
}
