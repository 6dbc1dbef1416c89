//! The aggregated path: one worker serves the whole request. Its tries go through the
//! try layer ([`crate::tries`]); a stream that may migrate is answered through the
//! migration layer ([`crate::migrate`]), any other answer through [`respond_first`].
//! A disaggregated model's bypass comes here too.

use std::sync::Arc;
use std::time::Duration;

use http::Response;
use router_core::WorkerId;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use crate::body::{respond_first, ProxyBody};
use crate::error::ApiError;
use crate::migrate::Plan;
use crate::prepared::{Bodies, Prepared};
use crate::state::State;
use crate::stream::Respond;
use crate::tries;

/// Routes `p.request` (whatever phase it names) and forwards it, retrying failures before
/// the first byte on workers not yet tried (see [`crate::retry`]); a stream that breaks
/// later is continued elsewhere when it can be (see [`crate::migrate`]).
pub(crate) async fn forward(
    state: &Arc<State>,
    p: Prepared,
    arrived: Instant,
    permit: OwnedSemaphorePermit,
) -> Result<Response<ProxyBody>, ApiError> {
    let deadline = arrived + Duration::from_millis(state.cfg.limits.request_timeout_ms);
    let pool = p.pool.clone();
    let plan = Plan::of(&p, &state.cfg.migration);
    let (json, text) =
        plan.as_ref().map_or_else(|| (p.json.clone(), p.forward_body.clone()), |m| m.first_body(&p.forward_body));
    let body = Bodies::with_ids(text, json, p.ids.clone());
    let mut shape = p.shape;
    shape.stream |= plan.is_some();
    let mut request = p.request.clone();
    let mut tried: Vec<WorkerId> = Vec::new();
    let tries = tries::Tries { state, pool: &pool, p: &p, body, path: None, deadline, shape };
    let a = tries::first_answer(&tries, &mut request, &mut tried).await?;
    let ctx = Respond { model: &pool.name, arrived, deadline, prefill_worker: None };
    match plan {
        // A worker that sent no token ids cannot be continued: its stream passes through.
        Some(plan) if a.resp.status().is_success() && plan.can_continue(a.first.as_ref()) => {
            let resp = crate::migrate::respond(state, a, plan, p, request, tried, ctx, permit);
            Ok(resp.map(|b| ProxyBody::Migrating(Box::new(b))))
        }
        _ => Ok(respond_first(state, a.resp, a.booking, ctx, permit, a.first)),
    }
}
