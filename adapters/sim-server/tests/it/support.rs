//! Shared helpers: starting a worker, a minimal HTTP client (hyper, HTTP/1.1 or h2c),
//! SSE parsing, and bounded waits.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvroute_sim_server::{spawn, SimServerConfig, SimServerHandle};
use serde_json::Value;
use tokio::net::TcpStream;

/// The longest any single wait may take before the test fails.
pub const T: Duration = Duration::from_secs(10);

/// Awaits `f`, failing the test if it takes longer than [`T`].
#[track_caller]
pub fn bounded<F: Future>(f: F) -> impl Future<Output = F::Output> {
    let caller = std::panic::Location::caller();
    async move {
        match tokio::time::timeout(T, f).await {
            Ok(v) => v,
            Err(_) => panic!("timed out after {T:?} at {caller}"),
        }
    }
}

/// A fast worker on ephemeral ports: speedup 1000, small blocks.
pub fn fast_config() -> SimServerConfig {
    let mut cfg = SimServerConfig::default();
    cfg.engine.speedup = 1000.0;
    cfg.engine.block_size = 4;
    cfg.engine.blocks_per_worker = 4096;
    cfg.model = "sim-test".to_string();
    cfg
}

pub async fn start(cfg: SimServerConfig) -> SimServerHandle {
    bounded(spawn(cfg)).await.expect("worker starts")
}

pub struct Reply {
    pub status: StatusCode,
    pub content_type: String,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse(&self) -> Vec<String> {
        let text = std::str::from_utf8(&self.body).expect("utf-8 stream");
        assert!(text.ends_with("\n\n"), "stream ends with a blank line: {text:?}");
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("not an SSE data line: {e:?}")).to_string())
            .collect()
    }
}

/// Sends one request over a fresh HTTP/1.1 connection.
pub async fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Reply {
    bounded(async {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
        tokio::spawn(conn);
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("valid request");
        read(tx.send_request(req).await.expect("response")).await
    })
    .await
}

/// Sends one request over a fresh h2c (HTTP/2 prior knowledge) connection.
pub async fn request_h2(addr: SocketAddr, path: &str, body: &str) -> Reply {
    bounded(async {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut tx, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.expect("h2c");
        tokio::spawn(conn);
        let req = Request::builder()
            .method("POST")
            .uri(format!("http://{addr}{path}"))
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("valid request");
        read(tx.send_request(req).await.expect("response")).await
    })
    .await
}

async fn read(resp: hyper::Response<hyper::body::Incoming>) -> Reply {
    let status = resp.status();
    let content_type = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    Reply { status, content_type, body }
}

pub async fn post(addr: SocketAddr, path: &str, body: &str) -> Reply {
    request(addr, "POST", path, body).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    request(addr, "GET", path, "").await
}

/// Streams a POST and returns each SSE `data:` payload with its arrival time, measured
/// from just before the request was sent.
pub async fn stream_arrivals(addr: SocketAddr, path: &str, body: &str) -> Vec<(Duration, String)> {
    bounded(async {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
        tokio::spawn(conn);
        let req = post_request(addr, path, body);
        let t0 = std::time::Instant::now();
        let mut body = tx.send_request(req).await.expect("response").into_body();
        let mut out = Vec::new();
        let mut pending = String::new();
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.expect("frame").into_data() else { continue };
            let at = t0.elapsed();
            pending.push_str(std::str::from_utf8(&data).expect("utf-8"));
            while let Some(end) = pending.find("\n\n") {
                let event: String = pending.drain(..end + 2).collect();
                out.push((at, event.trim_end().trim_start_matches("data: ").to_string()));
            }
        }
        out
    })
    .await
}

/// A POST of `body` to `path` on `addr`.
fn post_request(addr: SocketAddr, path: &str, body: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method("POST")
        .uri(path)
        .header("host", addr.to_string())
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("valid request")
}

/// A stream in progress: the connection task (abort it to hang up), the bytes of the
/// first data frame, and the rest of the body.
pub type OpenStream = (tokio::task::JoinHandle<()>, Bytes, hyper::body::Incoming);

/// Starts a streaming POST and returns once its first data frame arrived.
pub async fn open_stream(addr: SocketAddr, path: &str, body: &str) -> OpenStream {
    bounded(async {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = post_request(addr, path, body);
        let mut body = tx.send_request(req).await.expect("response").into_body();
        loop {
            let frame = body.frame().await.expect("a first event").expect("frame");
            if let Ok(data) = frame.into_data() {
                return (conn, data, body);
            }
        }
    })
    .await
}
