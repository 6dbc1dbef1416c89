//! The listener: accepts connections (TCP_NODELAY, HTTP/1.1 or h2c, or either over TLS
//! with `[tls]`, see [`crate::tls::accept`]) up to
//! `connections_max`, sends each request to its endpoint, and shuts down gracefully:
//! stop accepting, let in-flight requests finish within `shutdown_grace_s`, then cut
//! what is left.
//!
//! A connection past the cap is accepted only to be told `503` and closed, so a flood
//! of idle sockets costs one descriptor each for an instant instead of a task each;
//! `kvroute_connections_refused_total` counts them.
//! Clients that dawdle over their request head (slowloris, a connection that never
//! sends a byte, or an idle keep-alive connection) are closed, which frees their slot: a
//! new connection has `header_read_timeout_ms` to send its first bytes and as long again
//! to finish its first head; later heads get `header_read_timeout_ms` each.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::admin;
use crate::auth::{self, Caller};
use crate::body::ProxyBody;
use crate::endpoints;
use crate::error::ApiError;
use crate::handler;
use crate::state::State;

/// How a shutdown went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Every connection finished within the grace period.
    pub drained: bool,
    /// Connections cut when the grace period ran out.
    pub connections_aborted: usize,
}

/// Sends a request to its endpoint. Never fails: errors are answers.
pub async fn dispatch(state: Arc<State>, peer: SocketAddr, req: http::Request<Incoming>) -> Response<ProxyBody> {
    let unread = body_pending(&req);
    let mut resp = route(state, peer, req).await;
    if unread && is_early_refusal(&resp) {
        close_after(&mut resp);
    }
    resp
}

/// Whether `req` is HTTP/1 and has body bytes still to come.
fn body_pending<B: hyper::body::Body>(req: &http::Request<B>) -> bool {
    req.version() <= http::Version::HTTP_11 && !req.body().is_end_stream()
}

/// Whether `resp` refuses its request before reading the body: a bad key, an admin
/// endpoint, an unknown path, a declared size past the limit, the concurrency cap or a
/// body too slow to arrive.
fn is_early_refusal<B>(resp: &Response<B>) -> bool {
    use kvroute_frontend::error::ErrorCode;
    matches!(
        resp.extensions().get::<ErrorCode>(),
        Some(ErrorCode(
            "invalid_api_key" | "forbidden" | "not_found" | "body_too_large" | "overloaded" | "body_timeout"
        ))
    )
}

/// Says `connection: close` on an HTTP/1 answer given before its body was read. Hyper
/// closes such a connection when it cannot drain the body at once, but may have written
/// the head first; a client told nothing reuses the connection and sees it drop.
fn close_after<B>(resp: &mut Response<B>) {
    resp.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
}

/// [`dispatch`] before the connection's fate is settled.
async fn route(state: Arc<State>, peer: SocketAddr, req: http::Request<Incoming>) -> Response<ProxyBody> {
    let path = req.uri().path().to_string();
    let caller = match (endpoints::proxied(req.method(), &path), auth::authenticate(&state.tenants, req.headers())) {
        (Ok(Some(endpoint)), Ok(caller)) => return handler::proxy(state, peer, req, endpoint, caller).await,
        // A stranger learns nothing of a forwarded path, not even the method it takes.
        (Ok(Some(_)) | Err(_), Err(e)) => {
            state.metrics.request("unknown", None, e.code, e.status.as_u16());
            return e.into_response();
        }
        (Err(e), Ok(_)) => return e.into_response(),
        (Ok(None), caller) => caller,
    };
    if let (true, Err(e)) = (path.starts_with("/v1/"), &caller) {
        return e.clone().into_response();
    }
    let method = req.method();
    let admin_only = matches!(path.as_str(), "/workers" | "/route/preview")
        || method == Method::DELETE
        || (method == Method::POST && path.starts_with("/workers/"));
    if admin_only {
        if let Some(e) = auth::admin_refusal(state.trust.is_trusted(peer.ip(), req.headers()), &caller) {
            if let Some(t) = caller.as_ref().ok().and_then(Caller::tenant).and_then(|id| state.tenants.get(id)) {
                state.metrics.tenant_rejected(&t.name, "forbidden");
            }
            return e.into_response();
        }
    }
    let result = match (req.method(), path.as_str()) {
        (&Method::GET, "/v1/models") => Ok(admin::models(&state, caller.as_ref().ok()).await),
        (&Method::GET, p) if p.starts_with("/v1/models/") => {
            admin::model(&state, caller.as_ref().ok(), &p["/v1/models/".len()..]).await
        }
        (&Method::GET, "/health") => Ok(admin::health()),
        (&Method::GET, "/ready") => Ok(admin::ready(&state)),
        (&Method::GET, "/metrics") => Ok(admin::metrics(&state).await),
        (&Method::POST, p) if p.starts_with("/workers/") && p.ends_with("/drain") => {
            crate::drain::drain(&state, &p["/workers/".len()..p.len() - "/drain".len()], req.uri().query())
        }
        (&Method::GET, "/workers") => Ok(admin::workers(&state).await),
        (&Method::POST, "/workers") => admin::add_worker(&state, req).await,
        (&Method::DELETE, p) if p.starts_with("/workers/") => {
            admin::remove_worker(&state, &p["/workers/".len()..]).await
        }
        (&Method::POST, "/route/preview") => admin::preview(&state, peer, req, caller.unwrap_or(Caller::Open)).await,
        _ => Err(ApiError::no_route(&path)),
    };
    result.unwrap_or_else(ApiError::into_response)
}

/// The HTTP/1.1 + h2c server settings.
pub fn builder(state: &State) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(state.cfg.limits.header_read_timeout_ms))
        .max_buf_size(state.cfg.limits.connection_buffer_bytes_max);
    b.http2().timer(TokioTimer::new());
    b
}

/// Accepts until shutdown, then drains. Returns how the drain went.
pub async fn accept_loop(
    listener: TcpListener,
    state: Arc<State>,
    mut shutdown: watch::Receiver<bool>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> ShutdownReport {
    let builder = builder(&state);
    let graceful = GracefulShutdown::new();
    let mut conns = JoinSet::new();
    let slots = Arc::new(Semaphore::new(state.cfg.limits.connections_max));
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        state.metrics.connection_refused();
                        refuse(stream, peer);
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let st = state.clone();
                    let svc = service_fn(move |req| {
                        let st = st.clone();
                        async move { Ok::<_, Infallible>(dispatch(st, peer, req).await) }
                    });
                    let (builder, watcher, mut stop) = (builder.clone(), graceful.watcher(), shutdown.clone());
                    let tls = tls.clone();
                    let head_timeout = Duration::from_millis(state.cfg.limits.header_read_timeout_ms);
                    conns.spawn(async move {
                        tokio::select! {
                            sent = first_bytes(&stream, head_timeout) => if !sent { return },
                            _ = stop.changed() => return,
                        }
                        let Some((io, builder)) = crate::tls::accept(stream, tls.as_ref(), builder, head_timeout).await
                        else { return };
                        let conn = watcher.watch(builder.serve_connection(TokioIo::new(io), svc).into_owned());
                        if let Err(e) = conn.await {
                            tracing::debug!(%peer, error = %e, "connection ended with an error");
                        }
                        drop(slot);
                    });
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = shutdown.changed() => break,
        }
    }
    drop(listener);
    let grace = Duration::from_secs(state.cfg.limits.shutdown_grace_s);
    let drained = tokio::time::timeout(grace, async {
        graceful.shutdown().await;
        while conns.join_next().await.is_some() {}
    })
    .await
    .is_ok();
    let connections_aborted = conns.len();
    conns.abort_all();
    while conns.join_next().await.is_some() {}
    ShutdownReport { drained, connections_aborted }
}

/// The HTTP/2 connection preface; a client sending anything else speaks HTTP/1.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Waits, at most `limit`, until the client has sent enough to tell HTTP/1.1 from h2c.
/// The server's own first read, which makes that choice, is covered by no hyper timeout:
/// without this, a client that connects and sends nothing (or only part of the h2
/// preface) would hold its connection slot for ever. Only peeks, so the server reads
/// the same bytes afterwards. False when the time ran out or the client left.
async fn first_bytes(stream: &TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; H2_PREFACE.len()];
    let decided = async {
        loop {
            match stream.peek(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) if n == H2_PREFACE.len() || buf[..n] != H2_PREFACE[..n] => return true,
                // Part of the preface: peek would answer at once again, so pause instead.
                Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    };
    tokio::time::timeout(limit, decided).await.unwrap_or(false)
}

/// What a connection past `connections_max` is told before it is closed.
const TOO_MANY_CONNECTIONS: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
retry-after: 1\r\nconnection: close\r\ncontent-length: 114\r\n\r\n\
{\"error\":{\"message\":\"too many connections open\",\"type\":\"server_error\",\"param\":null,\"code\":\"too_many_connections\"}}";

/// Answers a connection past the cap without reading from it, and closes it. The write
/// never waits: a fresh socket's send buffer always has room for one short answer, and
/// if it has not, the client just sees the close.
fn refuse(stream: TcpStream, peer: SocketAddr) {
    tracing::debug!(%peer, "connection refused: connections_max reached");
    let _ = stream.try_write(TOO_MANY_CONNECTIONS);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_well_framed_openai_json() {
        let text = std::str::from_utf8(TOO_MANY_CONNECTIONS).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "));
        assert!(head.lines().any(|l| l == format!("content-length: {}", body.len())), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }
}
