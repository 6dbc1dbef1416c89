//! `kvroute-proxy` is an OpenAI-compatible HTTP proxy that sends each request to the
//! worker `router-core` picks, and streams the worker's answer back unchanged.
//!
//! Per request it reads the body (bounded), finds the model's pool, turns the prompt
//! into block hashes (a real tokenizer through [`Tokenize`], or hashed bytes), asks the
//! pool's [`kvroute_driver::Driver`] for a worker (waiting in the admission queue if
//! the fleet is busy), forwards the request without the `kvroute` object, confirms the
//! booking when the worker's headers arrive, and streams the body back frame by frame.
//! Connect failures are retried on other workers within a retry budget; repeated
//! failures eject a worker until a probe readmits it. A client that goes away frees its
//! load, lease and queue slot at once.
//!
//! A model with a `disagg_protocol` splits each request between a prefill and a decode
//! worker, speaking vLLM's NIXL or SGLang's bootstrap protocol, or runs it aggregated on
//! a decode worker when remote prefill would not pay (see [`disagg`]).
//!
//! Endpoints: every inference endpoint vLLM serves, by `POST` (`/v1/chat/completions`,
//! `/v1/completions`, `/v1/responses`, `/v1/embeddings`, `/v1/score`, `/v1/rerank`,
//! `/tokenize`, `/detokenize` and their aliases; what each routes on is in
//! `endpoints.rs`); `GET /v1/models` (cached, per tenant, see [`models`]),
//! `/v1/models/{id}`, `/health`, `/ready`, `/metrics`; and for trusted clients
//! `GET|POST /workers`, `DELETE /workers/{id}`, `POST /route/preview`.
//!
//! What it leaves to others: tokenizers (the binary registers them), KV events (the
//! events adapter feeds [`ServeHandle::driver`]), and the KV transfer between prefill
//! and decode workers (the engines move the cache). With `[tls]` it serves TLS (HTTP/2
//! or HTTP/1.1 by ALPN), its certificate read again when the files change; `https`
//! workers are reached over TLS, verified against `[upstream_tls]` (see [`tls`]).
//! With `[tracing]`, each request is a span with children per stage, exported over
//! OTLP, and its W3C trace context reaches the worker (see [`trace`]). What
//! happens before transport (configuration, pools, parsing, trust, subscriptions,
//! metrics, start-up) is `kvroute-frontend`'s, shared with the endpoint picker; its
//! modules are re-exported here under the proxy's own paths.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod admin;
mod aggregated;
pub mod auth;
pub mod body;
pub mod disagg;
pub mod drain;
mod endpoints;
pub mod handler;
pub mod health;
mod limits;
pub mod migrate;
pub mod models;
mod outliers;
mod prepared;
mod quota;
pub mod retry;
mod route;
pub mod server;
pub mod state;
mod stream;
pub mod tls;
pub mod trace;
mod tries;
mod usage;
// `ConnPool` and its methods are `pub` in a module the crate does not export; narrowing
// them belongs to the change now reworking `upstream/`.
#[allow(unreachable_pub)]
pub mod upstream;
mod workers;

// The front end's modules, under the paths the proxy's code and users have always used.
pub use kvroute_frontend::{
    config, cost_header, error, events, fleet, learn, media, metrics, request, scrape, tenants, tokenize, trust,
};

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use kvroute_driver::Driver;
use kvroute_frontend::tls::{ServerTls, TlsError};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

pub use config::{ConfigError, ProxyConfig, WorkerConfig};
pub use error::ApiError;
pub use fleet::FleetError;
pub use kvroute_frontend::{FrontEnd, StartError};
pub use server::ShutdownReport;
pub use tokenize::{tokenizer_missing_warning, Tokenize, TokenizeError, Tokenizers};
pub use workers::Workers;

use crate::outliers::Outliers;
use crate::state::State;
use crate::upstream::RetryBudget;

/// A running proxy: its address, its pools, and the way to stop it.
///
/// Dropping the handle starts the same graceful shutdown as [`ServeHandle::shutdown`],
/// without waiting for it; keep the handle for as long as the proxy should serve.
pub struct ServeHandle {
    local_addr: SocketAddr,
    state: Arc<State>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<ShutdownReport>,
}

/// Starts the proxy: loads `[tls]`'s certificate (and reloads it on change from then
/// on), starts the front end ([`kvroute_frontend::start`]: checks `cfg`, builds a pool
/// per model, registers the configured workers, subscribes to their KV events, joins
/// the peer replicas), binds `cfg.listen` and serves until [`ServeHandle::shutdown`].
/// Must run inside a tokio runtime.
pub async fn serve(cfg: ProxyConfig, tokenizers: Tokenizers) -> Result<ServeHandle, ProxyError> {
    // Before the front end starts anything (drivers, subscriptions, replicas).
    let tls = cfg.tls.as_ref().map(ServerTls::load).transpose().map_err(ProxyError::Tls)?.map(Arc::new);
    let front = kvroute_frontend::start(&cfg).await.map_err(ProxyError::Start)?;
    let listener = TcpListener::bind(cfg.listen).await.map_err(ProxyError::Bind)?;
    let local_addr = listener.local_addr().map_err(ProxyError::Bind)?;
    let (shutdown, shutdown_rx) = watch::channel(false);
    let FrontEnd {
        cfg,
        trust,
        tenants,
        fleet,
        mut metrics,
        session_header,
        dp_rank_header,
        subs,
        replica,
        tracing,
        client_tls,
    } = front;
    metrics.register_tokenizers(tokenizers.clone());
    if let Some(t) = &tls {
        metrics.register_tls_reloads(t.reloads());
        tokio::spawn(t.clone().watch(shutdown_rx.clone()));
    }
    let state = Arc::new(State {
        trust,
        limits: quota::TenantLimits::new(&tenants, &metrics, tokio::time::Instant::now()),
        tenants,
        client: upstream::client(&cfg.limits, client_tls),
        metrics,
        concurrency: Arc::new(Semaphore::new(cfg.limits.concurrent_requests_max)),
        budget: RetryBudget::new(&cfg.retry),
        outliers: Outliers::new(cfg.ejection.clone()),
        session_header,
        dp_rank_header,
        shutdown: shutdown_rx.clone(),
        subs,
        replica,
        scrapes: Arc::default(),
        tracing,
        models: models::ModelsCache::default(),
        fleet,
        tokenizers,
        cfg,
    });
    tokio::spawn(health::active_checks(state.clone()));
    tokio::spawn(events::watch_silent(Arc::downgrade(&state), |s| (&s.subs, &s.metrics)));
    let scraper =
        scrape::Scraper { cfg: state.cfg.learn.clone(), client: state.client.clone(), stats: state.scrapes.clone() };
    tokio::spawn(scrape::scrape_loop(scraper, Arc::downgrade(&state.fleet), shutdown_rx.clone()));
    let probes = kvroute_frontend::agree::probes(&state.tokenizers);
    let checks = kvroute_frontend::agree::check_loop(
        state.client.clone(),
        state.cfg.learn.clone(),
        probes,
        Arc::downgrade(&state.fleet),
        shutdown_rx.clone(),
    );
    tokio::spawn(checks);
    let acceptor = tls.map(|t| tokio_rustls::TlsAcceptor::from(t.config()));
    let task = tokio::spawn(server::accept_loop(listener, state.clone(), shutdown_rx, acceptor));
    Ok(ServeHandle { local_addr, state, shutdown, task })
}

impl ServeHandle {
    /// The address the proxy listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Whether clients connect over TLS (`[tls]`).
    pub fn is_tls(&self) -> bool {
        self.state.cfg.tls.is_some()
    }

    /// The driver of `model`'s pool, to feed it KV events or inspect it.
    pub fn driver(&self, model: &str) -> Option<Driver> {
        self.state.fleet.pool(model).map(|p| p.driver.clone())
    }

    /// Adds or replaces a worker, as `POST /workers` does.
    pub fn add_worker(&self, w: WorkerConfig) -> Result<bool, FleetError> {
        let invalid = |(key, message): (&str, String)| ConfigError::Invalid { key: key.into(), message };
        self.state.cfg.check_worker(&w).map_err(|e| FleetError::Invalid(invalid(e)))?;
        self.state.fleet.add_worker(w)
    }

    /// The worker registry, for discovery: add, remove and drain as the admin API does.
    pub fn workers(&self) -> Workers {
        Workers { state: self.state.clone() }
    }

    /// Removes a worker, as `DELETE /workers/{id}` does.
    pub fn remove_worker(&self, id: u64) -> bool {
        self.state.outliers.forget(id);
        self.state.fleet.remove_worker(id)
    }

    /// The Prometheus exposition, as `GET /metrics` serves it.
    pub fn metrics_text(&self) -> String {
        self.state.metrics.encode()
    }

    /// Stops accepting, lets in-flight requests finish within `shutdown_grace_s`, then
    /// cuts the rest.
    pub async fn shutdown(self) -> ShutdownReport {
        let _ = self.shutdown.send(true);
        let report = self.task.await.unwrap_or(ShutdownReport { drained: false, connections_aborted: 0 });
        // After the drain, so the ends of the last requests reach the peers first.
        if let Some(r) = &self.state.replica {
            r.goodbye().await;
        }
        // After the drain too, so the last requests' spans are exported.
        if let Some(t) = &self.state.tracing {
            t.shutdown().await;
        }
        report
    }

    /// Stops at once, as a crash would: open connections are cut and peer replicas are
    /// told nothing (they drop this replica's load once it has been silent for
    /// `replica_silence_max_ms`). For failure tests.
    pub fn abort(self) {
        if let Some(r) = &self.state.replica {
            r.abort();
        }
        self.task.abort();
    }

    /// Whether this replica's NATS link is up; `None` for a proxy routing alone.
    pub fn nats_connected(&self) -> Option<bool> {
        self.state.replica.as_ref().map(|r| r.connected())
    }
}

/// Why [`crate::serve`] could not start.
#[derive(Debug)]
#[non_exhaustive]
pub enum ProxyError {
    /// The front end did not start (configuration, workers, KV events, replicas).
    Start(StartError),
    /// The listening socket could not be bound.
    Bind(std::io::Error),
    /// `[tls]`'s certificate or key could not be loaded.
    Tls(TlsError),
}

impl fmt::Display for ProxyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProxyError::Start(e) => write!(f, "{e}"),
            ProxyError::Bind(e) => write!(f, "cannot listen: {e}"),
            ProxyError::Tls(e) => write!(f, "tls: {e}"),
        }
    }
}

impl std::error::Error for ProxyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ProxyError::Start(e) => Some(e),
            ProxyError::Bind(e) => Some(e),
            ProxyError::Tls(e) => Some(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use serde_json::json;

    use super::*;

    /// Each level of `e`'s chain, from `e` down.
    fn chain<'a>(e: &'a (dyn Error + 'static)) -> Vec<&'a (dyn Error + 'static)> {
        let mut out = vec![e];
        while let Some(s) = out[out.len() - 1].source() {
            out.push(s);
        }
        out
    }

    /// `cfg` is refused with a chain `depth` deep whose messages each print the next
    /// (they are quoted whole) and whose last level passes `cause`.
    #[track_caller]
    fn check(e: ProxyError, depth: usize, cause: fn(&(dyn Error + 'static)) -> bool) {
        let levels = chain(&e);
        assert_eq!(levels.len(), depth, "{e:?}");
        for w in levels.windows(2) {
            assert!(w[0].to_string().contains(&w[1].to_string()), "{} does not print {}", w[0], w[1]);
        }
        assert!(cause(levels[depth - 1]), "{e:?}");
    }

    async fn serve_err(cfg: ProxyConfig) -> ProxyError {
        match serve(cfg, Tokenizers::new()).await {
            Err(e) => e,
            Ok(_) => panic!("the proxy started"),
        }
    }

    #[tokio::test]
    async fn start_errors_chain_to_their_cause() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let cfg = ProxyConfig { listen: taken.local_addr().unwrap(), ..ProxyConfig::default() };
        let e = serve_err(cfg).await;
        assert!(matches!(e, ProxyError::Bind(_)), "{e:?}");
        check(e, 2, |s| {
            s.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::AddrInUse)
        });

        let cfg = ProxyConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            models: vec![serde_json::from_value(json!({"name": "m"})).unwrap()],
            workers: vec![serde_json::from_value(
                json!({"id": 1, "url": "http://127.0.0.1:1", "model": "m", "dp_ranks": 4_000_000_000u32}),
            )
            .unwrap()],
            ..ProxyConfig::default()
        };
        let e = serve_err(cfg).await;
        assert!(matches!(e, ProxyError::Start(StartError::Worker { id: 1, .. })), "{e:?}");
        // ProxyError, StartError, FleetError, DriveError, InputError, WorkerError.
        check(e, 6, |s| s.is::<router_core::WorkerError>());
    }
}
