//! The listener: accepts connections (TCP_NODELAY, HTTP/1.1 or h2c), sends each request
//! to its endpoint, and shuts down gracefully: stop accepting, let in-flight requests
//! finish within `shutdown_grace_s`, then cut what is left.

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
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::admin;
use crate::body::ProxyBody;
use crate::error::ApiError;
use crate::handler;
use crate::request::Endpoint;
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
    let proxied = match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/chat/completions") => Some(Endpoint::Chat),
        (&Method::POST, "/v1/completions") => Some(Endpoint::Completions),
        (&Method::POST, "/v1/embeddings") => Some(Endpoint::Embeddings),
        _ => None,
    };
    if let Some(endpoint) = proxied {
        return handler::proxy(state, peer, req, endpoint).await;
    }
    let path = req.uri().path().to_string();
    let admin = |state: &State| state.trust.is_trusted(peer.ip(), req.headers());
    let result = match (req.method(), path.as_str()) {
        (&Method::GET, "/v1/models") => Ok(admin::models(&state).await),
        (&Method::GET, "/health") => Ok(admin::health()),
        (&Method::GET, "/ready") => Ok(admin::ready(&state)),
        (&Method::GET, "/metrics") => Ok(admin::metrics(&state)),
        (_, "/workers" | "/route/preview") | (&Method::DELETE, _) if !admin(&state) => Err(ApiError::forbidden()),
        (&Method::GET, "/workers") => Ok(admin::workers(&state).await),
        (&Method::POST, "/workers") => admin::add_worker(&state, req).await,
        (&Method::DELETE, p) if p.starts_with("/workers/") => {
            admin::remove_worker(&state, &p["/workers/".len()..]).await
        }
        (&Method::POST, "/route/preview") => admin::preview(&state, peer, req).await,
        _ => Err(ApiError::no_route(&path)),
    };
    result.unwrap_or_else(ApiError::into_response)
}

/// The HTTP/1.1 + h2c server settings.
pub fn builder(state: &State) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(state.cfg.limits.header_read_timeout_ms));
    b.http2().timer(TokioTimer::new());
    b
}

/// Accepts until shutdown, then drains. Returns how the drain went.
pub async fn accept_loop(
    listener: TcpListener,
    state: Arc<State>,
    mut shutdown: watch::Receiver<bool>,
) -> ShutdownReport {
    let builder = builder(&state);
    let graceful = GracefulShutdown::new();
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    let st = state.clone();
                    let svc = service_fn(move |req| {
                        let st = st.clone();
                        async move { Ok::<_, Infallible>(dispatch(st, peer, req).await) }
                    });
                    let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), svc).into_owned());
                    conns.spawn(async move {
                        if let Err(e) = conn.await {
                            tracing::debug!(%peer, error = %e, "connection ended with an error");
                        }
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
