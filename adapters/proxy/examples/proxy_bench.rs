//! Measures what the proxy adds on loopback. Four trivial upstreams, the proxy (kv mode,
//! byte-fallback tokenizer) and the load generator share one process; every
//! configuration runs direct-to-upstream and through-the-proxy runs interleaved, three
//! short repeats each, and prints one JSON line with medians.
//!
//! Per configuration (concurrency 1, 16, 64; non-streaming and 16-token streaming):
//! requests/s through the proxy and direct, the latency the proxy adds at p50 and p99,
//! the whole process's CPU seconds per 10k requests for both paths (client and upstreams
//! are in the process too, so the difference is the proxy's share), the proxy's mean
//! per-stage routing overhead from its metrics, and the 1-minute load average.
//!
//! `cargo run --release -p kvroute-proxy --example proxy_bench -- [run_ms] [plain|stream]`
//! (default 800 ms per run, both modes).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvroute_proxy::config::ModelConfig;
use kvroute_proxy::{serve, ProxyConfig, ServeHandle, Tokenizers};
use serde_json::json;
use tokio::net::TcpListener;

/// Tokens per streamed response.
const STREAM_TOKENS: usize = 16;
/// Repeats per path and configuration; the line reports medians.
const REPEATS: usize = 3;
/// Distinct conversations; prompts share a system prompt so the cache term matters.
const CONVERSATIONS: usize = 64;

const JSON_BODY: &str = "{\"id\":\"c\",\"object\":\"chat.completion\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"abcdefghijklmnop\"},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":300,\"completion_tokens\":16,\"total_tokens\":316}}";

/// A response body of ready frames: one chunk per token, then `[DONE]`.
struct Frames(VecDeque<Bytes>);

impl Body for Frames {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
}

fn sse_frames() -> VecDeque<Bytes> {
    let mut v: VecDeque<Bytes> = (0..STREAM_TOKENS)
        .map(|i| {
            Bytes::from(format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
            ))
        })
        .collect();
    v.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    v
}

/// An upstream that answers a chat completion at once: JSON, or SSE when the body asks
/// for `"stream":true`.
async fn upstream() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind upstream");
    let addr = l.local_addr().expect("upstream addr");
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let svc = service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                    let stream = body.windows(13).any(|w| w == b"\"stream\":true");
                    let (frames, ctype) = if stream {
                        (sse_frames(), "text/event-stream")
                    } else {
                        (VecDeque::from([Bytes::from_static(JSON_BODY.as_bytes())]), "application/json")
                    };
                    let mut r = http::Response::new(Frames(frames));
                    r.headers_mut().insert("content-type", http::HeaderValue::from_static(ctype));
                    Ok::<_, Infallible>(r)
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
            });
        }
    });
    addr
}

type BenchClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> BenchClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(60)).build(conn)
}

/// ~1.2 KB chat prompts: a shared system prompt and a per-conversation user turn.
fn bodies(stream: bool) -> Vec<Bytes> {
    let system = "You are a helpful assistant who answers briefly and cites sources. ".repeat(12);
    (0..CONVERSATIONS)
        .map(|c| {
            let user =
                format!("Conversation {c}: summarise the attached notes about topic {c} in three bullets. ").repeat(4);
            let body = json!({"model": "m", "stream": stream, "max_tokens": STREAM_TOKENS,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]});
            Bytes::from(body.to_string())
        })
        .collect()
}

/// One run: `concurrency` closed-loop clients for `dur`, each target picked round-robin.
/// Returns sorted latencies, wall time and process CPU seconds used.
async fn run(
    client: &BenchClient,
    targets: &[SocketAddr],
    bodies: &Arc<Vec<Bytes>>,
    concurrency: usize,
    dur: Duration,
) -> (Vec<Duration>, Duration, f64) {
    let next = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let uris: Arc<Vec<String>> = Arc::new(targets.iter().map(|t| format!("http://{t}/v1/chat/completions")).collect());
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, next, stop, uris, bodies) =
            (client.clone(), next.clone(), stop.clone(), uris.clone(), bodies.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(4096);
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let req = http::Request::post(&uris[i % uris.len()])
                    .header("content-type", "application/json")
                    .body(Full::new(bodies[i % bodies.len()].clone()))
                    .expect("request");
                let s = Instant::now();
                let resp = client.request(req).await.expect("response");
                assert!(resp.status().is_success(), "status {}", resp.status());
                let _ = resp.into_body().collect().await.expect("body");
                lat.push(s.elapsed());
            }
            lat
        }));
    }
    tokio::time::sleep(dur).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("client task"));
    }
    let wall = t0.elapsed();
    let cpu = cpu_seconds() - cpu0;
    all.sort();
    (all, wall, cpu)
}

/// utime + stime of the whole process from `/proc/self/stat`, assuming 100 ticks/s.
fn cpu_seconds() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
    // Fields after the `(comm)`, which may hold spaces: state is field 3, utime 14, stime 15.
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

fn pct_us(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e6
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Per repeat: requests/s, p50 µs, p99 µs, CPU s per 10k requests.
#[derive(Default)]
struct Path {
    rps: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
    cpu10k: Vec<f64>,
    requests: usize,
}

impl Path {
    fn push(&mut self, (lat, wall, cpu): (Vec<Duration>, Duration, f64)) {
        let n = lat.len().max(1) as f64;
        self.rps.push(n / wall.as_secs_f64());
        self.p50.push(pct_us(&lat, 0.5));
        self.p99.push(pct_us(&lat, 0.99));
        self.cpu10k.push(cpu / n * 10_000.0);
        self.requests += lat.len();
    }
}

/// `(sum, count)` of each stage's overhead histogram.
fn stages(proxy: &ServeHandle) -> [(f64, f64); 3] {
    let text = proxy.metrics_text();
    ["parse", "tokenize", "route"].map(|stage| {
        let get = |suffix: &str| {
            let prefix = format!("kvroute_routing_overhead_microseconds_{suffix}{{stage=\"{stage}\"}}");
            text.lines()
                .find(|l| l.starts_with(&prefix))
                .and_then(|l| l.rsplit_once(' '))
                .and_then(|(_, v)| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        (get("sum"), get("count"))
    })
}

#[tokio::main]
async fn main() {
    let run_ms = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(800u64);
    let dur = Duration::from_millis(run_ms);
    let warm = Duration::from_millis(run_ms / 4);
    let only = std::env::args().nth(2);
    let ups = vec![upstream().await, upstream().await, upstream().await, upstream().await];
    let mut cfg = ProxyConfig {
        listen: "127.0.0.1:0".parse().expect("listen"),
        seed: Some(1),
        models: vec![ModelConfig {
            name: "m".into(),
            block_size: Some(16),
            mode: None,
            lora_adapters: vec![],
            tokenizer: None,
            ..ModelConfig::default()
        }],
        ..ProxyConfig::default()
    };
    cfg.health_check.interval_ms = 0;
    for (i, a) in ups.iter().enumerate() {
        let w = json!({"id": i, "url": format!("http://{a}"), "model": "m"});
        cfg.workers.push(serde_json::from_value(w).expect("worker"));
    }
    let proxy = serve(cfg, Tokenizers::new()).await.expect("serve");
    let via = [proxy.local_addr()];
    let client = client();
    for stream in [false, true] {
        if only.as_deref().is_some_and(|o| o != if stream { "stream" } else { "plain" }) {
            continue;
        }
        let bodies = Arc::new(bodies(stream));
        for concurrency in [1usize, 16, 64] {
            let _ = run(&client, &ups, &bodies, concurrency, warm).await;
            let _ = run(&client, &via, &bodies, concurrency, warm).await;
            let before = stages(&proxy);
            let (mut direct, mut proxied) = (Path::default(), Path::default());
            for _ in 0..REPEATS {
                direct.push(run(&client, &ups, &bodies, concurrency, dur).await);
                proxied.push(run(&client, &via, &bodies, concurrency, dur).await);
            }
            let after = stages(&proxy);
            let stage_us: Vec<f64> =
                (0..3).map(|i| (after[i].0 - before[i].0) / (after[i].1 - before[i].1).max(1.0)).collect();
            let (d50, d99, dcpu) = (median(direct.p50), median(direct.p99), median(direct.cpu10k));
            let (p50, p99, pcpu) = (median(proxied.p50), median(proxied.p99), median(proxied.cpu10k));
            let line = json!({
                "concurrency": concurrency,
                "stream": stream,
                "tokens": if stream { STREAM_TOKENS } else { 0 },
                "requests": proxied.requests,
                "direct_requests": direct.requests,
                "proxy_rps": median(proxied.rps).round(),
                "direct_rps": median(direct.rps).round(),
                "proxy_p50_us": p50.round(),
                "proxy_p99_us": p99.round(),
                "direct_p50_us": d50.round(),
                "direct_p99_us": d99.round(),
                "added_p50_us": (p50 - d50).round(),
                "added_p99_us": (p99 - d99).round(),
                "cpu_s_per_10k_proxied": (pcpu * 1000.0).round() / 1000.0,
                "cpu_s_per_10k_direct": (dcpu * 1000.0).round() / 1000.0,
                "cpu_s_per_10k_proxy_share": ((pcpu - dcpu) * 1000.0).round() / 1000.0,
                "stage_mean_us": {"parse": (stage_us[0] * 10.0).round() / 10.0,
                    "tokenize": (stage_us[1] * 10.0).round() / 10.0,
                    "route": (stage_us[2] * 10.0).round() / 10.0},
                "load1": load1(),
            });
            println!("{line}");
        }
    }
    let _ = proxy.shutdown().await;
}
