//! `/metrics` stays bounded under worker churn, and carries the per-worker request
//! histograms and the KV-event ingestion series.

use http::{Method, StatusCode};
use kvroute_sim_server::{EngineConfig, SimServerConfig};
use serde_json::json;

use crate::*;

/// Workers added and removed through the admin API, one request pinned to every fourth.
const CHURNED_WORKERS: u64 = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_churn_leaves_metrics_at_its_starting_size() {
    let w = Fake::start(&[MODEL]).await;
    w.set(Behavior::Stream { chunks: sse_chunks(2), gap_ms: 0 });
    let p = start(config(&[(1, w.addr)])).await;
    let addr = p.local_addr();
    assert_eq!(post(addr, "/v1/chat/completions", &[], &chat("warm up worker one")).await.status, 200);
    let before = scrape(addr, 1).await;

    for id in 1_000..1_000 + CHURNED_WORKERS {
        let added = post(addr, "/workers", &[], &serde_json::to_value(worker(id, w.addr)).unwrap()).await;
        assert_eq!(added.status, StatusCode::CREATED, "{}", added.text());
        if id % 4 == 0 {
            let pin = id.to_string();
            // A prompt of its own, so no worker ever has a better overlap than the pinned one.
            let a = post(addr, "/v1/chat/completions", &[("x-worker-id", &pin)], &chat(&format!("churn {id}"))).await;
            assert_eq!((a.status, a.worker()), (StatusCode::OK, Some(id)), "{}", a.text());
        }
        if id == 1_000 {
            // While the worker is in the fleet its series are there.
            let live = scrape(addr, 2).await;
            let on = format!("worker=\"{id}\"");
            assert_eq!(sample(&live, "kvroute_request_duration_seconds_count", &[&on]), Some(1.0), "{live}");
            assert_eq!(sample(&live, "kvroute_prompt_tokens_count", &[&on]), Some(1.0));
            assert_eq!(sample(&live, "kvroute_cached_tokens_count", &[&on]), Some(1.0));
            assert_eq!(sample(&live, "kvroute_requests_total", &[&on, "outcome=\"ok\""]), Some(1.0));
        }
        let gone = call(addr, Method::DELETE, &format!("/workers/{id}"), &[], None).await;
        assert_eq!(gone.status, StatusCode::NO_CONTENT, "{}", gone.text());
    }

    let after = get(addr, "/metrics").await.text();
    let removed: Vec<&str> = after.lines().filter(|l| names_churned_worker(l)).collect();
    assert!(removed.is_empty(), "series of removed workers: {removed:#?}");
    assert_eq!(after.lines().count(), before.lines().count(), "before:\n{before}\nafter:\n{after}");
    let _ = p.shutdown().await;
}

/// Whether a sample line names a worker id from the churned range.
fn names_churned_worker(line: &str) -> bool {
    let Some((_, rest)) = line.split_once("worker=\"") else { return false };
    let id: u64 = rest.split('"').next().and_then(|s| s.parse().ok()).unwrap_or(0);
    (1_000..1_000 + CHURNED_WORKERS).contains(&id)
}

/// `/metrics` once `requests` requests have ended (a stream's end is counted just after
/// its client read the last byte).
async fn scrape(addr: std::net::SocketAddr, requests: u64) -> String {
    eventually(5_000, "the requests' ends are counted", || async {
        let t = get(addr, "/metrics").await.text();
        total(&t, "kvroute_request_duration_seconds_count", "model=\"m\"") == requests as f64
    })
    .await;
    get(addr, "/metrics").await.text()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_ingestion_and_index_entries_appear_per_worker() {
    let sim = kvroute_sim_server::spawn(SimServerConfig {
        model: MODEL.into(),
        replay_port: Some(0),
        engine: EngineConfig { speedup: 1000.0, block_size: 16, ..EngineConfig::default() },
        ..SimServerConfig::default()
    })
    .await
    .expect("sim worker starts");
    let mut cfg = config(&[]);
    cfg.workers = vec![serde_json::from_value(json!({
        "id": 7, "url": sim.base_url(), "model": MODEL,
        "kv_events": sim.events_endpoint(), "kv_events_replay": sim.replay_endpoint(),
    }))
    .unwrap()];
    let p = start(cfg).await;
    let addr = p.local_addr();
    let on = ["worker=\"7\"", "rank=\"0\""];
    eventually(30_000, "the stream connects", || async {
        sample(&get(addr, "/metrics").await.text(), "kvroute_kv_event_stream_connected", &on) == Some(1.0)
    })
    .await;
    // ZeroMQ drops what is published before the subscription reaches the publisher, so
    // prompts go out until one batch is applied and indexed.
    let mut n = 0u32;
    eventually(30_000, "a batch applied and indexed", || {
        n += 1;
        let prompt: Vec<u32> = (0..64).map(|i| n * 1_000 + i).collect();
        async move {
            let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": true});
            assert_eq!(post(addr, "/v1/completions", &[], &body).await.status, StatusCode::OK);
            let t = get(addr, "/metrics").await.text();
            let applied = sample(&t, "kvroute_kv_event_batches_total", &[on[0], "result=\"applied\""]);
            applied.is_some_and(|v| v >= 1.0)
                && sample(&t, "kvroute_worker_index_entries", &on).is_some_and(|v| v >= 4.0)
        }
    })
    .await;
    let t = get(addr, "/metrics").await.text();
    assert!(sample(&t, "kvroute_kv_events_total", &[on[0], "result=\"applied\""]).is_some_and(|v| v >= 1.0), "{t}");
    assert_eq!(sample(&t, "kvroute_kv_event_batches_total", &[on[0], "result=\"malformed\""]), Some(0.0));
    for name in
        ["kvroute_kv_event_gaps_total", "kvroute_kv_event_stream_resets_total", "kvroute_kv_event_replays_total"]
    {
        assert!(sample(&t, name, &on).is_some(), "{name} missing from\n{t}");
    }
    let age = sample(&t, "kvroute_kv_event_last_message_age_seconds", &on).expect("a message arrived");
    assert!((0.0..30.0).contains(&age), "age {age}");

    // Removed, the worker's ingestion series go with it.
    assert_eq!(call(addr, Method::DELETE, "/workers/7", &[], None).await.status, StatusCode::NO_CONTENT);
    let t = get(addr, "/metrics").await.text();
    assert!(!t.lines().any(|l| !l.starts_with('#') && l.contains("worker=\"7\"")), "{t}");
    let _ = p.shutdown().await;
    sim.shutdown().await;
}
