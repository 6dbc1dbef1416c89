//! The official `openai` Python client on every vLLM endpoint through a closed gateway
//! (`tests/py/openai_endpoints.py`): the Responses API whole and streamed, embeddings
//! in the client's default base64, score, rerank, tokenize, models, an unknown path,
//! and a key the gateway does not know on each endpoint.

use std::process::Command;

use serde_json::{json, Value};

use crate::endpoints::{Gateway, KEY_ALL};
use crate::MODEL;

/// Each `(JSON pointer, value)` of `want` holds in what the script saw.
#[track_caller]
fn check(seen: &Value, want: &[(&str, Value)]) {
    for (pointer, value) in want {
        assert_eq!(seen.pointer(pointer), Some(value), "at {pointer}: {seen}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_reaches_every_endpoint_and_a_stranger_none() {
    let g = Gateway::start().await;
    let base = format!("http://{}", g.addr());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/openai_endpoints.py");
    let out =
        tokio::task::spawn_blocking(move || Command::new("python3").args([script, &base, MODEL, KEY_ALL]).output())
            .await
            .unwrap()
            .expect("python3 runs (CI installs the `openai` package)");
    assert!(out.status.success(), "the openai client failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let seen: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let refused = json!({"status": 401, "code": "invalid_api_key"});
    check(
        &seen,
        &[
            ("/responses/object", json!("response")),
            ("/responses/status", json!("incomplete")),
            ("/responses/output_tokens", json!(4)),
            ("/responses_stream/first", json!("response.created")),
            ("/responses_stream/last", json!("response.completed")),
            ("/responses_stream/deltas", json!(3)),
            ("/responses_stream/text_matches", json!(true)),
            ("/embeddings/count", json!(2)),
            ("/embeddings/dims", json!(16)),
            ("/score", json!(["score", "score"])),
            ("/rerank_best", json!(1)),
            ("/tokenize_count", json!(2)),
            ("/models", json!(["m", "m-lora", "n"])),
            ("/model", json!("m")),
            ("/unknown_path", json!({"status": 404, "code": "not_found"})),
            ("/stranger/responses", refused.clone()),
            ("/stranger/responses_stream", refused.clone()),
            ("/stranger/embeddings", refused.clone()),
            ("/stranger/models", refused.clone()),
            ("/stranger/score", refused.clone()),
            ("/stranger/rerank", refused.clone()),
            ("/stranger/tokenize", refused.clone()),
            ("/stranger/detokenize", refused),
        ],
    );
    assert!(!seen["responses"]["text"].as_str().unwrap_or("").is_empty(), "{seen}");
    // An unknown name falls back to the default model, as for every endpoint.
    assert_eq!(seen["unknown_model"], Value::Null, "{seen}");
    g.stop().await;
}
