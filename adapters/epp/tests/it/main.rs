//! The endpoint picker end to end on loopback: a gRPC client generated from the same
//! protos plays the gateway against real `kvroute sim-worker` servers, and a recorded
//! Kubernetes API plays the cluster.

mod config;
mod errors;
mod extproc;
mod gateway;
mod k8s;
mod replica;
mod scrape;

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_epp::{EppConfig, EppHandle};
use kvroute_frontend::{ProxyConfig, Tokenizers};
use kvroute_sim_server::{EngineConfig, SimServerConfig, SimServerHandle};
use router_core::RouterMode;
use serde_json::json;

pub use gateway::{Gateway, Picked, Stream};

pub const MODEL: &str = "m";

/// A fast simulated worker of model `m` with 16-token blocks.
pub async fn sim_worker() -> SimServerHandle {
    let cfg = SimServerConfig {
        model: MODEL.into(),
        engine: EngineConfig { speedup: 1000.0, block_size: 16, ..EngineConfig::default() },
        ..SimServerConfig::default()
    };
    kvroute_sim_server::spawn(cfg).await.expect("sim worker starts")
}

/// The test baseline: loopback, one model `m` with 16-token blocks, KV-aware routing on
/// predicted caches, the given workers (ids 0, 1, ...).
pub fn config(workers: &[SocketAddr]) -> EppConfig {
    let mut proxy = ProxyConfig {
        seed: Some(1),
        models: vec![serde_json::from_value(json!({"name": MODEL, "block_size": 16})).unwrap()],
        workers: workers
            .iter()
            .enumerate()
            .map(|(i, a)| {
                serde_json::from_value(json!({"id": i, "url": format!("http://{a}"), "model": MODEL})).unwrap()
            })
            .collect(),
        ..ProxyConfig::default()
    };
    proxy.router.mode = RouterMode::Kv;
    proxy.health_check.interval_ms = 0;
    proxy.limits.shutdown_grace_s = 2;
    EppConfig { proxy, listen: "127.0.0.1:0".parse().unwrap(), ..EppConfig::default() }
}

pub async fn start(cfg: EppConfig) -> EppHandle {
    kvroute_epp::serve(cfg, Tokenizers::new()).await.expect("the picker starts")
}

/// Nothing held: no request tracked, queued or leased, no load.
pub fn released(epp: &EppHandle) -> bool {
    let s = epp.driver(MODEL).expect("the model's pool").snapshot();
    s.requests_in_flight == 0
        && s.queue_depth == 0
        && s.affinity_live_leases == 0
        && s.load_total == router_core::WorkerLoad::default()
}

/// Requests the router tracks now.
pub fn in_flight(epp: &EppHandle) -> usize {
    epp.driver(MODEL).expect("the model's pool").snapshot().requests_in_flight
}

/// Runs `f` with a time limit, failing the test instead of hanging.
pub async fn within<F: std::future::Future>(ms: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_millis(ms), f).await.expect("timed out")
}

/// Polls `cond` every 10 ms for up to `ms`; fails with `what` if it never holds.
pub async fn eventually(ms: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(ms);
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened within {ms} ms: {what}");
}
