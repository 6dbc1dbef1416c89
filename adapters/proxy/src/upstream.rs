//! Talking to workers: the pooled HTTP client (TCP_NODELAY, connect timeout), header
//! filtering in both directions, and the retry budget.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::config::{LimitsConfig, RetryConfig};

/// The client every request and probe to a worker goes through.
pub type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// A pooled HTTP/1.1 client with TCP_NODELAY and the configured connect timeout.
pub fn client(limits: &LimitsConfig) -> UpstreamClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(Duration::from_millis(limits.connect_timeout_ms)));
    conn.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_millis(limits.upstream_idle_timeout_ms))
        .http1_max_buf_size(limits.connection_buffer_bytes_max)
        .build(conn)
}

/// Hop-by-hop headers (RFC 9110 §7.6.1): they describe one connection, never forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// Headers that steer the proxy itself; they never reach a worker.
pub const PIN_HEADERS: [&str; 4] = ["x-worker-id", "x-dp-rank", "x-prefill-worker-id", "x-decode-worker-id"];

/// The preview flag header.
pub const PREVIEW_HEADER: &str = "x-kvroute-preview";

/// The response header naming the worker that served a request.
pub const WORKER_HEADER: &str = "x-kvroute-worker";

/// Removes hop-by-hop headers, including those the `Connection` header names.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(n);
    }
    h.remove(header::UPGRADE);
}

/// The headers sent to a worker: the client's, minus hop-by-hop, host, length (the
/// body was rewritten), the proxy's own steering headers and the trust token.
pub fn upstream_headers(client: &HeaderMap, token_header: &HeaderName, body_len: usize) -> HeaderMap {
    let mut h = client.clone();
    strip_hop_by_hop(&mut h);
    h.remove(header::HOST);
    h.remove(header::CONTENT_LENGTH);
    h.remove(header::EXPECT);
    h.remove(token_header);
    for p in PIN_HEADERS {
        h.remove(p);
    }
    let internal: Vec<HeaderName> = h.keys().filter(|k| k.as_str().starts_with("x-kvroute-")).cloned().collect();
    for k in internal {
        h.remove(k);
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
        let b = RetryBudget::new(&RetryConfig { retries_max: 2, budget_ratio: 0.5, budget_initial: 1, budget_max: 2 });
        assert!(b.withdraw());
        assert!(!b.withdraw());
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
