//! The tenant limits layer: a `tower` layer over the route that refuses a tenant's
//! request past its `requests_per_second`, `tokens_per_minute` or `concurrent_max` with
//! 429 `rate_limit_exceeded` and a `Retry-After` in seconds (the quotas themselves are
//! `quota.rs`).
//!
//! A request is charged its prompt tokens plus its output limit
//! (`max_completion_tokens`, else `max_tokens`) on admission; a request larger than the
//! whole minute is charged the whole minute, so it waits for a full bucket instead of
//! never running. The charge is trued up to what the response used when its body ends
//! (`quota::Hold`); an error answer keeps the prompt's share. The concurrency slot is
//! held by the response body and freed when it ends or is dropped (a client gone, an
//! error): no exit path keeps it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::time::Instant;
use tower_service::Service;

use crate::body::ProxyBody;
use crate::error::ApiError;
use crate::quota::rate_limited;
use crate::route::{Admitted, Reply, Route};
use crate::state::State;

/// The limits layer over `S`: refuses a tenant's request past its limits, else calls `S`
/// and holds the tenant's concurrency slot until the response body ends.
#[derive(Clone)]
pub(crate) struct Limits<S> {
    pub(crate) inner: S,
    pub(crate) state: Arc<crate::state::State>,
}

impl<S> Service<Admitted> for Limits<S>
where
    S: Service<Admitted, Response = http::Response<ProxyBody>, Error = ApiError>,
    S::Future: Send + 'static,
{
    type Response = http::Response<ProxyBody>;
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Reply> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ApiError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, a: Admitted) -> Self::Future {
        let state = &self.state;
        let tenant = match state.tenants.is_empty() {
            true => None,
            false => state.tenants.get(a.p.request.tenant),
        };
        let Some(tenant) = tenant else { return Box::pin(self.inner.call(a)) };
        let prompt = u64::from(a.p.request.isl_tokens);
        let output = a.p.shape.max_output_tokens.unwrap_or(0);
        let tokens = prompt.saturating_add(output);
        match state.limits.admit(usize::from(tenant.id.0), prompt, tokens, Instant::now()) {
            Err((over, s)) => {
                state.metrics.tenant_rejected(&tenant.name, over.label());
                let e = rate_limited(&tenant.name, over, s);
                Box::pin(std::future::ready(Err(e)))
            }
            Ok(hold) => {
                if let Some(s) = state.limits.series(tenant.id) {
                    s.prompt_tokens.inc_by(prompt);
                }
                let fut = self.inner.call(a);
                Box::pin(async move {
                    let resp = match fut.await {
                        Ok(resp) => resp,
                        Err(e) => {
                            hold.failed();
                            return Err(e);
                        }
                    };
                    Ok(match hold.is_empty() {
                        true => resp,
                        false => resp.map(|b| ProxyBody::Held(Box::new(b), hold)),
                    })
                })
            }
        }
    }
}

/// The services between admission and the route, outermost first: the tenant limits
/// over [`Route`]. Authentication comes before the body is read (`auth.rs`), so it is
/// not a layer here.
pub(crate) fn stack(state: &Arc<State>) -> Limits<Route> {
    Limits { inner: Route::new(state.clone()), state: state.clone() }
}
