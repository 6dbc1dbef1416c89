//! The HTTP surface: routing, body limits, the in-flight limit, and the generation
//! handler that turns a parsed request into an engine submission and a response.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`
//! (see the `responses` module), `GET /v1/models`, `GET /health`, `GET /metrics`; the
//! pooling endpoints (`POST /v1/embeddings`, `/v1/score`, `/v1/rerank` and their
//! aliases, see the `pooling` module); vLLM's preprocessing (`POST /v1/completions/render`,
//! `POST /v1/chat/completions/render`, `POST /tokenize`, `POST /detokenize`, see the
//! `preprocess` module); and what routers read about a worker (`GET /version`,
//! `/server_info`, `/get_server_info`, `/kv_event_sources`, `/get_load`, see the `info`
//! module). Every refusal is an OpenAI error body; no input panics.
//!
//! Disaggregation: a prefill-role request with `bootstrap_room` holds that room until
//! its prefill is done; a decode-role request with one first pairs with its prefill
//! through the prefill worker's bootstrap server (see the `bootstrap` module) and is
//! refused with a 502 if that fails.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use kvroute_sim::engine::{EngineRole, RejectReason};
use kvroute_sim::prompt::PromptError;
use prometheus_client::registry::Registry;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use crate::bootstrap::{self, Rooms, RoomsFull};
use crate::engine_task::{Submit, SubmitError};
use crate::faults::Faults;
use crate::greedy::Greedy;
use crate::info::{self, Facts};
use crate::media::SimMedia;
use crate::metrics::{render, Metrics};
use crate::openai::{self, full_response, ApiError, Bootstrap, Kind, KvSource, ParseLimits, ResponseMeta};
use crate::pooling;
use crate::preprocess::{self, engine_prompt};
use crate::sse::{collect, Clock, Finish, SseBody};
use crate::tokenizer::PromptTokenizer;

pub(crate) type Body = BoxBody<Bytes, Infallible>;

/// What every handler shares.
pub(crate) struct State {
    pub(crate) model: String,
    pub(crate) role: EngineRole,
    pub(crate) facts: Facts,
    pub(crate) limits: ParseLimits,
    pub(crate) body_bytes_max: usize,
    pub(crate) requests_in_flight_max: usize,
    pub(crate) tokenizer: Arc<dyn PromptTokenizer>,
    /// How the model reads images; `None`: image parts are refused by the tokenizer.
    pub(crate) media: Option<SimMedia>,
    pub(crate) submit_tx: mpsc::Sender<Submit>,
    pub(crate) metrics: Metrics,
    pub(crate) registry: Registry,
    pub(crate) in_flight: Arc<AtomicUsize>,
    pub(crate) next_response: AtomicU64,
    pub(crate) engine_id: String,
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) created: u64,
    pub(crate) rooms: Arc<Rooms>,
    pub(crate) faults: Faults,
}

impl State {
    /// A fresh response or request id, as vLLM prefixes them.
    pub(crate) fn response_id(&self, kind: Kind) -> String {
        let n = self.next_response.fetch_add(1, Ordering::Relaxed);
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completions => "cmpl",
            Kind::Responses => "resp",
        };
        format!("{prefix}-{:x}-{n}", self.created)
    }
}

/// Every path served, for telling a wrong method from an unknown path.
const PATHS: [&str; 21] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/score",
    "/score",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/models",
    "/health",
    "/metrics",
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/tokenize",
    "/detokenize",
    "/version",
    "/server_info",
    "/get_server_info",
    "/kv_event_sources",
    "/get_load",
];

/// Holds one slot of the in-flight limit until dropped.
pub(crate) struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves one request; never fails (errors are responses).
pub(crate) async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().trim_end_matches('/').to_string();
    let resp = match (req.method(), path.as_str()) {
        (&Method::POST, "/v1/completions") => generate(&state, Kind::Completions, req).await,
        (&Method::POST, "/v1/chat/completions") => generate(&state, Kind::Chat, req).await,
        (&Method::POST, "/v1/responses") => generate(&state, Kind::Responses, req).await,
        (&Method::POST, "/v1/embeddings") => answer(&state, req, pooling::embeddings).await,
        (&Method::POST, "/v1/score" | "/score") => answer(&state, req, pooling::score).await,
        (&Method::POST, "/v1/rerank" | "/rerank" | "/v2/rerank") => answer(&state, req, pooling::rerank).await,
        (&Method::POST, "/v1/completions/render") => {
            answer(&state, req, |s, b| preprocess::render(s, Kind::Completions, b)).await
        }
        (&Method::POST, "/v1/chat/completions/render") => {
            answer(&state, req, |s, b| preprocess::render(s, Kind::Chat, b)).await
        }
        (&Method::POST, "/tokenize") => answer(&state, req, preprocess::tokenize).await,
        (&Method::POST, "/detokenize") => answer(&state, req, preprocess::detokenize).await,
        (&Method::GET, "/v1/models") => Ok(json_response(StatusCode::OK, &models(&state))),
        (&Method::GET, "/health") => Ok(text_response(StatusCode::OK, "", "text/plain")),
        (&Method::GET, "/metrics") => Ok(text_response(
            StatusCode::OK,
            render(&state.registry),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )),
        (&Method::GET, "/version") => Ok(json_response(StatusCode::OK, &info::version())),
        (&Method::GET, "/server_info" | "/get_server_info") => {
            Ok(json_response(StatusCode::OK, &info::server_info(&state.facts)))
        }
        (&Method::GET, "/kv_event_sources") => Ok(json_response(StatusCode::OK, &info::kv_event_sources(&state.facts))),
        (&Method::GET, "/get_load") => Ok(json_response(StatusCode::OK, &info::get_load(&state.facts, &state.metrics))),
        (_, p) if PATHS.contains(&p) => {
            Err(ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed"))
        }
        _ => Err(ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("no route for {path}"))),
    };
    Ok(resp.unwrap_or_else(|e| json_response(e.status, &e.body())))
}

fn models(state: &State) -> Value {
    json!({"object": "list", "data": [{
        "id": state.model,
        "object": "model",
        "created": state.created,
        "owned_by": "kvroute",
        "root": state.model,
        "max_model_len": state.facts.max_model_len(),
    }]})
}

/// Reads a JSON body and answers what `f` makes of it.
async fn answer(
    state: &State,
    req: Request<Incoming>,
    f: impl FnOnce(&State, &[u8]) -> Result<Value, ApiError>,
) -> Result<Response<Body>, ApiError> {
    let body = read_body(state, req).await?;
    f(state, &body).map(|v| json_response(StatusCode::OK, &v))
}

/// The whole body, refused past `body_bytes_max`.
async fn read_body(state: &State, req: Request<Incoming>) -> Result<Bytes, ApiError> {
    let body = Limited::new(req.into_body(), state.body_bytes_max).collect().await.map_err(|e| {
        if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("request body exceeds {} bytes", state.body_bytes_max),
            )
        } else {
            ApiError::bad(None, format!("cannot read the request body: {e}"))
        }
    })?;
    Ok(body.to_bytes())
}

async fn generate(state: &Arc<State>, kind: Kind, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    state.metrics.requests.inc();
    if let Some((status, retry_after_s)) = state.faults.status() {
        return Ok(injected_status(status, retry_after_s));
    }
    let result = generate_inner(state, kind, req).await;
    if result.is_err() {
        state.metrics.rejected.inc();
    }
    result
}

async fn generate_inner(state: &Arc<State>, kind: Kind, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let clock = Clock::start(&state.metrics);
    let guard = admit(state)?;
    let body = read_body(state, req).await?;
    let (parsed, json_body) = openai::parse(kind, &body, &state.limits)?;
    if state.faults.wedged() {
        // A wedged engine: the request is read and never answered.
        std::future::pending::<()>().await;
    }
    // Opened before anything else can fail, so that any failure fails the room.
    let room = match (state.role, parsed.bootstrap.room) {
        (EngineRole::Prefill, Some(room)) => Some(state.rooms.open(room).map_err(|RoomsFull(n)| {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", format!("{n} bootstrap rooms are open"))
        })?),
        _ => None,
    };
    let (tokens, media) = engine_prompt(state, &parsed.prompt, &json_body)?;
    let prompt_tokens = tokens.len() as u32;
    let greedy = Greedy::after(&tokens);
    let prompt_ids = parsed.return_token_ids.then(|| tokens.clone());
    let paired = match state.role {
        EngineRole::Decode => pair(state, &parsed.bootstrap).await?,
        _ => false,
    };
    let remote_prefill = state.role == EngineRole::Decode
        && (paired
            || parsed
                .kv_transfer_params
                .as_ref()
                .is_some_and(|p| p.get("do_remote_prefill") != Some(&Value::Bool(false))));
    let (progress, rx) = mpsc::unbounded_channel();
    let (accepted_tx, accepted_rx) = oneshot::channel();
    let submit =
        Submit { tokens, media, output_len: parsed.max_tokens, remote_prefill, progress, accepted: accepted_tx };
    let unavailable = || ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the worker is shutting down");
    state.submit_tx.send(submit).await.map_err(|_| unavailable())?;
    accepted_rx.await.map_err(|_| unavailable())?.map_err(submit_error)?;

    let meta = ResponseMeta {
        id: state.response_id(kind),
        created: unix_secs(),
        model: state.model.clone(),
        kind,
        prompt_tokens,
    };
    let kv_params = (state.role == EngineRole::Prefill).then(|| KvSource {
        engine_id: state.engine_id.clone(),
        host: state.host.clone(),
        port: state.port,
    });
    if parsed.stream {
        let finish = Finish {
            meta,
            greedy,
            prompt_ids,
            return_token_ids: parsed.return_token_ids,
            stall_after_tokens: state.faults.stall_after_tokens(),
            kv_params,
            clock,
        };
        let body = SseBody::new(rx, finish, parsed.include_usage, guard, room);
        let mut resp = Response::new(body.boxed());
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(resp);
    }
    let (text, done) = collect(rx, greedy, clock).await.ok_or_else(unavailable)?;
    drop(guard);
    if let Some(room) = room {
        room.done();
    }
    let kv = kv_params.map(|k| k.params(done.prompt_blocks));
    Ok(json_response(StatusCode::OK, &full_response(&meta, &text, &done, kv)))
}

/// A decode request naming a bootstrap room waits for that room's prefill. Returns
/// whether it paired (its KV comes from the prefill worker).
async fn pair(state: &State, b: &Bootstrap) -> Result<bool, ApiError> {
    let Some(room) = b.room else { return Ok(false) };
    let (Some(host), Some(port)) = (&b.host, b.port) else {
        return Err(ApiError::bad(Some("bootstrap_host"), "a bootstrap_room needs bootstrap_host and bootstrap_port"));
    };
    bootstrap::pair(host, port, room, state.rooms.timeout).await.map_err(|why| {
        ApiError::new(StatusCode::BAD_GATEWAY, "server_error", format!("bootstrap room {room} failed: {why}"))
    })?;
    Ok(true)
}

fn admit(state: &State) -> Result<InFlight, ApiError> {
    let prev = state.in_flight.fetch_add(1, Ordering::Relaxed);
    let guard = InFlight(state.in_flight.clone());
    if prev >= state.requests_in_flight_max {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!("overloaded: {} requests in flight", state.requests_in_flight_max),
        ));
    }
    Ok(guard)
}

fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::Engine(RejectReason::TooLong { blocks, capacity }) => ApiError::bad(
            Some("prompt"),
            format!("prompt plus max_tokens need {blocks} KV blocks; this worker holds {capacity}"),
        ),
        SubmitError::Prompt(PromptError::ReservedTokenId { index, id }) => {
            ApiError::bad(Some("prompt"), format!("token {index} has id {id}; ids must be below 2^31"))
        }
        SubmitError::Prompt(p) => ApiError::bad(Some("prompt"), p.to_string()),
        SubmitError::Engine(r) => ApiError::bad(None, r.to_string()),
    }
}

/// Fault injection: an error answer with this status and maybe a `Retry-After`.
fn injected_status(status: u16, retry_after_s: Option<u64>) -> Response<Body> {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let e = ApiError::new(status, "server_error", "injected failure");
    let mut resp = json_response(status, &e.body());
    if let Some(s) = retry_after_s {
        resp.headers_mut().insert(hyper::header::RETRY_AFTER, HeaderValue::from(s));
    }
    resp
}

fn unix_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    text_response(status, v.to_string(), "application/json")
}

fn text_response(status: StatusCode, body: impl Into<Bytes>, content_type: &'static str) -> Response<Body> {
    let mut resp = Response::new(Full::new(body.into()).boxed());
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}
