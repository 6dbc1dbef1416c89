//! Disaggregated serving: one request split between a prefill worker, which computes
//! the prompt's KV cache, and a decode worker, which receives it and generates.
//!
//! For a model with a `disagg_protocol`, the router first plans the request
//! ([`kvroute_driver::Driver::plan_disagg`]): a prompt whose uncached part is short, or
//! a busy or empty prefill pool, runs aggregated on a decode worker (the bypass,
//! counted by reason in `kvroute_disagg_plans`). A request pinned to a prefill worker
//! (`x-prefill-worker-id`) is always split. A split request books each phase with the
//! router on its own, so pins, session bindings and load are per phase, and drives the
//! protocol the engines speak:
//!
//! * [`DisaggProtocol::VllmNixl`]: prefill, then decode with the prefill's
//!   `kv_transfer_params` (see the `nixl` module);
//! * [`DisaggProtocol::SglangBootstrap`]: both at once, paired by a bootstrap room (see
//!   the `bootstrap` module).
//!
//! Every booking is a [`kvroute_driver::Booking`] guard held by the future that uses
//! it, so a phase that fails, is aborted or whose client goes away releases its load,
//! lease and slot exactly once. Answers name the decode worker in `x-kvroute-worker`
//! and the prefill worker in `x-kvroute-prefill-worker`.
//!
//! With `disagg_same_label`, a decode pick is restricted to workers sharing that
//! topology label with the prefill worker (the core's eligibility does it).
//!
//! What it leaves to others: the KV transfer itself (the engines' business). Embeddings
//! are never split.

mod bootstrap;
mod nixl;
mod phase;

use std::sync::Arc;
use std::time::Duration;

use http::{Response, StatusCode};
use kvroute_frontend::ask::routed_json;
use router_core::{BypassReason, DisaggPlan, Phase};
use serde_json::{json, Value};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use crate::body::ProxyBody;
use crate::config::DisaggProtocol;
use crate::error::{json_response, ApiError};
use crate::prepared::Prepared;
use crate::request::Endpoint;
use crate::state::State;

pub use bootstrap::PREFILL_VERDICT_WAIT_MS;

pub use crate::upstream::PREFILL_WORKER_HEADER;

/// The protocol that splits `p`, if its model is disaggregated and it generates text.
pub fn protocol(p: &Prepared) -> Option<DisaggProtocol> {
    p.pool.disagg.filter(|_| matches!(p.endpoint, Endpoint::Chat | Endpoint::Completions))
}

/// Plans, counts and serves a request of a disaggregated model.
pub(crate) async fn forward(
    state: &Arc<State>,
    p: Prepared,
    protocol: DisaggProtocol,
    arrived: Instant,
    permit: OwnedSemaphorePermit,
) -> Result<Response<ProxyBody>, ApiError> {
    let plan = plan(&p, true);
    state.metrics.disagg_plan(&p.pool.name, plan_label(plan));
    let deadline = arrived + Duration::from_millis(state.cfg.limits.request_timeout_ms);
    match (plan, protocol) {
        (DisaggPlan::Bypass(_), _) => crate::aggregated::forward(state, p, arrived, permit).await,
        (DisaggPlan::Split, DisaggProtocol::VllmNixl) => nixl::forward(state, p, arrived, deadline, permit).await,
        (DisaggPlan::Split, DisaggProtocol::SglangBootstrap) => {
            bootstrap::forward(state, p, arrived, deadline, permit).await
        }
    }
}

/// The decisions the router would make now, changing nothing: for a split request the
/// decode pick at the top level (as `x-kvroute-worker` would name it) and the prefill
/// pick under `prefill`; for a bypass the aggregated pick. `disagg` says which and why.
pub fn preview(state: &State, p: Prepared, protocol: DisaggProtocol) -> Result<Response<ProxyBody>, ApiError> {
    let driver = &p.pool.driver;
    let (name, isl) = (p.pool.name.as_str(), p.request.isl_tokens);
    let pick =
        |r| driver.preview(r, driver.draw()).map_err(|e| ApiError::from_drive(&e, state.cfg.router.queue_timeout_ms));
    let plan = plan(&p, false);
    let mut out = match plan {
        DisaggPlan::Split => {
            let pre = pick(phase::phase_request(&p.request, Phase::Prefill))?;
            let dec = match state.fleet.worker(pre.target.worker.0) {
                Some(w) => phase::decode_request(&p.request, &p.pool, &w),
                None => phase::phase_request(&p.request, Phase::Decode),
            };
            let dec = pick(dec)?;
            let mut v = routed_json(name, isl, &dec);
            v["prefill"] = routed_json(name, isl, &pre);
            v
        }
        DisaggPlan::Bypass(_) => routed_json(name, isl, &pick(p.request.clone())?),
    };
    out["disagg"] = plan_json(protocol, plan);
    Ok(json_response(StatusCode::OK, &out))
}

/// Split or bypass. A pinned prefill worker is a request to split.
fn plan(p: &Prepared, count: bool) -> DisaggPlan {
    let driver = &p.pool.driver;
    if p.request.hints.prefill_worker_id.is_some() {
        DisaggPlan::Split
    } else if count {
        driver.plan_disagg(&p.request)
    } else {
        driver.plan_disagg_query(&p.request)
    }
}

/// The `plan` label of `kvroute_disagg_plans`.
fn plan_label(plan: DisaggPlan) -> &'static str {
    match plan {
        DisaggPlan::Split => "split",
        DisaggPlan::Bypass(r) => r.as_str(),
    }
}

fn plan_json(protocol: DisaggProtocol, plan: DisaggPlan) -> Value {
    let mut v = json!({"protocol": protocol.as_str(), "plan": plan_label(plan), "split": plan == DisaggPlan::Split});
    if let DisaggPlan::Bypass(BypassReason::ShortPrompt { effective_isl_tokens }) = plan {
        v["effective_isl_tokens"] = json!(effective_isl_tokens);
    }
    v
}
