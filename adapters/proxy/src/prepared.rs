//! A request read and checked ([`Prepared`]), and what every try makes of it: the
//! worker's request ([`upstream_request`]) and the shape of its body ([`BodyShape`], read when it was parsed).
//! Every layer below the handler takes a `Prepared`; this module names none of them.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http::header::HeaderValue;
use http::HeaderMap;
use http_body_util::Full;
use kvroute_frontend::ask::ids_body;
pub(crate) use kvroute_frontend::error::error_chain;
use kvroute_frontend::otel::RequestTrace;
pub(crate) use kvroute_frontend::shape::BodyShape;
use router_core::{Request, WorkerKey};
use serde_json::Value;

use crate::config::WorkerConfig;
use crate::error::ApiError;
use crate::fleet::Pool;
use crate::request::Endpoint;
use crate::state::State;
use crate::upstream::upstream_headers;

/// A request read, checked and turned into a routing question.
pub struct Prepared {
    /// The pool serving it.
    pub pool: Arc<Pool>,
    /// The router's question.
    pub request: Request,
    /// The body to forward (the `kvroute` object removed).
    pub forward_body: Bytes,
    /// The forward body, parsed.
    pub json: Arc<Value>,
    /// The prompt's token ids, when it may reach a worker that tokenizes as the router
    /// does as them (see [`Bodies`]).
    pub ids: Option<Arc<[u32]>>,
    /// The client's headers.
    pub headers: HeaderMap,
    /// Path and query to forward to.
    pub path_and_query: String,
    /// Whether the trusted preview flag was set.
    pub preview: bool,
    /// The endpoint the request came to (or looks like, for a preview).
    pub endpoint: Endpoint,
    /// Whether it streams and its output limit (the `forward_body`'s).
    pub shape: BodyShape,
    /// Its trace, when it is traced (see [`crate::trace`]).
    pub trace: Option<RequestTrace>,
}

/// What each try of a request sends: the text body, or, to a worker that tokenizes as the
/// router does (see `kvroute_frontend::agree`), the same with the prompt as the router's
/// token ids, written once on first use.
pub(crate) struct Bodies {
    text: Bytes,
    /// The object the ids body is written from, and the ids.
    ids: Option<(Arc<Value>, Arc<[u32]>)>,
    ids_body: OnceLock<Bytes>,
}

impl Bodies {
    /// `text` to every worker, never ids.
    pub(crate) fn text(text: Bytes) -> Self {
        Bodies { text, ids: None, ids_body: OnceLock::new() }
    }

    /// `text`, or `json` (the same body, parsed) with its prompt as `ids`.
    pub(crate) fn with_ids(text: Bytes, json: Arc<Value>, ids: Option<Arc<[u32]>>) -> Self {
        Bodies { ids: ids.map(|i| (json, i)), ..Bodies::text(text) }
    }

    /// The body for `worker` of `pool`; a prompt sent as ids is counted.
    pub(crate) fn for_worker(&self, state: &State, pool: &Pool, worker: u64) -> Bytes {
        match &self.ids {
            Some((json, ids)) if state.fleet.sends_ids_to(pool, worker) => {
                state.metrics.sent_as_ids(&pool.name);
                self.ids_body.get_or_init(|| ids_body(json, ids)).clone()
            }
            _ => self.text.clone(),
        }
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
    // With tenants the key is the router's (see `crate::auth`); without, the worker's.
    if !state.tenants.is_empty() {
        headers.remove(http::header::AUTHORIZATION);
    }
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
