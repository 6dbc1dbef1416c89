//! Disaggregated serving: a prefill-role worker answers with one token and
//! `kv_transfer_params`; a decode-role worker given them waits out the modelled KV
//! transfer and decodes the rest.

use std::time::Instant;

use hyper::StatusCode;
use kvroute_sim_server::{EngineRole, KvTransfer};
use serde_json::{json, Value};

use crate::support::{fast_config, post, start};

#[tokio::test]
async fn prefill_then_decode() {
    let mut p = fast_config();
    p.engine.role = EngineRole::Prefill;
    let prefill = start(p).await;
    let mut d = fast_config();
    d.engine.role = EngineRole::Decode;
    let decode = start(d).await;

    let prompt = "x".repeat(164); // 41 tokens of four bytes
    let r = post(prefill.http_addr(), "/v1/completions", &json!({"prompt": prompt, "max_tokens": 9}).to_string()).await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 1, "a prefill worker stops after the first token");
    let kv = v["kv_transfer_params"].clone();
    assert_eq!((kv["do_remote_prefill"].as_bool(), kv["do_remote_decode"].as_bool()), (Some(true), Some(false)));
    assert_eq!(kv["remote_block_ids"].as_array().map(Vec::len), Some(10), "41 tokens: 10 full blocks");
    assert_eq!(kv["remote_port"], prefill.http_addr().port());
    assert_eq!(kv["remote_host"], "127.0.0.1");
    assert!(kv["remote_engine_id"].as_str().is_some_and(|s| !s.is_empty()));

    // Streaming from the prefill worker carries the params on the final chunk.
    let r = post(prefill.http_addr(), "/v1/completions", &json!({"prompt": prompt, "stream": true}).to_string()).await;
    let events = r.sse();
    let last: Value = serde_json::from_str(&events[events.len() - 2]).expect("final chunk");
    assert_eq!(last["kv_transfer_params"]["do_remote_prefill"], true);

    for stream in [false, true] {
        let body = json!({"prompt": prompt, "max_tokens": 9, "kv_transfer_params": kv, "stream": stream}).to_string();
        let r = post(decode.http_addr(), "/v1/completions", &body).await;
        assert_eq!(r.status, StatusCode::OK);
        if stream {
            assert_eq!(r.sse().len(), 9 + 2, "nine tokens, a final chunk and [DONE]");
        } else {
            assert_eq!(r.json()["usage"]["completion_tokens"], 9, "the decode worker returns the whole output");
        }
    }
    // Without params a decode worker still serves the request (prefill modelled as free).
    let r = post(decode.http_addr(), "/v1/completions", &json!({"prompt": prompt, "max_tokens": 3}).to_string()).await;
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    prefill.shutdown().await;
    decode.shutdown().await;
}

#[tokio::test]
async fn decode_waits_for_the_kv_transfer() {
    let mut d = fast_config();
    d.engine.role = EngineRole::Decode;
    d.engine.speedup = 1.0;
    // 100 tokens × 1,000 bytes at 1 MB/s: 100 ms of transfer before decoding.
    d.engine.kv_transfer = KvTransfer { kv_bytes_per_token: 1_000, bandwidth_bytes_per_s: 1e6 };
    let decode = start(d).await;
    let body = json!({"prompt": "y".repeat(400), "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": true}});
    let t0 = Instant::now();
    let r = post(decode.http_addr(), "/v1/completions", &body.to_string()).await;
    let elapsed = t0.elapsed();
    assert_eq!(r.json()["usage"]["completion_tokens"], 2);
    assert!(elapsed.as_millis() >= 100, "transfer modelled: took {elapsed:?}");
    decode.shutdown().await;
}

/// A prefill worker with a bootstrap server and a decode worker.
async fn bootstrap_pair(timeout_ms: u64) -> (kvroute_sim_server::SimServerHandle, kvroute_sim_server::SimServerHandle) {
    let mut p = fast_config();
    p.engine.role = EngineRole::Prefill;
    p.bootstrap_port = Some(0);
    p.bootstrap_timeout_ms = timeout_ms;
    let mut d = fast_config();
    d.engine.role = EngineRole::Decode;
    d.bootstrap_timeout_ms = timeout_ms;
    (start(p).await, start(d).await)
}

fn with_room(prefill: &kvroute_sim_server::SimServerHandle, room: u64, stream: bool) -> String {
    json!({
        "prompt": "z".repeat(40), "max_tokens": 6, "stream": stream,
        "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port().expect("bootstrap server"),
        "bootstrap_room": room,
    })
    .to_string()
}

#[tokio::test]
async fn bootstrap_rooms_pair_prefill_and_decode() {
    let (prefill, decode) = bootstrap_pair(10_000).await;
    for (room, stream) in [(1u64, false), ((1 << 63) - 1, true)] {
        let body = with_room(&prefill, room, stream);
        // The decode request arrives first and waits for its room.
        let waiting = tokio::spawn({
            let (addr, body) = (decode.http_addr(), body.clone());
            async move { post(addr, "/v1/completions", &body).await }
        });
        let r = post(prefill.http_addr(), "/v1/completions", &body).await;
        assert_eq!(r.status, StatusCode::OK);
        let d = waiting.await.expect("decode task");
        assert_eq!(d.status, StatusCode::OK, "{:?}", d.body);
        if stream {
            assert_eq!(d.sse().len(), 6 + 2, "six tokens, a final chunk and [DONE]");
        } else {
            assert_eq!(d.json()["usage"]["completion_tokens"], 6);
        }
    }
    // A room already done pairs at once.
    let body = with_room(&prefill, 1, false);
    assert_eq!(post(decode.http_addr(), "/v1/completions", &body).await.status, StatusCode::OK);
    prefill.shutdown().await;
    decode.shutdown().await;
}

#[tokio::test]
async fn a_failed_or_missing_prefill_fails_its_decode() {
    let (prefill, decode) = bootstrap_pair(300).await;
    let port = prefill.bootstrap_port().expect("bootstrap server");
    // A prefill the worker refuses (the prompt outgrows its KV cache) fails its room.
    let huge = json!({"prompt": "z".repeat(80_000), "bootstrap_room": 5}).to_string();
    assert_eq!(post(prefill.http_addr(), "/v1/completions", &huge).await.status, StatusCode::BAD_REQUEST);
    let cases = [
        (json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 5}), "failed"),
        (json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 6}), "within"),
        (json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7}), "reach"),
    ];
    for (fields, why) in cases {
        let mut body = json!({"prompt": "z".repeat(40), "max_tokens": 3});
        body.as_object_mut().unwrap().extend(fields.as_object().unwrap().clone());
        let r = post(decode.http_addr(), "/v1/completions", &body.to_string()).await;
        assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{body}");
        let msg = r.json()["error"]["message"].as_str().unwrap_or_default().to_string();
        assert!(msg.contains(why), "{msg:?} should say {why:?}");
    }
    let half = json!({"prompt": "z", "bootstrap_room": 8}).to_string();
    assert_eq!(post(decode.http_addr(), "/v1/completions", &half).await.status, StatusCode::BAD_REQUEST);
    prefill.shutdown().await;
    decode.shutdown().await;
}
