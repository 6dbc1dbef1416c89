//! The tries of one request before its first byte reaches the client: route, send, wait
//! for the head and (for a stream) the first body frame, and on a failure that
//! [`crate::retry`] says is retryable, release the booking, back off and try another
//! worker. What reaches the caller is a worker's answer that may go to the client, or an
//! error for the client.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::Response;
use http_body::Frame;
use http_body_util::BodyExt;
use kvroute_driver::{Booking, DispatchFailure, DriveError};
use router_core::Request;
use router_core::WorkerId;
use tokio::time::error::Elapsed;
use tokio::time::Instant;

use crate::error::ApiError;
use crate::fleet::Pool;
use crate::health;
use crate::prepared::{error_chain, upstream_request_to, Bodies, BodyShape, Prepared};
use crate::retry::{self, RetryReason};
use crate::state::State;
use crate::upstream::Upstream;

/// A worker's answer that goes to the client: its booking, its head and body, and the
/// first body frame when the proxy waited for it (a stream). `None` there with a stream
/// means its body ended before any frame.
pub(crate) struct Answered {
    pub booking: Booking,
    pub resp: Response<Upstream>,
    pub first: Option<Frame<Bytes>>,
}

/// What one request's tries share.
pub(crate) struct Tries<'a> {
    pub state: &'a Arc<State>,
    pub pool: &'a Arc<Pool>,
    pub p: &'a Prepared,
    /// The body each try sends.
    pub body: Bodies,
    /// The path each try goes to.
    pub path: Option<String>,
    /// When the whole request must be done.
    pub deadline: Instant,
    /// Whether the answer streams, so the first byte is awaited under its own timeout,
    /// and the output limit a non-streaming answer's timeout is sized by.
    pub shape: BodyShape,
}

/// How one try ended, if it did not produce an answer for the client.
enum Failed {
    /// Retry elsewhere, for this reason; a retryable answer kept in case no retry is left.
    Retry(RetryReason, Option<Box<Answered>>, ApiError),
    /// The request's own time ran out.
    TimedOut,
}

/// Tries workers until one answers with something the client may get. `request` gains
/// the workers tried in `failed_workers`; `tried` lists them too.
pub(crate) async fn first_answer(
    t: &Tries<'_>,
    request: &mut Request,
    tried: &mut Vec<WorkerId>,
) -> Result<Answered, ApiError> {
    let state = t.state;
    // A request that pins its worker has nowhere else to go.
    let pinned = router_core::explicit_pin(request.phase.0, &request.hints).is_some();
    let mut last_err: Option<ApiError> = None;
    // The reason of the retry the next try would be, counted once that try is sent.
    let mut retrying: Option<RetryReason> = None;
    for attempt in 0..=state.cfg.retry.retries_max {
        // The core excludes workers that already failed this request (unless a pin names them).
        request.failed_workers.clone_from(tried);
        let booking = match route(t, request.clone(), last_err.is_some(), attempt).await {
            Ok(Some(b)) => b,
            Ok(None) => break,
            Err(e) => return Err(e),
        };
        if let Some(reason) = retrying.take() {
            // Dropping the booking cancels it: nothing was sent.
            if !state.budget.withdraw() {
                break;
            }
            state.metrics.retry(&t.pool.name, reason.as_str());
        }
        let worker = booking.target().worker;
        tried.push(worker);
        let (reason, kept, err) = match one_try(t, booking, request.isl_tokens, !pinned).await {
            Ok(a) => return Ok(a),
            Err(Failed::TimedOut) => return Err(ApiError::timeout()),
            Err(Failed::Retry(reason, kept, err)) => (reason, kept, err),
        };
        let can_retry = !pinned && attempt < state.cfg.retry.retries_max && state.budget.available();
        if !can_retry {
            // No retry left: a worker's own answer goes to the client as it is.
            return kept.map(|a| *a).ok_or(err);
        }
        let after = kept.as_ref().and_then(|a| retry::retry_after(a.resp.headers(), unix_now_s(), cfg_cap(state)));
        let err = match kept.map(|a| *a) {
            Some(a) => {
                give_up(state, a.booking, worker.0, reason);
                // Should no other worker take it, the client gets what this one said.
                worker_error(worker.0, a.resp, a.first).await.unwrap_or(err)
            }
            None => err,
        };
        retrying = Some(reason);
        last_err = Some(err);
        let wait = retry::backoff(&state.cfg.retry, attempt + 1, t.pool.driver.draw().0, after);
        if Instant::now() + wait >= t.deadline {
            return Err(ApiError::timeout());
        }
        tokio::time::sleep(wait).await;
    }
    Err(last_err.unwrap_or_else(|| ApiError::upstream("no worker could take the request")))
}

fn cfg_cap(state: &State) -> u64 {
    state.cfg.retry.retry_after_max_ms
}

/// The tokens of a prompt of `isl_tokens` that `booking`'s worker does not hold, which
/// its prefill (and so its first byte) waits for.
pub(crate) fn uncached_tokens(pool: &Pool, booking: &Booking, isl_tokens: u32) -> u32 {
    let cached = booking.routed().overlap.device.saturating_mul(pool.block_size.tokens());
    isl_tokens.saturating_sub(cached)
}

/// A worker's `Retry-After` as the wait it asks for, capped by the configuration.
pub(crate) fn retry_after_of(state: &State, headers: &http::HeaderMap) -> Option<Duration> {
    retry::retry_after(headers, unix_now_s(), cfg_cap(state))
}

pub(crate) fn unix_now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Routes one try. `Ok(None)`: a retry found no other worker (the caller reports the
/// failure that caused it).
async fn route(t: &Tries<'_>, request: Request, retrying: bool, attempt: u32) -> Result<Option<Booking>, ApiError> {
    let (state, pool) = (t.state, t.pool);
    let t0 = Instant::now();
    let (isl, tenant) = (request.isl_tokens, request.tenant);
    let routed = tokio::time::timeout_at(t.deadline, pool.driver.route(request, pool.driver.draw())).await;
    let booking = match routed {
        Err(_) => return Err(ApiError::timeout()),
        Ok(Err(_)) if retrying => return Ok(None),
        Ok(Err(e)) => {
            if let DriveError::Rejected(r) = &e {
                state.metrics.rejected(&pool.name, &r.class, r.limit_kind.as_str());
            }
            return Err(ApiError::from_drive(&e, state.cfg.router.queue_timeout_ms));
        }
        Ok(Ok(b)) => b,
    };
    state.metrics.stage(if booking.waited() { "queue_wait" } else { "route" }, t0.elapsed());
    if let Some(s) = state.limits.series(tenant) {
        s.queue_wait.observe(t0.elapsed().as_secs_f64());
    }
    crate::trace::routed(t.p.trace.as_ref(), t0, &booking, attempt);
    let r = booking.routed();
    state.metrics.decision(&pool.name, r.overlap.raw(), r.max_overlap_blocks, r.request_blocks);
    let block = pool.block_size.tokens();
    state.metrics.routed(&pool.name, booking.target().worker.0, isl, r.overlap.raw(), block);
    Ok(Some(booking))
}

/// A deadline no request reaches, for a [`wait_first_byte`] whose caller bounds it in
/// time: the caller's bound then answers at the request's deadline, as a timeout.
pub(crate) fn bounded_by_caller() -> Instant {
    Instant::now() + Duration::from_secs(365 * 24 * 3600)
}

/// Waits for `answer` until `limit` after the wait began (or `deadline`), and returns it
/// with the instant the wait ended at. A worker that served others while this try waited
/// is busy, not wedged: the try waits another period where it is rather than count a
/// failure against a healthy worker and send its prompt to be computed again elsewhere.
/// Under a fleet-wide overload, retries would only add work and ejections take capacity
/// away. `None`: with `on_ejection`, the worker was ejected first. Every phase of a
/// request (whole, prefill, decode) waits for its first byte this way.
pub(crate) async fn wait_first_byte<F: Future>(
    state: &State,
    pool: &str,
    w: u64,
    (limit, deadline): (Option<Duration>, Instant),
    mut answer: Pin<&mut F>,
    on_ejection: bool,
) -> Option<(Result<F::Output, Elapsed>, Instant)> {
    let by = |from: Instant| limit.and_then(|d| from.checked_add(d)).map_or(deadline, |at| at.min(deadline));
    let mut waited_from = Instant::now();
    loop {
        let until = by(waited_from);
        let sent = tokio::select! {
            // An answer that is ready says more than the ejection it may have caused.
            biased;
            sent = tokio::time::timeout_at(until, answer.as_mut()) => sent,
            () = state.outliers.ejected(w), if on_ejection => return None,
        };
        if sent.is_err() && until < deadline && state.outliers.progressed_since(w, waited_from) {
            state.metrics.first_byte_wait_extended(pool);
            waited_from = Instant::now();
            continue;
        }
        return Some((sent, until));
    }
}

/// Sends one try of a prompt of `isl_tokens` and waits for its head and, for a stream,
/// its first frame, within the try's first-byte timeout (for a non-streaming try, its
/// answer timeout). With `on_ejection`, the wait ends when the worker is ejected, which
/// bounds a try that has no timeout of its own (a non-streaming request naming no
/// output limit) on a wedged worker.
async fn one_try(t: &Tries<'_>, mut booking: Booking, isl_tokens: u32, on_ejection: bool) -> Result<Answered, Failed> {
    let state = t.state;
    let worker_id = booking.target().worker;
    let Some(worker) = state.fleet.worker(worker_id.0) else {
        // Removed between the decision and now.
        let _ = booking.fail(DispatchFailure::Worker);
        return Err(Failed::Retry(RetryReason::Connect, None, ApiError::upstream("the worker was removed")));
    };
    let path = t.path.as_deref().unwrap_or(&t.p.path_and_query);
    let mut up = match upstream_request_to(
        state,
        &worker,
        booking.target(),
        t.p,
        path,
        t.body.for_worker(state, t.pool, worker.id),
    ) {
        Ok(up) => up,
        Err(e) => {
            let _ = booking.fail(DispatchFailure::Worker);
            return Err(Failed::Retry(RetryReason::Connect, None, e));
        }
    };
    let span = crate::trace::try_span(t.p.trace.as_ref(), "upstream", worker_id.0, &mut up);
    let limit = retry::try_limit(&state.cfg.retry, t.shape, uncached_tokens(t.pool, &booking, isl_tokens));
    booking.sending();
    let answer = std::pin::pin!(async {
        let mut resp = state.client.send(up).await?;
        let first = if t.shape.stream && resp.status().is_success() {
            match resp.body_mut().frame().await {
                None => None,
                Some(Ok(f)) => Some(f),
                Some(Err(e)) => return Err(crate::upstream::SendError::Request(e)),
            }
        } else {
            None
        };
        Ok((resp, first))
    });
    let w = worker_id.0;
    let Some((sent, first_byte_by)) =
        wait_first_byte(state, &t.pool.name, w, (limit, t.deadline), answer, on_ejection).await
    else {
        if let Some(s) = &span {
            s.fail("the worker was ejected before its first byte".into());
        }
        give_up(state, booking, w, RetryReason::Ejected);
        let e = ApiError::upstream(format!("worker {w} was ejected before it sent a byte"));
        return Err(Failed::Retry(RetryReason::Ejected, None, e));
    };
    if let Some(s) = &span {
        crate::trace::try_answered(s, crate::trace::head_of(&sent, |(r, _)| r.status().as_u16()));
    }
    let sent = sent.map(|r| {
        r.map(|(mut resp, first)| {
            crate::trace::ride_along(&mut resp, span);
            (resp, first)
        })
    });
    match sent {
        Err(_) if first_byte_by >= t.deadline => {
            // No answer at all within the request's time counts against the worker, so a
            // worker gone slow is ejected like one gone dead.
            let _ = booking.fail(DispatchFailure::Worker);
            health::failure(state, w, "timeout");
            Err(Failed::TimedOut)
        }
        Err(_) => {
            give_up(state, booking, w, RetryReason::FirstByteTimeout);
            let e = ApiError::upstream(format!("worker {w} sent no byte within its first-byte timeout"));
            Err(Failed::Retry(RetryReason::FirstByteTimeout, None, e))
        }
        Ok(Err(e)) => {
            let reason = if e.is_connect() { RetryReason::Connect } else { RetryReason::Reset };
            give_up(state, booking, w, reason);
            let msg = format!("worker {w} failed: {}", error_chain(&e));
            Err(Failed::Retry(reason, None, ApiError::upstream(msg)))
        }
        Ok(Ok((resp, first))) => match retry::for_status(resp.status()) {
            None => {
                state.outliers.progress(w);
                Ok(Answered { booking, resp, first })
            }
            Some(reason) => {
                let e = status_error(w, resp.status());
                Err(Failed::Retry(reason, Some(Box::new(Answered { booking, resp, first })), e))
            }
        },
    }
}

/// A worker's error answer as the client's error: its status, message and
/// `Retry-After`. `None` if its body does not arrive within a second or is too long.
async fn worker_error(worker: u64, resp: Response<Upstream>, first: Option<Frame<Bytes>>) -> Option<ApiError> {
    const ERROR_BYTES_MAX: usize = 64 << 10;
    let status = resp.status();
    let retry_after_s = retry::retry_after(resp.headers(), unix_now_s(), u64::MAX).map(|d| d.as_secs());
    let mut body = first.and_then(|f| f.into_data().ok()).map(Vec::from).unwrap_or_default();
    let collect = async {
        let mut up = resp.into_body();
        while let Some(f) = up.frame().await {
            body.extend_from_slice(&f.ok()?.into_data().unwrap_or_default());
            if body.len() > ERROR_BYTES_MAX {
                return None;
            }
        }
        Some(())
    };
    tokio::time::timeout(Duration::from_secs(1), collect).await.ok()??;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let message = v.pointer("/error/message").and_then(|m| m.as_str()).map(String::from);
    let mut e = status_error(worker, status);
    e.status = status;
    e.code = "upstream_error";
    e.message = message.unwrap_or_else(|| format!("worker {worker} answered {status}"));
    e.retry_after_s = retry_after_s.or(e.retry_after_s);
    Some(e)
}

/// The client's error when a retried status was the last thing a worker said and no
/// other worker could be tried.
fn status_error(worker: u64, status: http::StatusCode) -> ApiError {
    let mut e = ApiError::upstream(format!("worker {worker} answered {status}"));
    if status == http::StatusCode::TOO_MANY_REQUESTS {
        e.status = status;
        e.kind = "rate_limit_error";
        e.code = "upstream_rate_limited";
        e.retry_after_s = Some(1);
    }
    e
}

/// A try is abandoned: its booking is released, and the failure counts towards the
/// worker's ejection unless it was only a 429. A worker that could not be reached or
/// broke the connection loses the session's binding; one that answered (a 429, a 5xx)
/// or is only slow keeps it, since it is still available: this request alone goes
/// elsewhere.
pub(crate) fn give_up(state: &Arc<State>, booking: Booking, worker: u64, reason: RetryReason) {
    let why = match reason {
        RetryReason::Connect | RetryReason::Reset => DispatchFailure::Worker,
        _ => DispatchFailure::Refused,
    };
    let _ = booking.fail(why);
    if reason.counts_against_worker() {
        let kind = match reason {
            RetryReason::Connect => "connect",
            RetryReason::Reset => "request",
            RetryReason::Status5xx => "status_5xx",
            _ => "first_byte_timeout",
        };
        health::failure(state, worker, kind);
    }
}
