//! What both protocols share: one phase's routing question, booking a worker for it
//! with retries, rewriting the body, and the prefill exchange.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use kvroute_driver::{Booking, DispatchFailure, DriveError};
use router_core::{Phase, PhaseField, Request, WorkerId};
use serde_json::{Map, Value};
use tokio::time::Instant;

use crate::body::ProxyBody;
use crate::config::WorkerConfig;
use crate::error::ApiError;
use crate::fleet::Pool;
use crate::handler::{error_chain, Prepared};
use crate::health;
use crate::state::State;

use super::PREFILL_WORKER_HEADER;

/// Largest prefill answer read; a NIXL answer lists one block id per prompt block.
const PREFILL_ANSWER_BYTES_MAX: usize = 4 << 20;

/// A worker removed between its decision and the lookup of its URL is skipped at most
/// this many times per phase before the request fails.
const REMOVED_WORKER_SKIPS_MAX: u32 = 3;

/// `r` asked for one phase.
pub(super) fn phase_request(r: &Request, phase: Phase) -> Request {
    Request { phase: PhaseField(phase), ..r.clone() }
}

/// `r`'s decode phase, restricted to decode workers that share the pool's topology label
/// with `prefill`.
pub(super) fn decode_request(r: &Request, pool: &Pool, prefill: &WorkerConfig) -> Request {
    let mut d = phase_request(r, Phase::Decode);
    d.same_label_as = pool
        .disagg_same_label
        .as_ref()
        .and_then(|key| prefill.labels.get(key).map(|value| (key.clone(), value.clone())));
    d
}

/// The client's body with `edit` applied.
pub(super) fn edited_body(p: &Prepared, edit: impl FnOnce(&mut Map<String, Value>)) -> Result<Bytes, ApiError> {
    let mut v: Value = serde_json::from_slice(&p.forward_body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let Some(obj) = v.as_object_mut() else {
        return Err(ApiError::bad_request("the request body must be a JSON object"));
    };
    edit(obj);
    Ok(Bytes::from(v.to_string()))
}

/// The workers that failed one phase of a request, and whether it may try another.
pub(super) struct Retry {
    tried: Vec<WorkerId>,
    last_err: Option<ApiError>,
    retries: u32,
}

impl Retry {
    pub(super) fn new() -> Self {
        Retry { tried: Vec::new(), last_err: None, retries: 0 }
    }

    /// `worker` failed: it is excluded from now on. Returns whether another worker may
    /// be tried: the failure is `retryable`, `retries_max` is not spent, and the retry
    /// budget has a retry (which this takes).
    pub(super) fn failed(
        &mut self,
        state: &State,
        model: &str,
        worker: WorkerId,
        err: ApiError,
        retryable: bool,
    ) -> bool {
        self.tried.push(worker);
        self.last_err = Some(err);
        if !retryable || self.retries >= state.cfg.retry.retries_max || !state.budget.withdraw() {
            return false;
        }
        self.retries += 1;
        state.metrics.retry(model, "connect");
        true
    }

    /// The failure to report once no retry is left.
    pub(super) fn into_err(self) -> ApiError {
        self.last_err.unwrap_or_else(|| ApiError::upstream("no worker could take the request"))
    }
}

/// Books a worker for `req`'s phase, excluding those `retry` saw fail. Once something
/// failed, a router refusal reports that failure instead (no other worker was left).
pub(super) async fn book(
    state: &State,
    pool: &Pool,
    req: &mut Request,
    retry: &Retry,
    deadline: Instant,
) -> Result<(Booking, Arc<WorkerConfig>), ApiError> {
    req.failed_workers.clone_from(&retry.tried);
    for _ in 0..REMOVED_WORKER_SKIPS_MAX {
        let t0 = Instant::now();
        let routed = tokio::time::timeout_at(deadline, pool.driver.route(req.clone(), pool.driver.draw())).await;
        let booking = match routed {
            Err(_) => return Err(ApiError::timeout()),
            Ok(Err(e)) => {
                if let Some(last) = &retry.last_err {
                    return Err(last.clone());
                }
                if let DriveError::Rejected(r) = &e {
                    state.metrics.rejected(&pool.name, &r.class, r.limit_kind.as_str());
                }
                return Err(ApiError::from_drive(&e, state.cfg.router.queue_timeout_ms));
            }
            Ok(Ok(b)) => b,
        };
        state.metrics.stage(if booking.waited() { "queue_wait" } else { "route" }, t0.elapsed());
        if booking.phase() != Phase::Decode {
            // Decode picks get no prefix credit by design; their overlap says nothing.
            let r = booking.routed();
            state.metrics.decision(&pool.name, r.overlap.raw(), r.max_overlap_blocks, r.request_blocks);
        }
        match state.fleet.worker(booking.target().worker.0) {
            Some(w) => return Ok((booking, w)),
            // Removed between the decision and now: the router no longer offers it.
            None => {
                let _ = booking.fail(DispatchFailure::Worker);
            }
        }
    }
    Err(ApiError::upstream("the chosen workers were removed while routing"))
}

/// How a prefill exchange ended.
pub(super) enum PrefillEnd {
    /// The prefill ran; this is its answer's body.
    Done(Bytes),
    /// The worker refused the request as the client's mistake (a 4xx): pass it on.
    Refused(Response<ProxyBody>),
    /// The worker failed. `cause` labels metrics; a `retryable` failure may go to
    /// another prefill worker (the client has seen nothing yet).
    Failed { err: ApiError, cause: &'static str, retryable: bool },
}

/// Sends the prefill request and reads its whole answer, ending the prefill booking:
/// finished when the prefill ran or the worker refused the request, failed when the
/// worker failed. The caller bounds it in time; dropping it releases the booking and
/// closes the connection.
pub(super) async fn run_prefill(
    state: &Arc<State>,
    model: &str,
    worker: &WorkerConfig,
    mut booking: Booking,
    up: http::Request<Full<Bytes>>,
) -> PrefillEnd {
    let id = worker.id;
    let fail = |booking: Booking, kind: &'static str, message: String, retryable: bool| {
        let _ = booking.fail(DispatchFailure::Worker);
        health::failure(state, id, kind);
        let err = ApiError::upstream(format!("prefill worker {id} failed: {message}"));
        PrefillEnd::Failed { err, cause: kind, retryable }
    };
    booking.sending();
    let resp = match state.client.send(up).await {
        Ok(r) => r,
        Err(e) if e.is_connect() => return fail(booking, "connect", error_chain(&e), true),
        Err(e) => return fail(booking, "request", error_chain(&e), true),
    };
    let status = resp.status();
    let content_type = resp.headers().get(CONTENT_TYPE).cloned();
    let body = Limited::new(resp.into_body(), PREFILL_ANSWER_BYTES_MAX).collect().await.map(|c| c.to_bytes());
    if status.is_server_error() {
        return fail(booking, "status_5xx", format!("status {}", status.as_u16()), true);
    }
    let body = match body {
        Ok(b) => b,
        Err(e) => return fail(booking, "stream_broken", format!("its answer broke off: {e}"), true),
    };
    if !status.is_success() {
        let _ = booking.finish();
        health::success(state, id);
        state.metrics.request(model, Some(id), "upstream_error", status.as_u16());
        return PrefillEnd::Refused(refusal(status, content_type, body, id));
    }
    // The session's prefill binding commits only once the worker has done its part.
    let _ = booking.dispatched();
    let _ = booking.prefill_done();
    let _ = booking.finish();
    health::success(state, id);
    PrefillEnd::Done(body)
}

/// A prefill worker's 4xx, passed to the client as it came.
fn refusal(status: StatusCode, content_type: Option<HeaderValue>, body: Bytes, worker: u64) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::full(body));
    *resp.status_mut() = status;
    if let Some(ct) = content_type {
        resp.headers_mut().insert(CONTENT_TYPE, ct);
    }
    resp.headers_mut().insert(PREFILL_WORKER_HEADER, HeaderValue::from(worker));
    resp
}
