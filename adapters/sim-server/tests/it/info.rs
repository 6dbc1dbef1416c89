//! What routers read about a worker: `/version`, `/server_info`, `/kv_event_sources`
//! and `/get_load`, in the shapes vLLM, SGLang and the peer routers use.

use hyper::StatusCode;
use serde_json::{json, Value};

use crate::support::{bounded, fast_config, get, open_stream, start};

async fn ok(a: std::net::SocketAddr, path: &str) -> Value {
    let r = get(a, path).await;
    assert_eq!(r.status, StatusCode::OK, "{path}: {:?}", r.body);
    assert_eq!(r.content_type, "application/json");
    r.json()
}

/// Checks `pointer` in `v` against `want`.
#[track_caller]
fn check(v: &Value, pointer: &str, want: Value) {
    assert_eq!(v.pointer(pointer), Some(&want), "{pointer} in {v}");
}

#[tokio::test]
async fn version_and_server_info_describe_the_worker() {
    let mut cfg = fast_config();
    cfg.engine.blocks_per_worker = 100;
    cfg.engine.max_num_seqs = 7;
    let w = start(cfg).await;
    let a = w.http_addr();
    let version = ok(a, "/version").await;
    assert!(version["version"].as_str().is_some_and(|v| v.split('.').count() == 3), "semver-like: {version}");

    for path in ["/server_info", "/get_server_info", "/server_info?config_format=json"] {
        let info = ok(a, path).await;
        // vllm-router's reads: the vLLM config, and its discovery's top-level keys.
        check(&info, "/vllm_config/model_config/model", json!("sim-test"));
        check(&info, "/vllm_config/cache_config/block_size", json!(4));
        check(&info, "/vllm_config/model_config/max_model_len", json!(400));
        check(&info, "/vllm_config/scheduler_config/max_num_seqs", json!(7));
        check(&info, "/model_id", json!("sim-test"));
        check(&info, "/kv_block_size", json!(4));
        assert!(info["instance_id"].as_str().is_some_and(|id| id.contains(&a.port().to_string())), "{info}");
        // SGLang's keys, which SMG and sglang-router read.
        check(&info, "/dp_size", json!(1));
        check(&info, "/context_length", json!(400));
        check(&info, "/max_running_requests", json!(7));
        check(&info, "/version", version["version"].clone());
    }
    w.shutdown().await;
}

#[tokio::test]
async fn kv_event_sources_name_the_bound_sockets() {
    let mut cfg = fast_config();
    cfg.replay_port = Some(0);
    cfg.topic = "kv".to_string();
    let w = start(cfg).await;
    let sources = ok(w.http_addr(), "/kv_event_sources").await;
    let rank = &sources["0"];
    check(rank, "/endpoint", json!(w.events_endpoint()));
    check(rank, "/replay_endpoint", json!(w.replay_endpoint().expect("replay on")));
    check(rank, "/topic", json!("kv"));
    // vllm-router subscribes only to sources declaring exactly this wire format.
    check(rank, "/publisher", json!("zmq"));
    check(rank, "/encoding", json!("msgpack"));
    check(rank, "/schema_version", json!(1));
    check(rank, "/enable_kv_cache_events", json!(true));
    assert_eq!(sources.as_object().map(|o| o.len()), Some(1), "one rank: {sources}");
    w.shutdown().await;
}

#[tokio::test]
async fn get_load_counts_running_requests_and_their_tokens() {
    let mut cfg = fast_config();
    cfg.engine.speedup = 1.0;
    let w = start(cfg).await;
    let a = w.http_addr();
    check(
        &ok(a, "/get_load").await,
        "",
        json!([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]),
    );
    // A long stream holds its blocks; the gauges move at pass boundaries, so poll.
    let body = json!({"prompt": "twelve bytes", "max_tokens": 10_000, "stream": true}).to_string();
    let (conn, _first, _rest) = open_stream(a, "/v1/completions", &body).await;
    let load = bounded(async {
        loop {
            let load = ok(a, "/get_load").await;
            if load[0]["num_reqs"] == 1 {
                return load;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    let tokens = load[0]["num_tokens"].as_u64().expect("num_tokens");
    assert!(tokens >= 4 && tokens % 4 == 0, "whole blocks of the running request: {load}");
    conn.abort();
}
