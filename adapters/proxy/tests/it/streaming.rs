//! The end-to-end path: route, forward, stream back unchanged, release.

use std::sync::Arc;

use bytes::Bytes;
use http::Method;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tokio::sync::Semaphore;

use crate::*;

#[tokio::test]
async fn sse_passes_through_byte_exact() {
    let w = Fake::start(&[MODEL]).await;
    let chunks = sse_chunks(20);
    w.set(Behavior::Stream { chunks: chunks.clone(), gap_ms: 1 });
    let p = start(config(&[(7, w.addr)])).await;
    let mut body = chat("hello");
    body["kvroute"] = json!({"expected_output_tokens": 20, "cache_salt": "t"});
    let a =
        post(p.local_addr(), "/v1/chat/completions", &[("x-session-id", "s1"), ("x-kvroute-extra", "1")], &body).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.worker(), Some(7));
    assert_eq!(a.body, chunks.concat(), "the stream arrives byte for byte");
    assert_eq!(a.headers["content-type"], "text/event-stream");
    let seen = w.seen();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].body.get("kvroute").is_none(), "the kvroute object is not forwarded");
    assert_eq!(seen[0].body["messages"], body["messages"]);
    assert!(seen[0].headers.get("x-kvroute-extra").is_none(), "internal headers never leak upstream");
    assert_eq!(seen[0].headers["x-session-id"], "s1");
    eventually(10_000, "everything released", || released(p.local_addr())).await;
}

#[tokio::test]
async fn chunks_arrive_before_the_stream_ends() {
    let w = Fake::start(&[MODEL]).await;
    let gate = Arc::new(Semaphore::new(1));
    let chunks = sse_chunks(2);
    w.set(Behavior::Gated { chunks: chunks.clone(), gate: gate.clone() });
    let p = start(config(&[(1, w.addr)])).await;
    let resp = send(p.local_addr(), Method::POST, "/v1/chat/completions", &[], Some(&chat("x"))).await;
    assert_eq!(resp.status(), 200, "headers come as soon as the worker answers");
    let mut body = resp.into_body();
    let first = within(10_000, body.frame()).await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, chunks[0], "the first chunk is forwarded while the worker still holds the rest");
    assert_eq!(pool(p.local_addr()).await["active_requests"], 1, "the stream holds its booking");
    gate.add_permits(chunks.len());
    let rest = within(10_000, body.collect()).await.unwrap().to_bytes();
    assert_eq!([first, rest].concat(), chunks.concat());
    eventually(10_000, "the booking is released at the end", || released(p.local_addr())).await;
}

#[tokio::test]
async fn completions_and_embeddings_are_forwarded() {
    let w = Fake::start(&[MODEL]).await;
    w.set(Behavior::Json);
    let p = start(config(&[(1, w.addr)])).await;
    let cases = [
        ("/v1/completions", json!({"model": MODEL, "prompt": "once upon a time"})),
        ("/v1/completions", json!({"model": MODEL, "prompt": [1, 2, 3, 4, 5]})),
        ("/v1/completions?x=1", json!({"model": "m-lora", "prompt": [[1, 2], [3]]})),
        ("/v1/embeddings", json!({"model": MODEL, "input": ["a", "b"]})),
    ];
    for (path, body) in &cases {
        let a = post(p.local_addr(), path, &[], body).await;
        assert_eq!(a.status, 200, "{path}: {}", a.text());
        assert_eq!(a.json()["model"], body["model"]);
    }
    let paths: Vec<String> = w.seen().into_iter().map(|s| s.path).collect();
    assert_eq!(paths, ["/v1/completions", "/v1/completions", "/v1/completions", "/v1/embeddings"]);
    eventually(10_000, "released", || released(p.local_addr())).await;
}

#[tokio::test]
async fn h2c_clients_are_served() {
    let w = Fake::start(&[MODEL]).await;
    let p = start(config(&[(1, w.addr)])).await;
    let c = Client::builder(TokioExecutor::new()).http2_only(true).build_http::<http_body_util::Full<Bytes>>();
    let req = http::Request::post(format!("http://{}/v1/chat/completions", p.local_addr()))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from(chat("h2").to_string())))
        .unwrap();
    let resp = within(10_000, c.request(req)).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.headers()["x-kvroute-worker"], "1");
    let body = within(10_000, resp.into_body().collect()).await.unwrap().to_bytes();
    assert_eq!(body, sse_chunks(3).concat());
}
