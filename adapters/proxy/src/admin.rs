//! The proxy's own endpoints: `/v1/models`, `/health`, `/ready`, `/metrics`, and the
//! trusted admin API (`/workers`, `/route/preview`).

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use router_core::Health;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::body::ProxyBody;
use crate::config::WorkerConfig;
use crate::drain::{forget, readmit};
use crate::error::{json_response, ApiError};
use crate::events::StreamReport;
use crate::handler;
use crate::state::State;

/// Largest admin request body.
const ADMIN_BODY_BYTES_MAX: usize = 64 << 10;

/// `GET /health`: the process is up.
pub fn health() -> Response<ProxyBody> {
    json_response(StatusCode::OK, &json!({"status": "ok"}))
}

/// `GET /ready`: at least one healthy worker in some pool.
pub fn ready(state: &State) -> Response<ProxyBody> {
    let healthy: usize = state
        .fleet
        .pools()
        .map(|p| p.driver.with_router(|r| r.snapshot().workers.iter().filter(|w| w.health == Health::Healthy).count()))
        .sum();
    let status = if healthy > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let mut body = json!({"ready": healthy > 0, "healthy_workers": healthy});
    // A replica that lost NATS still serves, on local load only: ready, but it says so.
    if let Some(nats) = state.nats_status() {
        body["nats"] = json!(nats);
    }
    json_response(status, &body)
}

/// `GET /metrics`: the Prometheus text exposition, with the KV-event streams' counters
/// asked of the events runner first.
pub async fn metrics(state: &State) -> Response<ProxyBody> {
    let rows = state.subs.lock().await.ingest_rows().await;
    state.metrics.set_ingest(rows);
    let mut resp = Response::new(ProxyBody::full(state.metrics.encode()));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(prometheus_client::encoding::prometheus_text::CONTENT_TYPE));
    resp
}

/// `GET /v1/models`: what `caller`'s tenant may use, from the cached listing
/// ([`crate::models`]).
pub async fn models(state: &Arc<State>, caller: Option<&Caller>) -> Response<ProxyBody> {
    let all = state.models.all(&state.fleet, &state.client).await;
    json_response(StatusCode::OK, &crate::models::visible(&all, &state.fleet, tenant_of(state, caller)))
}

/// `GET /v1/models/{id}`: one entry of the listing, or 404 when it is not there or
/// not for `caller`'s tenant.
pub async fn model(state: &Arc<State>, caller: Option<&Caller>, id: &str) -> Result<Response<ProxyBody>, ApiError> {
    let all = state.models.all(&state.fleet, &state.client).await;
    match all.get(id) {
        Some(v) if crate::models::may_see(&state.fleet, tenant_of(state, caller), id, v) => {
            Ok(json_response(StatusCode::OK, v))
        }
        _ => Err(ApiError::model_not_found(id)),
    }
}

fn tenant_of<'a>(state: &'a State, caller: Option<&Caller>) -> Option<&'a kvroute_frontend::tenants::Tenant> {
    caller.and_then(Caller::tenant).and_then(|id| state.tenants.get(id))
}

/// `GET /workers`: every worker with its health, per-rank load and KV-event streams,
/// and every pool.
pub async fn workers(state: &State) -> Response<ProxyBody> {
    let served = state.metrics.served_totals();
    let subs = state.subs.lock().await;
    let mut workers = Vec::new();
    let mut pools = Vec::new();
    for p in state.fleet.pools() {
        let s = p.driver.snapshot();
        // Without a tokenizer, a worker's KV events match the router's fallback tokens
        // only if it tokenizes the same way (a sim-worker does, a real engine does not).
        let no_tokenizer = state.cfg.models.iter().any(|m| m.name == p.name && m.tokenizer.is_none());
        for w in &s.workers {
            let id = w.spec.id.0;
            // The listing awaits below, so a worker may be removed after the snapshot.
            let Some(cfg) = state.fleet.worker(id) else { continue };
            let keys: Vec<Value> = w
                .keys
                .iter()
                .map(|k| {
                    json!({
                        "rank": k.key.rank.0,
                        "active_prefill_tokens": k.load.active_prefill_tokens,
                        "active_decode_blocks": k.load.active_decode_blocks,
                        "active_requests": k.load.active_requests,
                        "index_entries": k.index_entries,
                        "fleet": {
                            "active_prefill_tokens": k.fleet_load.active_prefill_tokens,
                            "active_decode_blocks": k.fleet_load.active_decode_blocks,
                            "active_requests": k.fleet_load.active_requests,
                        },
                    })
                })
                .collect();
            workers.push(json!({
                "id": id,
                "url": cfg.url.to_string(),
                "model": p.name,
                "role": w.spec.role.as_str(),
                "health": w.health.as_str(),
                "in_flight": crate::drain::in_flight(state, id),
                "outlier": state.outliers.view(id),
                "publishes_events": w.publishes_events,
                "tokenizer_missing": no_tokenizer && cfg.kv_events.is_some(),
                // `null` until checked (see `kvroute_frontend::agree`).
                "tokenizer_check": state.fleet.verdicts().get(id).map(|v| v.label()),
                "kv_events": kv_events_json(&subs.report(id, served.get(&id).copied().unwrap_or(0)).await),
                "ranks": keys,
                // Apart from `ranks`, which says what the worker holds: this grows with traffic.
                "learned": w.keys.iter().map(|k| crate::learn::learned_json(p.driver.learned(k.key))).collect::<Vec<_>>(),
            }));
        }
        pools.push(json!({
            "model": p.name,
            "tokenizer": !no_tokenizer,
            "queue_depth": s.queue_depth,
            "requests_in_flight": s.requests_in_flight,
            "waiters": s.driver.waiters,
            "affinity_sessions": s.affinity_sessions,
            "affinity_live_leases": s.affinity_live_leases,
            "active_requests": s.load_total.active_requests,
            "active_prefill_tokens": s.load_total.active_prefill_tokens,
            "dispatched": s.router.dispatched,
            "rejected": s.router.rejected,
            "timed_out": s.router.timed_out,
        }));
    }
    let scrapes = &state.scrapes;
    let engine_scrapes = json!({
        "ok": scrapes.ok.load(std::sync::atomic::Ordering::Relaxed),
        "dropped": scrapes.dropped.load(std::sync::atomic::Ordering::Relaxed),
    });
    json_response(StatusCode::OK, &json!({"workers": workers, "pools": pools, "engine_scrapes": engine_scrapes}))
}

/// A worker's event streams: `null` without a subscription, else one row per rank.
fn kv_events_json(streams: &[StreamReport]) -> Value {
    if streams.is_empty() {
        return Value::Null;
    }
    let rows: Vec<Value> = streams
        .iter()
        .map(|r| {
            let s = r.status.as_ref();
            json!({
                "rank": r.rank,
                "endpoint": r.endpoint,
                "replay_endpoint": r.replay_endpoint,
                "connected": s.is_some_and(|s| s.connected),
                "silent": r.silent,
                "trusted": s.is_some_and(|s| s.trusted),
                "last_message_age_ms": r.last_message_age_ms,
                "last_seq": s.and_then(|s| s.last_seq),
                "events_applied": s.map(|s| s.events_applied),
                "events_dropped": s.map(|s| s.events_dropped),
                "batches_applied": s.map(|s| s.batches_applied),
                "batches_malformed": s.map(|s| s.batches_malformed),
                "gaps": s.map(|s| s.seq.gaps),
                "replays_completed": s.map(|s| s.seq.replays_completed),
                "replays_failed": s.map(|s| s.seq.replays_failed),
                "config_error": s.and_then(|s| s.config_error.as_ref()).map(|e| e.to_string()),
            })
        })
        .collect();
    json!({"streams": rows})
}

/// `POST /workers`: add or replace a worker (a [`WorkerConfig`] as JSON).
pub async fn add_worker(state: &State, req: http::Request<Incoming>) -> Result<Response<ProxyBody>, ApiError> {
    let body = Limited::new(req.into_body(), ADMIN_BODY_BYTES_MAX)
        .collect()
        .await
        .map_err(|_| ApiError::too_large(ADMIN_BODY_BYTES_MAX as u64))?
        .to_bytes();
    let w: WorkerConfig =
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("invalid worker: {e}")))?;
    state.cfg.check_worker(&w).map_err(|(k, m)| ApiError::bad_request(format!("{k}: {m}")))?;
    let shown = serde_json::to_value(&w).unwrap_or(Value::Null);
    let new = state.fleet.add_worker(w.clone()).map_err(|e| ApiError::bad_request(e.to_string()))?;
    readmit(state, &w);
    // Subscriptions follow registration: a replaced worker's stream is re-opened.
    state
        .subs
        .lock()
        .await
        .add(&state.cfg, &state.fleet, &w)
        .await
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(json_response(if new { StatusCode::CREATED } else { StatusCode::OK }, &shown))
}

/// `DELETE /workers/{id}`: remove a worker; its sessions re-bind elsewhere and its
/// in-flight streams run to completion.
pub async fn remove_worker(state: &State, id: &str) -> Result<Response<ProxyBody>, ApiError> {
    let id: u64 = id.parse().map_err(|_| ApiError::bad_request(format!("{id:?} is not a worker id")))?;
    if !state.fleet.remove_worker(id) {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            code: "worker_not_found",
            ..ApiError::bad_request(format!("no worker {id}"))
        });
    }
    forget(state, id).await;
    let mut resp = Response::new(ProxyBody::full(Bytes::new()));
    *resp.status_mut() = StatusCode::NO_CONTENT;
    Ok(resp)
}

/// `POST /route/preview`: the decision for a request body, with the per-worker
/// explanation, changing nothing.
pub async fn preview(
    state: &Arc<State>,
    peer: SocketAddr,
    req: http::Request<Incoming>,
    caller: crate::auth::Caller,
) -> Result<Response<ProxyBody>, ApiError> {
    let mut model = String::new();
    let p = handler::prepare(state, peer, req, None, caller, &mut model).await?;
    handler::preview(state, p)
}

//END
