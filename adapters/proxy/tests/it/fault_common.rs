//! Helpers shared by the fault-injection tests (`fault_*.rs`).

use std::net::SocketAddr;

use serde_json::Value;

use crate::*;

/// The value of a sample, 0 when absent.
pub fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    sample(text, name, labels).unwrap_or(0.0)
}

/// A worker's outlier view from `/workers` (`consecutive_failures`, `ejected`, `ejections`).
pub async fn outlier(addr: SocketAddr, id: u64) -> Value {
    let w = get(addr, "/workers").await.json();
    let found = w["workers"].as_array().unwrap().iter().find(|w| w["id"] == id).cloned();
    found.map(|w| w["outlier"].clone()).unwrap_or(Value::Null)
}

/// A worker's health from `/workers`: `healthy`, `ejected`, ...
pub async fn health_of(addr: SocketAddr, id: u64) -> String {
    let w = get(addr, "/workers").await.json();
    let found = w["workers"].as_array().unwrap().iter().find(|w| w["id"] == id).cloned();
    found.map(|w| w["health"].as_str().unwrap().to_string()).unwrap_or_default()
}

/// What requests hold, from `/workers`: the pool's queue, tracked requests, waiters,
/// live leases and load, and every worker's per-rank load. Counters that only grow
/// (dispatched, rejected) are left out, so two calls compare equal when everything
/// taken was given back.
pub async fn holdings(addr: SocketAddr) -> Value {
    let w = get(addr, "/workers").await.json();
    let p = &w["pools"][0];
    let pool: Vec<Value> = [
        "queue_depth",
        "requests_in_flight",
        "waiters",
        "affinity_live_leases",
        "active_requests",
        "active_prefill_tokens",
    ]
    .iter()
    .map(|k| serde_json::json!([k, p[k]]))
    .collect();
    let workers: Vec<Value> =
        w["workers"].as_array().unwrap().iter().map(|w| serde_json::json!([w["id"], w["ranks"]])).collect();
    serde_json::json!({"pool": pool, "workers": workers})
}

/// An SSE body that ended cleanly: `[DONE]` last, no error event.
pub fn sse_ok(text: &str) -> bool {
    text.ends_with("data: [DONE]\n\n") && !text.contains("event: error")
}

/// The answer is an error in the OpenAI shape: JSON with `error.message`, `type`, `code`.
#[track_caller]
pub fn assert_openai_error(a: &Answer) {
    assert!(a.status.is_client_error() || a.status.is_server_error(), "{} {}", a.status, a.text());
    let j = a.json();
    let e = &j["error"];
    assert!(e["message"].is_string() && e["type"].is_string() && e["code"].is_string(), "OpenAI error shape: {j}");
}

/// The resident set size of this process (the proxy, the fakes and the clients), in bytes.
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Taken for the whole of a test that measures the process's memory or leans on the
/// machine (thousands of sockets): such tests run one at a time, so that one's
/// allocations are not read as another's growth.
pub async fn heavy() -> tokio::sync::MutexGuard<'static, ()> {
    HEAVY.lock().await
}
