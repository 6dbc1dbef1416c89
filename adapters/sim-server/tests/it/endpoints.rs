//! The Responses API and the pooling endpoints in vLLM's shapes: whole and streamed
//! responses, embeddings (floats and base64), scores, reranking, and their refusals.

use std::net::SocketAddr;

use base64::Engine as _;
use hyper::StatusCode;
use serde_json::{json, Value};

use crate::support::{fast_config, post, start};

/// A request (path and body), the status it gets, and `(JSON pointer, value)` pairs
/// that hold in the answer.
type Case = (&'static str, Value, u16, Vec<(&'static str, Value)>);

/// `path` with `body` answers `status`, and each `(JSON pointer, value)` of `want`
/// holds in the answer.
#[track_caller]
fn check(path: &str, body: &Value, got: (StatusCode, Value), status: u16, want: &[(&str, Value)]) {
    let (s, v) = got;
    assert_eq!(s.as_u16(), status, "{path} {body}: {v}");
    for (pointer, value) in want {
        assert_eq!(v.pointer(pointer), Some(value), "{path} {body} at {pointer}: {v}");
    }
}

async fn ask(a: SocketAddr, path: &str, body: &Value) -> (StatusCode, Value) {
    let r = post(a, path, &body.to_string()).await;
    (r.status, serde_json::from_slice(&r.body).unwrap_or(Value::Null))
}

#[tokio::test]
async fn pooling_and_responses_answer_in_vllms_shapes() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    let cases: Vec<Case> = vec![
        (
            "/v1/responses",
            json!({"model": "sim-test", "input": "hello there", "instructions": "be brief", "max_output_tokens": 3}),
            200,
            vec![
                ("/object", json!("response")),
                ("/status", json!("incomplete")),
                ("/incomplete_details/reason", json!("max_output_tokens")),
                ("/output/0/type", json!("message")),
                ("/output/0/role", json!("assistant")),
                ("/output/0/content/0/type", json!("output_text")),
                ("/usage/output_tokens", json!(3)),
            ],
        ),
        ("/v1/responses", json!({"model": "sim-test", "input": []}), 400, vec![("/error/param", json!("input"))]),
        ("/v1/responses", json!({"model": "sim-test", "input": [{"type": "web_search"}]}), 400, vec![]),
        (
            "/v1/embeddings",
            json!({"model": "sim-test", "input": ["one text", "another"], "encoding_format": "float"}),
            200,
            vec![("/object", json!("list")), ("/data/1/index", json!(1)), ("/data/1/object", json!("embedding"))],
        ),
        (
            "/v1/embeddings",
            json!({"model": "sim-test", "input": [1, 2, 3]}),
            200,
            vec![("/usage/prompt_tokens", json!(3))],
        ),
        ("/v1/embeddings", json!({"model": "sim-test"}), 400, vec![("/error/param", json!("input"))]),
        (
            "/v1/embeddings",
            json!({"model": "sim-test", "input": "x", "encoding_format": "bytes"}),
            400,
            vec![("/error/param", json!("encoding_format"))],
        ),
        (
            "/v1/score",
            json!({"model": "sim-test", "queries": "what is a cache", "documents": ["what is a cache", "zebra stripes"]}),
            200,
            vec![("/object", json!("list")), ("/data/0/object", json!("score")), ("/data/1/index", json!(1))],
        ),
        (
            "/score",
            json!({"model": "sim-test", "text_1": ["a", "b"], "text_2": ["c", "d"]}),
            200,
            vec![("/data/1/index", json!(1))],
        ),
        ("/v1/score", json!({"model": "sim-test", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), 400, vec![]),
        ("/v1/score", json!({"model": "sim-test", "queries": "a"}), 400, vec![]),
        (
            "/v1/rerank",
            json!({"model": "sim-test", "query": "kv cache", "documents": ["zebra", "kv cache", "apples"], "top_n": 2}),
            200,
            vec![("/results/0/index", json!(1)), ("/results/0/document/text", json!("kv cache"))],
        ),
        (
            "/rerank",
            json!({"model": "sim-test", "query": "", "documents": ["a"]}),
            400,
            vec![("/error/param", json!("query"))],
        ),
        ("/v2/rerank", json!({"model": "sim-test", "query": "q", "documents": [{"image": "x"}]}), 400, vec![]),
    ];
    for (path, body, status, want) in &cases {
        check(path, body, ask(a, path, body).await, *status, want);
    }
    w.shutdown().await;
}

#[tokio::test]
async fn scores_and_embeddings_follow_the_text() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    let docs = ["zebra stripes", "prefix caching in a router", "apples"];
    let body = json!({"model": "sim-test", "query": "prefix caching in a router", "documents": docs});
    let (_, v) = ask(a, "/rerank", &body).await;
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 3, "{v}");
    assert_eq!(results[0]["index"], 1, "the equal text ranks first: {v}");
    let scores: Vec<f64> = results.iter().map(|r| r["relevance_score"].as_f64().unwrap()).collect();
    assert!(scores.windows(2).all(|w| w[0] >= w[1]), "best first: {scores:?}");

    let floats = ask(a, "/v1/embeddings", &json!({"model": "sim-test", "input": "same text"})).await.1;
    let b64 =
        ask(a, "/v1/embeddings", &json!({"model": "sim-test", "input": "same text", "encoding_format": "base64"}))
            .await
            .1;
    let bytes =
        base64::engine::general_purpose::STANDARD.decode(b64["data"][0]["embedding"].as_str().unwrap()).unwrap();
    let decoded: Vec<f64> =
        bytes.chunks_exact(4).map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect();
    let plain: Vec<f64> =
        floats["data"][0]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(decoded.len(), plain.len());
    assert!(decoded.iter().zip(&plain).all(|(x, y)| (x - y).abs() < 1e-6), "{decoded:?} vs {plain:?}");
    w.shutdown().await;
}

#[tokio::test]
async fn a_streamed_response_is_typed_events_ending_in_completed() {
    let w = start(fast_config()).await;
    let body = json!({"model": "sim-test", "input": "stream me", "stream": true, "max_output_tokens": 4});
    let r = post(w.http_addr(), "/v1/responses", &body.to_string()).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.content_type, "text/event-stream");
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    let events: Vec<(String, Value)> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (kind, data) = e.split_once('\n').expect("event and data lines");
            let kind = kind.strip_prefix("event: ").expect("an event line").to_string();
            (kind, serde_json::from_str(data.strip_prefix("data: ").expect("a data line")).unwrap())
        })
        .collect();
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    let deltas = ["response.output_text.delta"; 4];
    let want = [
        &["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"][..],
        &deltas[..],
        &["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
            [..],
    ]
    .concat();
    assert_eq!(kinds, want);
    for (i, (kind, data)) in events.iter().enumerate() {
        assert_eq!((&data["type"], data["sequence_number"].as_u64()), (&json!(kind), Some(i as u64)), "{data}");
    }
    let streamed: String = events.iter().filter_map(|(_, d)| d["delta"].as_str()).collect();
    let done = &events.last().unwrap().1["response"];
    assert_eq!(done["output"][0]["content"][0]["text"], streamed.as_str(), "{done}");
    assert_eq!(done["usage"]["output_tokens"], 4, "{done}");
    assert!(!text.contains("[DONE]"), "vLLM ends a Responses stream with response.completed");
    w.shutdown().await;
}
