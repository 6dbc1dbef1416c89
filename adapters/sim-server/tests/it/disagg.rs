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

    let prompt = "x".repeat(41);
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
    let body = json!({"prompt": "y".repeat(100), "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": true}});
    let t0 = Instant::now();
    let r = post(decode.http_addr(), "/v1/completions", &body.to_string()).await;
    let elapsed = t0.elapsed();
    assert_eq!(r.json()["usage"]["completion_tokens"], 2);
    assert!(elapsed.as_millis() >= 100, "transfer modelled: took {elapsed:?}");
    decode.shutdown().await;
}
