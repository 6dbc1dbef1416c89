//! Replicas end to end on loopback: a real `nats-server`, real `kvroute serve` replicas
//! (in-process), real simulated workers publishing KV events over ZeroMQ, and a tiny
//! seeded load balancer that sends each request to a random replica.
//!
//! `nats-server` must be on PATH (CI installs the Debian package); every test fails
//! with a clear message when it is not.

mod failures;
mod parity;
mod sessions;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_proxy::{ProxyConfig, ServeHandle, Tokenizers};
use kvroute_sim::trace::{read_trace, PromptContent, TraceLimits, TraceRecord};
use kvroute_sim_server::{EngineConfig, SimServerConfig, SimServerHandle};
use router_core::Draw;
use serde_json::{json, Value};

pub const MODEL: &str = "m";
/// Peers heartbeat this often, in ms, and are presumed gone after `SILENCE_MS`.
pub const HEARTBEAT_MS: u64 = 200;
pub const SILENCE_MS: u64 = 1_000;

const FIXTURE: &str = include_str!("../../../sim/fixtures/mooncake_conversation_head.jsonl");

/// The first `n` requests of the bundled Mooncake conversation trace.
pub fn trace_slice(n: usize) -> Vec<TraceRecord> {
    let mut records = read_trace(FIXTURE.as_bytes(), &TraceLimits::default()).expect("bundled trace parses");
    records.truncate(n);
    records
}

/// A `nats-server` on a free loopback port, killed when dropped.
pub struct Nats {
    child: tokio::process::Child,
    port: u16,
}

impl Nats {
    pub async fn start() -> Nats {
        let port = free_port();
        let child = tokio::process::Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run nats-server ({e}): install the Debian package `nats-server` (CI does)")
            });
        let nats = Nats { child, port };
        eventually(10_000, "nats-server accepts connections", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()
        })
        .await;
        nats
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server, as a crash or a network loss would.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address").port()
}

/// Simulated workers running `speedup` times faster than real time.
pub struct Fleet {
    pub workers: Vec<SimServerHandle>,
}

impl Fleet {
    pub async fn start(n: usize, speedup: f64) -> Fleet {
        let mut workers = Vec::new();
        for _ in 0..n {
            let cfg = SimServerConfig {
                model: MODEL.into(),
                replay_port: Some(0),
                engine: EngineConfig { speedup, ..EngineConfig::default() },
                ..SimServerConfig::default()
            };
            workers.push(kvroute_sim_server::spawn(cfg).await.expect("sim worker starts"));
        }
        Fleet { workers }
    }

    /// What each worker's own `/metrics` says, in worker order.
    pub async fn stats(&self) -> Vec<WorkerStats> {
        let mut out = Vec::new();
        for w in &self.workers {
            let text = get_text(w.http_addr(), "/metrics").await;
            out.push(WorkerStats {
                requests: sample(&text, "kvroute_sim:requests"),
                prefix_queries: sample(&text, "vllm:prefix_cache_queries"),
                prefix_hits: sample(&text, "vllm:prefix_cache_hits"),
            });
        }
        out
    }

    pub async fn shutdown(self) {
        for w in self.workers {
            w.shutdown().await;
        }
    }
}

/// One worker's counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct WorkerStats {
    pub requests: f64,
    pub prefix_queries: f64,
    pub prefix_hits: f64,
}

/// Prefix reuse (cached ÷ looked-up prompt tokens) and imbalance (the busiest worker's
/// requests ÷ the mean) over a fleet.
#[derive(Clone, Copy, Debug)]
pub struct Figures {
    pub reuse: f64,
    /// Busiest worker's requests ÷ the mean.
    pub imbalance: f64,
    /// Busiest worker's computed (uncached) prompt tokens ÷ the mean.
    pub work_imbalance: f64,
    pub requests: f64,
}

impl Figures {
    pub fn of(stats: &[WorkerStats]) -> Figures {
        let hits: f64 = stats.iter().map(|s| s.prefix_hits).sum();
        let queries: f64 = stats.iter().map(|s| s.prefix_queries).sum();
        let requests: f64 = stats.iter().map(|s| s.requests).sum();
        let max_over_mean = |f: fn(&WorkerStats) -> f64| {
            let max = stats.iter().map(f).fold(0.0, f64::max);
            let mean = stats.iter().map(f).sum::<f64>() / stats.len().max(1) as f64;
            max / mean.max(1e-9)
        };
        Figures {
            reuse: hits / queries.max(1.0),
            imbalance: max_over_mean(|s| s.requests),
            work_imbalance: max_over_mean(|s| s.prefix_queries - s.prefix_hits),
            requests,
        }
    }
}

/// The config of replica `i` of a cluster in front of `fleet`; `nats` makes it share.
pub fn replica_config(fleet: &Fleet, i: usize, nats: Option<(&str, &str)>) -> ProxyConfig {
    let workers: Vec<Value> = fleet
        .workers
        .iter()
        .enumerate()
        .map(|(id, w)| {
            json!({
                "id": id, "url": w.base_url(), "model": MODEL,
                "kv_events": w.events_endpoint(), "kv_events_replay": w.replay_endpoint(),
            })
        })
        .collect();
    let mut cfg = json!({
        "listen": "127.0.0.1:0",
        "seed": 1 + i,
        "models": [{ "name": MODEL, "block_size": 64 }],
        "workers": workers,
        "router": {
            "mode": "kv",
            "approximate": false,
            // The engines queue internally; these tests compare placement, not shedding.
            "prefill_tokens_frac_of_batch": 0.0,
            "decode_blocks_frac_of_kv": 0.0,
        },
        "trust": { "cidrs": ["127.0.0.0/8"] },
        "limits": { "body_bytes_max": 16 << 20, "shutdown_grace_s": 0 },
        "health_check": { "interval_ms": 0 },
    });
    if let Some((url, cluster)) = nats {
        cfg["replica"] = json!({
            "id": format!("replica-{i}"), "nats_url": url, "cluster": cluster,
            "heartbeat_ms": HEARTBEAT_MS, "replica_silence_max_ms": SILENCE_MS,
        });
    }
    serde_json::from_value(cfg).expect("a valid replica config")
}

/// `n` replicas in front of `fleet`, sharing through `nats` when given; returns once
/// every replica follows every worker's events and, when sharing, hears all its peers.
pub async fn replicas(fleet: &Fleet, n: usize, nats: Option<&Nats>) -> Vec<ServeHandle> {
    let url = nats.map(Nats::url);
    let mut out = Vec::new();
    for i in 0..n {
        let cfg = replica_config(fleet, i, url.as_deref().map(|u| (u, "test")));
        out.push(kvroute_proxy::serve(cfg, Tokenizers::new()).await.expect("replica starts"));
    }
    if nats.is_some() {
        for r in &out {
            let want = (n - 1) as f64;
            eventually(10_000, "every replica hears its peers", || async {
                metric(r, "kvroute_replica_peers") == Some(want)
            })
            .await;
        }
    }
    // Every KV-event subscription connected before the first request makes events: what
    // a worker publishes before then is lost until its next batch asks for a replay.
    for r in &out {
        eventually(30_000, "every replica's KV-event streams connect", || async {
            streams_connected(r.local_addr()).await
        })
        .await;
    }
    out
}

/// Whether every KV-event stream `/workers` lists at `addr` is connected (and there is one).
async fn streams_connected(addr: SocketAddr) -> bool {
    let (_, text) = get(addr, "/workers").await;
    let Ok(listed) = serde_json::from_str::<Value>(&text) else { return false };
    let streams: Vec<&Value> = listed["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| w["kv_events"]["streams"].as_array())
        .flatten()
        .collect();
    !streams.is_empty() && streams.iter().all(|s| s["connected"] == true)
}

/// A metric of a replica, from its own exposition.
pub fn metric(r: &ServeHandle, name: &str) -> Option<f64> {
    let text = r.metrics_text();
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        (series == name).then(|| value.parse().ok())?
    })
}

/// The sum of a counter or gauge over all its samples, in an exposition (OpenMetrics
/// counters carry a `_total` suffix).
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let n = series.split_once('{').map_or(series, |(n, _)| n);
            (n == name || n.strip_suffix("_total") == Some(name)).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// A tiny seeded load balancer: each request to a uniformly drawn live replica.
pub struct Lb {
    addrs: Vec<Option<SocketAddr>>,
    draw: Draw,
}

impl Lb {
    pub fn new(replicas: &[ServeHandle], seed: u64) -> Lb {
        Lb { addrs: replicas.iter().map(|r| Some(r.local_addr())).collect(), draw: Draw(seed) }
    }

    /// The replica for the next request.
    pub fn pick(&mut self) -> (usize, SocketAddr) {
        loop {
            let i = (self.draw.next_u64() % self.addrs.len() as u64) as usize;
            if let Some(a) = self.addrs[i] {
                return (i, a);
            }
        }
    }

    /// Replaces the replicas (`None`: out of rotation).
    pub fn set_addrs(&mut self, addrs: Vec<Option<SocketAddr>>) {
        self.addrs = addrs;
    }

    /// Takes replica `i` out of rotation.
    pub fn remove(&mut self, i: usize) {
        self.addrs[i] = None;
    }
}

/// Tokens each Mooncake hash id stands for here. The trace's ids are 512-token blocks;
/// one 64-token block each keeps the prefix structure (which requests share which
/// blocks) while cutting the tokens the debug-built engines and routers hash eightfold.
pub const TOKENS_PER_HASH_ID: usize = 64;

/// The token ids a trace record stands for, scaled by [`TOKENS_PER_HASH_ID`] / 512.
pub fn record_tokens(r: &TraceRecord) -> Vec<u32> {
    let len = (r.input_length as usize * TOKENS_PER_HASH_ID).div_ceil(512);
    match &r.content {
        PromptContent::HashIds(ids) => {
            ids.iter().flat_map(|&h| std::iter::repeat_n(h, TOKENS_PER_HASH_ID)).take(len).collect()
        }
        PromptContent::Tokens(t) => t.to_vec(),
    }
}

/// How one request of a replay went.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub replica: usize,
    pub ok: bool,
    /// The serving worker, or what went wrong.
    pub detail: String,
    /// When it was sent and when its stream ended, in seconds since the replay began.
    pub sent_s: f64,
    pub ended_s: f64,
}

/// Sends `records` at their trace times divided by `compress`, each to the replica
/// `lb` picks, and returns every outcome in trace order. `midway` runs once, after
/// half the requests were sent (to break something mid-run).
pub async fn replay<F, Fut>(records: &[TraceRecord], compress: f64, lb: &mut Lb, midway: F) -> Vec<Outcome>
where
    F: FnOnce(&mut Lb) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let client = client();
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    let mut midway = Some(midway);
    let at_ms = spread_arrivals(records);
    for (n, r) in records.iter().enumerate() {
        if n == records.len() / 2 {
            if let Some(f) = midway.take() {
                f(lb).await;
            }
        }
        tokio::time::sleep_until(start + Duration::from_secs_f64(at_ms[n] / 1000.0 / compress)).await;
        let body = json!({
            "model": MODEL,
            "prompt": record_tokens(r),
            "max_tokens": r.output_length.clamp(1, 32),
            "stream": true,
        });
        let (replica, addr) = lb.pick();
        let client = client.clone();
        // Taken when the replica is picked, not when the task first runs: on a busy
        // machine that may be well after a replica died that was picked before.
        let sent_s = start.elapsed().as_secs_f64();
        tasks.push(tokio::spawn(async move {
            let (ok, detail) = complete(&client, addr, &body, &[]).await;
            Outcome { replica, ok, detail, sent_s, ended_s: start.elapsed().as_secs_f64() }
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(within(60_000, t).await.expect("request task"));
    }
    out
}

/// Arrival times in ms. The trace's timestamps are whole seconds, so a dozen requests
/// often share one; they are spread evenly over that second, in trace order, instead of
/// arriving in one instant no router could see between.
pub fn spread_arrivals(records: &[TraceRecord]) -> Vec<f64> {
    let mut out = Vec::with_capacity(records.len());
    let mut i = 0;
    while i < records.len() {
        let t = records[i].timestamp_ms;
        let k = records[i..].iter().take_while(|r| r.timestamp_ms == t).count();
        out.extend((0..k).map(|j| t + 1000.0 * j as f64 / k as f64));
        i += k;
    }
    out
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(c)
}

/// POSTs a streamed completion and reads it to the end: whether it finished with
/// `[DONE]`, and the serving worker (or what went wrong).
pub async fn complete(
    client: &Client<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    body: &Value,
    headers: &[(&str, &str)],
) -> (bool, String) {
    let mut b = http::Request::post(format!("http://{addr}/v1/completions")).header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(Bytes::from(body.to_string()))).expect("a request");
    let resp = match tokio::time::timeout(Duration::from_secs(30), client.request(req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return (false, format!("transport: {e}")),
        Err(_) => return (false, "no answer in 30 s".into()),
    };
    let status = resp.status();
    let worker = resp.headers().get("x-kvroute-worker").and_then(|v| v.to_str().ok()).unwrap_or("-").to_string();
    match tokio::time::timeout(Duration::from_secs(30), resp.into_body().collect()).await {
        Ok(Ok(c)) => {
            let text = String::from_utf8_lossy(&c.to_bytes()).into_owned();
            let ok = status.is_success() && text.contains("data: [DONE]");
            (ok, if ok { worker } else { format!("{status}: {text}") })
        }
        Ok(Err(e)) => (false, format!("{status}, body cut: {e}")),
        Err(_) => (false, format!("{status}, body not finished in 30 s")),
    }
}

/// `GET path` as text.
pub async fn get_text(addr: SocketAddr, path: &str) -> String {
    let (_, text) = get(addr, path).await;
    text
}

/// `GET path`: status and body.
pub async fn get(addr: SocketAddr, path: &str) -> (http::StatusCode, String) {
    let req = http::Request::get(format!("http://{addr}{path}")).body(Full::new(Bytes::new())).expect("a request");
    let resp = within(10_000, client().request(req)).await.expect("an answer");
    let status = resp.status();
    let body = within(10_000, resp.into_body().collect()).await.expect("a body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Runs `f` with a time limit, failing the test instead of hanging.
pub async fn within<F: std::future::Future>(ms: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_millis(ms), f).await.expect("timed out")
}

/// Polls `cond` every 20 ms for up to `ms`; fails with `what` if it never holds.
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
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never happened within {ms} ms: {what}");
}
