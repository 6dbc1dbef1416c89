//! What both protocols share: one phase's routing question, booking a worker for it
//! with retries, rewriting the body, and the prefill exchange.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use kvroute_driver::{Booking, DispatchFailure, DriveError};
use router_core::{Phase, PhaseField, Request, WorkerId};
use serde_json::{Map, Value};
use tokio::time::Instant;

use crate::config::WorkerConfig;
use crate::error::ApiError;
use crate::fleet::Pool;
use crate::health;
use crate::prepared::{error_chain, Prepared};
use crate::retry::{self, RetryReason};
use crate::state::State;
use crate::tries;
use crate::upstream::{Upstream, PREFILL_WORKER_HEADER};

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

/// The workers that failed one phase of a request, and whether it may try another,
/// by the rules of [`crate::retry`]: the same reasons, budget, backoff and `Retry-After`
/// as an aggregated request.
pub(super) struct Retry {
    tried: Vec<WorkerId>,
    last_err: Option<ApiError>,
    retries: u32,
    /// The reason of the retry the next booking makes, counted once it finds a worker.
    pending: Option<RetryReason>,
}

impl Retry {
    pub(super) fn new() -> Self {
        Retry { tried: Vec::new(), last_err: None, retries: 0, pending: None }
    }

    /// `worker` failed for `reason` (`None`: not retryable): it is excluded from now on.
    /// Returns whether another worker may be tried, after the backoff.
    pub(super) async fn failed(
        &mut self,
        state: &State,
        pool: &Pool,
        worker: WorkerId,
        err: ApiError,
        reason: Option<(RetryReason, Option<Duration>)>,
        deadline: Instant,
    ) -> bool {
        self.record(worker, err);
        match reason {
            Some((reason, after)) if self.may_retry(state) => self.backoff(state, pool, reason, after, deadline).await,
            _ => false,
        }
    }

    /// `worker` failed this phase; `err` is reported if no retry follows.
    pub(super) fn record(&mut self, worker: WorkerId, err: ApiError) {
        self.tried.push(worker);
        self.last_err = Some(err);
    }

    /// Whether one more retry is allowed: `retries_max` is not spent and the retry
    /// budget has a retry (taken when the retry finds a worker, see [`book`]).
    pub(super) fn may_retry(&mut self, state: &State) -> bool {
        if self.retries >= state.cfg.retry.retries_max || !state.budget.available() {
            return false;
        }
        self.retries += 1;
        true
    }

    /// Waits the backoff of a retry for `reason` (never less than the worker's
    /// `Retry-After`); false when that would pass the request's deadline. The retry is
    /// counted when it finds a worker.
    pub(super) async fn backoff(
        &mut self,
        state: &State,
        pool: &Pool,
        reason: RetryReason,
        after: Option<Duration>,
        deadline: Instant,
    ) -> bool {
        self.pending = Some(reason);
        let wait = retry::backoff(&state.cfg.retry, self.retries, pool.driver.draw().0, after);
        if Instant::now() + wait >= deadline {
            self.last_err = Some(ApiError::timeout());
            return false;
        }
        tokio::time::sleep(wait).await;
        true
    }

    /// The failure to report once no retry is left.
    pub(super) fn into_err(self) -> ApiError {
        self.last_err.unwrap_or_else(|| ApiError::upstream("no worker could take the request"))
    }
}

/// Books a worker for `req`'s phase, excluding those `retry` saw fail. Once something
/// failed, a router refusal reports that failure instead (no other worker was left). A
/// retry that finds a worker is counted and taken from the budget here.
pub(super) async fn book(
    state: &State,
    pool: &Pool,
    req: &mut Request,
    retry: &mut Retry,
    deadline: Instant,
) -> Result<(Booking, Arc<WorkerConfig>), ApiError> {
    let booked = book_one(state, pool, req, retry, deadline).await?;
    if let Some(reason) = retry.pending.take() {
        if !state.budget.withdraw() {
            // Dropping the booking cancels it: nothing was sent.
            return Err(retry.last_err.clone().unwrap_or_else(|| ApiError::upstream("no retry left")));
        }
        state.metrics.retry(&pool.name, reason.as_str());
    }
    Ok(booked)
}

async fn book_one(
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
    Refused(Response<Bytes>),
    /// The worker failed (`cause` labels metrics) for `reason`, with the `Retry-After`
    /// it asked for: another prefill worker may be tried, the client has seen nothing.
    Failed { err: ApiError, cause: &'static str, reason: RetryReason, after: Option<Duration> },
}

/// How long a prefill try may take to answer: the first-byte timeout of the prompt
/// tokens the booked worker does not hold.
pub(super) fn prefill_limit(state: &State, pool: &Pool, booking: &Booking, isl_tokens: u32) -> Duration {
    retry::first_byte_timeout(&state.cfg.retry, tries::uncached_tokens(pool, booking, isl_tokens))
}

/// The retry reason of a decode answer's status, with its `Retry-After`; `None` when the
/// answer goes to the client.
pub(super) fn retryable_answer(state: &State, resp: &Response<Upstream>) -> Option<(RetryReason, Option<Duration>)> {
    let reason = retry::for_status(resp.status())?;
    Some((reason, tries::retry_after_of(state, resp.headers())))
}

/// Sends the prefill request of `p` and reads its whole answer, ending the prefill
/// booking: finished when the prefill ran or the worker refused the request, failed
/// when the worker failed or sent no head within `limit` (extended while the worker
/// serves others, see [`tries::wait_first_byte`]). The caller bounds it in time; dropping
/// it releases the booking and closes the connection (and ends its span).
pub(super) async fn run_prefill(
    state: &Arc<State>,
    p: &Prepared,
    worker: &WorkerConfig,
    mut booking: Booking,
    mut up: http::Request<Full<Bytes>>,
    limit: Duration,
) -> PrefillEnd {
    let (id, model) = (worker.id, p.pool.name.as_str());
    let span = crate::trace::try_span(p.trace.as_ref(), "prefill", id, &mut up);
    let fail = |booking: Booking, cause: &'static str, message: String, reason: RetryReason, after| {
        tries::give_up(state, booking, id, reason);
        if let Some(s) = &span {
            s.fail(message.clone());
        }
        let err = ApiError::upstream(format!("prefill worker {id} failed: {message}"));
        PrefillEnd::Failed { err, cause, reason, after }
    };
    booking.sending();
    let send = std::pin::pin!(state.client.send(up));
    let sent = tries::wait_first_byte(state, model, id, (Some(limit), tries::bounded_by_caller()), send, false).await;
    let Some((sent, _)) = sent else {
        let msg = "ejected before its first byte".to_string();
        return fail(booking, "ejected", msg, RetryReason::Ejected, None);
    };
    let resp = match sent {
        Ok(Ok(r)) => {
            if let Some(s) = &span {
                crate::trace::try_answered(s, Ok(r.status().as_u16()));
            }
            state.outliers.head(id, r.status());
            r
        }
        Ok(Err(e)) if e.is_connect() => return fail(booking, "connect", error_chain(&e), RetryReason::Connect, None),
        Ok(Err(e)) => return fail(booking, "request", error_chain(&e), RetryReason::Reset, None),
        Err(_) => {
            let msg = format!("no answer within its first-byte timeout ({} ms)", limit.as_millis());
            return fail(booking, "first_byte_timeout", msg, RetryReason::FirstByteTimeout, None);
        }
    };
    let status = resp.status();
    let content_type = resp.headers().get(CONTENT_TYPE).cloned();
    let after = tries::retry_after_of(state, resp.headers());
    let body = Limited::new(resp.into_body(), PREFILL_ANSWER_BYTES_MAX).collect().await.map(|c| c.to_bytes());
    if let Some(reason) = retry::for_status(status) {
        return fail(booking, reason.as_str(), format!("status {}", status.as_u16()), reason, after);
    }
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            return fail(booking, "stream_broken", format!("its answer broke off: {e}"), RetryReason::Reset, None)
        }
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
fn refusal(status: StatusCode, content_type: Option<HeaderValue>, body: Bytes, worker: u64) -> Response<Bytes> {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    if let Some(ct) = content_type {
        resp.headers_mut().insert(CONTENT_TYPE, ct);
    }
    resp.headers_mut().insert(PREFILL_WORKER_HEADER, HeaderValue::from(worker));
    resp
}
