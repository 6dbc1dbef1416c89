//! vLLM's NIXL protocol: prefill first, then decode with what the prefill returned.
//!
//! 1. The prefill worker gets the request as a one-token, non-streaming completion
//!    asking it to keep the KV for a remote decode (`kv_transfer_params` with
//!    `do_remote_decode: true`, the other fields null, as vLLM's own disaggregation
//!    proxy sends them). A failure here is retried on another prefill worker: the
//!    client has seen nothing yet.
//! 2. Its answer's `kv_transfer_params` (where and which blocks to pull) go into the
//!    original request, which the decode worker streams back to the client. A decode
//!    worker that fails before its first byte (by the rules of [`crate::retry`]: no
//!    connection, a reset, a 5xx, a 429, no head within its first-byte timeout) is
//!    replaced by another one with the same transfer parameters; the prefilled KV stays
//!    where it is until some decode worker pulls it.
//!
//! The prefill booking ends when its answer arrives (the prefill worker's part is done);
//! the decode booking lives as long as the client's stream.

use std::sync::Arc;

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
use crate::config::WorkerConfig;
use crate::error::ApiError;
use crate::prepared::{error_chain, upstream_request, Prepared};
use crate::retry::{self, RetryReason};
use crate::state::State;
use crate::stream::Respond;
use crate::tries;

/// What the prefill step came to.
enum Prefilled {
    /// The KV waits on `worker`; `params` tell a decode worker how to pull it.
    Ready { worker: Arc<WorkerConfig>, params: Option<Value> },
    /// The prefill worker refused the request; this is the client's answer.
    Answer(Response<ProxyBody>),
}

/// Prefill on one worker, then decode on another, streaming the decode's answer.
pub(super) async fn forward(
    state: &Arc<State>,
    p: Prepared,
    arrived: Instant,
    deadline: Instant,
    permit: OwnedSemaphorePermit,
) -> Result<Response<ProxyBody>, ApiError> {
    let (prefill_worker, params) = match tokio::time::timeout_at(deadline, prefill(state, &p, deadline)).await {
        Err(_) => return Err(ApiError::timeout()),
        Ok(Err(e)) => return Err(e),
        Ok(Ok(Prefilled::Answer(resp))) => return Ok(resp),
        Ok(Ok(Prefilled::Ready { worker, params })) => (worker, params),
    };
    let mut req = decode_request(&p.request, &p.pool, &prefill_worker);
    let body = match params {
        Some(params) => edited_body(&p, |o| {
            o.insert("kv_transfer_params".into(), params);
        })?,
        // Without params the decode worker computes the prompt itself.
        None => p.forward_body.clone(),
    };
    let model = p.pool.name.as_str();
    let shape = p.shape;
    // The decode pulls the whole prompt's KV before its first token.
    let limit = retry::try_limit(&state.cfg.retry, shape, p.request.isl_tokens);
    let mut retry = Retry::new();
    loop {
        let (booking, worker) = book(state, &p.pool, &mut req, &mut retry, deadline).await?;
        let mut up = upstream_request(state, &worker, booking.target(), &p, body.clone())?;
        let span = crate::trace::try_span(p.trace.as_ref(), "decode", worker.id, &mut up);
        let send = std::pin::pin!(state.client.send(up));
        // Not watching for ejection, the wait always ends with an answer or a timeout.
        let Some((sent, by)) = tries::wait_first_byte(state, model, worker.id, (limit, deadline), send, false).await
        else {
            return Err(ApiError::upstream(format!("decode worker {} was ejected before it sent a byte", worker.id)));
        };
        if let Some(s) = &span {
            crate::trace::try_answered(s, crate::trace::head_of(&sent, |r| r.status().as_u16()));
        }
        let (reason, err) = match sent {
            Err(_) if by >= deadline => return Err(ApiError::timeout()),
            Err(_) => {
                let msg = format!("decode worker {} sent no byte within its first-byte timeout", worker.id);
                (RetryReason::FirstByteTimeout, ApiError::upstream(msg))
            }
            Ok(Ok(mut resp)) => match retryable_answer(state, &resp) {
                Some((reason, after)) if retry.may_retry(state) => {
                    tries::give_up(state, booking, worker.id, reason);
                    let err = ApiError::upstream(format!("decode worker {} answered {}", worker.id, resp.status()));
                    retry.record(WorkerId(worker.id), err);
                    if !retry.backoff(state, &p.pool, reason, after, deadline).await {
                        return Err(retry.into_err());
                    }
                    continue;
                }
                _ => {
                    // No retry left, or none needed: the answer goes to the client as it is.
                    state.outliers.head(worker.id, resp.status());
                    crate::trace::ride_along(&mut resp, span);
                    let ctx = Respond { model, arrived, deadline, prefill_worker: Some(prefill_worker.id) };
                    return Ok(respond(state, resp, booking, ctx, permit));
                }
            },
            Ok(Err(e)) => {
                let reason = if e.is_connect() { RetryReason::Connect } else { RetryReason::Reset };
                (reason, ApiError::upstream(format!("decode worker {} failed: {}", worker.id, error_chain(&e))))
            }
        };
        tries::give_up(state, booking, worker.id, reason);
        if !retry.failed(state, &p.pool, WorkerId(worker.id), err, Some((reason, None)), deadline).await {
            return Err(retry.into_err());
        }
    }
}

/// Runs the prefill on the first prefill worker that does not fail.
async fn prefill(state: &Arc<State>, p: &Prepared, deadline: Instant) -> Result<Prefilled, ApiError> {
    let body = edited_body(p, prefill_fields)?;
    let mut req = phase_request(&p.request, Phase::Prefill);
    let mut retry = Retry::new();
    loop {
        let (booking, worker) = book(state, &p.pool, &mut req, &mut retry, deadline).await?;
        let up = upstream_request(state, &worker, booking.target(), p, body.clone())?;
        let limit = prefill_limit(state, &p.pool, &booking, p.request.isl_tokens);
        match run_prefill(state, p, &worker, booking, up, limit).await {
            PrefillEnd::Done(answer) => return Ok(Prefilled::Ready { params: transfer_params(&answer), worker }),
            PrefillEnd::Refused(resp) => return Ok(Prefilled::Answer(resp.map(ProxyBody::full))),
            PrefillEnd::Failed { err, reason, after, .. } => {
                let why = Some((reason, after));
                if !retry.failed(state, &p.pool, WorkerId(worker.id), err, why, deadline).await {
                    return Err(retry.into_err());
                }
            }
        }
    }
}

/// The prefill request: one token, no stream, and the KV kept for a remote decode.
fn prefill_fields(o: &mut Map<String, Value>) {
    let params = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    });
    o.insert("kv_transfer_params".into(), params);
    o.insert("stream".into(), Value::Bool(false));
    o.insert("max_tokens".into(), json!(1));
    if o.contains_key("max_completion_tokens") {
        o.insert("max_completion_tokens".into(), json!(1));
    }
    // Options of a stream or of a longer output that a one-token answer cannot honour.
    for key in ["stream_options", "min_tokens", "min_completion_tokens"] {
        o.remove(key);
    }
}

/// The `kv_transfer_params` object of a prefill answer, if it has one.
fn transfer_params(answer: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(answer).ok()?;
    match v.get("kv_transfer_params") {
        Some(o @ Value::Object(_)) => Some(o.clone()),
        _ => {
            tracing::debug!("prefill answer carries no kv_transfer_params; decode computes the prompt");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(client: Value, want: Value) {
        let mut o = client.as_object().cloned().unwrap();
        prefill_fields(&mut o);
        assert_eq!(Value::Object(o), want);
    }

    #[test]
    fn the_prefill_request_asks_for_one_token_and_keeps_the_kv() {
        let kv = json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null});
        check(
            json!({"model": "m", "prompt": "p", "stream": true, "max_tokens": 90, "stream_options": {"include_usage": true}}),
            json!({"model": "m", "prompt": "p", "stream": false, "max_tokens": 1, "kv_transfer_params": kv}),
        );
        check(
            json!({"model": "m", "messages": [], "max_completion_tokens": 9, "min_tokens": 3, "kv_transfer_params": {"x": 1}}),
            json!({"model": "m", "messages": [], "stream": false, "max_tokens": 1, "max_completion_tokens": 1,
                "kv_transfer_params": kv}),
        );
    }

    #[test]
    fn transfer_params_come_from_the_answer_object() {
        let params = json!({"do_remote_prefill": true, "remote_block_ids": [0, 1]});
        let answer = json!({"choices": [], "kv_transfer_params": params}).to_string();
        assert_eq!(transfer_params(answer.as_bytes()), Some(params));
        assert_eq!(transfer_params(br#"{"kv_transfer_params": null}"#), None);
        assert_eq!(transfer_params(b"not json"), None);
    }
}
