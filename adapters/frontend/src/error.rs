//! [`ApiError`]: answering a client in the OpenAI error shape. A client's mistake is
//! always a 4xx, never a 500.

use std::fmt;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use kvroute_driver::DriveError;
use router_core::{EligibilityError, PinError, QueueRejection, RouteError, SelectError};
use serde_json::{json, Value};

/// Longest `Retry-After` suggested for a full queue, in seconds.
const RETRY_AFTER_S_MAX: u64 = 10;

/// An error answer: status, OpenAI error `type` and `code`, message, and the metrics
/// outcome it counts as.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI error `type`.
    pub kind: &'static str,
    /// Stable machine-readable `code`, also the metrics outcome.
    pub code: &'static str,
    /// Human-readable message.
    pub message: String,
    /// Seconds for a `Retry-After` header.
    pub retry_after_s: Option<u64>,
    /// Extra fields under `error.kvroute`.
    pub detail: Option<Box<Value>>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, code, message: message.into(), retry_after_s: None, detail: None }
    }

    /// 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_request", message)
    }

    /// 400 (413 for an image too large): an image part that cannot be read.
    pub fn media(e: &kvroute_media::MediaError) -> Self {
        match e.http_status() {
            413 => Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "image_too_large", e.to_string()),
            _ => Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_image", e.to_string()),
        }
    }

    /// 400: an image URL that is neither `data:` nor under `[media] url_allow`.
    pub fn image_url_not_allowed() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "image_url_not_allowed",
            "image URLs must be data: URLs (or http:// URLs under the router's [media] url_allow)",
        )
    }

    /// 400: an allowed image URL whose fetch failed.
    pub fn image_fetch(why: impl fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "image_fetch_failed",
            format!("fetching the image failed: {why}"),
        )
    }

    /// 404: no pool serves the model.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("the model `{model}` does not exist"),
        )
    }

    /// 404: no such endpoint.
    pub fn no_route(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", "not_found", format!("no endpoint at {path}"))
    }

    /// 403: an admin endpoint from an untrusted client.
    pub fn forbidden() -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", "forbidden", "this endpoint is for trusted clients only")
    }

    /// 413: the body is larger than `body_bytes_max`.
    pub fn too_large(limit: u64) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("request body exceeds {limit} bytes"),
        )
    }

    /// 503: `concurrent_requests_max` requests are in progress.
    pub fn overloaded() -> Self {
        let mut e =
            Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "overloaded", "too many requests in progress");
        e.retry_after_s = Some(1);
        e
    }

    /// 502: no worker could be reached.
    pub fn upstream(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "server_error", "upstream_unavailable", message)
    }

    /// 504: `request_timeout_ms` passed before the worker answered.
    pub fn timeout() -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", "timeout", "the request timed out")
    }

    /// 408: the client did not send its body within `request_timeout_ms`.
    pub fn body_timeout() -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "body_timeout",
            "the request body did not arrive in time",
        )
    }

    /// 503: the proxy is shutting down.
    pub fn shutting_down() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "shutting_down", "the proxy is shutting down")
    }

    /// 429 for a queue rejection, with the rejection in `error.kvroute`.
    pub fn rejected(r: &QueueRejection, retry_after_s: u64) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_full",
            format!("admission queue refused the request: {r}"),
        );
        e.retry_after_s = Some(retry_after_s.max(1));
        e.detail = Some(Box::new(json!({
            "class": r.class, "limit_kind": r.limit_kind.as_str(), "current": r.current, "limit": r.limit,
        })));
        e
    }

    /// The answer for a routing failure. Unsatisfiable pins and bad session ids are the
    /// client's (4xx); a fleet that cannot take the request is ours (503).
    pub fn from_drive(e: &DriveError, queue_timeout_ms: u64) -> Self {
        use router_core::AffinityError;
        let unavailable = |code, msg: String| {
            let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", code, msg);
            e.retry_after_s = Some(1);
            e
        };
        match e {
            DriveError::Rejected(r) => Self::rejected(r, queue_timeout_ms.div_ceil(1000).min(RETRY_AFTER_S_MAX)),
            DriveError::QueueTimeout => unavailable("queue_timeout", e.to_string()),
            DriveError::Route(RouteError::Pin(p @ PinError::Ineligible { .. })) => {
                unavailable("pinned_worker_unavailable", p.to_string())
            }
            DriveError::Route(RouteError::Pin(p)) => Self::bad_request(format!("cannot honour the routing pins: {p}")),
            // No worker can take it (all ejected, draining or busy with other roles): ours.
            DriveError::Route(RouteError::Select(s @ SelectError::NoCandidates)) => {
                unavailable("no_worker", s.to_string())
            }
            DriveError::Route(RouteError::Select(s @ SelectError::DirectTargetNotEligible { .. })) => {
                unavailable("pinned_worker_unavailable", s.to_string())
            }
            DriveError::Route(RouteError::Select(s)) => Self::bad_request(s.to_string()),
            DriveError::Route(RouteError::Affinity(AffinityError::TableFull { .. })) => {
                unavailable("sessions_full", e.to_string())
            }
            DriveError::Route(RouteError::Affinity(a)) => Self::bad_request(format!("bad session id: {a}")),
            DriveError::Route(RouteError::Eligibility(EligibilityError::TooManyTolerations { .. })) => {
                Self::bad_request(e.to_string())
            }
            DriveError::Route(_) => unavailable("no_worker", e.to_string()),
            DriveError::Input(_) | DriveError::Closed => unavailable("no_worker", e.to_string()),
            _ => unavailable("no_worker", e.to_string()),
        }
    }

    /// The OpenAI-shaped JSON body.
    pub fn body_json(&self) -> Value {
        let mut err = json!({ "message": self.message, "type": self.kind, "param": null, "code": self.code });
        if let Some(d) = &self.detail {
            err["kvroute"] = (**d).clone();
        }
        json!({ "error": err })
    }

    /// The response, with a body of any type made from bytes.
    pub fn into_response<B: From<Bytes>>(self) -> Response<B> {
        let body = Bytes::from(self.body_json().to_string());
        let mut resp = Response::new(B::from(body));
        *resp.status_mut() = self.status;
        resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(s) = self.retry_after_s {
            resp.headers_mut().insert(RETRY_AFTER, HeaderValue::from(s));
        }
        resp.extensions_mut().insert(ErrorCode(self.code));
        resp
    }
}

/// The `code` of an [`ApiError`] answer, kept in its response's extensions (never sent)
/// so the server can tell a refusal given before the body was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorCode(pub &'static str);

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status.as_u16(), self.code, self.message)
    }
}

/// A JSON response with status 200 (or `status`).
pub fn json_response<B: From<Bytes>>(status: StatusCode, v: &Value) -> Response<B> {
    let mut resp = Response::new(B::from(Bytes::from(v.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// An error and its causes, for messages.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(e: DriveError, status: u16, code: &str) {
        let a = ApiError::from_drive(&e, 1_000);
        assert_eq!((a.status.as_u16(), a.code), (status, code), "{e}");
    }

    #[test]
    fn a_fleet_that_cannot_serve_is_a_503_not_the_clients_fault() {
        check(DriveError::Route(RouteError::Select(SelectError::NoCandidates)), 503, "no_worker");
        check(DriveError::QueueTimeout, 503, "queue_timeout");
        check(
            DriveError::Route(RouteError::Select(SelectError::DirectTargetRequired {
                phase: router_core::Phase::Aggregated,
            })),
            400,
            "invalid_request",
        );
    }
}
