//! The proxied endpoints: read and check the request, build the router's question,
//! route it, forward it (retrying connect failures elsewhere), and stream the answer.
//! Models with a `disagg_protocol` hand their requests to [`crate::disagg`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, Response};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use kvroute_driver::Booking;
use router_core::{Request, WorkerId, WorkerKey};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use kvroute_frontend::ask::{question_timed, routed_json, Asker, Question};
use kvroute_frontend::otel::RequestTrace;

use crate::body::{ProxyBody, StreamCtx, UpstreamBody};
use crate::config::WorkerConfig;
use crate::disagg;
use crate::error::ApiError;
use crate::fleet::Pool;
use crate::forward;
use crate::request::Endpoint;
use crate::state::State;
use crate::upstream::{strip_hop_by_hop, upstream_headers, WORKER_HEADER};

/// A request read, checked and turned into a routing question.
pub struct Prepared {
    /// The pool serving it.
    pub pool: Arc<Pool>,
    /// The router's question.
    pub request: Request,
    /// The body to forward (the `kvroute` object removed).
    pub forward_body: Bytes,
    /// The client's headers.
    pub headers: HeaderMap,
    /// Path and query to forward to.
    pub path_and_query: String,
    /// Whether the trusted preview flag was set.
    pub preview: bool,
    /// The endpoint the request came to (or looks like, for a preview).
    pub endpoint: Endpoint,
    /// Its trace, when it is traced (see [`crate::trace`]).
    pub trace: Option<RequestTrace>,
}

/// `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.
pub async fn proxy(
    state: Arc<State>,
    peer: SocketAddr,
    req: http::Request<Incoming>,
    endpoint: Endpoint,
) -> Response<ProxyBody> {
    let arrived = Instant::now();
    let trace = crate::trace::open(&state, req.headers(), arrived);
    let mut model = "unknown".to_string();
    let result = match state.concurrency.clone().try_acquire_owned() {
        Err(_) => Err(ApiError::overloaded()),
        Ok(permit) => {
            // A client trickling its body must not hold a permit past the request's time.
            let deadline = arrived + Duration::from_millis(state.cfg.limits.request_timeout_ms);
            let prepared = prepare_traced(&state, peer, req, Some(endpoint), &mut model, trace.clone());
            match tokio::time::timeout_at(deadline, prepared).await {
                Err(_) => Err(ApiError::body_timeout()),
                Ok(Ok(p)) if p.preview => preview(&state, p),
                Ok(Ok(p)) => forward(&state, p, arrived, permit).await,
                Ok(Err(e)) => Err(e),
            }
        }
    };
    let resp = result.unwrap_or_else(|e| {
        state.metrics.request(&model, None, e.code, e.status.as_u16());
        e.into_response()
    });
    match trace {
        // An unsampled request's span records nothing: its body needs no wrapper to end it.
        Some(t) if t.sampled() => crate::trace::finish(&state, t, &model, resp),
        _ => resp,
    }
}

/// Reads, checks and hashes a request. `endpoint: None` guesses it from the body (for
/// `/route/preview`). `model_label` becomes the pool's name once it is known.
pub async fn prepare(
    state: &Arc<State>,
    peer: SocketAddr,
    req: http::Request<Incoming>,
    endpoint: Option<Endpoint>,
    model_label: &mut String,
) -> Result<Prepared, ApiError> {
    prepare_traced(state, peer, req, endpoint, model_label, None).await
}

/// [`prepare`] of a traced request: its `parse` and `tokenize` spans are recorded.
async fn prepare_traced(
    state: &Arc<State>,
    peer: SocketAddr,
    req: http::Request<Incoming>,
    endpoint: Option<Endpoint>,
    model_label: &mut String,
    trace: Option<RequestTrace>,
) -> Result<Prepared, ApiError> {
    let (parts, body) = req.into_parts();
    let trusted = state.trust.is_trusted(peer.ip(), &parts.headers);
    let raw = read_body(body, &parts.headers, state.cfg.limits.body_bytes_max).await?;
    let cx = Asker {
        fleet: &state.fleet,
        tokenizers: &state.tokenizers,
        metrics: &state.metrics,
        session_header: &state.session_header,
        session_id_bytes_max: state.cfg.limits.session_id_bytes_max,
    };
    let asked = Instant::now();
    let (q, parsed) = question_timed(&cx, trusted, &parts.headers, raw, endpoint, model_label).await?;
    crate::trace::stages(trace.as_ref(), asked, parsed);
    let path_and_query = parts.uri.path_and_query().map_or(parts.uri.path(), |p| p.as_str()).to_string();
    let Question { pool, request, forward_body, preview, endpoint } = q;
    Ok(Prepared { pool, request, forward_body, headers: parts.headers, path_and_query, preview, endpoint, trace })
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

/// Routes and forwards: split across a prefill and a decode worker when the model is
/// disaggregated, else to one worker.
async fn forward(
    state: &Arc<State>,
    p: Prepared,
    arrived: Instant,
    permit: OwnedSemaphorePermit,
) -> Result<Response<ProxyBody>, ApiError> {
    if state.shutting_down() {
        return Err(ApiError::shutting_down());
    }
    state.budget.deposit();
    match disagg::protocol(&p) {
        Some(protocol) => disagg::forward(state, p, protocol, arrived, permit).await,
        None => forward_aggregated(state, p, arrived, permit).await,
    }
}

/// Routes `p.request` (whatever phase it names) and forwards it, retrying failures before
/// the first byte on workers not yet tried (see [`crate::retry`]); a stream that breaks
/// later is continued elsewhere when it can be (see [`crate::migrate`]).
pub(crate) async fn forward_aggregated(
    state: &Arc<State>,
    p: Prepared,
    arrived: Instant,
    permit: OwnedSemaphorePermit,
) -> Result<Response<ProxyBody>, ApiError> {
    let deadline = arrived + Duration::from_millis(state.cfg.limits.request_timeout_ms);
    let pool = p.pool.clone();
    let plan = crate::migrate::Plan::of(&p, &state.cfg.migration);
    let body = plan.as_ref().map_or_else(|| p.forward_body.clone(), |m| m.first_body());
    let mut shape = crate::migrate::body_shape(&p.forward_body);
    shape.stream |= plan.is_some();
    let mut request = p.request.clone();
    let mut tried: Vec<WorkerId> = Vec::new();
    let tries = forward::Tries { state, pool: &pool, p: &p, body, path: None, deadline, shape };
    let a = forward::first_answer(&tries, &mut request, &mut tried).await?;
    let ctx = Respond { model: &pool.name, arrived, deadline, prefill_worker: None };
    match plan {
        // A worker that sent no token ids cannot be continued: its stream passes through.
        Some(plan) if a.resp.status().is_success() && plan.can_continue(a.first.as_ref()) => {
            Ok(crate::migrate::respond(state, a, plan, p, request, tried, ctx, permit))
        }
        _ => Ok(respond_first(state, a.resp, a.booking, ctx, permit, a.first)),
    }
}

/// The request to send `body` to `target` on `worker`, with the client's headers.
pub(crate) fn upstream_request(
    state: &State,
    worker: &WorkerConfig,
    target: WorkerKey,
    p: &Prepared,
    body: Bytes,
) -> Result<http::Request<Full<Bytes>>, ApiError> {
    upstream_request_to(state, worker, target, p, &p.path_and_query, body)
}

/// [`upstream_request`] to another path than the client's.
pub(crate) fn upstream_request_to(
    state: &State,
    worker: &WorkerConfig,
    target: WorkerKey,
    p: &Prepared,
    path: &str,
    body: Bytes,
) -> Result<http::Request<Full<Bytes>>, ApiError> {
    let uri = worker.url.join(path).map_err(|e| ApiError::upstream(format!("bad worker URL: {e}")))?;
    let mut headers = upstream_headers(&p.headers, state.trust.token_header(), body.len());
    // The rank header is the router's word to the engine, never the client's.
    headers.remove(&state.dp_rank_header);
    if worker.dp_ranks > 1 {
        headers.insert(state.dp_rank_header.clone(), HeaderValue::from(target.rank.0));
    }
    if let Some(t) = &p.trace {
        t.inject(&mut headers);
    }
    let mut req = http::Request::post(uri).body(Full::new(body)).map_err(|e| ApiError::upstream(e.to_string()))?;
    *req.headers_mut() = headers;
    Ok(req)
}

/// What a streamed answer is part of.
pub(crate) struct Respond<'a> {
    /// The pool's name.
    pub model: &'a str,
    /// When the request arrived.
    pub arrived: Instant,
    /// When it must be done.
    pub deadline: Instant,
    /// The prefill worker of a split request, named in `x-kvroute-prefill-worker`.
    pub prefill_worker: Option<u64>,
}

/// The worker accepted: confirm the booking and stream its answer back.
pub(crate) fn respond(
    state: &Arc<State>,
    resp: Response<crate::upstream::Upstream>,
    booking: Booking,
    ctx: Respond<'_>,
    permit: OwnedSemaphorePermit,
) -> Response<ProxyBody> {
    respond_first(state, resp, booking, ctx, permit, None)
}

/// [`respond`], with the body's first frame already read from `resp`.
pub(crate) fn respond_first(
    state: &Arc<State>,
    resp: Response<crate::upstream::Upstream>,
    mut booking: Booking,
    ctx: Respond<'_>,
    permit: OwnedSemaphorePermit,
    first: Option<http_body::Frame<Bytes>>,
) -> Response<ProxyBody> {
    let Respond { model, arrived, deadline, prefill_worker } = ctx;
    let _ = booking.dispatched();
    let worker = booking.target().worker.0;
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.insert(WORKER_HEADER, HeaderValue::from(worker));
    // Only the proxy names workers: a worker's own header of that name never passes.
    match prefill_worker {
        Some(w) => parts.headers.insert(disagg::PREFILL_WORKER_HEADER, HeaderValue::from(w)),
        None => parts.headers.remove(disagg::PREFILL_WORKER_HEADER),
    };
    let sse = parts.headers.get(CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let injects_errors =
        sse && !parts.headers.contains_key(CONTENT_LENGTH) && !parts.headers.contains_key(CONTENT_ENCODING);
    let ctx = StreamCtx {
        state: state.clone(),
        model: model.to_string(),
        worker,
        status: parts.status.as_u16(),
        arrived,
        deadline,
        injects_errors,
        idle: crate::forward::idle_timeout(state),
    };
    let body = UpstreamBody::new(body, booking, ctx, Some(permit)).with_first(first);
    Response::from_parts(parts, ProxyBody::Stream(Box::new(body)))
}

/// An error and its causes, for messages.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
