//! The whole path with real parts: `kvroute sim-worker` servers publish KV events over
//! ZeroMQ, the proxy subscribes, its index follows their caches, and routing follows
//! the index.

use std::time::Duration;

use http::Method;
use kvroute_proxy::events::Subscriptions;
use kvroute_sim_server::{EngineConfig, SimServerConfig, SimServerHandle};
use serde_json::json;

use super::*;

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
    cfg.workers = workers
        .iter()
        .enumerate()
        .map(|(i, w)| {
            serde_json::from_value(json!({
                "id": i, "url": w.base_url(), "model": MODEL,
                "kv_events": w.events_endpoint(), "kv_events_replay": w.replay_endpoint(),
            }))
            .unwrap()
        })
        .collect();
    let proxy = start(cfg.clone()).await;
    let _subs = Subscriptions::start(&cfg, &proxy).await.expect("subscriptions");
    let driver = proxy.driver(MODEL).expect("the model's driver");

    let prompt: Vec<u32> = (0..640).map(|i| 1000 + i).collect();
    let first = call(proxy.local_addr(), Method::POST, "/v1/completions", &[], Some(&completion(&prompt))).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    let home = first.worker().expect("x-kvroute-worker");

    // The worker's Stored events reach the index over ZeroMQ (slow-joiner losses are
    // recovered by replay); wait until the router sees the whole prompt there.
    let full_blocks = (prompt.len() / 16) as u32;
    let mut seen = 0;
    for _ in 0..200 {
        let snap = driver.snapshot();
        let w = snap.workers.iter().find(|w| w.spec.id.0 == home).expect("home worker");
        seen = w.keys.iter().map(|k| k.index_entries).sum::<u32>();
        if seen >= full_blocks && w.publishes_events {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(seen >= full_blocks, "the index holds {seen} of {full_blocks} blocks from worker {home}");

    // A longer prompt sharing that prefix goes home, whatever round of draws it gets.
    for n in 0..5u32 {
        let mut longer = prompt.clone();
        longer.extend((0..64).map(|i| 50_000 + n * 100 + i));
        let a = call(proxy.local_addr(), Method::POST, "/v1/completions", &[], Some(&completion(&longer))).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        assert_eq!(a.worker(), Some(home), "request {n} follows its cached prefix");
        assert!(a.text().contains("data: [DONE]"), "streams to the end");
    }
    driver.check_invariants().expect("router invariants");
    let _ = proxy.shutdown().await;
    for w in workers {
        w.shutdown().await;
    }
}
