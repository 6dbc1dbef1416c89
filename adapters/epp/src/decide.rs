//! The routing decision for one gateway stream: trust, the proxy's question, the
//! gateway's endpoint subset, the admission queue, and the destination to answer with.

use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use kvroute_driver::{Booking, DispatchFailure, DriveError};
use kvroute_frontend::ask::{question, routed_json, Asker, Question};
use kvroute_frontend::headers::WORKER_HEADER;
use kvroute_frontend::request::{header_hints, Endpoint};
use kvroute_frontend::ApiError;
use router_core::{Request, WorkerId};
use tokio::time::Instant;

use crate::reply::Destination;
use crate::Shared;

/// What the gateway told about the request besides its bytes.
#[derive(Debug, Default)]
pub(crate) struct Asked {
    /// The request headers, pseudo-headers left out.
    pub headers: HeaderMap,
    /// `:path`, if sent.
    pub path: Option<String>,
    /// The client's address, if the gateway reported it.
    pub client_ip: Option<IpAddr>,
    /// The endpoints the gateway allows (`ip:port`), if it restricted them.
    pub subset: Option<Vec<String>>,
}

/// A routed request: its booking and where it goes.
pub(crate) struct Decided {
    pub booking: Booking,
    pub model: String,
    pub destination: Destination,
    /// The body to pass on (the `kvroute` object removed).
    pub forward_body: Bytes,
}

/// How deciding ended without a booking.
pub(crate) enum Undecided {
    /// Answer with this error.
    Refused { model: String, error: ApiError },
    /// Answer 200 with this preview (trusted `x-kvroute-preview`).
    Preview(serde_json::Value),
}

/// Builds and routes the question; `gone` resolves when the gateway stops listening, and
/// then the wait in the queue is abandoned (dropping it frees the slot). Returns `None`
/// when the gateway left.
pub(crate) async fn decide(
    shared: &Arc<Shared>,
    asked: &Asked,
    body: Bytes,
    gone: impl std::future::Future<Output = ()>,
) -> Option<Result<Decided, Undecided>> {
    let mut model = "unknown".to_string();
    let refused = |model: &String, error| Some(Err(Undecided::Refused { model: model.clone(), error }));
    if *shared.shutdown.borrow() {
        return refused(&model, ApiError::shutting_down());
    }
    // Without a reported address only the shared token can make a client trusted.
    let ip = asked.client_ip.unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED));
    let trusted = shared.trust.is_trusted(ip, &asked.headers);
    let q = if body.is_empty() {
        bodiless(shared, asked, trusted, &mut model)
    } else {
        let cx = Asker {
            fleet: &shared.fleet,
            tokenizers: &shared.tokenizers,
            metrics: &shared.metrics,
            session_header: &shared.session_header,
            session_id_bytes_max: shared.cfg.proxy.limits.session_id_bytes_max,
            cache_salt: None,
        };
        question(&cx, trusted, &asked.headers, body, endpoint(asked.path.as_deref()), &mut model).await
    };
    let mut q = match q {
        Ok(q) => q,
        Err(e) => return refused(&model, e),
    };
    if q.preview {
        let driver = &q.pool.driver;
        let isl = q.request.isl_tokens;
        return match driver.preview(q.request, driver.draw()) {
            Ok(r) => Some(Err(Undecided::Preview(routed_json(&model, isl, &r)))),
            Err(e) => refused(&model, ApiError::from_drive(&e, shared.cfg.proxy.router.queue_timeout_ms)),
        };
    }
    if let Some(subset) = &asked.subset {
        let ids = subset_ids(shared, &q.pool.name, subset);
        if ids.is_empty() {
            return refused(&model, no_candidate());
        }
        q.request.hints.allowed_worker_ids = Some(ids);
    }
    let t0 = Instant::now();
    let routed = tokio::select! {
        r = q.pool.driver.route(q.request.clone(), q.pool.driver.draw()) => r,
        () = gone => return None,
    };
    let booking = match routed {
        Ok(b) => b,
        Err(e) => {
            if let DriveError::Rejected(r) = &e {
                shared.metrics.rejected(&q.pool.name, &r.class, r.limit_kind.as_str());
            }
            return refused(&model, ApiError::from_drive(&e, shared.cfg.proxy.router.queue_timeout_ms));
        }
    };
    shared.metrics.stage(if booking.waited() { "queue_wait" } else { "route" }, t0.elapsed());
    let r = booking.routed();
    shared.metrics.decision(&q.pool.name, r.overlap.raw(), r.max_overlap_blocks, r.request_blocks);
    let (isl, block) = (q.request.isl_tokens, q.pool.block_size.tokens());
    shared.metrics.routed(&q.pool.name, booking.target().worker.0, isl, r.overlap.raw(), block);
    match destination(shared, &booking) {
        Some(destination) => Some(Ok(Decided { booking, model, destination, forward_body: q.forward_body })),
        None => {
            // Removed between the decision and now.
            let _ = booking.fail(DispatchFailure::Worker);
            refused(&model, ApiError::upstream("the chosen worker left the pool"))
        }
    }
}

/// The endpoint a `:path` names; other paths are guessed from the body.
fn endpoint(path: Option<&str>) -> Option<Endpoint> {
    Endpoint::at(path?)
}

/// A request without a body (`GET /v1/models` through the gateway): a zero-token request
/// of the default model's pool, or of the only pool.
fn bodiless(shared: &Shared, asked: &Asked, trusted: bool, model: &mut String) -> Result<Question, ApiError> {
    let fleet = &shared.fleet;
    let pool = match shared.cfg.proxy.default_model.as_deref() {
        Some(m) => fleet.pool(m),
        None => {
            let mut pools = fleet.pools();
            match (pools.next(), pools.next()) {
                (Some(p), None) => Some(p),
                _ => None,
            }
        }
    };
    let Some(pool) = pool.cloned() else {
        return Err(ApiError::bad_request("a request without a body names no model, and there is no default_model"));
    };
    model.clone_from(&pool.name);
    let (hh, _) = header_hints(&asked.headers, trusted)?;
    let session = kvroute_frontend::request::session_id(
        &asked.headers,
        &shared.session_header,
        shared.cfg.proxy.limits.session_id_bytes_max,
    )?;
    let request = Request { id: pool.driver.next_request_id(), hints: hh.hints, session, ..Request::default() };
    Ok(Question {
        pool,
        request,
        forward_body: Bytes::new(),
        json: Default::default(),
        ids: None,
        preview: hh.preview,
        endpoint: Endpoint::Completions,
        shape: Default::default(),
    })
}

/// Workers of `model` whose address is in the gateway's subset, in id order.
fn subset_ids(shared: &Shared, model: &str, subset: &[String]) -> Vec<WorkerId> {
    shared
        .fleet
        .workers()
        .iter()
        .filter(|w| w.model == model && subset.iter().any(|s| s == w.url.authority()))
        .map(|w| WorkerId(w.id))
        .collect()
}

fn no_candidate() -> ApiError {
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        kind: "server_error",
        code: "no_worker",
        message: "none of the endpoints the gateway allows is a known worker".into(),
        retry_after_s: Some(1),
        detail: None,
    }
}

/// Where the booking goes: the worker's `host:port`, its id, its dp rank when it has
/// several, and the trust token removed.
fn destination(shared: &Shared, booking: &Booking) -> Option<Destination> {
    let target = booking.target();
    let w = shared.fleet.worker(target.worker.0)?;
    let mut set = vec![(WORKER_HEADER.to_string(), target.worker.0.to_string())];
    if w.dp_ranks > 1 {
        set.push((shared.dp_rank_header.as_str().to_string(), target.rank.0.to_string()));
    }
    Some(Destination {
        endpoint: w.url.authority().to_string(),
        set,
        remove: vec![shared.trust.token_header().as_str().to_string()],
    })
}
