//! KV-event subscriptions: every worker that names a `kv_events` endpoint feeds its
//! model's router through the events adapter (ZeroMQ, msgpack, sequencing, replay).
//! Workers without one are routed on the router's own predictions. Each stream's status
//! is reported through [`Subscriptions::report`] for `GET /workers`.

use std::collections::BTreeMap;
use std::fmt;

use kvroute_driver::Driver;
use kvroute_events::ingest::{IngestError, StreamStatus};
use kvroute_events::{
    runner, EndpointConfig, EventSink, IngestHandle, RouterEvent, RunnerConfig, StreamConfig, ZmqConnector,
};
use router_core::{BlockSize, WorkerKey};

use crate::config::{ProxyConfig, WorkerConfig};
use crate::fleet::Fleet;
use crate::metrics::{IngestRow, Metrics};

/// Feeds one model's router from its workers' event streams.
#[derive(Clone)]
pub struct DriverSink(pub Driver);

impl EventSink for DriverSink {
    fn apply(&mut self, key: WorkerKey, ev: &RouterEvent) {
        // The router counts what it refuses (unregistered worker, unknown parent).
        let _ = self.0.apply_kv_event(key, ev.as_index_event());
    }
    fn clear_worker(&mut self, key: WorkerKey) {
        self.0.clear_kv(key);
    }
    fn set_trusted(&mut self, key: WorkerKey, trusted: bool) {
        self.0.set_overlap_trust(key, trusted);
    }
}

/// One model's ingestion and when it started (the runner's clock counts from then).
struct Runner {
    ingest: IngestHandle<DriverSink>,
    started: tokio::time::Instant,
}

/// A subscribed worker.
struct Subscribed {
    model: String,
    ranks: u32,
    endpoint: String,
    replay_endpoint: Option<String>,
}

/// One rank's KV-event stream, as `GET /workers` shows it.
#[derive(Clone, Debug)]
pub struct StreamReport {
    /// The data-parallel rank.
    pub rank: u32,
    /// The PUB address subscribed to.
    pub endpoint: String,
    /// The replay address, if any.
    pub replay_endpoint: Option<String>,
    /// The ingestion's counters; `None` if the runner is gone.
    pub status: Option<StreamStatus>,
    /// Milliseconds since the stream's last message of any kind; `None` before the first.
    pub last_message_age_ms: Option<u64>,
    /// Quiet for the silence threshold while the worker served requests.
    pub silent: bool,
}

/// The event subscriptions of every model, keyed by model name.
pub struct Subscriptions {
    by_model: BTreeMap<String, Runner>,
    /// Subscribed workers.
    workers: BTreeMap<u64, Subscribed>,
    /// Streams already reported silent, so each is reported once per silence.
    reported: std::collections::BTreeSet<WorkerKey>,
}

impl Subscriptions {
    /// Subscribes to every configured worker that names a KV-event endpoint.
    pub async fn start(cfg: &ProxyConfig, fleet: &Fleet) -> Result<Self, SubscribeError> {
        let mut subs =
            Subscriptions { by_model: BTreeMap::new(), workers: BTreeMap::new(), reported: Default::default() };
        for w in &cfg.workers {
            subs.add(cfg, fleet, w).await?;
        }
        Ok(subs)
    }

    /// Closes a worker's subscriptions and purges what they fed (a worker left, or is
    /// being replaced). A worker without a subscription is a no-op.
    pub async fn remove(&mut self, id: u64) {
        let Some(sub) = self.workers.remove(&id) else { return };
        if let Some(r) = self.by_model.get(&sub.model) {
            for rank in 0..sub.ranks {
                // A stream that is already gone has nothing left to purge.
                let _ = r.ingest.remove_endpoint(WorkerKey::new(id, rank)).await;
            }
        }
        self.reported.retain(|k| k.worker.0 != id);
    }

    /// Reports streams that stayed silent while their worker served requests: a silent
    /// stream is the most common misconfiguration (wrong port, events not enabled).
    /// Each is resubscribed once per silence, in case the subscription itself was lost
    /// (a connection dropped without a word, a publisher that forgot it).
    pub async fn check_silent(&mut self, metrics: &Metrics) {
        let served = metrics.served_totals();
        for (model, runner) in &self.by_model {
            let totals: BTreeMap<WorkerKey, u64> = self
                .workers
                .iter()
                .filter(|(_, s)| &s.model == model)
                .flat_map(|(&id, s)| {
                    let n = served.get(&id).copied().unwrap_or(0);
                    (0..s.ranks).map(move |r| (WorkerKey::new(id, r), n))
                })
                .collect();
            let silent = runner.ingest.silent_streams(totals).await;
            let now_silent: std::collections::BTreeSet<WorkerKey> = silent.iter().map(|s| s.key).collect();
            for s in &silent {
                if self.reported.insert(s.key) {
                    tracing::warn!(
                        worker = s.key.worker.0,
                        rank = s.key.rank.0,
                        silent_ms = s.silent_ms,
                        requests = s.requests,
                        "KV-event stream silent while the worker serves requests; resubscribing; \
                         check its kv_events endpoint if it stays silent"
                    );
                    metrics.silent_stream(model, s.key.worker.0);
                    let _ = runner.ingest.resubscribe(s.key).await;
                }
            }
            self.reported
                .retain(|k| self.workers.get(&k.worker.0).is_none_or(|s| &s.model != model) || now_silent.contains(k));
        }
    }

    /// Worker `id`'s streams, one per rank; empty if it subscribes to none. `served` is
    /// how many requests it has served, for the silence verdict. Asks the runner once
    /// per rank.
    pub async fn report(&self, id: u64, served: u64) -> Vec<StreamReport> {
        let Some(sub) = self.workers.get(&id) else { return Vec::new() };
        let Some(runner) = self.by_model.get(&sub.model) else { return Vec::new() };
        let keys: Vec<WorkerKey> = (0..sub.ranks).map(|r| WorkerKey::new(id, r)).collect();
        let silent = runner.ingest.silent_streams(keys.iter().map(|&k| (k, served)).collect()).await;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let status = runner.ingest.status(key).await;
            // The runner's clock starts when it is spawned, just after `started`: the age
            // is at most that gap too old.
            let now_us = u64::try_from(runner.started.elapsed().as_micros()).unwrap_or(u64::MAX);
            let last_message_age_ms =
                status.as_ref().and_then(|s| s.last_message_at).map(|at| now_us.saturating_sub(at.as_micros()) / 1000);
            out.push(StreamReport {
                rank: key.rank.0,
                endpoint: offset_port(&sub.endpoint, key.rank.0),
                replay_endpoint: sub.replay_endpoint.as_deref().map(|r| offset_port(r, key.rank.0)),
                status,
                last_message_age_ms,
                silent: silent.iter().any(|s| s.key == key),
            });
        }
        out
    }

    /// Every subscribed stream's counters now, for the metrics
    /// ([`Metrics::set_ingest`]). Asks the runner once per stream.
    pub async fn ingest_rows(&self) -> Vec<IngestRow> {
        let mut rows = Vec::new();
        for (&id, sub) in &self.workers {
            let Some(runner) = self.by_model.get(&sub.model) else { continue };
            for rank in 0..sub.ranks {
                let Some(status) = runner.ingest.status(WorkerKey::new(id, rank)).await else { continue };
                let now_us = u64::try_from(runner.started.elapsed().as_micros()).unwrap_or(u64::MAX);
                let last_message_age_s =
                    status.last_message_at.map(|at| now_us.saturating_sub(at.as_micros()) as f64 / 1e6);
                rows.push(IngestRow { model: sub.model.clone(), worker: id, rank, status, last_message_age_s });
            }
        }
        rows
    }

    /// Subscribes to one worker's events (if it names an endpoint).
    pub async fn add(&mut self, cfg: &ProxyConfig, fleet: &Fleet, w: &WorkerConfig) -> Result<(), SubscribeError> {
        self.remove(w.id).await;
        let Some(endpoint) = &w.kv_events else { return Ok(()) };
        let driver = fleet
            .pool(&w.model)
            .map(|p| p.driver.clone())
            .ok_or_else(|| SubscribeError::UnknownModel { worker: w.id, model: w.model.clone() })?;
        let block =
            cfg.models.iter().find(|m| m.name == w.model).and_then(|m| m.block_size).unwrap_or(cfg.router.block_size);
        let block_size =
            BlockSize::new(block).map_err(|_| SubscribeError::BlockSize { worker: w.id, tokens: block })?;
        let runner = self.by_model.entry(w.model.clone()).or_insert_with(|| {
            let started = tokio::time::Instant::now();
            // Seeded so a worker cannot aim its engine hashes at one bucket of the translator.
            let mut rc = RunnerConfig::default();
            rc.ingest.map_seed = fleet.seed_for(1);
            rc.ingest.decode.engine_hash_seed = fleet.seed_for(2);
            let (ingest, _task) = runner::spawn(rc, ZmqConnector::default(), DriverSink(driver));
            Runner { ingest, started }
        });
        for rank in 0..w.dp_ranks {
            let stream = StreamConfig {
                key: WorkerKey::new(w.id, rank),
                block_size,
                cache_salt: None,
                blocks_max: w.kv_blocks as usize,
                has_replay: w.kv_events_replay.is_some(),
            };
            let ep = EndpointConfig {
                stream,
                endpoint: offset_port(endpoint, rank),
                replay_endpoint: w.kv_events_replay.as_deref().map(|r| offset_port(r, rank)),
                topic: String::new(),
            };
            let stream = |source| SubscribeError::Stream { worker: w.id, rank, source };
            runner.ingest.add_endpoint(ep).await.map_err(stream)?;
        }
        let sub = Subscribed {
            model: w.model.clone(),
            ranks: w.dp_ranks,
            endpoint: endpoint.clone(),
            replay_endpoint: w.kv_events_replay.clone(),
        };
        self.workers.insert(w.id, sub);
        Ok(())
    }
}

/// Why a worker's KV events could not be subscribed to.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum SubscribeError {
    /// The worker names a model that is not configured.
    UnknownModel {
        /// The worker.
        worker: u64,
        /// The model it names.
        model: String,
    },
    /// The model's block size is not one the router accepts.
    BlockSize {
        /// The worker.
        worker: u64,
        /// The refused size, in tokens.
        tokens: u32,
    },
    /// The event ingestion refused one rank's stream.
    Stream {
        /// The worker.
        worker: u64,
        /// The data-parallel rank.
        rank: u32,
        /// Why.
        source: IngestError,
    },
}

impl fmt::Display for SubscribeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubscribeError::UnknownModel { worker, model } => write!(f, "worker {worker}: unknown model {model}"),
            SubscribeError::BlockSize { worker, tokens } => {
                write!(f, "worker {worker}: block size {tokens} is not a power of two from 1 to 1024")
            }
            SubscribeError::Stream { worker, rank, source } => write!(f, "worker {worker} rank {rank}: {source}"),
        }
    }
}

impl std::error::Error for SubscribeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SubscribeError::Stream { source, .. } => Some(source),
            SubscribeError::UnknownModel { .. } | SubscribeError::BlockSize { .. } => None,
        }
    }
}

/// Engines bind one socket per dp rank, at the base port plus the rank.
fn offset_port(endpoint: &str, rank: u32) -> String {
    if rank == 0 {
        return endpoint.to_string();
    }
    match endpoint.rsplit_once(':') {
        Some((host, port)) => match port.parse::<u32>() {
            Ok(p) => format!("{host}:{}", p + rank),
            Err(_) => endpoint.to_string(),
        },
        None => endpoint.to_string(),
    }
}

/// How often streams are checked for silence.
const SILENT_CHECK_INTERVAL_MS: u64 = 10_000;

/// Where a server keeps its subscriptions and metrics, for [`watch_silent`].
pub type SilentParts<S> = fn(&S) -> (&tokio::sync::Mutex<Subscriptions>, &Metrics);

/// Checks for silent streams, and refreshes the ingestion metrics, until the server
/// holding them (`state`) is gone.
pub async fn watch_silent<S>(state: std::sync::Weak<S>, parts: SilentParts<S>) {
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(SILENT_CHECK_INTERVAL_MS)).await;
        let Some(state) = state.upgrade() else { return };
        let (subs, metrics) = parts(&state);
        let mut subs = subs.lock().await;
        subs.check_silent(metrics).await;
        metrics.set_ingest(subs.ingest_rows().await);
    }
}
