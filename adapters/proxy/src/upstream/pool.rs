//! Connections to workers that run inside the request that uses them: no task per
//! connection. The request's future drives the connection until the response head
//! arrives, and the response body ([`Upstream`]) drives it while it is read, then puts
//! it back in the pool if it can carry another request.
//!
//! Driving the connection from the body is what lets the proxy forward every chunk the
//! worker has already sent in one write: after taking a chunk, polling the connection
//! decodes the next one from its read buffer at once, with no hand-off to another task.
//! It also spares each request two cross-task wake-ups.
//!
//! An `https` URI's connection is TLS ([`crate::tls::connect`]), pooled apart from a
//! plain one to the same address.
//!
//! Idle connections are not polled. A worker that closed one is found out when it is
//! taken (it reads as closed or not ready) or when the request on it fails before being
//! written, which sends the request again on another connection to the same worker.

use std::collections::HashMap;
use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HeaderValue, HOST};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::tls::Io;

/// Idle connections kept per worker address; more are closed when they come back.
pub const IDLE_PER_WORKER_MAX: usize = 256;

/// Stale pooled connections tried before opening a fresh one.
const STALE_TRIES_MAX: usize = 4;

type Conn = Connection<TokioIo<Io>, Full<Bytes>>;

/// A connection and its request handle.
struct Live {
    send: SendRequest<Full<Bytes>>,
    conn: Conn,
    /// The connection future has completed and must not be polled again.
    done: bool,
}

impl Live {
    /// Drives the connection; false once it has ended.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.done && Pin::new(&mut self.conn).poll(cx).is_ready() {
            self.done = true;
        }
        !self.done
    }
}

struct Idle {
    live: Live,
    since: Instant,
}

/// Where a connection goes: a worker's address, over TLS or not.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Origin {
    https: bool,
    authority: Authority,
}

/// Idle connections by worker address, oldest first.
#[derive(Default)]
struct Idles {
    by_worker: HashMap<Origin, Vec<Idle>>,
    /// Connections put back since the last sweep.
    puts: u32,
}

/// Connections put back between sweeps of expired ones (of workers no longer used, too).
const PUTS_PER_SWEEP: u32 = 1024;

/// Idle connections by worker address.
pub struct ConnPool {
    idle: Mutex<Idles>,
    idle_timeout: Duration,
    connect_timeout: Duration,
    /// hyper's read buffer cap per connection, which bounds what a slow reader holds.
    buf_bytes_max: usize,
    /// The TLS client of `https` workers.
    tls: TlsConnector,
}

/// Why a request to a worker failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum SendError {
    /// No connection could be opened, or it closed before the request was written:
    /// nothing reached the worker.
    Connect(std::io::Error),
    /// The request was written, or may have been, and then failed.
    Request(hyper::Error),
    /// The connection ended without answering.
    Closed,
    /// The URI names no host to connect to.
    NoHost,
    /// The TLS handshake with an `https` worker failed (its certificate was not
    /// trusted, named another host, or the handshake timed out): nothing reached it.
    Tls(std::io::Error),
}

impl SendError {
    /// Whether nothing reached the worker, so another worker may take the request.
    pub fn is_connect(&self) -> bool {
        matches!(self, SendError::Connect(_) | SendError::NoHost | SendError::Tls(_))
    }
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendError::Connect(_) => f.write_str("could not connect"),
            SendError::Request(_) => f.write_str("the request failed"),
            SendError::Closed => f.write_str("the connection closed without an answer"),
            SendError::NoHost => f.write_str("the worker URL has no host"),
            SendError::Tls(_) => f.write_str("the TLS handshake failed"),
        }
    }
}

impl std::error::Error for SendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SendError::Connect(e) | SendError::Tls(e) => Some(e),
            SendError::Request(e) => Some(e),
            SendError::Closed | SendError::NoHost => None,
        }
    }
}

impl ConnPool {
    /// An empty pool; `tls` is the client of `https` workers.
    pub fn new(
        idle_timeout: Duration,
        connect_timeout: Duration,
        buf_bytes_max: usize,
        tls: Arc<rustls::ClientConfig>,
    ) -> Arc<Self> {
        let tls = TlsConnector::from(tls);
        Arc::new(ConnPool { idle: Mutex::new(Idles::default()), idle_timeout, connect_timeout, buf_bytes_max, tls })
    }

    /// Sends `req` (an absolute URI) on a pooled or new connection to its host and waits
    /// for the response head. A request a stale connection refused goes out again.
    pub async fn send(self: &Arc<Self>, mut req: Request<Full<Bytes>>) -> Result<Response<Upstream>, SendError> {
        let Some(authority) = req.uri().authority().cloned() else { return Err(SendError::NoHost) };
        let origin = Origin { https: req.uri().scheme() == Some(&Scheme::HTTPS), authority };
        let path = req.uri().path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        *req.uri_mut() = Uri::from(path);
        if !req.headers().contains_key(HOST) {
            if let Ok(v) = HeaderValue::from_str(origin.authority.as_str()) {
                req.headers_mut().insert(HOST, v);
            }
        }
        let mut tries = 0;
        loop {
            let (live, fresh) = match self.checkout(&origin, &mut tries) {
                Some(live) => (live, false),
                None => (self.connect(&origin).await?, true),
            };
            match send_on(live, req).await {
                Ok((resp, live)) => {
                    let pool = self.clone();
                    return Ok(resp.map(|inner| Upstream { inner, conn: Some(Driven { live, pool, origin }) }));
                }
                Err(Failed::Unsent(r)) if !fresh => req = *r,
                Err(Failed::Unsent(_)) => {
                    let e = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "closed before the request");
                    return Err(SendError::Connect(e));
                }
                Err(Failed::Sent(Some(e))) => return Err(SendError::Request(e)),
                Err(Failed::Sent(None)) => return Err(SendError::Closed),
            }
        }
    }

    /// The most recently used idle connection to `origin` that is still usable.
    fn checkout(&self, origin: &Origin, tries: &mut usize) -> Option<Live> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let list = idle.by_worker.get_mut(origin)?;
        let now = Instant::now();
        while *tries < STALE_TRIES_MAX {
            let Idle { mut live, since } = list.pop()?;
            if now.saturating_duration_since(since) >= self.idle_timeout {
                // The rest are older still.
                list.clear();
                return None;
            }
            if ready(&mut live) {
                return Some(live);
            }
            *tries += 1;
        }
        None
    }

    async fn connect(&self, origin: &Origin) -> Result<Live, SendError> {
        let host = origin.authority.host().trim_start_matches('[').trim_end_matches(']');
        let addr = (host, origin.authority.port_u16().unwrap_or(if origin.https { 443 } else { 80 }));
        let tcp = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) => return Err(SendError::Connect(e)),
            Err(_) => return Err(SendError::Connect(std::io::ErrorKind::TimedOut.into())),
        };
        let _ = tcp.set_nodelay(true);
        let io = if origin.https {
            crate::tls::connect(&self.tls, tcp, host, self.connect_timeout).await.map_err(SendError::Tls)?
        } else {
            Io::Plain(tcp)
        };
        // The handshake does no I/O for HTTP/1.
        let (send, conn) = http1::Builder::new()
            .max_buf_size(self.buf_bytes_max)
            .handshake(TokioIo::new(io))
            .await
            .map_err(SendError::Request)?;
        Ok(Live { send, conn, done: false })
    }

    fn put(&self, origin: Origin, live: Live) {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.puts += 1;
        if idle.puts >= PUTS_PER_SWEEP {
            // Linear in the idle connections, once per PUTS_PER_SWEEP requests.
            idle.puts = 0;
            let timeout = self.idle_timeout;
            idle.by_worker.retain(|_, list| {
                list.retain(|i| now.saturating_duration_since(i.since) < timeout);
                !list.is_empty()
            });
        }
        let list = idle.by_worker.entry(origin).or_default();
        if list.len() < IDLE_PER_WORKER_MAX {
            list.push(Idle { live, since: now });
        }
    }
}

/// Polls an idle connection once: true if it can take a request now.
fn ready(live: &mut Live) -> bool {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    live.drive(&mut cx) && matches!(live.send.poll_ready(&mut cx), Poll::Ready(Ok(())))
}

enum Failed {
    /// Nothing was written; the request comes back.
    Unsent(Box<Request<Full<Bytes>>>),
    /// The request was written, or may have been; `None` if the connection ended
    /// without a word (hyper answers every request, so this is a fallback).
    Sent(Option<hyper::Error>),
}

/// Sends `req` on `live`, driving the connection until the response head arrives.
async fn send_on(mut live: Live, req: Request<Full<Bytes>>) -> Result<(Response<Incoming>, Live), Failed> {
    let mut pending = std::pin::pin!(live.send.try_send_request(req));
    let res = poll_fn(|cx| {
        let open = live.drive(cx);
        match pending.as_mut().poll(cx) {
            Poll::Ready(r) => Poll::Ready(Some(r)),
            Poll::Pending if !open => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    })
    .await;
    match res {
        Some(Ok(resp)) => Ok((resp, live)),
        Some(Err(mut e)) => match e.take_message() {
            Some(req) => Err(Failed::Unsent(Box::new(req))),
            None => Err(Failed::Sent(Some(e.into_error()))),
        },
        None => Err(Failed::Sent(None)),
    }
}

/// The connection a response body arrives on, and where it goes back to.
struct Driven {
    live: Live,
    pool: Arc<ConnPool>,
    origin: Origin,
}

/// A worker's response body. Reading it drives its connection, which goes back to the
/// pool once the body has ended cleanly; dropped early, the connection closes.
pub struct Upstream {
    inner: Incoming,
    conn: Option<Driven>,
}

impl Body for Upstream {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let mut r = Pin::new(&mut this.inner).poll_frame(cx);
        if r.is_pending() {
            if let Some(d) = &mut this.conn {
                // Decodes what the connection has already read (or reads more).
                d.live.drive(cx);
                r = Pin::new(&mut this.inner).poll_frame(cx);
            }
        }
        match &r {
            Poll::Ready(None) => {
                if let Some(mut d) = this.conn.take() {
                    // One more turn lets the connection settle into idle.
                    if d.live.drive(cx) && !d.live.send.is_closed() {
                        d.pool.put(d.origin, d.live);
                    }
                }
            }
            Poll::Ready(Some(Err(_))) => this.conn = None,
            _ => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use hyper::service::service_fn;
    use tokio::net::TcpListener;

    use super::*;

    /// A worker answering `body` to everything, counting the connections it accepted;
    /// `keep_alive: false` closes each connection after one response.
    async fn worker(body: &'static str, keep_alive: bool) -> (SocketAddr, Arc<AtomicUsize>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc =
                        service_fn(
                            |_req| async move { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body)))) },
                        );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(keep_alive)
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        (addr, accepted)
    }

    /// A TLS client trusting nothing: these workers are plain.
    fn tls() -> Arc<rustls::ClientConfig> {
        let roots = Arc::new(rustls::RootCertStore::empty());
        let p = Arc::new(rustls::crypto::ring::default_provider());
        let b = rustls::ClientConfig::builder_with_provider(p).with_safe_default_protocol_versions().unwrap();
        Arc::new(b.with_root_certificates(roots).with_no_client_auth())
    }

    fn request(addr: SocketAddr) -> Request<Full<Bytes>> {
        Request::post(format!("http://{addr}/v1/x")).body(Full::new(Bytes::from_static(b"{}"))).unwrap()
    }

    /// Sends `n` requests one after another, reading each body whole (or dropping it
    /// unread when `read` is false), and checks the connections the worker accepted.
    #[track_caller]
    fn check(keep_alive: bool, read: bool, idle_ms: u64, n: usize, want_connections: usize) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (addr, accepted) = worker("hello", keep_alive).await;
            let pool = ConnPool::new(Duration::from_millis(idle_ms), Duration::from_secs(5), 64 << 10, tls());
            for i in 0..n {
                let resp = pool.send(request(addr)).await.unwrap_or_else(|e| panic!("request {i}: {e:?}"));
                assert_eq!(resp.status(), 200);
                if read {
                    let body = resp.into_body().collect().await.expect("body").to_bytes();
                    assert_eq!(body, "hello", "request {i}");
                }
            }
            assert_eq!(accepted.load(Ordering::SeqCst), want_connections);
        });
    }

    #[test]
    fn connections_are_reused_only_when_clean() {
        // keep_alive, read whole body, idle timeout, requests, connections opened
        check(true, true, 60_000, 5, 1);
        check(false, true, 60_000, 3, 3);
        check(true, false, 60_000, 3, 3);
        check(true, true, 0, 3, 3);
    }

    #[test]
    fn nothing_listening_is_a_connect_error() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            // Bound but never listening, and held: a port merely released could be taken by
            // any listener on the machine before the pool connects.
            let sock = tokio::net::TcpSocket::new_v4().unwrap();
            sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let addr = sock.local_addr().unwrap();
            let pool = ConnPool::new(Duration::from_secs(60), Duration::from_secs(5), 64 << 10, tls());
            let e = pool.send(request(addr)).await.err().expect("no worker");
            drop(sock);
            assert!(e.is_connect(), "{e:?}");
        });
    }

    #[test]
    fn an_https_uri_speaks_tls_and_a_failed_handshake_is_a_connect_error() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (addr, accepted) = worker("hello", true).await;
            let pool = ConnPool::new(Duration::from_secs(60), Duration::from_secs(5), 64 << 10, tls());
            let req = Request::post(format!("https://{addr}/v1/x")).body(Full::new(Bytes::new())).unwrap();
            let e = pool.send(req).await.err().expect("a plaintext worker completes no handshake");
            assert!(matches!(e, SendError::Tls(_)) && e.is_connect(), "{e:?}");
            assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection, and nothing pooled from it");
            // Plain http to the same address still works: the two are pooled apart.
            let resp = pool.send(request(addr)).await.unwrap();
            assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "hello");
        });
    }

    #[test]
    fn the_host_header_names_the_worker() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            tokio::spawn(async move {
                let (s, _) = l.accept().await.unwrap();
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let seen = format!("{} {}", req.headers()[HOST].to_str().unwrap(), req.uri());
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(seen))))
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
            });
            let pool = ConnPool::new(Duration::from_secs(60), Duration::from_secs(5), 64 << 10, tls());
            let resp = pool.send(request(addr)).await.unwrap();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body, format!("{addr} /v1/x"));
        });
    }
}
