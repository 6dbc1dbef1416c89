//! The proxy's own endpoints: models, health, readiness, metrics, workers, preview.

use http::Method;
use serde_json::json;

use crate::*;

#[tokio::test]
async fn metrics_parse_as_prometheus_text() {
    let w = Fake::start(&[MODEL]).await;
    w.set(Behavior::Stream { chunks: sse_chunks(5), gap_ms: 2 });
    let p = start(config(&[(1, w.addr)])).await;
    let addr = p.local_addr();
    let secret_session = "session-7f3a";
    let secret_prompt = "my secret prompt, long enough to fill a few routing blocks of sixteen tokens";
    for _ in 0..3 {
        assert_eq!(
            post(addr, "/v1/chat/completions", &[("x-session-id", secret_session)], &chat(secret_prompt)).await.status,
            200
        );
    }
    let _ = post(addr, "/v1/chat/completions", &[], &json!({"model": "nope", "messages": [{}]})).await;
    let a = get(addr, "/metrics").await;
    assert_eq!(a.status, 200);
    assert!(a.headers["content-type"].to_str().unwrap().starts_with("text/plain; version=0.0.4"));
    let text = a.text();
    check_exposition(&text);
    assert!(!text.contains(secret_session) && !text.contains("secret prompt") && !text.contains("\"nope\""));
    for name in [
        "kvroute_requests_total",
        "kvroute_ttft_seconds_bucket",
        "kvroute_itl_seconds_count",
        "kvroute_routing_overhead_microseconds_bucket",
        "kvroute_overlap_ratio_count",
        "kvroute_queue_depth",
        "kvroute_worker_active_requests",
        "kvroute_worker_active_prefill_tokens",
        "kvroute_worker_active_decode_blocks",
        "kvroute_affinity_sessions",
        "kvroute_affinity_evictions_total",
    ] {
        assert!(text.lines().any(|l| l.starts_with(name)), "{name} missing from\n{text}");
    }
    assert_eq!(
        sample(&text, "kvroute_requests_total", &["outcome=\"ok\"", "worker=\"1\"", "status=\"200\""]),
        Some(3.0)
    );
    assert_eq!(
        sample(&text, "kvroute_requests_total", &["outcome=\"model_not_found\"", "model=\"unknown\""]),
        Some(1.0)
    );
    assert_eq!(sample(&text, "kvroute_itl_seconds_count", &[]), Some(15.0), "five gaps per stream of six chunks");
    assert_eq!(sample(&text, "kvroute_affinity_sessions", &["model=\"m\""]), Some(1.0));
}

/// Every line is a comment (`# HELP name …`, `# TYPE name kind`) or a sample
/// `name{k="v",…} number`, and every sample's family was typed.
#[track_caller]
fn check_exposition(text: &str) {
    let mut typed = std::collections::BTreeSet::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            typed.insert(name.to_string());
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        assert!(value.parse::<f64>().is_ok() || value == "+Inf", "bad value: {line}");
        let name = series.split('{').next().unwrap();
        assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'), "bad name: {line}");
        if let Some(labels) = series.strip_prefix(name).filter(|l| !l.is_empty()) {
            assert!(labels.starts_with('{') && labels.ends_with('}'), "bad labels: {line}");
            for pair in labels[1..labels.len() - 1].split("\",").filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=').unwrap_or_else(|| panic!("bad label: {line}"));
                assert!(
                    k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && v.starts_with('"'),
                    "bad label: {line}"
                );
            }
        }
        let family = ["_bucket", "_sum", "_count", "_total"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
        assert!(typed.contains(name) || typed.contains(family), "untyped sample: {line}");
    }
}

#[tokio::test]
async fn models_health_and_readiness() {
    let w = Fake::start(&[MODEL, "m-extra"]).await;
    let p = start(config(&[])).await;
    let addr = p.local_addr();
    assert_eq!(get(addr, "/health").await.status, 200);
    assert_eq!(get(addr, "/ready").await.status, 503, "no workers, not ready");
    let added = post(addr, "/workers", &[], &json!({"id": 4, "url": w.url(), "model": MODEL})).await;
    assert_eq!(added.status, 201, "{}", added.text());
    assert_eq!(get(addr, "/ready").await.status, 200);
    let models = get(addr, "/v1/models").await.json();
    let mut ids: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, ["m", "m-extra", "m-lora"]);
}

#[tokio::test]
async fn workers_can_be_added_replaced_and_removed() {
    let (a, b) = (Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await);
    let p = start(config(&[(1, a.addr)])).await;
    let addr = p.local_addr();
    let bad = [
        json!({"id": 2, "url": b.url(), "model": "other"}),
        json!({"id": 2, "url": "ftp://x", "model": MODEL}),
        json!({"id": 2, "url": b.url(), "model": MODEL, "colour": "red"}),
    ];
    for body in bad {
        assert_eq!(post(addr, "/workers", &[], &body).await.status, 400, "{body}");
    }
    assert_eq!(post(addr, "/workers", &[], &json!({"id": 2, "url": b.url(), "model": MODEL})).await.status, 201);
    assert_eq!(
        post(addr, "/workers", &[], &json!({"id": 2, "url": b.url(), "model": MODEL, "weight": 2})).await.status,
        200
    );
    let listed = get(addr, "/workers").await.json();
    assert_eq!(listed["workers"].as_array().unwrap().len(), 2);
    assert_eq!(call(addr, Method::DELETE, "/workers/1", &[], None).await.status, 204);
    for _ in 0..3 {
        assert_eq!(post(addr, "/v1/chat/completions", &[], &chat("x")).await.worker(), Some(2));
    }
    assert_eq!(call(addr, Method::DELETE, "/workers/x", &[], None).await.status, 400);
}

#[tokio::test]
async fn preview_explains_without_booking() {
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    let mut cfg = config(&[(1, fakes[0].addr), (2, fakes[1].addr)]);
    cfg.router.mode = router_core::RouterMode::Kv;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let body = chat(&"a shared system prompt, long enough for several blocks. ".repeat(10));
    // Serve it once on worker 1 so that its predicted cache holds the prefix.
    let served = post(addr, "/v1/chat/completions", &[("x-worker-id", "1")], &body).await;
    assert_eq!(served.worker(), Some(1));
    let a = post(addr, "/route/preview", &[("x-session-id", "p")], &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let j = a.json();
    assert_eq!(j["worker"], 1, "the cached worker wins: {j}");
    assert!(j["overlap_blocks"].as_u64().unwrap() > 0);
    assert_eq!(j["explanation"].as_array().unwrap().len(), 2);
    assert!(j["explanation"][0]["cost"].is_number());
    let flagged = post(addr, "/v1/chat/completions", &[("x-kvroute-preview", "1")], &body).await;
    assert_eq!(flagged.json()["worker"], 1);
    assert_eq!(fakes.iter().map(|f| f.seen().len()).sum::<usize>(), 1, "previews forward nothing");
    let pool = pool(addr).await;
    assert_eq!(
        (pool["affinity_sessions"].as_u64(), pool["dispatched"].as_u64()),
        (Some(0), Some(1)),
        "and book nothing"
    );
}
