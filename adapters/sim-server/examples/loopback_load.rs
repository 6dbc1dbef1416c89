//! Informational throughput check: one in-process worker on loopback, `C` keep-alive
//! HTTP/1.1 connections each sending requests back to back for a fixed count.
//!
//! `cargo run --release -p kvroute-sim-server --example loopback_load -- [C] [N] [SPEEDUP] [STREAM]`
//! (defaults 32 connections, 200 requests each, speedup 1e6, non-streaming). Prints
//! requests per second and the worker's own counters.

use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use kvroute_sim_server::{spawn, SimServerConfig};
use tokio::net::TcpStream;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let conns: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(32);
    let per_conn: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(200);
    let speedup: f64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1e6);
    let stream = args.get(3).is_some_and(|s| s == "stream");
    let mut cfg = SimServerConfig::default();
    cfg.engine.speedup = speedup;
    let w = spawn(cfg).await.expect("worker starts");
    let addr = w.http_addr();
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..conns)
        .map(|c| {
            tokio::spawn(async move {
                let io = TcpStream::connect(addr).await.expect("connect");
                io.set_nodelay(true).expect("nodelay");
                let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await.expect("handshake");
                tokio::spawn(conn);
                let mut bytes = 0usize;
                for i in 0..per_conn {
                    let prompt = format!("connection {c} request {i}: {}", "shared system prompt text ".repeat(8));
                    let body = serde_json::json!({"prompt": prompt, "max_tokens": 16, "stream": stream}).to_string();
                    let req = Request::builder()
                        .method("POST")
                        .uri("/v1/completions")
                        .header("host", addr.to_string())
                        .body(Full::new(Bytes::from(body)))
                        .expect("request");
                    tx.ready().await.expect("ready");
                    let resp = tx.send_request(req).await.expect("response");
                    assert!(resp.status().is_success());
                    bytes += resp.into_body().collect().await.expect("body").to_bytes().len();
                }
                bytes
            })
        })
        .collect();
    let mut bytes = 0;
    for t in tasks {
        bytes += t.await.expect("task");
    }
    let secs = t0.elapsed().as_secs_f64();
    let n = conns * per_conn;
    println!(
        "{n} requests over {conns} connections in {secs:.2} s: {:.0} req/s, {:.1} MB/s of responses (stream={stream}, speedup={speedup})",
        n as f64 / secs,
        bytes as f64 / secs / 1e6
    );
    w.shutdown().await;
}
