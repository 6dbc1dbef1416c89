//! The official `openai` Python client against the proxy in front of sim-workers:
//! non-streaming and streaming chat, completions, models, and a client error.

use std::process::Command;

use kvroute_sim_server::{EngineConfig, SimServerConfig};
use serde_json::{json, Value};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_through_the_proxy() {
    let mut workers = Vec::new();
    for _ in 0..2 {
        let cfg = SimServerConfig {
            model: MODEL.into(),
            engine: EngineConfig { speedup: 1000.0, ..EngineConfig::default() },
            ..SimServerConfig::default()
        };
        workers.push(kvroute_sim_server::spawn(cfg).await.expect("sim worker"));
    }
    let mut cfg = config(&[]);
    cfg.workers = workers
        .iter()
        .enumerate()
        .map(|(i, w)| serde_json::from_value(json!({"id": i, "url": w.base_url(), "model": MODEL})).unwrap())
        .collect();
    let proxy = start(cfg).await;
    let base = format!("http://{}", proxy.local_addr());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/openai_client.py");
    let out = tokio::task::spawn_blocking(move || Command::new("python3").args([script, &base, MODEL]).output())
        .await
        .unwrap()
        .expect("python3 runs (CI installs the `openai` package)");
    assert!(
        out.status.success(),
        "the openai client failed (is `pip install openai` done?):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert!(!seen["chat_content"].as_str().unwrap().is_empty(), "{seen}");
    assert_eq!(seen["chat_completion_tokens"], 5, "{seen}");
    let worker: u64 = seen["raw_worker_header"].as_str().expect("x-kvroute-worker").parse().unwrap();
    assert!(worker < 2, "{seen}");
    assert!(seen["stream_chunks"].as_u64().unwrap() >= 2, "streamed in pieces: {seen}");
    assert!(!seen["stream_text"].as_str().unwrap().is_empty(), "{seen}");
    assert_eq!(seen["stream_finish"], "length", "{seen}");
    assert!(!seen["completion_text"].as_str().unwrap().is_empty(), "{seen}");
    assert!(seen["models"].as_array().unwrap().iter().any(|m| m == MODEL), "{seen}");
    assert_eq!(seen["bad_request_status"], 400, "a malformed body is a 400: {seen}");
    let _ = proxy.shutdown().await;
    for w in workers {
        w.shutdown().await;
    }
}
