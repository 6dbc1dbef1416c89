//! The proxy end to end on loopback: real sockets, a fake upstream, bounded waits.
// `fault_conns` borrows a socket's fd to read TCP_NODELAY; the workspace denies `unsafe`.
#![allow(unsafe_code)]

mod admin;
mod disagg;
mod endpoints;
mod failover;
mod failures;
mod fake;
mod fault_common;
mod fault_conns;
mod fault_input;
mod fault_overload;
mod fault_readers;
mod fault_shutdown;
mod fault_slow;
mod fault_workers;
mod fleet;
mod leaks;
mod learn;
mod limits;
mod media;
mod media_fleet;
mod metrics;
mod migration;
mod openai_client;
mod openai_endpoints;
mod otel;
mod refusals;
mod release;
mod sessions;
mod shutdown;
mod sims;
mod stalls;
mod streaming;
mod tenant_flood;
mod tenants;
mod tokenizer_check;
mod trust;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_proxy::config::{ModelConfig, WorkerConfig};
use kvroute_proxy::{serve, ProxyConfig, ServeHandle, Tokenizers};
use router_core::RouterMode;
use serde_json::{json, Value};

pub use fake::{sse_chunks, Behavior, Fake};

pub const MODEL: &str = "m";

/// A worker of model `m` at `addr`.
pub fn worker(id: u64, addr: SocketAddr) -> WorkerConfig {
    serde_json::from_value(json!({"id": id, "url": format!("http://{addr}"), "model": MODEL})).unwrap()
}

/// The test baseline: loopback, one model `m`, round-robin, loopback trusted, no active
/// health checks, short time-outs.
pub fn config(workers: &[(u64, SocketAddr)]) -> ProxyConfig {
    let mut c = ProxyConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        seed: Some(1),
        models: vec![ModelConfig {
            name: MODEL.into(),
            block_size: Some(16),
            mode: None,
            lora_adapters: vec!["m-lora".into()],
            tokenizer: None,
            ..ModelConfig::default()
        }],
        workers: workers.iter().map(|&(id, a)| worker(id, a)).collect(),
        ..ProxyConfig::default()
    };
    c.router.mode = RouterMode::RoundRobin;
    c.trust.cidrs = vec!["127.0.0.0/8".parse().unwrap()];
    c.health_check.interval_ms = 0;
    c.limits.connect_timeout_ms = 500;
    c.limits.request_timeout_ms = 10_000;
    c.limits.shutdown_grace_s = 5;
    c
}

pub async fn start(cfg: ProxyConfig) -> ServeHandle {
    serve(cfg, Tokenizers::new()).await.expect("proxy starts")
}

/// A chat body with one user message.
pub fn chat(text: &str) -> Value {
    json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": text}]})
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// Sends a request and returns the response with its body unread.
pub async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> http::Response<Incoming> {
    let mut b = http::Request::builder().method(method).uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let body = body.map_or_else(Bytes::new, |v| Bytes::from(v.to_string()));
    if !body.is_empty() {
        b = b.header("content-type", "application/json");
    }
    let req = b.body(Full::new(body)).unwrap();
    within(10_000, client().request(req)).await.expect("the proxy answers")
}

/// Sends a streamed chat that the worker holds before its first chunk, and returns once
/// the router tracks it. The proxy answers a stream with its first chunk, so the
/// response (with its body unread) comes from the task once the worker sends one.
pub async fn hold(addr: SocketAddr, body: &Value) -> tokio::task::JoinHandle<http::Response<Incoming>> {
    let body = body.clone();
    let before = pool(addr).await["requests_in_flight"].as_u64().unwrap_or(0);
    let task = tokio::spawn(async move { send(addr, Method::POST, "/v1/chat/completions", &[], Some(&body)).await });
    eventually(10_000, "the held request is in flight", || async {
        pool(addr).await["requests_in_flight"].as_u64().unwrap_or(0) > before
    })
    .await;
    task
}

/// A complete answer: status, headers, body.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
    pub fn worker(&self) -> Option<u64> {
        self.headers.get("x-kvroute-worker").map(|v| v.to_str().unwrap().parse().unwrap())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub async fn call(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> Answer {
    let resp = send(addr, method, path, headers, body).await;
    let (parts, body) = resp.into_parts();
    let body = within(10_000, body.collect()).await.map(|c| c.to_bytes()).unwrap_or_default();
    Answer { status: parts.status, headers: parts.headers, body }
}

pub async fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> Answer {
    call(addr, Method::POST, path, headers, Some(body)).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Answer {
    call(addr, Method::GET, path, &[], None).await
}

/// Runs `f` with a time limit, failing the test instead of hanging.
pub async fn within<F: std::future::Future>(ms: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_millis(ms), f).await.expect("timed out")
}

/// Polls `cond` every 10 ms for up to `ms`; fails with `what` if it never holds.
pub async fn eventually<F, Fut>(ms: u64, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_millis(ms);
    while tokio::time::Instant::now() < deadline {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened within {ms} ms: {what}");
}

/// The pool's figures from `/workers`.
pub async fn pool(addr: SocketAddr) -> Value {
    get(addr, "/workers").await.json()["pools"][0].clone()
}

/// Nothing held: no request tracked, no lease, no queue slot, no load.
pub async fn released(addr: SocketAddr) -> bool {
    let p = pool(addr).await;
    p["requests_in_flight"] == 0 && p["affinity_live_leases"] == 0 && p["queue_depth"] == 0 && p["active_requests"] == 0
}

/// The value of the sample `name{labels}` in a Prometheus exposition, labels given as
/// `k="v"` pairs that must all appear.
pub fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        (n == name && labels.iter().all(|lab| rest.contains(lab))).then(|| value.parse().ok())?
    })
}

/// The sum of every sample of `name` whose labels contain `label`.
pub fn total(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, ""));
            (n == name && rest.contains(label)).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}
