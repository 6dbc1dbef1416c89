//! Measures what the proxy adds on loopback: the same streamed completions sent straight
//! to a trivial upstream and through the proxy (kv mode, four workers), with latency
//! percentiles and the proxy's own per-stage routing overhead.
//!
//! `cargo run --release -p kvroute-proxy --example loopback_bench -- [requests] [concurrency]`

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvroute_proxy::config::ModelConfig;
use kvroute_proxy::{serve, ProxyConfig, Tokenizers};
use serde_json::json;
use tokio::net::TcpListener;

const SSE: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\ndata: [DONE]\n\n";

async fn upstream() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let svc = service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    let mut r = http::Response::new(Full::new(Bytes::from_static(SSE.as_bytes())));
                    r.headers_mut().insert("content-type", "text/event-stream".parse().unwrap());
                    Ok::<_, Infallible>(r)
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
            });
        }
    });
    addr
}

async fn run(target: SocketAddr, requests: usize, concurrency: usize) -> (Vec<Duration>, Duration) {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(conn);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, next) = (client.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= requests {
                    return lat;
                }
                // Eight conversations with a shared system prompt, so the cache matters.
                let body = json!({"model": "m", "stream": true, "messages": [
                    {"role": "system", "content": "You are a helpful assistant. ".repeat(40)},
                    {"role": "user", "content": format!("conversation {} turn {}", i % 8, i / 8)}]});
                let req = http::Request::post(format!("http://{target}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .header("x-session-id", format!("s{}", i % 8))
                    .body(Full::new(Bytes::from(body.to_string())))
                    .unwrap();
                let s = Instant::now();
                let resp = client.request(req).await.expect("request");
                assert!(resp.status().is_success());
                let _ = resp.into_body().collect().await.expect("body");
                lat.push(s.elapsed());
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    (all, t0.elapsed())
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p) as usize].as_secs_f64() * 1e6
}

fn report(name: &str, mut lat: Vec<Duration>, wall: Duration) {
    lat.sort();
    println!(
        "{{\"path\":\"{name}\",\"requests\":{},\"rps\":{:.0},\"p50_us\":{:.0},\"p99_us\":{:.0}}}",
        lat.len(),
        lat.len() as f64 / wall.as_secs_f64(),
        pct(&lat, 0.5),
        pct(&lat, 0.99)
    );
}

#[tokio::main]
async fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let requests = args.first().copied().unwrap_or(4000);
    let concurrency = args.get(1).copied().unwrap_or(16);
    let ups = [upstream().await, upstream().await, upstream().await, upstream().await];
    let mut cfg = ProxyConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        seed: Some(1),
        models: vec![ModelConfig {
            name: "m".into(),
            block_size: Some(16),
            mode: None,
            lora_adapters: vec![],
            tokenizer: None,
        }],
        ..ProxyConfig::default()
    };
    cfg.health_check.interval_ms = 0;
    for (i, a) in ups.iter().enumerate() {
        cfg.workers.push(serde_json::from_value(json!({"id": i, "url": format!("http://{a}"), "model": "m"})).unwrap());
    }
    let proxy = serve(cfg, Tokenizers::new()).await.unwrap();
    let _ = run(ups[0], 200, concurrency).await; // warm up both paths
    let _ = run(proxy.local_addr(), 200, concurrency).await;
    let (lat, wall) = run(ups[0], requests, concurrency).await;
    report("direct", lat, wall);
    let (lat, wall) = run(proxy.local_addr(), requests, concurrency).await;
    report("proxy", lat, wall);
    let text = proxy.metrics_text();
    for stage in ["parse", "tokenize", "route"] {
        let get = |suffix: &str| {
            text.lines()
                .find(|l| {
                    l.starts_with(&format!("kvroute_routing_overhead_microseconds_{suffix}{{stage=\"{stage}\"}}"))
                })
                .and_then(|l| l.rsplit_once(' '))
                .and_then(|(_, v)| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        println!("{{\"stage\":\"{stage}\",\"mean_us\":{:.1}}}", get("sum") / get("count").max(1.0));
    }
    let _ = proxy.shutdown().await;
}
