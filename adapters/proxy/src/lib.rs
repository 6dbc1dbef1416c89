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
//! Endpoints: `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`;
//! `GET /v1/models`, `/health`, `/ready`, `/metrics`; and for trusted clients
//! `GET|POST /workers`, `DELETE /workers/{id}`, `POST /route/preview`.
//!
//! What it leaves to others: tokenizers (the binary registers them), KV events (the
//! events adapter feeds [`ServeHandle::driver`]), TLS (terminate it in front), and the
//! KV transfer between prefill and decode workers (the engines move the cache).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod body;
pub mod config;
pub mod cost_header;
pub mod disagg;
pub mod error;
pub mod events;
pub mod fleet;
pub mod handler;
pub mod health;
pub mod learn;
pub mod metrics;
pub mod request;
pub mod scrape;
pub mod server;
pub mod state;
pub mod tokenize;
pub mod trust;
pub mod upstream;

use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;

use http::HeaderName;
use kvroute_driver::Driver;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

pub use config::{ConfigError, ProxyConfig, WorkerConfig};
pub use error::{ApiError, ProxyError};
pub use fleet::FleetError;
pub use server::ShutdownReport;
pub use tokenize::{tokenizer_missing, tokenizer_missing_warning, Tokenize, TokenizeError, Tokenizers};

use crate::fleet::Fleet;
use crate::health::Outliers;
use crate::metrics::Metrics;
use crate::state::State;
use crate::trust::Trust;
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

/// Starts the proxy: checks `cfg`, builds a pool per model, registers the configured
/// workers, binds `cfg.listen` and serves until [`ServeHandle::shutdown`]. Must run
/// inside a tokio runtime.
pub async fn serve(cfg: ProxyConfig, tokenizers: Tokenizers) -> Result<ServeHandle, ProxyError> {
    cfg.validate()?;
    let seed = cfg.seed.unwrap_or_else(random_seed);
    let fleet = Arc::new(Fleet::new(&cfg, seed));
    for w in &cfg.workers {
        fleet.add_worker(w.clone()).map_err(|e| ProxyError::Worker { id: w.id, message: e.0 })?;
    }
    let subs =
        events::Subscriptions::start(&cfg, &fleet).await.map_err(|message| ProxyError::Worker { id: 0, message })?;
    let replica = match &cfg.replica {
        Some(r) => {
            let pools = fleet
                .pools()
                .map(|p| kvroute_replica::PoolLink { model: p.name.clone(), driver: p.driver.clone() })
                .collect();
            let handle = kvroute_replica::start(r.options(), pools)
                .await
                .map_err(|e| ProxyError::Worker { id: 0, message: e.to_string() })?;
            Some(Arc::new(handle))
        }
        None => None,
    };
    let listener = TcpListener::bind(cfg.listen).await.map_err(ProxyError::Bind)?;
    let local_addr = listener.local_addr().map_err(ProxyError::Bind)?;
    let (shutdown, shutdown_rx) = watch::channel(false);
    let header = |name: &str| {
        HeaderName::from_bytes(name.as_bytes()).map_err(|e| ProxyError::Worker { id: 0, message: e.to_string() })
    };
    let mut metrics = Metrics::new(fleet.clone());
    let missing = tokenize::tokenizer_missing(&cfg);
    for model in &missing {
        tracing::warn!("{}", tokenize::tokenizer_missing_warning(model));
    }
    metrics.register_tokenizer_missing(cfg.models.iter().map(|m| m.name.as_str()), &missing);
    if let Some(r) = &replica {
        metrics.register_replica(r.clone(), fleet.clone());
    }
    let state = Arc::new(State {
        trust: Trust::new(&cfg.trust),
        client: upstream::client(&cfg.limits),
        metrics,
        concurrency: Arc::new(Semaphore::new(cfg.limits.concurrent_requests_max)),
        budget: RetryBudget::new(&cfg.retry),
        outliers: Outliers::new(cfg.ejection.clone()),
        session_header: header(&cfg.session_header)?,
        dp_rank_header: header(&cfg.dp_rank_header)?,
        shutdown: shutdown_rx.clone(),
        subs: tokio::sync::Mutex::new(subs),
        replica,
        scrapes: Arc::default(),
        fleet,
        tokenizers,
        cfg,
    });
    tokio::spawn(health::active_checks(state.clone()));
    tokio::spawn(events::watch_silent(std::sync::Arc::downgrade(&state)));
    let scraper =
        scrape::Scraper { cfg: state.cfg.learn.clone(), client: state.client.clone(), stats: state.scrapes.clone() };
    tokio::spawn(scrape::scrape_loop(scraper, Arc::downgrade(&state.fleet), shutdown_rx.clone()));
    let task = tokio::spawn(server::accept_loop(listener, state.clone(), shutdown_rx));
    Ok(ServeHandle { local_addr, state, shutdown, task })
}

impl ServeHandle {
    /// The address the proxy listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The driver of `model`'s pool, to feed it KV events or inspect it.
    pub fn driver(&self, model: &str) -> Option<Driver> {
        self.state.fleet.pool(model).map(|p| p.driver.clone())
    }

    /// Adds or replaces a worker, as `POST /workers` does.
    pub fn add_worker(&self, w: WorkerConfig) -> Result<bool, FleetError> {
        self.state.cfg.check_worker(&w).map_err(|(k, m)| FleetError(format!("{k}: {m}")))?;
        self.state.fleet.add_worker(w)
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

/// A seed from the process's random hasher keys, so hash tables and draws differ per run.
fn random_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x6b76_726f_7574_6521);
    h.finish()
}
