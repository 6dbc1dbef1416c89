//! The proxied endpoints: read and check the request, build the router's question,
//! route it, forward it (retrying connect failures elsewhere), and stream the answer.
//! Models with a `disagg_protocol` hand their requests to [`crate::disagg`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, Response};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use kvroute_driver::{Booking, DispatchFailure, DriveError};
use router_core::router::Request;
use router_core::{WorkerId, WorkerKey};
use serde_json::Value;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use crate::body::{ProxyBody, StreamCtx, UpstreamBody};
use crate::config::WorkerConfig;
use crate::disagg;
use crate::error::ApiError;
use crate::fleet::{Fleet, Pool};
use crate::health;
use crate::metrics::Metrics;
use crate::request::{self, Build, Endpoint, Prompt};
use crate::state::State;
use crate::tokenize::{fallback_chat, fallback_text, Tokenizers};
use crate::upstream::{strip_hop_by_hop, upstream_headers, WORKER_HEADER};

/// Bodies larger than this are tokenized on a blocking thread, off the reactor.
const TOKENIZE_INLINE_BYTES_MAX: usize = 64 << 10;

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
}

/// `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.
pub async fn proxy(
    state: Arc<State>,
    peer: SocketAddr,
    req: http::Request<Incoming>,
    endpoint: Endpoint,
) -> Response<ProxyBody> {
    let arrived = Instant::now();
    let mut model = "unknown".to_string();
    let result = match state.concurrency.clone().try_acquire_owned() {
        Err(_) => Err(ApiError::overloaded()),
        Ok(permit) => {
            // A client trickling its body must not hold a permit past the request's time.
            let deadline = arrived + Duration::from_millis(state.cfg.limits.request_timeout_ms);
            match tokio::time::timeout_at(deadline, prepare(&state, peer, req, Some(endpoint), &mut model)).await {
                Err(_) => Err(ApiError::body_timeout()),
                Ok(Ok(p)) if p.preview => preview(&state, p),
                Ok(Ok(p)) => forward(&state, p, arrived, permit).await,
                Ok(Err(e)) => Err(e),
            }
        }
    };
    result.unwrap_or_else(|e| {
        state.metrics.request(&model, None, e.code, e.status.as_u16());
        e.into_response()
    })
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
    let q = question(&cx, trusted, &parts.headers, raw, endpoint, model_label).await?;
    let path_and_query = parts.uri.path_and_query().map_or(parts.uri.path(), |p| p.as_str()).to_string();
    let Question { pool, request, forward_body, preview, endpoint } = q;
    Ok(Prepared { pool, request, forward_body, headers: parts.headers, path_and_query, preview, endpoint })
}

/// What turning a request into a routing question reads: pools, tokenizers, metrics and
/// the session header. The proxy lends its own; the endpoint picker builds one.
pub struct Asker<'a> {
    /// Pools and workers.
    pub fleet: &'a Fleet,
    /// Tokenizers by model.
    pub tokenizers: &'a Tokenizers,
    /// Where parse and tokenize times, fallbacks and stripped fields are counted.
    pub metrics: &'a Metrics,
    /// The session id header.
    pub session_header: &'a HeaderName,
    /// Longest session id accepted, in bytes.
    pub session_id_bytes_max: usize,
}

/// A request body turned into the router's question.
pub struct Question {
    /// The pool serving it.
    pub pool: Arc<Pool>,
    /// The router's question.
    pub request: Request,
    /// The body to forward (the `kvroute` object removed).
    pub forward_body: Bytes,
    /// Whether the trusted preview flag was set.
    pub preview: bool,
    /// The endpoint the request came to (or looks like).
    pub endpoint: Endpoint,
}

/// Checks a buffered request body with its headers, finds its pool and hashes its prompt
/// into the router's question. Pins, priorities and the preview flag count only when
/// `trusted`. `endpoint: None` guesses it from the body. Work is linear in the body;
/// large prompts are tokenized on a blocking thread.
pub async fn question(
    cx: &Asker<'_>,
    trusted: bool,
    headers: &HeaderMap,
    raw: Bytes,
    endpoint: Option<Endpoint>,
    model_label: &mut String,
) -> Result<Question, ApiError> {
    let t0 = Instant::now();
    let mut json: Value =
        serde_json::from_slice(&raw).map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let endpoint = match endpoint.or_else(|| Endpoint::guess(&json)) {
        Some(e) => e,
        None => return Err(ApiError::bad_request("the body has none of `messages`, `prompt`, `input`")),
    };
    let had_kvroute = json.get("kvroute").is_some();
    let mut parsed = request::parse(endpoint, &mut json)?;
    let Some((pool, alias_lora)) = cx.fleet.resolve(&parsed.model) else {
        return Err(ApiError::model_not_found(&parsed.model));
    };
    let pool = pool.clone();
    *model_label = pool.name.clone();
    let lora = parsed.kv.lora_name.clone().or(alias_lora.map(String::from));
    let (hh, stripped_headers) = request::header_hints(headers, trusted)?;
    let stripped_fields = if trusted { Vec::new() } else { parsed.kv.strip_untrusted() };
    let (cost, cost_sent) = crate::cost_header::overrides(headers, trusted)?;
    let cost_stripped = cost_sent.then_some(crate::cost_header::COST_HEADER);
    for f in stripped_headers.into_iter().chain(stripped_fields).chain(cost_stripped) {
        cx.metrics.untrusted(f);
    }
    let session = request::session_id(headers, cx.session_header, cx.session_id_bytes_max)?;
    let forward_body = if had_kvroute { Bytes::from(json.to_string()) } else { raw };
    cx.metrics.stage("parse", t0.elapsed());

    let t1 = Instant::now();
    let tokens = tokens(cx, &pool.name, &parsed.prompt, json, forward_body.len()).await;
    let build = Build {
        id: pool.driver.next_request_id(),
        block_size: pool.block_size,
        lora: lora.as_deref(),
        parsed: &parsed,
        hints: hh.hints,
        session,
    };
    let request = Request { cost, ..request::build(build, &tokens) };
    cx.metrics.stage("tokenize", t1.elapsed());
    Ok(Question { pool, request, forward_body, preview: hh.preview, endpoint })
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

/// The routing tokens: the model's tokenizer if it has one, else hashed bytes.
async fn tokens(cx: &Asker<'_>, model: &str, prompt: &Prompt, body: Value, body_len: usize) -> Vec<u32> {
    if let Prompt::Tokens(t) = prompt {
        return t.clone();
    }
    let Some(tok) = cx.tokenizers.get(model).cloned() else {
        cx.metrics.fallback(model, "no_tokenizer");
        return fallback(prompt, &body);
    };
    let prompt = prompt.clone();
    let run = move || {
        let out = match &prompt {
            Prompt::Text(t) => tok.encode_text(t),
            _ => tok.encode_chat(&body),
        };
        // Boxed: the request travels back for the fallback, and Err stays small.
        out.map_err(|e| Box::new((e, prompt, body)))
    };
    let out = if body_len > TOKENIZE_INLINE_BYTES_MAX {
        match tokio::task::spawn_blocking(run).await {
            Ok(r) => r,
            Err(_) => return Vec::new(),
        }
    } else {
        run()
    };
    out.unwrap_or_else(|failed| {
        let (e, prompt, body) = *failed;
        tracing::debug!(model, error = %e, "tokenizer failed; routing on bytes");
        cx.metrics.fallback(model, "tokenizer_error");
        fallback(&prompt, &body)
    })
}

fn fallback(prompt: &Prompt, body: &Value) -> Vec<u32> {
    match prompt {
        Prompt::Text(t) => fallback_text(t),
        Prompt::Tokens(t) => t.clone(),
        Prompt::Chat => fallback_chat(body),
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
    let mut out = crate::admin::routed_json(&p.pool.name, isl, &routed);
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

/// Routes `p.request` (whatever phase it names) and forwards it, retrying connect
/// failures on workers not yet tried.
pub(crate) async fn forward_aggregated(
    state: &Arc<State>,
    p: Prepared,
    arrived: Instant,
    permit: OwnedSemaphorePermit,
) -> Result<Response<ProxyBody>, ApiError> {
    let deadline = arrived + Duration::from_millis(state.cfg.limits.request_timeout_ms);
    let pool = p.pool.clone();
    let mut request = p.request.clone();
    let mut tried: Vec<WorkerId> = Vec::new();
    let mut last_err: Option<ApiError> = None;
    for attempt in 0..=state.cfg.retry.retries_max {
        // The core excludes workers that already failed this request (unless a pin names them).
        request.failed_workers.clone_from(&tried);
        let t0 = Instant::now();
        let routed = tokio::time::timeout_at(deadline, pool.driver.route(request.clone(), pool.driver.draw())).await;
        let booking = match routed {
            Err(_) => return Err(ApiError::timeout()),
            // A retry that finds no other worker reports the failure that caused it.
            Ok(Err(_)) if last_err.is_some() => break,
            Ok(Err(e)) => {
                if let DriveError::Rejected(r) = &e {
                    state.metrics.rejected(&pool.name, &r.class, r.limit_kind.as_str());
                }
                return Err(ApiError::from_drive(&e, state.cfg.router.queue_timeout_ms));
            }
            Ok(Ok(b)) => b,
        };
        state.metrics.stage(if booking.waited() { "queue_wait" } else { "route" }, t0.elapsed());
        let r = booking.routed();
        state.metrics.decision(&pool.name, r.overlap.raw(), r.max_overlap_blocks, r.request_blocks);
        let worker_id = booking.target().worker;
        tried.push(worker_id);
        let Some(worker) = state.fleet.worker(worker_id.0) else {
            // Removed between the decision and now.
            let _ = booking.fail(DispatchFailure::Worker);
            continue;
        };
        let up = upstream_request(state, &worker, booking.target(), &p, p.forward_body.clone())?;
        match tokio::time::timeout_at(deadline, state.client.send(up)).await {
            Err(_) => {
                // No answer at all within the request's time counts against the worker, so a
                // worker gone slow is ejected like one gone dead.
                let _ = booking.fail(DispatchFailure::Worker);
                health::failure(state, worker_id.0, "timeout");
                return Err(ApiError::timeout());
            }
            Ok(Ok(resp)) => {
                let ctx = Respond { model: &pool.name, arrived, deadline, prefill_worker: None };
                return Ok(respond(state, resp, booking, ctx, permit));
            }
            Ok(Err(e)) => {
                let connect = e.is_connect();
                let _ = booking.fail(DispatchFailure::Worker);
                health::failure(state, worker_id.0, if connect { "connect" } else { "request" });
                last_err = Some(ApiError::upstream(format!("worker {} failed: {}", worker_id.0, error_chain(&e))));
                if !connect || attempt == state.cfg.retry.retries_max || !state.budget.withdraw() {
                    break;
                }
                state.metrics.retry(&pool.name);
            }
        }
    }
    Err(last_err.unwrap_or_else(|| ApiError::upstream("no worker could take the request")))
}

/// The request to send `body` to `target` on `worker`, with the client's headers.
pub(crate) fn upstream_request(
    state: &State,
    worker: &WorkerConfig,
    target: WorkerKey,
    p: &Prepared,
    body: Bytes,
) -> Result<http::Request<Full<Bytes>>, ApiError> {
    let uri = worker.url.join(&p.path_and_query).map_err(|e| ApiError::upstream(format!("bad worker URL: {e}")))?;
    let mut headers = upstream_headers(&p.headers, state.trust.token_header(), body.len());
    // The rank header is the router's word to the engine, never the client's.
    headers.remove(&state.dp_rank_header);
    if worker.dp_ranks > 1 {
        headers.insert(state.dp_rank_header.clone(), HeaderValue::from(target.rank.0));
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
    mut booking: Booking,
    ctx: Respond<'_>,
    permit: OwnedSemaphorePermit,
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
    };
    Response::from_parts(parts, ProxyBody::Stream(Box::new(UpstreamBody::new(body, booking, ctx, Some(permit)))))
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
