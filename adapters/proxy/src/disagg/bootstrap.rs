//! SGLang's bootstrap protocol: prefill and decode at once, paired by a room number.
//!
//! Both workers get the same request with `bootstrap_host` and `bootstrap_port` (the
//! prefill worker's bootstrap server) and a random `bootstrap_room`; the decode worker
//! finds the prefill's KV through that room. The proxy streams the decode answer and
//! reads the prefill answer only for its status.
//!
//! The decode answer is passed on only once the prefill answered successfully: the
//! decode cannot produce a token before the prefill's KV arrived anyway, and holding its
//! headers that long means a prefill that fails at any point is caught while the client
//! has seen nothing. Then the decode request is aborted (its connection closed, its
//! booking released without blaming the decode worker) and the pair is retried with
//! another prefill worker, within the retry budget. The other way round, a decode
//! worker that fails aborts the prefill. Either side failing before the client's first
//! byte (by the rules of [`crate::retry`]: no connection, a reset, a 5xx, a 429, no head
//! within its first-byte timeout) retries the pair with a new room and another worker
//! on the failed side, with the same budget, backoff and `Retry-After` as an
//! aggregated request.
//!
//! A decode worker whose prefill failed often answers with an error of its own, which
//! can arrive before the proxy hears from the prefill. So an error answer from the
//! decode waits up to [`PREFILL_VERDICT_WAIT_MS`] for the prefill's verdict: a failed
//! prefill is blamed and retried, otherwise the decode's answer goes to the client.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::upstream::Upstream;
use http::Response;
use router_core::{Phase, WorkerId};
use serde_json::{json, Map, Value};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::phase::{
    book, decode_request, edited_body, phase_request, prefill_limit, retryable_answer, run_prefill, PrefillEnd, Retry,
};
use crate::body::respond;
use crate::body::ProxyBody;
use crate::config::{WorkerConfig, WorkerUrl};
use crate::error::ApiError;
use crate::prepared::{error_chain, upstream_request, Prepared};
use crate::retry::{self, RetryReason};
use crate::state::State;
use crate::stream::Respond;
use crate::tries;

/// How long an error answer from the decode worker waits for its prefill's verdict.
pub const PREFILL_VERDICT_WAIT_MS: u64 = 1_000;

/// How one paired attempt ended.
enum Paired {
    /// The prefill ran and the decode worker answered (maybe with an error of its own).
    Decode(Response<Upstream>),
    /// The decode worker answered with an error while its prefill had not finished.
    DecodeRefused(Response<Upstream>),
    /// The prefill worker refused the request as the client's mistake.
    Refused(Response<ProxyBody>),
    /// The prefill worker failed.
    PrefillFailed { err: ApiError, cause: &'static str, reason: RetryReason, after: Option<Duration> },
    /// The decode request failed before any answer.
    DecodeFailed { err: ApiError, reason: RetryReason },
}

/// Prefill and decode at once; streams the decode's answer.
pub(super) async fn forward(
    state: &Arc<State>,
    p: Prepared,
    arrived: Instant,
    deadline: Instant,
    permit: OwnedSemaphorePermit,
) -> Result<Response<ProxyBody>, ApiError> {
    let model = p.pool.name.as_str();
    let mut pre = phase_request(&p.request, Phase::Prefill);
    let (mut retry_pre, mut retry_dec) = (Retry::new(), Retry::new());
    let shape = p.shape;
    // The decode waits for the whole prompt's KV before its first token.
    let dec_limit = retry::try_limit(&state.cfg.retry, shape, p.request.isl_tokens);
    loop {
        let (pre_booking, pre_worker) = book(state, &p.pool, &mut pre, &mut retry_pre, deadline).await?;
        let mut dec = decode_request(&p.request, &p.pool, &pre_worker);
        let (dec_booking, dec_worker) = book(state, &p.pool, &mut dec, &mut retry_dec, deadline).await?;
        // A u63, as SGLang draws it.
        let room = p.pool.driver.draw().next_u64() >> 1;
        let body = edited_body(&p, |o| bootstrap_fields(o, &pre_worker, room))?;
        let up_pre = upstream_request(state, &pre_worker, pre_booking.target(), &p, body.clone())?;
        let mut up_dec = upstream_request(state, &dec_worker, dec_booking.target(), &p, body)?;
        let dec_span = crate::trace::try_span(p.trace.as_ref(), "decode", dec_worker.id, &mut up_dec);
        let pre_limit = prefill_limit(state, &p.pool, &pre_booking, p.request.isl_tokens);
        let prefill = run_prefill(state, &p, &pre_worker, pre_booking, up_pre, pre_limit);
        let decode = async {
            let sent = std::pin::pin!(state.client.send(up_dec));
            // The decode's first byte waits for the prefill: a stalled prefill is blamed
            // by its own timeout, which comes first.
            let (limit, by) = (dec_limit.map(|l| pre_limit + l), tries::bounded_by_caller());
            let Some((sent, _)) = tries::wait_first_byte(state, model, dec_worker.id, (limit, by), sent, false).await
            else {
                return Err((RetryReason::Ejected, "ejected before its first byte".into()));
            };
            if let Some(s) = &dec_span {
                crate::trace::try_answered(s, crate::trace::head_of(&sent, |r| r.status().as_u16()));
            }
            match sent {
                Ok(Ok(resp)) => {
                    state.outliers.head(dec_worker.id, resp.status());
                    Ok(resp)
                }
                Ok(Err(e)) if e.is_connect() => Err((RetryReason::Connect, error_chain(&e))),
                Ok(Err(e)) => Err((RetryReason::Reset, error_chain(&e))),
                Err(_) => Err((RetryReason::FirstByteTimeout, "no byte within its first-byte timeout".into())),
            }
        };
        let paired = match tokio::time::timeout_at(deadline, pair(prefill, decode)).await {
            Err(_) => return Err(ApiError::timeout()),
            Ok(p) => p,
        };
        let ctx = Respond { model, arrived, deadline, prefill_worker: Some(pre_worker.id) };
        let dec_id = WorkerId(dec_worker.id);
        match paired {
            Paired::Decode(resp) | Paired::DecodeRefused(resp) if retryable(state, &resp, &mut retry_dec) => {
                let (reason, after) = retryable_answer(state, &resp).unwrap_or((RetryReason::Status5xx, None));
                tries::give_up(state, dec_booking, dec_worker.id, reason);
                state.metrics.disagg_abort(model, "prefill", reason.as_str());
                retry_dec.record(
                    dec_id,
                    ApiError::upstream(format!("decode worker {} answered {}", dec_worker.id, resp.status())),
                );
                if !retry_dec.backoff(state, &p.pool, reason, after, deadline).await {
                    return Err(retry_dec.into_err());
                }
            }
            Paired::Decode(mut resp) => {
                crate::trace::ride_along(&mut resp, dec_span);
                return Ok(respond(state, resp, dec_booking, ctx, permit));
            }
            Paired::DecodeRefused(mut resp) => {
                state.metrics.disagg_abort(model, "prefill", "status");
                crate::trace::ride_along(&mut resp, dec_span);
                return Ok(respond(state, resp, dec_booking, ctx, permit));
            }
            Paired::Refused(resp) => {
                state.metrics.disagg_abort(model, "decode", "refused");
                return Ok(resp);
            }
            Paired::PrefillFailed { err, cause, reason, after } => {
                // Dropping the booking cancels it: the decode worker did nothing wrong.
                drop(dec_booking);
                state.metrics.disagg_abort(model, "decode", cause);
                let why = Some((reason, after));
                if !retry_pre.failed(state, &p.pool, WorkerId(pre_worker.id), err, why, deadline).await {
                    return Err(retry_pre.into_err());
                }
            }
            Paired::DecodeFailed { err, reason } => {
                tries::give_up(state, dec_booking, dec_worker.id, reason);
                let cause = if reason == RetryReason::Reset { "request" } else { reason.as_str() };
                state.metrics.disagg_abort(model, "prefill", cause);
                if !retry_dec.failed(state, &p.pool, dec_id, err, Some((reason, None)), deadline).await {
                    return Err(retry_dec.into_err());
                }
            }
        }
    }
}

/// Whether a decode answer is a retryable status and a retry is left (which this takes).
fn retryable(state: &State, resp: &Response<Upstream>, retry: &mut Retry) -> bool {
    retryable_answer(state, resp).is_some() && retry.may_retry(state)
}

/// Drives both requests until the prefill's verdict and the decode's answer are in, or
/// one side fails. Whatever is still running when this returns is dropped: its
/// connection closes and its booking is released.
async fn pair(
    prefill: impl Future<Output = PrefillEnd>,
    decode: impl Future<Output = Result<Response<Upstream>, (RetryReason, String)>>,
) -> Paired {
    tokio::pin!(prefill, decode);
    let mut answered: Option<Response<Upstream>> = None;
    let mut verdict_by: Option<Instant> = None;
    let decode_failed = |(reason, message): (RetryReason, String)| Paired::DecodeFailed {
        err: ApiError::upstream(format!("decode worker failed: {message}")),
        reason,
    };
    loop {
        let wait = async {
            match verdict_by {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            end = &mut prefill => {
                return match end {
                    PrefillEnd::Done(_) => match answered {
                        Some(resp) => Paired::Decode(resp),
                        None => match (&mut decode).await {
                            Ok(resp) => Paired::Decode(resp),
                            Err(e) => decode_failed(e),
                        },
                    },
                    PrefillEnd::Refused(resp) => Paired::Refused(resp.map(ProxyBody::full)),
                    PrefillEnd::Failed { err, cause, reason, after } => {
                        Paired::PrefillFailed { err, cause, reason, after }
                    }
                };
            }
            got = &mut decode, if answered.is_none() => match got {
                Err(e) => return decode_failed(e),
                Ok(resp) => {
                    if !resp.status().is_success() {
                        verdict_by = Some(Instant::now() + Duration::from_millis(PREFILL_VERDICT_WAIT_MS));
                    }
                    answered = Some(resp);
                }
            },
            () = wait => {
                if let Some(resp) = answered.take() {
                    return Paired::DecodeRefused(resp);
                }
            }
        }
    }
}

/// Where the decode worker finds the prefill's KV: the prefill worker's bootstrap
/// server, and the room of this request.
fn bootstrap_fields(o: &mut Map<String, Value>, prefill: &WorkerConfig, room: u64) {
    o.insert("bootstrap_host".into(), json!(bootstrap_host(&prefill.url)));
    // Checked at registration: prefill workers of a bootstrap model name their port.
    o.insert("bootstrap_port".into(), json!(prefill.bootstrap_port));
    o.insert("bootstrap_room".into(), json!(room));
}

/// The host of a worker's URL, without IPv6 brackets.
fn bootstrap_host(url: &WorkerUrl) -> String {
    let authority = url.authority();
    let host = match authority.parse::<http::uri::Authority>() {
        Ok(a) => a.host().to_string(),
        Err(_) => authority.to_string(),
    };
    host.trim_start_matches('[').trim_end_matches(']').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(url: &str, want: &str) {
        let url: WorkerUrl = url.parse().unwrap();
        assert_eq!(bootstrap_host(&url), want);
    }

    #[test]
    fn the_bootstrap_host_is_the_prefill_workers_host() {
        check("http://10.0.0.5:8000", "10.0.0.5");
        check("http://prefill-3.local:8000/v1", "prefill-3.local");
        check("http://[::1]:8000", "::1");
        check("http://gpu7", "gpu7");
    }
}
