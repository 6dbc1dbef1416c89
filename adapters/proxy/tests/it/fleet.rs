//! The whole path with real parts: `kvroute sim-worker` servers publish KV events over
//! ZeroMQ, the proxy subscribes, its index follows their caches, and routing follows
//! the index.

use std::time::Duration;

use http::Method;
use kvroute_sim_server::{EngineConfig, SimServerConfig, SimServerHandle};
use serde_json::json;

use super::*;

/// The configs of `workers`, ids from `first_id`, each with its KV event streams.
pub(super) fn sim_worker_configs(workers: &[SimServerHandle], first_id: usize) -> Vec<WorkerConfig> {
    let config = |(i, w): (usize, &SimServerHandle)| {
        serde_json::from_value(json!({
            "id": first_id + i, "url": w.base_url(), "model": MODEL,
            "kv_events": w.events_endpoint(), "kv_events_replay": w.replay_endpoint(),
        }))
        .unwrap()
    };
    workers.iter().enumerate().map(config).collect()
}

async fn sim_worker() -> SimServerHandle {
    let cfg = SimServerConfig {
        model: MODEL.into(),
        replay_port: Some(0),
        engine: EngineConfig { speedup: 1000.0, block_size: 16, ..EngineConfig::default() },
        ..SimServerConfig::default()
    };
    kvroute_sim_server::spawn(cfg).await.expect("sim worker starts")
}

/// Token-id completion for `tokens`, streamed.
fn completion(tokens: &[u32]) -> serde_json::Value {
    json!({"model": MODEL, "prompt": tokens, "max_tokens": 4, "stream": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_from_sim_workers_steer_routing() {
    let workers = [sim_worker().await, sim_worker().await, sim_worker().await];
    let mut cfg = config(&[]);
    cfg.router.mode = RouterMode::Kv;
    // No predictions: only the workers' own events can tell the router where blocks are.
    cfg.router.approximate = false;
    cfg.workers = sim_worker_configs(&workers, 0);
    let proxy = start(cfg.clone()).await;
    let driver = proxy.driver(MODEL).expect("the model's driver");
    for id in 0..3 {
        subscribed(proxy.local_addr(), id).await;
    }

    let prompt: Vec<u32> = (0..640).map(|i| 1000 + i).collect();
    let first = call(proxy.local_addr(), Method::POST, "/v1/completions", &[], Some(&completion(&prompt))).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    let home = first.worker().expect("x-kvroute-worker");

    // The worker's Stored events reach the index over ZeroMQ; wait until the router
    // holds the whole prompt there and trusts the stream.
    let full_blocks = (prompt.len() / 16) as u64;
    indexed(proxy.local_addr(), &workers[home as usize], home, &prompt, full_blocks).await;
    let snap = driver.snapshot();
    assert!(snap.workers.iter().any(|w| w.spec.id.0 == home && w.publishes_events), "worker {home} publishes events");

    // A longer prompt sharing that prefix goes home, whatever round of draws it gets.
    for n in 0..5u32 {
        // From an idle fleet: the last request's booking ends just after its client saw
        // `[DONE]`, and its load would weigh on the cost of its own worker; and while a
        // gap in the stream is being replayed, the router does not trust its overlap.
        eventually(30_000, "the last request released, the stream trusted", || async {
            released(proxy.local_addr()).await && stream_row(proxy.local_addr(), home).await["trusted"] == true
        })
        .await;
        let mut longer = prompt.clone();
        longer.extend((0..64).map(|i| 50_000 + n * 100 + i));
        let a = call(proxy.local_addr(), Method::POST, "/v1/completions", &[], Some(&completion(&longer))).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        assert_eq!(a.worker(), Some(home), "request {n} follows its cached prefix");
        assert!(a.text().contains("data: [DONE]"), "streams to the end");
    }
    driver.check_invariants().expect("router invariants");

    // `/workers` shows the home stream live and counting, with the address it follows.
    let listed = get(proxy.local_addr(), "/workers").await.json();
    let stream = &stream_of(&listed, home)[0];
    let want_endpoint = workers[home as usize].events_endpoint();
    assert_eq!(stream["endpoint"], json!(want_endpoint), "{stream}");
    assert_eq!((stream["rank"].as_u64(), stream["silent"].as_bool()), (Some(0), Some(false)), "{stream}");
    assert!(stream["events_applied"].as_u64() >= Some(1), "{stream}");
    assert!(stream["last_seq"].is_u64() && stream["last_message_age_ms"].is_u64(), "{stream}");
    assert!(stream["events_dropped"].is_u64() && stream["connected"].is_boolean(), "{stream}");
    let _ = proxy.shutdown().await;
    for w in workers {
        w.shutdown().await;
    }
}

/// The KV-event stream rows `/workers` lists for worker `id` (none without a subscription).
#[track_caller]
fn stream_of(listed: &serde_json::Value, id: u64) -> Vec<serde_json::Value> {
    let w = listed["workers"].as_array().expect("workers").iter().find(|w| w["id"] == id).expect("worker listed");
    match &w["kv_events"] {
        serde_json::Value::Null => Vec::new(),
        ev => ev["streams"].as_array().expect("streams").clone(),
    }
}

/// Worker `id`'s rank-0 KV-event stream row from `/workers` (`Null` without one).
async fn stream_row(addr: SocketAddr, id: u64) -> serde_json::Value {
    stream_of(&get(addr, "/workers").await.json(), id).into_iter().next().unwrap_or_default()
}

/// Waits until worker `id`'s stream reports its subscription connected.
async fn subscribed(addr: SocketAddr, id: u64) {
    eventually(30_000, "the KV-event stream connects", || async { stream_row(addr, id).await["connected"] == true })
        .await;
}

/// The index's overlap with `tokens`, in device blocks, at worker `id`, from a preview.
async fn overlap_at(addr: SocketAddr, tokens: &[u32], id: u64) -> u64 {
    let a = call(addr, Method::POST, "/v1/completions", &[("x-kvroute-preview", "1")], Some(&completion(tokens))).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let j = a.json();
    let rows = j["explanation"].as_array().cloned().unwrap_or_default();
    rows.iter().find(|r| r["worker"] == id).and_then(|r| r["overlap"]["device"].as_u64()).unwrap_or(0)
}

/// Waits until the index holds `blocks` blocks of `prompt` at worker `id` (served by
/// `worker`) and trusts its stream. ZeroMQ drops what is published before a
/// subscription reaches the publisher (slow joiner); the stream recovers it with a
/// replay from 0 once a later batch shows the gap. A worker that served only the lost
/// request publishes no later batch, so while its stream has applied nothing, it is
/// nudged: a short request of other tokens sent to it directly.
async fn indexed(addr: SocketAddr, worker: &SimServerHandle, id: u64, prompt: &[u32], blocks: u64) {
    let mut nudges = 0u32;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let row = stream_row(addr, id).await;
        if row["trusted"] == true && overlap_at(addr, prompt, id).await >= blocks {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the index never held the {blocks} blocks of worker {id}'s prompt: {row}"
        );
        if row["last_seq"].is_null() && row["connected"] == true {
            nudges += 1;
            let other: Vec<u32> = (0..32).map(|i| 90_000 + nudges * 100 + i).collect();
            let a = call(worker.http_addr(), Method::POST, "/v1/completions", &[], Some(&completion(&other))).await;
            assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Index entries the router holds for `worker` (rank 0), registered or not.
fn entries(driver: &kvroute_driver::Driver, worker: u64) -> u32 {
    driver.with_router(|r| r.index_entries(router_core::WorkerKey::new(worker, 0)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_follow_dynamic_registration() {
    let first = sim_worker().await;
    let mut cfg = config(&[]);
    cfg.router.mode = RouterMode::Kv;
    cfg.router.approximate = false;
    cfg.workers = vec![serde_json::from_value(json!({"id": 1, "url": first.base_url(), "model": MODEL})).unwrap()];
    let proxy = start(cfg).await;
    let driver = proxy.driver(MODEL).expect("driver");

    // Register a second worker with an event endpoint through the admin API.
    let second = sim_worker().await;
    let body = json!({
        "id": 2, "url": second.base_url(), "model": MODEL,
        "kv_events": second.events_endpoint(), "kv_events_replay": second.replay_endpoint(),
    });
    let added = call(proxy.local_addr(), Method::POST, "/workers", &[], Some(&body)).await;
    assert_eq!(added.status, StatusCode::CREATED, "{}", added.text());
    subscribed(proxy.local_addr(), 2).await;
    let prompt: Vec<u32> = (0..320).map(|i| 7000 + i).collect();
    let pinned = [("x-worker-id", "2")];
    let a = call(proxy.local_addr(), Method::POST, "/v1/completions", &pinned, Some(&completion(&prompt))).await;
    assert_eq!((a.status, a.worker()), (StatusCode::OK, Some(2)), "{}", a.text());
    indexed(proxy.local_addr(), &second, 2, &prompt, 20).await;
    assert!(entries(&driver, 2) >= 20, "the new worker's events reach the index");
    let listed = get(proxy.local_addr(), "/workers").await.json();
    assert!(stream_of(&listed, 1).is_empty(), "a worker without an endpoint has no stream");
    assert_eq!(stream_of(&listed, 2).len(), 1, "the registered worker's stream is listed");

    // Removing it purges its entries and closes its stream.
    let gone = call(proxy.local_addr(), Method::DELETE, "/workers/2", &[], None).await;
    assert_eq!(gone.status, StatusCode::NO_CONTENT, "{}", gone.text());
    assert_eq!(entries(&driver, 2), 0);
    // Events it still publishes are not applied: it is no longer registered.
    let direct = call(second.http_addr(), Method::POST, "/v1/completions", &[], Some(&completion(&prompt))).await;
    assert_eq!(direct.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(entries(&driver, 2), 0, "a removed worker's stream feeds nothing");
    let listed = get(proxy.local_addr(), "/workers").await.json();
    assert!(listed["workers"].as_array().unwrap().iter().all(|w| w["id"] != 2), "removed from the listing");
    let _ = proxy.shutdown().await;
    first.shutdown().await;
    second.shutdown().await;
}
