//! Limits and client errors: 413, 400, 404, 429, 503. A client's mistake is never a 500.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

use crate::*;

#[track_caller]
fn check(a: &Answer, status: u16, code: &str) {
    assert_eq!(a.status.as_u16(), status, "{}", a.text());
    let j = a.json();
    assert_eq!(j["error"]["code"], code, "{j}");
    assert!(j["error"]["message"].is_string() && j["error"]["type"].is_string(), "OpenAI error shape: {j}");
}

#[tokio::test]
async fn malformed_requests_are_client_errors() {
    let w = Fake::start(&[MODEL]).await;
    let p = start(config(&[(1, w.addr)])).await;
    let addr = p.local_addr();
    let cases: [(&str, Value, u16, &str); 7] = [
        ("/v1/chat/completions", json!({"model": MODEL}), 400, "invalid_request"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user"}]}), 400, "invalid_request"),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{}], "kvroute": {"priority": "high"}}),
            400,
            "invalid_request",
        ),
        ("/v1/completions", json!({"model": MODEL, "prompt": [1, -1]}), 400, "invalid_request"),
        ("/v1/embeddings", json!({"model": MODEL, "input": {}}), 400, "invalid_request"),
        ("/v1/chat/completions", json!({"model": "nope", "messages": [{}]}), 404, "model_not_found"),
        ("/v1/nothing", json!({}), 404, "not_found"),
    ];
    for (path, body, status, code) in cases {
        check(&post(addr, path, &[], &body).await, status, code);
    }
    let raw = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .body(http_body_util::Full::new(Bytes::from_static(b"{not json")))
        .unwrap();
    let resp = within(10_000, client().request(raw)).await.unwrap();
    assert_eq!(resp.status(), 400);
    let pin_unknown = post(addr, "/v1/chat/completions", &[("x-worker-id", "99")], &chat("x")).await;
    check(&pin_unknown, 400, "invalid_request");
    check(&post(addr, "/v1/chat/completions", &[("x-worker-id", "x")], &chat("x")).await, 400, "invalid_request");
    assert!(w.seen().is_empty(), "nothing malformed reached the worker");
    assert!(released(addr).await);
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    let w = Fake::start(&[MODEL]).await;
    let mut cfg = config(&[(1, w.addr)]);
    cfg.limits.body_bytes_max = 1024;
    let p = start(cfg).await;
    let big = chat(&"x".repeat(2000));
    check(&post(p.local_addr(), "/v1/chat/completions", &[], &big).await, 413, "body_too_large");

    // A declared length over the limit is refused before any body byte is sent.
    let mut s = tokio::net::TcpStream::connect(p.local_addr()).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n";
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 512];
    let n = within(10_000, s.read(&mut buf)).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 413"), "{}", String::from_utf8_lossy(&buf[..n]));

    // A chunked body with no declared length is cut off at the limit.
    let mut s = tokio::net::TcpStream::connect(p.local_addr()).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n";
    s.write_all(head.as_bytes()).await.unwrap();
    let chunk = format!("{:x}\r\n{}\r\n", 600, "y".repeat(600));
    s.write_all(chunk.as_bytes()).await.unwrap();
    s.write_all(chunk.as_bytes()).await.unwrap();
    let n = within(10_000, s.read(&mut buf)).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 413"));
    assert!(w.seen().is_empty());
}

#[tokio::test]
async fn a_full_queue_answers_429_with_retry_after() {
    let w = Fake::start(&[MODEL]).await;
    let gate = Arc::new(Semaphore::new(0));
    w.set(Behavior::Gated { chunks: sse_chunks(1), gate: gate.clone() });
    let mut cfg = config(&[(1, w.addr)]);
    cfg.router.prefill_tokens_max = 1;
    cfg.router.queued_max = 0;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let holder = hold(addr, &chat(&"long ".repeat(40))).await;
    let a = post(addr, "/v1/chat/completions", &[], &chat("more")).await;
    check(&a, 429, "queue_full");
    assert!(a.headers["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    let k = &a.json()["error"]["kvroute"];
    assert_eq!(
        (k["limit_kind"].as_str(), k["limit"].as_u64(), k["class"].as_str()),
        (Some("queue_full"), Some(0), Some("default"))
    );
    let m = get(addr, "/metrics").await.text();
    assert_eq!(sample(&m, "kvroute_queue_rejections_total", &["limit=\"queue_full\""]), Some(1.0));
    gate.add_permits(5);
    within(10_000, holder.await.unwrap().into_body().collect()).await.unwrap();
    eventually(10_000, "released", || released(addr)).await;
}

#[tokio::test]
async fn a_queued_request_times_out_with_503() {
    let w = Fake::start(&[MODEL]).await;
    let gate = Arc::new(Semaphore::new(0));
    w.set(Behavior::Gated { chunks: sse_chunks(1), gate: gate.clone() });
    let mut cfg = config(&[(1, w.addr)]);
    cfg.router.prefill_tokens_max = 1;
    cfg.router.queue_timeout_ms = 200;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let holder = hold(addr, &chat(&"long ".repeat(40))).await;
    check(&post(addr, "/v1/chat/completions", &[], &chat("more")).await, 503, "queue_timeout");
    gate.add_permits(5);
    within(10_000, holder.await.unwrap().into_body().collect()).await.unwrap();
    eventually(10_000, "released", || released(addr)).await;
}

#[tokio::test]
async fn concurrent_requests_max_sheds_load() {
    let w = Fake::start(&[MODEL]).await;
    let gate = Arc::new(Semaphore::new(0));
    w.set(Behavior::Gated { chunks: sse_chunks(1), gate: gate.clone() });
    let mut cfg = config(&[(1, w.addr)]);
    cfg.limits.concurrent_requests_max = 1;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let holder = hold(addr, &chat("a")).await;
    check(&post(addr, "/v1/chat/completions", &[], &chat("b")).await, 503, "overloaded");
    gate.add_permits(5);
    within(10_000, holder.await.unwrap().into_body().collect()).await.unwrap();
    let a = post(addr, "/v1/chat/completions", &[], &chat("c")).await;
    assert_eq!(a.status, 200, "the permit returns with the finished stream");
}

#[tokio::test]
async fn slow_clients_are_cut_off() {
    let w = Fake::start(&[MODEL]).await;
    let mut cfg = config(&[(1, w.addr)]);
    cfg.limits.header_read_timeout_ms = 200;
    cfg.limits.request_timeout_ms = 300;
    let p = start(cfg).await;
    let mut buf = vec![0u8; 512];

    // Headers that never finish: the connection is closed.
    let mut s = tokio::net::TcpStream::connect(p.local_addr()).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let n = within(10_000, s.read(&mut buf)).await.unwrap_or(0);
    let answer = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(n == 0 || answer.starts_with("HTTP/1.1 408"), "{answer}");

    // A body that never finishes: 408, and the permit is back.
    let mut s = tokio::net::TcpStream::connect(p.local_addr()).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"model\":";
    s.write_all(head.as_bytes()).await.unwrap();
    let n = within(10_000, s.read(&mut buf)).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 408"), "{}", String::from_utf8_lossy(&buf[..n]));
    assert!(w.seen().is_empty());
}
