//! The route layer: a request admitted and parsed ([`Admitted`]) goes to its worker or
//! workers. It refuses new work once shutdown began, funds the retry budget, and takes
//! the path the model's pool names: split across a prefill and a decode worker
//! ([`crate::disagg`], which may still bypass to one worker) or one worker
//! ([`crate::aggregated`]). Both paths ask the core for their workers and share the try
//! layer ([`crate::tries`]) and the body layers ([`crate::body`]).
//!
//! [`Route`] is a `tower` [`Service`], so that layers can wrap it with no edit to the
//! handler above or the paths below. The tenant work's authentication and limits are
//! two such layers (`tower_layer::Layer<S>` for any `S: Service<Admitted>`): they go in
//! [`stack`], outermost first, and a refusal is an [`ApiError`] from `poll_ready` or from
//! their future. Today the stack is the route alone.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Response;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tower_service::Service;

use crate::body::ProxyBody;
use crate::disagg;
use crate::error::ApiError;
use crate::prepared::Prepared;
use crate::state::State;

/// A request past admission and parsing, on its way to a worker.
pub(crate) struct Admitted {
    /// The request, read and checked.
    pub p: Prepared,
    /// When it arrived (its deadline counts from here).
    pub arrived: Instant,
    /// Its slot of `concurrent_requests_max`, held until its body ends.
    pub permit: OwnedSemaphorePermit,
}

/// What the route layer and the layers around it answer.
pub(crate) type Reply = Result<Response<ProxyBody>, ApiError>;

/// The route layer. Always ready: the core's admission queue is its back-pressure. Its
/// future is boxed, as a `tower` service's must be named: one allocation per request.
#[derive(Clone)]
pub(crate) struct Route {
    state: Arc<State>,
}

impl Route {
    /// The route over `state`'s pools.
    pub(crate) fn new(state: Arc<State>) -> Self {
        Route { state }
    }
}

impl Service<Admitted> for Route {
    type Response = Response<ProxyBody>;
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Reply> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ApiError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, a: Admitted) -> Self::Future {
        let state = self.state.clone();
        Box::pin(async move { forward(&state, a).await })
    }
}

/// Calls `svc` once: waits until it is ready (a limit may refuse there), then sends
/// `req`. A service that is never called is never made to wait for.
pub(crate) async fn call<S: Service<R>, R>(mut svc: S, req: R) -> Result<S::Response, S::Error> {
    std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
    svc.call(req).await
}

/// Routes and forwards: split across a prefill and a decode worker when the model is
/// disaggregated, else to one worker.
async fn forward(state: &Arc<State>, a: Admitted) -> Reply {
    let Admitted { p, arrived, permit } = a;
    if state.shutting_down() {
        return Err(ApiError::shutting_down());
    }
    state.budget.deposit();
    match disagg::protocol(&p) {
        // Boxed: the split path's future is nearly three times the aggregated one's
        // (about 25 KB against 9 KB), and Route's boxed future would be as large for
        // every request.
        Some(protocol) => Box::pin(disagg::forward(state, p, protocol, arrived, permit)).await,
        None => crate::aggregated::forward(state, p, arrived, permit).await,
    }
}

#[cfg(test)]
mod tests {
    use std::future::Ready;

    use super::*;

    /// A service that is ready after `pending` polls, or refuses with `refusal`, and
    /// echoes what it is called with.
    struct Gate {
        pending: u32,
        refusal: Option<&'static str>,
        calls: u32,
    }

    impl Service<u32> for &mut Gate {
        type Response = u32;
        type Error = &'static str;
        type Future = Ready<Result<u32, &'static str>>;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), &'static str>> {
            if let Some(r) = self.refusal {
                return Poll::Ready(Err(r));
            }
            if self.pending > 0 {
                self.pending -= 1;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: u32) -> Self::Future {
            self.calls += 1;
            std::future::ready(Ok(req))
        }
    }

    #[track_caller]
    fn check(pending: u32, refusal: Option<&'static str>, want: Result<u32, &'static str>, calls_want: u32) {
        let mut gate = Gate { pending, refusal, calls: 0 };
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(rt.block_on(call(&mut gate, 7)), want);
        assert_eq!(gate.calls, calls_want);
    }

    #[test]
    fn a_layer_is_called_once_it_is_ready_and_never_after_a_refusal() {
        check(0, None, Ok(7), 1);
        check(3, None, Ok(7), 1);
        check(0, Some("over the tenant's limit"), Err("over the tenant's limit"), 0);
    }
}
