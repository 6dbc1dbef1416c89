//! Measures what the proxy adds on loopback. Four trivial upstreams, the proxy (kv mode,
//! byte-fallback tokenizer) and the load generator share one process; every
//! configuration runs direct-to-upstream and through-the-proxy runs interleaved, a few
//! short repeats each, and prints one JSON line with medians.
//!
//! Per configuration (concurrency 1, 16, 64; non-streaming and 16-token streaming):
//! requests/s through the proxy and direct, the latency the proxy adds at p50 and p99,
//! the whole process's CPU seconds per 10k requests for both paths (client and upstreams
//! are in the process too, so the difference is the proxy's share), the proxy's mean
//! per-stage routing overhead from its metrics, and the 1-minute load average.
//!
//! Other proxies put in front of the same upstreams (another kvroute process, a
//! reference router) are measured in the same interleaved loop with `--external`, so
//! their ratios to kvroute hold even on a machine busy with other work.
//!
//! `cargo run --release -p kvroute-proxy --example proxy_bench -- [run_ms] [plain|stream] [flags]`
//! (default 800 ms per run, both modes). Flags:
//!
//! * `--conc 1,16,64`: the concurrencies;
//! * `--repeats 3`: runs per path and configuration;
//! * `--upstream-port P`: the upstreams listen on P..P+3 (default: any free ports);
//! * `--external NAME=HOST:PORT[@PID]` (repeatable): a proxy to measure too; with a PID
//!   its process's CPU is added to its share, and reported alone as `cpu_s_per_10k_own`
//!   (ratio `cpu_own`), free of the load generator's noise;
//! * `--external-bearer KEY`: the externals' requests carry `Authorization: Bearer KEY`;
//! * `--baseline NAME`: report every other path's ratios to this external one;
//! * `--no-inproc`: skip the in-process proxy;
//! * `--wrk`: generate the load with wrk (a separate process, `-t1` at concurrency 1,
//!   else `-t2`) instead of in-process clients; the direct path then goes to the first
//!   upstream only;
//! * `--upstreams-only`: serve the upstreams until killed (for an outside load generator);
//! * `--auth`: also measure in-process proxies with one tenant: `kvroute_auth`, every
//!   request carrying its key, limited and cache-isolated; `kvroute_key`, the key only
//!   (no limits, a shared cache); `kvroute_salt`, the key and the isolation (no limits);
//!   and `kvroute_open2`, a second open proxy, the control
//!   whose ratio to `kvroute` is the noise between two identical paths. With `--baseline
//!   kvroute` their ratios to the open proxy are printed;
//! * `--otlp-sink-port P`: serve the OTLP sink on P, for traced proxies in their own
//!   processes (see the tracing recipe below);
//! * `--tracing 0.1,1`: also measure in-process proxies with `[tracing]` on at these
//!   sampling ratios (paths `kvroute_trace_<ratio>`), exporting every 1 s over OTLP/HTTP
//!   to a sink in this process that reads each export and answers 200; with
//!   `--baseline kvroute` their ratios to the untraced proxy are printed (`cpu_share` is
//!   the traced proxy's CPU per request over the untraced one's).
//!
//! The comparison with the reference router runs the routers as their own processes in
//! front of upstreams on fixed ports, with wrk as the load:
//!
//! ```text
//! kvroute serve --config bench.toml --listen 127.0.0.1:18081   # kv mode, workers on :19001..:19004
//! python -m sglang_router.launch_router --port 18090 --policy cache_aware \
//!     --worker-urls http://127.0.0.1:19001 http://127.0.0.1:19002 http://127.0.0.1:19003 http://127.0.0.1:19004
//! proxy_bench 2000 --wrk --repeats 5 --no-inproc --upstream-port 19001 \
//!     --external kvroute=127.0.0.1:18081@<pid> --external sglang=127.0.0.1:18090@<pid>
//! ```

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
use kvroute_proxy::config::{ModelConfig, TracingConfig};
use kvroute_proxy::{serve, ProxyConfig, ServeHandle, Tokenizers};
use serde_json::json;
use tokio::net::TcpListener;

/// Tokens per streamed response.
const STREAM_TOKENS: usize = 16;
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
async fn upstream(port: u16) -> SocketAddr {
    let l = TcpListener::bind(("127.0.0.1", port)).await.expect("bind upstream");
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

/// Where a path sends its requests, and whose CPU it adds to this process's.
#[derive(Clone)]
struct Target {
    name: String,
    addrs: Vec<SocketAddr>,
    pid: Option<u32>,
    /// The `Authorization` header its requests carry (in-process load only).
    authorization: Option<&'static str>,
}

/// One run's figures.
struct Sample {
    requests: usize,
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    /// CPU seconds of this process and the target's.
    cpu: f64,
    /// CPU seconds of the target's process alone (0 without a PID).
    own_cpu: f64,
}

/// One run through `load`: in-process clients, or wrk when a Lua script is given.
async fn run(
    client: &BenchClient,
    wrk: Option<&std::path::Path>,
    target: &Target,
    bodies: &Arc<Vec<Bytes>>,
    concurrency: usize,
    dur: Duration,
) -> Sample {
    match wrk {
        None => run_inproc(client, target, bodies, concurrency, dur).await,
        Some(script) => {
            let (script, target) = (script.to_path_buf(), Target { ..target.clone() });
            tokio::task::spawn_blocking(move || run_wrk(&script, &target, concurrency, dur)).await.expect("wrk run")
        }
    }
}

/// One run: `concurrency` closed-loop clients for `dur`, each address picked round-robin.
async fn run_inproc(
    client: &BenchClient,
    target: &Target,
    bodies: &Arc<Vec<Bytes>>,
    concurrency: usize,
    dur: Duration,
) -> Sample {
    let targets = &target.addrs;
    let ext0 = target.pid.map_or(0.0, |p| cpu_seconds_of(Some(p)));
    let next = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let authorization = target.authorization;
    let uris: Arc<Vec<String>> = Arc::new(targets.iter().map(|t| format!("http://{t}/v1/chat/completions")).collect());
    let cpu0 = cpu_seconds_of(None);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, next, stop, uris, bodies) =
            (client.clone(), next.clone(), stop.clone(), uris.clone(), bodies.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(4096);
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let mut req = http::Request::post(&uris[i % uris.len()])
                    .header("content-type", "application/json")
                    .body(Full::new(bodies[i % bodies.len()].clone()))
                    .expect("request");
                if let Some(a) = authorization {
                    req.headers_mut().insert(http::header::AUTHORIZATION, http::HeaderValue::from_static(a));
                }
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
    let ext = target.pid.map_or(0.0, |p| cpu_seconds_of(Some(p)) - ext0);
    let cpu = cpu_seconds_of(None) - cpu0 + ext;
    all.sort();
    Sample {
        requests: all.len(),
        rps: all.len() as f64 / wall.as_secs_f64(),
        p50_us: pct_us(&all, 0.5),
        p99_us: pct_us(&all, 0.99),
        cpu,
        own_cpu: ext,
    }
}

/// One run of wrk (`wrk -t1` at concurrency 1, else `-t2`) against the target's first
/// address, with `script` choosing the bodies.
fn run_wrk(script: &std::path::Path, target: &Target, concurrency: usize, dur: Duration) -> Sample {
    let ext0 = target.pid.map_or(0.0, |p| cpu_seconds_of(Some(p)));
    let cpu0 = cpu_seconds_of(None);
    let out = std::process::Command::new("wrk")
        .arg(format!("-t{}", if concurrency == 1 { 1 } else { 2 }))
        .arg(format!("-c{concurrency}"))
        // wrk takes whole seconds.
        .arg(format!("-d{}s", dur.as_millis().div_ceil(1000).max(1)))
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(format!("http://{}", target.addrs[0]))
        .output()
        .expect("wrk runs (apt-get install wrk)");
    let ext = target.pid.map_or(0.0, |p| cpu_seconds_of(Some(p)) - ext0);
    let cpu = cpu_seconds_of(None) - cpu0 + ext;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("Non-2xx"), "{} answered errors:\n{text}", target.name);
    let field = |prefix: &str| -> Option<&str> {
        text.lines()
            .find_map(|l| l.trim_start().strip_prefix(prefix))
            .map(|r| r.split_whitespace().next().unwrap_or(""))
    };
    let us = |v: &str| -> f64 {
        let split = v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len());
        let n: f64 = v[..split].parse().unwrap_or(f64::NAN);
        n * match &v[split..] {
            "ms" => 1e3,
            "s" => 1e6,
            _ => 1.0,
        }
    };
    let requests = text
        .lines()
        .find_map(|l| l.trim().split_once(" requests in").and_then(|(n, _)| n.parse().ok()))
        .unwrap_or_else(|| panic!("no wrk summary:\n{text}"));
    Sample {
        requests,
        rps: field("Requests/sec:").and_then(|v| v.parse().ok()).unwrap_or(0.0),
        p50_us: field("50%").map_or(f64::NAN, us),
        p99_us: field("99%").map_or(f64::NAN, us),
        cpu,
        own_cpu: ext,
    }
}

/// A wrk script sending `bodies` round-robin.
fn wrk_script(bodies: &[Bytes], stream: bool) -> std::path::PathBuf {
    let mut lua = String::from("local bodies = {\n");
    for b in bodies {
        lua.push_str("  [==[");
        lua.push_str(std::str::from_utf8(b).expect("JSON is UTF-8"));
        lua.push_str("]==],\n");
    }
    lua.push_str("}\nlocal i = 0\nrequest = function()\n  i = i + 1\n");
    lua.push_str("  return wrk.format('POST', '/v1/chat/completions', {['Content-Type']='application/json'}, ");
    lua.push_str("bodies[(i % #bodies) + 1])\nend\n");
    let mode = if stream { "stream" } else { "plain" };
    let path = std::env::temp_dir().join(format!("proxy_bench_{}_{mode}.lua", std::process::id()));
    std::fs::write(&path, lua).expect("write the wrk script");
    path
}

/// utime + stime of a process (this one by default) from `/proc/<pid>/stat`, assuming
/// 100 ticks/s.
fn cpu_seconds_of(pid: Option<u32>) -> f64 {
    let path = pid.map_or_else(|| "/proc/self/stat".to_string(), |p| format!("/proc/{p}/stat"));
    let Ok(s) = std::fs::read_to_string(path) else { return 0.0 };
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

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Per repeat: requests/s, p50 µs, p99 µs, CPU s per 10k requests.
#[derive(Default)]
struct Path {
    rps: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
    cpu10k: Vec<f64>,
    own10k: Vec<f64>,
    requests: usize,
}

impl Path {
    fn push(&mut self, s: Sample) {
        self.rps.push(s.rps);
        self.p50.push(s.p50_us);
        self.p99.push(s.p99_us);
        self.cpu10k.push(s.cpu / s.requests.max(1) as f64 * 10_000.0);
        self.own10k.push(s.own_cpu / s.requests.max(1) as f64 * 10_000.0);
        self.requests += s.requests;
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

/// Measures what the proxy adds on loopback: direct-to-upstream and through-the-proxy
/// runs, interleaved, with medians printed as one JSON line per configuration.
#[derive(clap::Parser)]
#[command(after_help = "See the example's module docs for what each figure means.")]
struct Args {
    /// Milliseconds per run.
    #[arg(default_value_t = 800)]
    run_ms: u64,
    /// Only this mode.
    #[arg(value_parser = ["plain", "stream"])]
    only: Option<String>,
    /// Concurrencies, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    conc: Vec<usize>,
    /// Runs per path and configuration.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// The upstreams listen on P..P+3 (default: any free ports).
    #[arg(long, value_name = "P")]
    upstream_port: Option<u16>,
    /// A proxy to measure too, `NAME=HOST:PORT[@PID]`; with a PID its process's CPU is
    /// added to its share and reported on its own (repeatable).
    #[arg(long, value_parser = parse_external)]
    external: Vec<Target>,
    /// The API key every `--external` proxy's requests carry (`Authorization: Bearer KEY`),
    /// for a proxy whose tenants need one.
    #[arg(long, value_name = "KEY")]
    external_bearer: Option<String>,
    /// Report every other path's ratios to this one.
    #[arg(long, default_value = "sglang")]
    baseline: String,
    /// Skip the in-process proxy.
    #[arg(long = "no-inproc", action = clap::ArgAction::SetFalse)]
    inproc: bool,
    /// Serve the upstreams (and the OTLP sink, with `--otlp-sink-port`) until killed.
    #[arg(long)]
    upstreams_only: bool,
    /// Generate the load with wrk instead of in-process clients.
    #[arg(long)]
    wrk: bool,
    /// Also measure in-process proxies tracing at these sampling ratios.
    #[arg(long, value_delimiter = ',')]
    tracing: Vec<f64>,
    /// Also measure in-process proxies with one tenant (paths `kvroute_auth`: every
    /// request authenticated, limited (limits too high to refuse) and cache-isolated;
    /// `kvroute_key`: authenticated only; `kvroute_salt`: authenticated and isolated),
    /// and a second open one (`kvroute_open2`).
    #[arg(long)]
    auth: bool,
    /// Serve the OTLP/HTTP sink on this port (for traced proxies in other processes).
    #[arg(long, value_name = "P")]
    otlp_sink_port: Option<u16>,
}

fn parse_external(v: &str) -> Result<Target, String> {
    let (name, rest) = v.split_once('=').ok_or("expected NAME=HOST:PORT[@PID]")?;
    let (addr, pid) = match rest.split_once('@') {
        Some((a, p)) => (a, Some(p.parse().map_err(|e| format!("pid {p:?}: {e}"))?)),
        None => (rest, None),
    };
    let addr = addr.parse().map_err(|e| format!("address {addr:?}: {e}"))?;
    Ok(Target { name: name.into(), addrs: vec![addr], pid, authorization: None })
}

/// An OTLP/HTTP sink: reads each export whole and answers 200 with an empty (valid)
/// response.
async fn otlp_sink(port: u16) -> SocketAddr {
    let l = TcpListener::bind(("127.0.0.1", port)).await.expect("bind the OTLP sink");
    let addr = l.local_addr().expect("sink addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::new())))
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
            });
        }
    });
    addr
}

/// The `Authorization` header of `--auth`'s tenant.
const BENCH_AUTHORIZATION: &str = "Bearer sk-bench-0123456789abcdef";

/// [`inproc_proxy`] with one tenant whose key [`BENCH_AUTHORIZATION`] carries: with
/// `limited`, limits set high enough that none refuses; with `isolated`, its cache
/// salted.
async fn auth_proxy(ups: &[SocketAddr], limited: bool, isolated: bool) -> ServeHandle {
    let key = &BENCH_AUTHORIZATION["Bearer ".len()..];
    let sha: String = ring::digest::digest(&ring::digest::SHA256, key.as_bytes())
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut tenant = json!({"name": "bench", "api_key_sha256": sha});
    if limited {
        tenant["requests_per_second"] = json!(10_000_000);
        tenant["tokens_per_minute"] = json!(1_000_000_000_000u64);
        tenant["concurrent_max"] = json!(100_000);
    }
    tenant["cache"] = json!(if isolated { "isolated" } else { "shared" });
    let tenant = json!([tenant]);
    inproc_proxy_with(ups, None, serde_json::from_value(tenant).expect("tenant")).await
}

/// The proxy under test, in this process, in front of `ups`, tracing when `tracing`.
async fn inproc_proxy(ups: &[SocketAddr], tracing: Option<TracingConfig>) -> ServeHandle {
    inproc_proxy_with(ups, tracing, Vec::new()).await
}

async fn inproc_proxy_with(
    ups: &[SocketAddr],
    tracing: Option<TracingConfig>,
    tenants: Vec<kvroute_frontend::tenants::TenantConfig>,
) -> ServeHandle {
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
    cfg.tracing = tracing;
    cfg.tenants = tenants;
    for (i, a) in ups.iter().enumerate() {
        let w = json!({"id": i, "url": format!("http://{a}"), "model": "m"});
        cfg.workers.push(serde_json::from_value(w).expect("worker"));
    }
    serve(cfg, Tokenizers::new()).await.expect("serve")
}

/// A path's medians as JSON, with what it adds to going direct.
fn summary(p: &Path, direct: &Path) -> serde_json::Value {
    let (d50, d99, dcpu) = (median(&direct.p50), median(&direct.p99), median(&direct.cpu10k));
    let (p50, p99, cpu) = (median(&p.p50), median(&p.p99), median(&p.cpu10k));
    json!({
        "requests": p.requests,
        "rps": median(&p.rps).round(),
        "p50_us": p50.round(),
        "p99_us": p99.round(),
        "added_p50_us": (p50 - d50).round(),
        "added_p99_us": (p99 - d99).round(),
        "cpu_s_per_10k_proxy_share": ((cpu - dcpu) * 1000.0).round() / 1000.0,
        "cpu_s_per_10k_own": (median(&p.own10k) * 1000.0).round() / 1000.0,
    })
}

/// `x`'s ratios to `base`: throughput, added p50, proxy CPU per request.
fn ratios(x: &Path, base: &Path, direct: &Path) -> serde_json::Value {
    let added = |p: &Path| median(&p.p50) - median(&direct.p50);
    let share = |p: &Path| median(&p.cpu10k) - median(&direct.cpu10k);
    let r = |a: f64, b: f64| if b.abs() > 1e-9 { (a / b * 100.0).round() / 100.0 } else { f64::NAN };
    json!({
        "rps": r(median(&x.rps), median(&base.rps)),
        "added_p50": r(added(x), added(base)),
        "cpu_share": r(share(x), share(base)),
        // Only for proxies in their own processes: their CPU, without the clients'.
        "cpu_own": r(median(&x.own10k), median(&base.own10k)),
    })
}

#[tokio::main]
async fn main() {
    let args = <Args as clap::Parser>::parse();
    let dur = Duration::from_millis(args.run_ms);
    let warm = Duration::from_millis(args.run_ms / 4);
    let mut ups = Vec::new();
    for i in 0..4u16 {
        ups.push(upstream(args.upstream_port.map_or(0, |p| p + i)).await);
    }
    let sink = match args.otlp_sink_port {
        Some(p) => Some(otlp_sink(p).await),
        None if !args.tracing.is_empty() => Some(otlp_sink(0).await),
        None => None,
    };
    if args.upstreams_only {
        eprintln!("upstreams on {ups:?}, OTLP sink on {sink:?}");
        std::future::pending::<()>().await;
    }
    let proxy = if args.inproc { Some(inproc_proxy(&ups, None).await) } else { None };
    let mut targets = vec![Target { name: "direct".into(), addrs: ups.clone(), pid: None, authorization: None }];
    if let Some(p) = &proxy {
        targets.push(Target { name: "kvroute".into(), addrs: vec![p.local_addr()], pid: None, authorization: None });
    }
    let mut traced = Vec::new();
    if let Some(sink) = sink {
        for &ratio in &args.tracing {
            let mut t = TracingConfig::new(format!("http://{sink}"));
            t.sampling_ratio = ratio;
            t.export_interval_ms = 1_000;
            let p = inproc_proxy(&ups, Some(t)).await;
            let name = format!("kvroute_trace_{ratio}");
            targets.push(Target { name, addrs: vec![p.local_addr()], pid: None, authorization: None });
            traced.push(p);
        }
    }
    let mut authed = Vec::new();
    if args.auth {
        for (name, tenant, authorization) in [
            ("kvroute_open2", None, None),
            ("kvroute_key", Some((false, false)), Some(BENCH_AUTHORIZATION)),
            ("kvroute_salt", Some((false, true)), Some(BENCH_AUTHORIZATION)),
            ("kvroute_auth", Some((true, true)), Some(BENCH_AUTHORIZATION)),
        ] {
            let p = match tenant {
                None => inproc_proxy(&ups, None).await,
                Some((limited, isolated)) => auth_proxy(&ups, limited, isolated).await,
            };
            targets.push(Target { name: name.into(), addrs: vec![p.local_addr()], pid: None, authorization });
            authed.push(p);
        }
    }
    // Leaked once: every request clones the header from a static string.
    let bearer: Option<&'static str> =
        args.external_bearer.map(|k| &*Box::leak(format!("Bearer {k}").into_boxed_str()));
    targets.extend(args.external.into_iter().map(|t| Target { authorization: bearer, ..t }));
    let client = client();
    for stream in [false, true] {
        if args.only.as_deref().is_some_and(|o| o != if stream { "stream" } else { "plain" }) {
            continue;
        }
        let bodies = Arc::new(bodies(stream));
        let script = args.wrk.then(|| wrk_script(&bodies, stream));
        let wrk = script.as_deref();
        for &concurrency in &args.conc {
            for t in &targets {
                let _ = run(&client, wrk, t, &bodies, concurrency, warm).await;
            }
            let before = proxy.as_ref().map(stages);
            let mut paths: Vec<Path> = targets.iter().map(|_| Path::default()).collect();
            for _ in 0..args.repeats {
                for (t, p) in targets.iter().zip(&mut paths) {
                    p.push(run(&client, wrk, t, &bodies, concurrency, dur).await);
                }
            }
            let mut line = json!({
                "concurrency": concurrency,
                "stream": stream,
                "tokens": if stream { STREAM_TOKENS } else { 0 },
                "load": if args.wrk { "wrk" } else { "in-process" },
                "load1": load1(),
            });
            let direct = &paths[0];
            line["direct_requests"] = json!(direct.requests);
            line["direct_rps"] = json!(median(&direct.rps).round());
            line["direct_p50_us"] = json!(median(&direct.p50).round());
            line["direct_p99_us"] = json!(median(&direct.p99).round());
            line["cpu_s_per_10k_direct"] = json!((median(&direct.cpu10k) * 1000.0).round() / 1000.0);
            for (t, p) in targets.iter().zip(&paths).skip(1) {
                line[t.name.as_str()] = summary(p, direct);
            }
            if let (Some(proxy), Some(before)) = (&proxy, before) {
                let after = stages(proxy);
                let mean = |i: usize| {
                    let us = (after[i].0 - before[i].0) / (after[i].1 - before[i].1).max(1.0);
                    (us * 10.0).round() / 10.0
                };
                line["kvroute"]["stage_mean_us"] = json!({"parse": mean(0), "tokenize": mean(1), "route": mean(2)});
            }
            if let Some(b) = targets.iter().position(|t| t.name == args.baseline) {
                let mut vs = serde_json::Map::new();
                for (i, t) in targets.iter().enumerate().skip(1).filter(|(i, _)| *i != b) {
                    vs.insert(t.name.clone(), ratios(&paths[i], &paths[b], direct));
                }
                line[format!("vs_{}", args.baseline)] = serde_json::Value::Object(vs);
            }
            println!("{line}");
        }
        if let Some(path) = script {
            let _ = std::fs::remove_file(path);
        }
    }
    for p in proxy.into_iter().chain(traced).chain(authed) {
        let _ = p.shutdown().await;
    }
}
