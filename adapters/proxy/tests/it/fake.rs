//! A tiny OpenAI-style upstream for the proxy's tests: streams SSE chunks, answers JSON,
//! refuses, dies mid-stream, stalls, floods, or fails its health check, on command; and
//! it can be killed outright, every connection cut and the port closed.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::time::Instant;

/// The sockets holding the ports of [`Fake::dead_addr`], bound and never listening.
static DEAD: Mutex<Vec<TcpSocket>> = Mutex::new(Vec::new());

/// What the fake does with the next completion requests.
#[derive(Clone)]
pub enum Behavior {
    /// 200 SSE: these chunks, one every `gap_ms`.
    Stream { chunks: Vec<Bytes>, gap_ms: u64 },
    /// 200 SSE: each chunk waits for a permit of the gate.
    Gated { chunks: Vec<Bytes>, gate: Arc<Semaphore> },
    /// 200 SSE: the first chunk at once, each later one after a permit of the gate.
    GatedAfterFirst { chunks: Vec<Bytes>, gate: Arc<Semaphore> },
    /// 200 SSE: these chunks, then the connection dies.
    DieAfter { chunks: Vec<Bytes> },
    /// Wait this long before answering the headers.
    Stall { ms: u64 },
    /// 200 SSE after `ms`: a worker with a fixed service time.
    Delayed { ms: u64, chunks: Vec<Bytes> },
    /// 200 SSE: `chunk` again and again until `bytes_total` were taken by the connection,
    /// counted in [`Fake::written`]; a flood only goes as fast as the proxy reads.
    Flood { chunk: Bytes, bytes_total: u64 },
    /// This status with an error JSON body.
    Status(u16),
    /// 200 JSON echoing the model.
    Json,
}

/// One request the fake received.
#[derive(Clone, Debug)]
pub struct Seen {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
    /// When its body had arrived.
    pub at: Instant,
}

pub struct Inner {
    behavior: Mutex<Behavior>,
    healthy: Mutex<bool>,
    seen: Mutex<Vec<Seen>>,
    models: Vec<String>,
    /// When each health check arrived.
    probes: Mutex<Vec<Instant>>,
    /// Body bytes of floods taken by the connections, and floods sent whole.
    written: AtomicU64,
    floods_done: AtomicU64,
    /// Connections accepted.
    connections: AtomicU64,
    killed: watch::Sender<bool>,
}

/// A running fake upstream.
#[derive(Clone)]
pub struct Fake {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
}

/// The SSE chunks of a short completion, `[DONE]` last.
pub fn sse_chunks(n: usize) -> Vec<Bytes> {
    let mut v: Vec<Bytes> = (0..n)
        .map(|i| {
            Bytes::from(format!(
                "data: {{\"id\":\"c\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}}}}]}}\n\n"
            ))
        })
        .collect();
    v.push(Bytes::from_static(b"data: [DONE]\n\n"));
    v
}

impl Fake {
    /// Starts a fake that streams `sse_chunks(3)` and lists `models` at /v1/models.
    pub async fn start(models: &[&str]) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let inner = Arc::new(Inner {
            behavior: Mutex::new(Behavior::Stream { chunks: sse_chunks(3), gap_ms: 0 }),
            healthy: Mutex::new(true),
            seen: Mutex::new(Vec::new()),
            models: models.iter().map(|s| s.to_string()).collect(),
            probes: Mutex::new(Vec::new()),
            written: AtomicU64::new(0),
            floods_done: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            killed: watch::channel(false).0,
        });
        let fake = Fake { addr, inner };
        let f = fake.clone();
        let mut killed = fake.inner.killed.subscribe();
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    a = listener.accept() => match a { Ok((s, _)) => s, Err(_) => return },
                    _ = killed.wait_for(|k| *k) => return,
                };
                f.inner.connections.fetch_add(1, Ordering::Relaxed);
                // Like a real engine's server: small SSE writes are not held back by Nagle.
                let _ = stream.set_nodelay(true);
                let f = f.clone();
                let mut killed = f.inner.killed.subscribe();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let f = f.clone();
                        async move { Ok::<_, Infallible>(f.serve(req).await) }
                    });
                    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = killed.wait_for(|k| *k) => {}
                    }
                });
            }
        });
        fake
    }

    /// The process died: the port is closed and every connection is cut, mid-stream or not.
    pub fn kill(&self) {
        self.inner.killed.send_replace(true);
    }

    /// When each health check (a probe or an active check) arrived.
    pub fn probes(&self) -> Vec<Instant> {
        self.inner.probes.lock().unwrap().clone()
    }

    /// Flood bytes the connections took so far, and floods sent whole.
    pub fn written(&self) -> (u64, u64) {
        (self.inner.written.load(Ordering::Relaxed), self.inner.floods_done.load(Ordering::Relaxed))
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.inner.connections.load(Ordering::Relaxed)
    }

    /// An address nothing listens on, for as long as this process runs: connecting to
    /// it is refused. Its port stays bound (never listening, without `SO_REUSEADDR`) in
    /// [`DEAD`], so that no listener can get it meanwhile, whether another test's fake or
    /// worker or another process's: a port merely released is free for the next
    /// `bind(0)` on the machine, and a proxy would then find a live "dead" worker.
    pub async fn dead_addr() -> SocketAddr {
        let sock = TcpSocket::new_v4().unwrap();
        sock.set_reuseaddr(false).unwrap();
        sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = sock.local_addr().unwrap();
        DEAD.lock().unwrap().push(sock);
        addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set(&self, b: Behavior) {
        *self.inner.behavior.lock().unwrap() = b;
    }

    pub fn set_healthy(&self, h: bool) {
        *self.inner.healthy.lock().unwrap() = h;
    }

    /// Completion requests received so far (health checks and model lists excluded).
    pub fn seen(&self) -> Vec<Seen> {
        self.inner.seen.lock().unwrap().clone()
    }

    async fn serve(&self, req: http::Request<Incoming>) -> Response<ChannelBody> {
        let path = req.uri().path().to_string();
        if path == "/health" {
            self.inner.probes.lock().unwrap().push(Instant::now());
            let ok = *self.inner.healthy.lock().unwrap();
            return full(if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, "text/plain", "ok");
        }
        if path == "/v1/models" {
            let data: Vec<Value> =
                self.inner.models.iter().map(|m| serde_json::json!({"id": m, "object": "model"})).collect();
            return full(
                StatusCode::OK,
                "application/json",
                &serde_json::json!({"object": "list", "data": data}).to_string(),
            );
        }
        let (parts, body) = req.into_parts();
        let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        self.inner.seen.lock().unwrap().push(Seen {
            path,
            headers: parts.headers,
            body: body.clone(),
            at: Instant::now(),
        });
        let behavior = self.inner.behavior.lock().unwrap().clone();
        match behavior {
            Behavior::Json => full(
                StatusCode::OK,
                "application/json",
                &serde_json::json!({"object": "ok", "model": body["model"]}).to_string(),
            ),
            Behavior::Status(s) => {
                full(StatusCode::from_u16(s).unwrap(), "application/json", r#"{"error":{"message":"fake failure"}}"#)
            }
            Behavior::Stall { ms } => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                full(StatusCode::OK, "application/json", "{}")
            }
            Behavior::Delayed { ms, chunks } => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                sse(move |tx| async move {
                    for c in chunks {
                        if tx.send(Ok(c)).await.is_err() {
                            return;
                        }
                    }
                })
            }
            Behavior::Flood { chunk, bytes_total } => {
                let mut r = Response::new(ChannelBody::Flood { chunk, left: bytes_total, inner: self.inner.clone() });
                r.headers_mut().insert("content-type", "text/event-stream".parse().unwrap());
                r
            }
            Behavior::Stream { chunks, gap_ms } => sse(move |tx| async move {
                for c in chunks {
                    if gap_ms > 0 {
                        tokio::time::sleep(Duration::from_millis(gap_ms)).await;
                    }
                    if tx.send(Ok(c)).await.is_err() {
                        return;
                    }
                }
            }),
            Behavior::Gated { chunks, gate } => sse(move |tx| async move {
                for c in chunks {
                    let Ok(p) = gate.acquire().await else { return };
                    p.forget();
                    if tx.send(Ok(c)).await.is_err() {
                        return;
                    }
                }
            }),
            Behavior::GatedAfterFirst { chunks, gate } => sse(move |tx| async move {
                for (i, c) in chunks.into_iter().enumerate() {
                    if i > 0 {
                        let Ok(p) = gate.acquire().await else { return };
                        p.forget();
                    }
                    if tx.send(Ok(c)).await.is_err() {
                        return;
                    }
                }
            }),
            Behavior::DieAfter { chunks } => sse(move |tx| async move {
                for c in chunks {
                    let _ = tx.send(Ok(c)).await;
                }
                // hyper drops what it has not flushed when a body fails, and it flushes
                // only once the body is pending: so the error waits until hyper has taken
                // the last chunk and found nothing after it. Sent at once, it could land
                // in the same poll and lose the chunks (seen as a 502 on a loaded host).
                if let Ok(permit) = tx.reserve().await {
                    drop(permit);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let _ = tx.send(Err("worker died".to_string())).await;
            }),
        }
    }
}

fn full(status: StatusCode, content_type: &str, body: &str) -> Response<ChannelBody> {
    let (tx, rx) = mpsc::channel(1);
    let _ = tx.try_send(Ok(Bytes::from(body.to_string())));
    let mut r = Response::new(ChannelBody::Channel { rx });
    *r.status_mut() = status;
    r.headers_mut().insert("content-type", content_type.parse().unwrap());
    r
}

fn sse<F, Fut>(produce: F) -> Response<ChannelBody>
where
    F: FnOnce(mpsc::Sender<Result<Bytes, String>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(produce(tx));
    let mut r = Response::new(ChannelBody::Channel { rx });
    r.headers_mut().insert("content-type", "text/event-stream".parse().unwrap());
    r
}

/// A body fed by a channel (an `Err` item breaks the connection), or a flood that
/// yields a chunk whenever the connection asks for one.
pub enum ChannelBody {
    Channel { rx: mpsc::Receiver<Result<Bytes, String>> },
    Flood { chunk: Bytes, left: u64, inner: Arc<Inner> },
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            ChannelBody::Channel { rx } => match rx.poll_recv(cx) {
                Poll::Ready(Some(Ok(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
            ChannelBody::Flood { left: 0, .. } => Poll::Ready(None),
            ChannelBody::Flood { chunk, left, inner } => {
                let n = (chunk.len() as u64).min(*left);
                *left -= n;
                inner.written.fetch_add(n, Ordering::Relaxed);
                if *left == 0 {
                    inner.floods_done.fetch_add(1, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(Frame::data(chunk.slice(..n as usize)))))
            }
        }
    }
}
