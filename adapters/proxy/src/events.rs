//! KV-event subscriptions: every worker that names a `kv_events` endpoint feeds its
//! model's router through the events adapter (ZeroMQ, msgpack, sequencing, replay).
//! Workers without one are routed on the router's own predictions.

use std::collections::BTreeMap;

use kvroute_driver::Driver;
use kvroute_events::{
    runner, EndpointConfig, EventSink, IngestHandle, RouterEvent, RunnerConfig, StreamConfig, ZmqConnector,
};
use router_core::hash::BlockSize;
use router_core::WorkerKey;

use crate::{ProxyConfig, ServeHandle, WorkerConfig};

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

/// The event subscriptions of every model, keyed by model name.
pub struct Subscriptions {
    by_model: BTreeMap<String, IngestHandle<DriverSink>>,
}

impl Subscriptions {
    /// Subscribes to every configured worker that names a KV-event endpoint.
    pub async fn start(cfg: &ProxyConfig, handle: &ServeHandle) -> Result<Self, String> {
        let mut subs = Subscriptions { by_model: BTreeMap::new() };
        for w in &cfg.workers {
            subs.add(cfg, handle, w).await?;
        }
        Ok(subs)
    }

    /// Subscribes to one worker's events (if it names an endpoint).
    pub async fn add(&mut self, cfg: &ProxyConfig, handle: &ServeHandle, w: &WorkerConfig) -> Result<(), String> {
        let Some(endpoint) = &w.kv_events else { return Ok(()) };
        let driver = handle.driver(&w.model).ok_or_else(|| format!("worker {}: unknown model {}", w.id, w.model))?;
        let block =
            cfg.models.iter().find(|m| m.name == w.model).and_then(|m| m.block_size).unwrap_or(cfg.router.block_size);
        let block_size = BlockSize::new(block).map_err(|e| e.to_string())?;
        let ingest = self.by_model.entry(w.model.clone()).or_insert_with(|| {
            let (h, _task) = runner::spawn(RunnerConfig::default(), ZmqConnector::default(), DriverSink(driver));
            h
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
            ingest.add_endpoint(ep).await.map_err(|e| format!("worker {} rank {rank}: {e:?}", w.id))?;
        }
        Ok(())
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
