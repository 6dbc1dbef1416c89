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

/// The resident set size of this process, in bytes. Only meaningful in a test that runs
/// [`alone`]: otherwise it counts the other tests' allocations as well.
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

/// Taken for the whole of a test that leans on the machine (thousands of sockets, a
/// flood of requests): such tests run one at a time, so that one does not starve
/// another. Held while a test runs [`alone`], too.
pub async fn heavy() -> tokio::sync::MutexGuard<'static, ()> {
    HEAVY.lock().await
}

/// Set in the environment of a test binary started by [`alone`].
const ALONE_ENV: &str = "KVROUTE_IT_ALONE";

/// Whether the calling test runs its body in this process. A test that reads the
/// process's resident memory must be the only one in it: the tests running at the same
/// time (up to `--test-threads` of them) allocate too, and their growth would be read as
/// its own. So, unless this process was started for it, this runs the test binary again
/// for `test` only (its full name, `module::function`), waits for it, fails if it
/// failed, and returns false: the caller then returns.
pub async fn alone(test: &'static str) -> bool {
    if std::env::var_os(ALONE_ENV).is_some() {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(exe)
            .args([test, "--exact", "--test-threads=1", "--nocapture"])
            .env(ALONE_ENV, "1")
            .output()
    })
    .await
    .expect("the child test runs")
    .expect("the test binary starts again");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprint!("{stderr}");
    // A name that matches no test would pass with nothing run.
    assert!(out.status.success() && stdout.contains(" 1 passed;"), "{test}, run alone, failed:\n{stdout}");
    false
}
