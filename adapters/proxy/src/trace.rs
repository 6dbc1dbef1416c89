//! The proxy's spans, when `[tracing]` is on (see [`kvroute_frontend::otel`]).
//!
//! A proxied request gets `kvroute.request` (server kind, opened on arrival) and, when
//! sampled, the children `parse`, `tokenize`, `queue_wait` (zero long when the decision
//! was immediate), `route` (the chosen worker, its overlap and cost) and one `upstream`
//! per try (client kind; its `first_byte` event marks the head and, for a stream, the
//! first frame). The worker's `traceparent` names the try's `upstream` span, or the
//! request span when the request is not sampled (flag `00`).
//!
//! The body is streamed after the handler returns, so the request span and the
//! answering try's `upstream` span ride with it ([`Traced`]) and end when the stream
//! ends or the client goes away. The try's span travels from the `tries` module to
//! [`finish`] in the response's extensions ([`TrySpan`]), which any path building the
//! client's response from the worker's head keeps.
//!
//! A migrated stream's continuations get `route` and `upstream` spans of their own
//! through the same tries, but such an `upstream` span ends when its head arrives, not
//! with its stream. A disaggregated request's tries are `prefill` and `decode` spans
//! instead (client kind, one per try of each leg, each worker's `traceparent` naming
//! its own): a prefill span ends with the prefill's answer, and the answering decode
//! span with the stream, as an `upstream` span does.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body::{Body, Frame, SizeHint};
use kvroute_driver::Booking;
use kvroute_frontend::otel::{wall, ChildSpan, KeyValue, RequestTrace, SpanKind};
use tokio::time::Instant;

use crate::state::State;

/// The `upstream` span of the try whose answer goes to the client.
#[derive(Clone)]
pub(crate) struct TrySpan(pub Arc<ChildSpan>);

/// The request's trace: `None` when tracing is off, or when the client sent no trace
/// and `start_traces` is off.
pub(crate) fn open(state: &State, headers: &HeaderMap, arrived: Instant) -> Option<RequestTrace> {
    state.tracing.as_ref()?.request(headers, wall(arrived))
}

/// `parse` from `start` to `parsed`, then `tokenize` until now.
pub(crate) fn stages(trace: Option<&RequestTrace>, start: Instant, parsed: Instant) {
    let Some(t) = trace.filter(|t| t.sampled()) else { return };
    let parsed = wall(parsed);
    t.stage("parse", wall(start), parsed, Vec::new());
    t.stage("tokenize", parsed, SystemTime::now(), Vec::new());
}

/// `queue_wait` and `route` of a decision asked for at `asked`: the chosen worker, its
/// overlap and (when the policy scores) its cost.
pub(crate) fn routed(trace: Option<&RequestTrace>, asked: Instant, booking: &Booking, attempt: u32) {
    let Some(t) = trace.filter(|t| t.sampled()) else { return };
    let (start, end) = (wall(asked), SystemTime::now());
    t.stage("queue_wait", if booking.waited() { start } else { end }, end, Vec::new());
    let r = booking.routed();
    let mut attrs = vec![
        KeyValue::new("kvroute.worker.id", r.target.worker.0 as i64),
        KeyValue::new("kvroute.worker.dp_rank", i64::from(r.target.rank.0)),
        KeyValue::new("kvroute.overlap_blocks", i64::from(r.overlap.raw())),
        KeyValue::new("kvroute.request_blocks", i64::from(r.request_blocks)),
        KeyValue::new("kvroute.max_overlap_blocks", i64::from(r.max_overlap_blocks)),
        KeyValue::new("kvroute.queued", booking.waited()),
        KeyValue::new("kvroute.attempt", i64::from(attempt)),
    ];
    let cost = r.explanation.iter().find(|row| row.key == r.target).and_then(|row| row.score.as_ref());
    if let Some(s) = cost {
        attrs.push(KeyValue::new("kvroute.cost", s.cost));
    }
    t.stage("route", start, end, attrs);
}

/// The span of one try on `worker`, if the request is sampled: `upstream`, or for a
/// disaggregated request its leg's (`prefill`, `decode`). Its context goes into `up`,
/// replacing the request span's, so that the worker's own spans hang under this try.
pub(crate) fn try_span<B>(
    trace: Option<&RequestTrace>,
    name: &'static str,
    worker: u64,
    up: &mut http::Request<B>,
) -> Option<ChildSpan> {
    let span = trace?.child(name, SpanKind::Client, SystemTime::now())?;
    span.set(KeyValue::new("kvroute.worker.id", worker as i64));
    span.inject(up.headers_mut());
    Some(span)
}

/// Hands the span of the try whose answer goes to the client to [`finish`], which ends
/// it with the stream.
pub(crate) fn ride_along<B>(resp: &mut Response<B>, span: Option<ChildSpan>) {
    if let Some(s) = span {
        resp.extensions_mut().insert(TrySpan(Arc::new(s)));
    }
}

/// How a try's wait for its head ended, for [`try_answered`]: the head's status, or why
/// none came.
pub(crate) fn head_of<T, E: std::fmt::Display>(
    sent: &Result<Result<T, E>, tokio::time::error::Elapsed>,
    status: impl FnOnce(&T) -> u16,
) -> Result<u16, String> {
    match sent {
        Err(_) => Err("no first byte within the try's time".into()),
        Ok(Err(e)) => Err(format!("the worker failed: {e}")),
        Ok(Ok(t)) => Ok(status(t)),
    }
}

/// A try's head (for a stream, with its first frame) arrived with a status: the
/// `first_byte` event, the status, and a failure from 500 on; or the try failed before.
pub(crate) fn try_answered(span: &ChildSpan, head: Result<u16, String>) {
    match head {
        Err(why) => span.fail(why),
        Ok(status) => {
            span.event("first_byte", Vec::new());
            span.set(KeyValue::new("http.response.status_code", i64::from(status)));
            if status >= 500 {
                span.fail(format!("status {status}"));
            }
        }
    }
}

/// The request is answered: the request span gets the pool, its policy and the status,
/// and ends with the body (with the answering try's `upstream` span).
pub(crate) fn finish<B>(state: &State, trace: RequestTrace, model: &str, mut resp: Response<B>) -> Response<Traced<B>> {
    let upstream = resp.extensions_mut().remove::<TrySpan>();
    let status = resp.status().as_u16();
    if trace.sampled() {
        let mode = state.cfg.models.iter().find(|m| m.name == model).and_then(|m| m.mode);
        trace.set(KeyValue::new("kvroute.model", model.to_string()));
        trace.set(KeyValue::new("kvroute.policy", mode.unwrap_or(state.cfg.router.mode).as_str()));
    }
    resp.map(|inner| Traced { inner, request: trace, upstream, status, ended: false })
}

/// A response body that ends the request's spans when it ends or is dropped.
pub struct Traced<B> {
    inner: B,
    request: RequestTrace,
    upstream: Option<TrySpan>,
    status: u16,
    ended: bool,
}

impl<B> Traced<B> {
    fn end(&mut self, broken: Option<&dyn std::fmt::Display>) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        if let Some(u) = self.upstream.take() {
            if let Some(e) = broken {
                u.0.fail(e.to_string());
            }
            u.0.end();
        }
        self.request.end(self.status);
    }
}

impl<B: Body<Data = Bytes> + Unpin> Traced<B>
where
    B::Error: std::fmt::Display,
{
    pub(crate) fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    pub(crate) fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }

    pub(crate) fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.end(None),
            Poll::Ready(Some(Err(e))) => self.end(Some(e)),
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.end(None),
            _ => {}
        }
        polled
    }
}

impl<B> Drop for Traced<B> {
    fn drop(&mut self) {
        self.end(None);
    }
}
