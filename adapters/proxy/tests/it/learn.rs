//! Cost learning with real parts: `kvroute sim-worker` servers answer streamed
//! requests and export vLLM's scheduler gauges; the proxy learns each worker's speed
//! from the streams, scrapes the gauges, and shows both in `/workers` and
//! `/route/preview`. And per-request cost overrides from trusted clients only.

use kvroute_sim_server::{EngineConfig, SimServerConfig, SimServerHandle};
use serde_json::{json, Value};

use super::*;

async fn sim_worker() -> SimServerHandle {
    let cfg = SimServerConfig {
        model: MODEL.into(),
        engine: EngineConfig { block_size: 16, ..EngineConfig::default() },
        ..SimServerConfig::default()
    };
    kvroute_sim_server::spawn(cfg).await.expect("sim worker starts")
}

fn completion(first: u32) -> Value {
    let prompt: Vec<u32> = (0..200).map(|i| first + i).collect();
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 6, "stream": true})
}

/// `/workers`' learner view of worker `id`, rank 0.
async fn learned(addr: std::net::SocketAddr, id: u64) -> Value {
    let listed = get(addr, "/workers").await.json();
    let w = listed["workers"].as_array().unwrap().iter().find(|w| w["id"] == id).cloned().unwrap();
    w["learned"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learned_speeds_and_engine_load_show_in_workers_and_preview() {
    let workers = [sim_worker().await, sim_worker().await];
    let mut cfg = config(&[]);
    cfg.router.mode = RouterMode::Kv;
    cfg.learn.costs = true;
    cfg.learn.engine_load = true;
    cfg.learn.samples_min = 2;
    cfg.learn.scrape_interval_ms = 20;
    cfg.workers = workers
        .iter()
        .enumerate()
        .map(|(i, w)| serde_json::from_value(json!({"id": i, "url": w.base_url(), "model": MODEL})).unwrap())
        .collect();
    let proxy = start(cfg).await;
    let addr = proxy.local_addr();
    for i in 0..8 {
        let a = post(addr, "/v1/completions", &[], &completion(1000 * i)).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    }
    for id in 0..2 {
        eventually(5_000, "both workers scraped", || async move { learned(addr, id).await["engine"].is_object() })
            .await;
    }
    let (a, b) = (learned(addr, 0).await, learned(addr, 1).await);
    let samples = |l: &Value, k: &str| l[k].as_u64().unwrap();
    assert_eq!(samples(&a, "prefill_samples") + samples(&b, "prefill_samples"), 8, "{a} {b}");
    // A stream whose tokens all arrive in its first frame times no decode.
    assert!((1..=8).contains(&(samples(&a, "decode_samples") + samples(&b, "decode_samples"))), "{a} {b}");
    for l in [&a, &b] {
        let per_token = l["prefill_ms_per_token"].as_f64().unwrap();
        assert!(per_token.is_finite() && per_token > 0.0, "{l}");
        let engine = &l["engine"];
        assert!(engine["kv_usage"].as_f64().unwrap() <= 1.0 && engine["age_ms"].as_u64().is_some(), "{l}");
    }
    let listed = get(addr, "/workers").await.json();
    assert!(listed["engine_scrapes"]["ok"].as_u64().unwrap() >= 2, "{listed}");

    let mut q = completion(1);
    q["stream"] = json!(false);
    let preview = post(addr, "/route/preview", &[], &q).await.json();
    assert_eq!(preview["learn"], json!({"costs": true, "engine_load": true}));
    for row in preview["explanation"].as_array().unwrap() {
        assert!(row["learned"]["prefill_samples"].as_u64().is_some(), "{row}");
    }
}

/// A worker `slowdown` times slower than the router's timing model: its learned prefill
/// and decode scales say so. Time to first token counts from the send, not from the
/// worker's answer, which for a stream comes with its first token (the proxy once timed
/// it from there, and learned that every worker prefilled in about a millisecond).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_slower_than_the_model_is_learned_slower() {
    let slowdown = 4.0;
    let cfg = SimServerConfig {
        model: MODEL.into(),
        engine: EngineConfig { block_size: 16, speedup: 1.0 / slowdown, ..EngineConfig::default() },
        ..SimServerConfig::default()
    };
    let worker = kvroute_sim_server::spawn(cfg).await.expect("sim worker starts");
    let mut cfg = config(&[]);
    cfg.router.mode = RouterMode::Kv;
    cfg.learn.samples_min = 4;
    cfg.workers = vec![serde_json::from_value(json!({"id": 0, "url": worker.base_url(), "model": MODEL})).unwrap()];
    let proxy = start(cfg).await;
    for i in 0..6 {
        let a = post(proxy.local_addr(), "/v1/completions", &[], &completion(1000 * i)).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    }
    let l = learned(proxy.local_addr(), 0).await;
    let prefill = l["prefill_scale"].as_f64().unwrap();
    // Loopback and the proxy add to every time; the engine's own share is the floor.
    assert!((slowdown * 0.75..slowdown * 3.0).contains(&prefill), "prefill {prefill}, expected about {slowdown}: {l}");
    // Six tokens a stream time five steps, with the frames' own delays: slower, roughly.
    assert!(l["decode_scale"].as_f64().unwrap() > 1.5, "{l}");
}

#[tokio::test]
async fn a_scrape_of_a_worker_without_engine_gauges_is_a_counted_drop() {
    let w = Fake::start(&[MODEL]).await;
    let mut cfg = config(&[(1, w.addr)]);
    cfg.learn.scrape_interval_ms = 20;
    let proxy = start(cfg).await;
    let addr = proxy.local_addr();
    eventually(5_000, "a dropped scrape", || async move {
        get(addr, "/workers").await.json()["engine_scrapes"]["dropped"].as_u64() > Some(0)
    })
    .await;
    assert_eq!(learned(addr, 1).await["engine"], Value::Null);
}

#[tokio::test]
async fn cost_overrides_need_trust() {
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    let mut cfg = config(&[(1, fakes[0].addr), (2, fakes[1].addr)]);
    cfg.router.mode = RouterMode::Kv;
    cfg.trust.cidrs.clear();
    cfg.trust.token = Some("s3cret".into());
    let p = start(cfg).await;
    let addr = p.local_addr();
    let token = ("x-kvroute-token", "s3cret");
    let cost = |headers: &[(&'static str, &'static str)]| {
        let mut h = vec![token, ("x-kvroute-preview", "1")];
        h.extend_from_slice(headers);
        async move {
            let a = post(addr, "/v1/chat/completions", &h, &chat("hello there")).await;
            assert_eq!(a.status, 200, "{}", a.text());
            a.json()["explanation"][0]["cost"].as_f64().unwrap()
        }
    };
    let plain = cost(&[]).await;
    let doubled = cost(&[("x-kvroute-cost", "prefill_load_scale=2")]).await;
    let json_form = cost(&[("x-kvroute-cost", r#"{"prefill_load_scale": 2}"#)]).await;
    assert!(doubled > plain, "a trusted override changes the cost: {plain} -> {doubled}");
    assert_eq!(doubled, json_form);
    let bad = post(addr, "/v1/chat/completions", &[token, ("x-kvroute-cost", "speed=2")], &chat("x")).await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    assert!(bad.json()["error"]["message"].as_str().unwrap().contains("x-kvroute-cost"), "{}", bad.text());

    let untrusted = post(addr, "/v1/chat/completions", &[("x-kvroute-cost", "speed=2")], &chat("x")).await;
    assert_eq!(untrusted.status, 200, "an untrusted header is ignored, even a malformed one");
    let m = get(addr, "/metrics").await.text();
    assert_eq!(sample(&m, "kvroute_untrusted_fields_stripped_total", &["field=\"x-kvroute-cost\""]), Some(1.0));
    for seen in fakes.iter().flat_map(|f| f.seen()) {
        assert!(seen.headers.get("x-kvroute-cost").is_none(), "the header leaked upstream");
    }
}
