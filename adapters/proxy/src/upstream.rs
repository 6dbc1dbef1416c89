//! Talking to workers: the pooled HTTP client (TCP_NODELAY, connect timeout; TLS to
//! `https` workers), header filtering in both directions, and the retry budget.
//!
//! Proxied requests go through [`UpstreamClient::send`], whose connections are driven by
//! the requests themselves (see [`pool`]); probes and admin calls use a plain hyper
//! client through [`UpstreamClient::request`].

mod pool;

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_frontend::tls::HttpsConnector;

use crate::config::{LimitsConfig, RetryConfig};

pub use kvroute_frontend::headers::{PIN_HEADERS, PREVIEW_HEADER, WORKER_HEADER};
pub use pool::{SendError, Upstream, IDLE_PER_WORKER_MAX};

/// The response header naming the prefill worker of a split request.
pub const PREFILL_WORKER_HEADER: &str = "x-kvroute-prefill-worker";

/// The client every request and probe to a worker goes through: HTTP/1.1, TCP_NODELAY,
/// the configured connect and idle timeouts, TLS to `https` workers.
#[derive(Clone)]
pub struct UpstreamClient {
    pool: Arc<pool::ConnPool>,
    plain: Client<HttpsConnector, Full<Bytes>>,
}

/// The client to workers; `tls` verifies the `https` ones.
pub fn client(limits: &LimitsConfig, tls: Arc<rustls::ClientConfig>) -> UpstreamClient {
    let connect_timeout = Duration::from_millis(limits.connect_timeout_ms);
    let idle_timeout = Duration::from_millis(limits.upstream_idle_timeout_ms);
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(connect_timeout));
    let plain = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(idle_timeout)
        .http1_max_buf_size(limits.connection_buffer_bytes_max)
        .build(kvroute_frontend::tls::https_connector(conn, &tls));
    let pool = pool::ConnPool::new(idle_timeout, connect_timeout, limits.connection_buffer_bytes_max, tls);
    UpstreamClient { pool, plain }
}

impl UpstreamClient {
    /// Sends a proxied request (absolute URI) and waits for the response head. Reading
    /// the body drives the connection; see [`pool`].
    pub async fn send(&self, req: http::Request<Full<Bytes>>) -> Result<http::Response<Upstream>, SendError> {
        self.pool.send(req).await
    }

    /// Sends a probe or admin request on the plain client.
    pub fn request(&self, req: http::Request<Full<Bytes>>) -> hyper_util::client::legacy::ResponseFuture {
        self.plain.request(req)
    }
}

/// Metrics pages for the engine-load scraper, and tokenizer checks, come over the plain
/// client.
impl kvroute_frontend::scrape::Fetch for UpstreamClient {
    async fn get(&self, uri: http::Uri, bytes_max: usize) -> Result<Bytes, kvroute_frontend::scrape::ScrapeError> {
        use kvroute_frontend::scrape::{read_page, ScrapeError};
        let req = http::Request::get(uri).body(Full::new(Bytes::new())).map_err(|_| ScrapeError::Unreachable)?;
        let resp = self.request(req).await.map_err(|_| ScrapeError::Unreachable)?;
        read_page(resp, bytes_max).await
    }

    async fn post(
        &self,
        uri: http::Uri,
        body: Bytes,
        bytes_max: usize,
    ) -> Result<Bytes, kvroute_frontend::scrape::ScrapeError> {
        use kvroute_frontend::scrape::{post_request, read_page, ScrapeError};
        let resp = self.request(post_request(uri, body)?).await.map_err(|_| ScrapeError::Unreachable)?;
        read_page(resp, bytes_max).await
    }
}

/// Hop-by-hop headers (RFC 9110 §7.6.1): they describe one connection, never forwarded.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(&name.as_str())
}

/// The header names a `Connection` header lists (rarely any).
fn connection_named(h: &HeaderMap) -> Vec<HeaderName> {
    h.get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect()
}

/// Removes hop-by-hop headers, including those the `Connection` header names.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    if !h.keys().any(is_hop_by_hop) {
        return;
    }
    for n in connection_named(h) {
        h.remove(n);
    }
    let present: Vec<HeaderName> = h.keys().filter(|k| is_hop_by_hop(k)).cloned().collect();
    for n in present {
        h.remove(n);
    }
}

/// The headers sent to a worker: the client's, minus hop-by-hop, host, length (the
/// body was rewritten), the proxy's own steering headers and the trust token. One pass
/// over the client's headers.
pub fn upstream_headers(client: &HeaderMap, token_header: &HeaderName, body_len: usize) -> HeaderMap {
    let named = if client.contains_key(header::CONNECTION) { connection_named(client) } else { Vec::new() };
    let dropped = |k: &HeaderName| {
        let s = k.as_str();
        is_hop_by_hop(k)
            || k == header::HOST
            || k == header::CONTENT_LENGTH
            || k == header::EXPECT
            || k == token_header
            || PIN_HEADERS.contains(&s)
            || s.starts_with("x-kvroute-")
            || named.contains(k)
    };
    let mut h = HeaderMap::with_capacity(client.keys_len() + 1);
    for (k, v) in client {
        if !dropped(k) {
            h.append(k.clone(), v.clone());
        }
    }
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(body_len));
    h
}

/// A token bucket of retries: each request deposits `budget_ratio` of a retry, each
/// retry withdraws one, and the balance stays within `0..=budget_max`. It keeps a dying
/// fleet from being hit by every request `1 + retries_max` times.
pub struct RetryBudget {
    /// Balance in thousandths of a retry.
    milli: AtomicI64,
    deposit_milli: i64,
    max_milli: i64,
}

impl RetryBudget {
    /// A budget with `budget_initial` retries banked.
    pub fn new(cfg: &RetryConfig) -> Self {
        let max_milli = i64::from(cfg.budget_max) * 1000;
        RetryBudget {
            milli: AtomicI64::new((i64::from(cfg.budget_initial) * 1000).min(max_milli)),
            deposit_milli: (cfg.budget_ratio.clamp(0.0, 1000.0) * 1000.0) as i64,
            max_milli,
        }
    }

    /// A request arrived.
    pub fn deposit(&self) {
        let (d, max) = (self.deposit_milli, self.max_milli);
        let _ = self.milli.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some((b + d).min(max)));
    }

    /// Whether the balance holds a retry now (a later [`RetryBudget::withdraw`] may
    /// still find it spent).
    pub fn available(&self) -> bool {
        self.milli.load(Ordering::Relaxed) >= 1000
    }

    /// Takes one retry if the balance allows.
    pub fn withdraw(&self) -> bool {
        self.milli.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| (b >= 1000).then_some(b - 1000)).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_internal_headers_never_leave() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-custom-hop"),
            ("x-custom-hop", "1"),
            ("keep-alive", "5"),
            ("transfer-encoding", "chunked"),
            ("host", "proxy"),
            ("content-length", "999"),
            ("x-worker-id", "3"),
            ("x-kvroute-preview", "1"),
            ("x-kvroute-token", "secret"),
            ("authorization", "Bearer k"),
            ("x-session-id", "s1"),
        ] {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        let out = upstream_headers(&h, &HeaderName::from_static("x-kvroute-token"), 12);
        let mut keys: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        keys.sort();
        assert_eq!(keys, ["authorization", "content-length", "x-session-id"]);
        assert_eq!(out["content-length"], "12");
    }

    #[test]
    fn the_budget_bounds_retries() {
        let b = RetryBudget::new(&RetryConfig {
            retries_max: 2,
            budget_ratio: 0.5,
            budget_initial: 1,
            budget_max: 2,
            ..RetryConfig::default()
        });
        assert!(b.available() && b.withdraw());
        assert!(!b.available() && !b.withdraw());
        b.deposit();
        assert!(!b.withdraw(), "half a retry is not a retry");
        b.deposit();
        assert!(b.withdraw());
        for _ in 0..100 {
            b.deposit();
        }
        assert!(b.withdraw() && b.withdraw() && !b.withdraw(), "the balance is capped at budget_max");
    }
}
