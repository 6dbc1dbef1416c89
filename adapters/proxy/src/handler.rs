//! The request layer, the top of a proxied request's stack (every forwarded endpoint:
//! chat, completions, responses, embeddings, score, rerank, tokenize, detokenize). Each
//! layer names only those below it:
//!
//! 1. accept: [`crate::server`] takes the connection, authenticates the tenant from its
//!    head ([`crate::auth`], 401 before any body is read) and sends the request here;
//! 2. admit: a slot of `concurrent_requests_max` ([`ApiError::overloaded`] without one);
//! 3. parse: read the body within the request's time, decide trust (an admin tenant is
//!    trusted), salt an isolated tenant's cache, build the router's question (a model
//!    the tenant may not use is a 404, as if there were none)
//!    ([`prepare`], giving a [`Prepared`]); a trusted preview is answered here
//!    ([`preview`]);
//! 4. tenant limits: a `tower` layer over the route (`route::stack`, `limits`), 429
//!    past a tenant's rate, tokens or concurrency;
//! 5. route: the core's decision and the path, aggregated or split (`route`);
//! 6. tries: retries, first-byte timeouts, ejection (`tries`, and the split
//!    legs' `disagg::phase`);
//! 7. stream: idle timeout, deadline, migration (`stream`, and
//!    [`crate::migrate`]);
//! 8. response: headers and the body that ends the booking ([`crate::body`]), which
//!    this layer wraps in the request's span ([`crate::trace`]).
//!
//! An error at any layer comes back up as an [`ApiError`], which this layer answers and
//! counts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::{HeaderMap, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use tokio::time::Instant;

use kvroute_frontend::ask::{question_timed, routed_json, Asker, Question};
use kvroute_frontend::otel::{KeyValue, RequestTrace};

use crate::auth::Caller;
use crate::body::ProxyBody;
use crate::disagg;
use crate::error::ApiError;
use crate::request::Endpoint;
use crate::route::{self, Admitted};
use crate::state::State;

pub use crate::prepared::Prepared;

/// A forwarded endpoint's request (`POST`, see `endpoints.rs` for the paths).
pub async fn proxy(
    state: Arc<State>,
    peer: SocketAddr,
    req: http::Request<Incoming>,
    endpoint: Endpoint,
    caller: Caller,
) -> Response<ProxyBody> {
    let arrived = Instant::now();
    let trace = crate::trace::open(&state, req.headers(), arrived);
    let tenant = caller.tenant().and_then(|id| state.tenants.get(id)).map(|t| t.name.as_str());
    if let (Some(t), Some(name)) = (trace.as_ref().filter(|t| t.sampled()), tenant) {
        t.set(KeyValue::new("kvroute.tenant", name.to_string()));
    }
    let mut model = "unknown".to_string();
    let result = match state.concurrency.clone().try_acquire_owned() {
        Err(_) => Err(ApiError::overloaded()),
        Ok(permit) => {
            // A client trickling its body must not hold a permit past the request's time.
            let deadline = arrived + Duration::from_millis(state.cfg.limits.request_timeout_ms);
            let prepared = prepare_traced(&state, peer, req, Some(endpoint), caller, &mut model, trace.clone());
            match tokio::time::timeout_at(deadline, prepared).await {
                Err(_) => Err(ApiError::body_timeout()),
                Ok(Ok(p)) if p.preview => preview(&state, p),
                Ok(Ok(p)) => route::call(crate::limits::stack(&state), Admitted { p, arrived, permit }).await,
                Ok(Err(e)) => Err(e),
            }
        }
    };
    match (&result, caller.tenant().and_then(|id| state.limits.series(id)), tenant) {
        (Ok(_), Some(s), _) => {
            s.ok.inc();
        }
        (Err(e), _, Some(name)) => state.metrics.tenant_request(name, e.code),
        _ => {}
    }
    let resp = result.unwrap_or_else(|e| {
        state.metrics.request(&model, None, e.code, e.status.as_u16());
        e.into_response()
    });
    match trace {
        // An unsampled request's span records nothing: its body needs no wrapper to end it.
        Some(t) if t.sampled() => crate::trace::finish(&state, t, &model, resp).map(|b| ProxyBody::Traced(Box::new(b))),
        _ => resp,
    }
}

/// Reads, checks and hashes a request. `endpoint: None` guesses it from the body (for
/// `/route/preview`). `caller` is who sent it ([`crate::auth`]): an admin tenant is
/// trusted. `model_label` becomes the pool's name once it is known.
pub async fn prepare(
    state: &Arc<State>,
    peer: SocketAddr,
    req: http::Request<Incoming>,
    endpoint: Option<Endpoint>,
    caller: Caller,
    model_label: &mut String,
) -> Result<Prepared, ApiError> {
    prepare_traced(state, peer, req, endpoint, caller, model_label, None).await
}

/// [`prepare`] of a traced request: its `parse` and `tokenize` spans are recorded.
async fn prepare_traced(
    state: &Arc<State>,
    peer: SocketAddr,
    req: http::Request<Incoming>,
    endpoint: Option<Endpoint>,
    caller: Caller,
    model_label: &mut String,
    trace: Option<RequestTrace>,
) -> Result<Prepared, ApiError> {
    let (parts, body) = req.into_parts();
    let trusted = caller.admin() || state.trust.is_trusted(peer.ip(), &parts.headers);
    let raw = read_body(body, &parts.headers, state.cfg.limits.body_bytes_max).await?;
    let tenant = caller.tenant().and_then(|id| state.tenants.get(id));
    let cx = Asker {
        fleet: &state.fleet,
        tokenizers: &state.tokenizers,
        metrics: &state.metrics,
        session_header: &state.session_header,
        session_id_bytes_max: state.cfg.limits.session_id_bytes_max,
        cache_salt: tenant.and_then(|t| t.cache_salt.as_ref()),
    };
    let asked = Instant::now();
    let (q, parsed) = question_timed(&cx, trusted, &parts.headers, raw, endpoint, model_label).await?;
    crate::trace::stages(trace.as_ref(), asked, parsed);
    let path_and_query = parts.uri.path_and_query().map_or(parts.uri.path(), |p| p.as_str()).to_string();
    let Question { pool, mut request, forward_body, json, ids, preview, endpoint, shape } = q;
    // A model the tenant may not use is one it cannot see: 404, as for no model at all.
    if tenant.is_some_and(|t| !t.may_use(&pool.name)) {
        return Err(ApiError::model_not_found(&pool.name));
    }
    if let Some(t) = tenant {
        request.tenant = t.id;
    }
    Ok(Prepared {
        pool,
        request,
        forward_body,
        json,
        ids,
        headers: parts.headers,
        path_and_query,
        preview,
        endpoint,
        shape,
        trace,
    })
}

/// Reads the body, refusing more than `max` bytes before buffering them.
async fn read_body(body: Incoming, headers: &HeaderMap, max: u64) -> Result<Bytes, ApiError> {
    let declared = headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|s| s.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max) {
        return Err(ApiError::too_large(max));
    }
    match Limited::new(body, usize::try_from(max).unwrap_or(usize::MAX)).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(ApiError::too_large(max)),
        Err(e) => Err(ApiError::bad_request(format!("could not read the request body: {e}"))),
    }
}

/// Answers with the decision the router would make, changing nothing.
pub fn preview(state: &State, p: Prepared) -> Result<Response<ProxyBody>, ApiError> {
    if let Some(protocol) = disagg::protocol(&p) {
        return disagg::preview(state, p, protocol);
    }
    let driver = &p.pool.driver;
    let isl = p.request.isl_tokens;
    let routed = driver
        .preview(p.request, driver.draw())
        .map_err(|e| ApiError::from_drive(&e, state.cfg.router.queue_timeout_ms))?;
    let mut out = routed_json(&p.pool.name, isl, &routed);
    crate::learn::annotate_preview(&mut out, driver, &routed, &state.cfg.learn);
    Ok(crate::error::json_response(http::StatusCode::OK, &out))
}
