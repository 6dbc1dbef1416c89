//! The client's response: [`ProxyBody`], any body the proxy sends (its own answers, a
//! worker's stream passed through or migrating, each maybe traced), and the response
//! built from a worker's accepted answer (`respond`). This is the top of the body
//! layers: the stream, migration and trace bodies below it never name it.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use http::Response;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use kvroute_driver::Booking;
use tokio::sync::OwnedSemaphorePermit;

use crate::migrate::MigratingBody;
use crate::state::State;
use crate::stream::{idle_timeout, Respond};
use crate::trace::Traced;
use crate::upstream::{strip_hop_by_hop, Upstream, PREFILL_WORKER_HEADER, WORKER_HEADER};

pub use crate::stream::{BodyError, StreamCtx, UpstreamBody, COALESCE_BYTES_MAX};

/// Any response body the proxy sends.
pub enum ProxyBody {
    /// A complete body.
    Full(Full<Bytes>),
    /// A worker's response, streamed through.
    Stream(Box<UpstreamBody>),
    /// A worker's stream that may continue on another worker (see [`crate::migrate`]).
    Migrating(Box<MigratingBody>),
    /// Another body, whose end also ends the request's spans (see [`crate::trace`]).
    Traced(Box<Traced<ProxyBody>>),
    /// Another body holding a tenant's concurrency slot and token charge until it ends
    /// or is dropped, reading its usage on the way (see `crate::limits`).
    Held(Box<ProxyBody>, crate::quota::Hold),
}

impl ProxyBody {
    /// A complete body.
    pub fn full(b: impl Into<Bytes>) -> Self {
        ProxyBody::Full(Full::new(b.into()))
    }
}

impl From<Bytes> for ProxyBody {
    fn from(b: Bytes) -> Self {
        ProxyBody::full(b)
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            ProxyBody::Full(f) => Pin::new(f).poll_frame(cx).map_err(|never| match never {}),
            ProxyBody::Stream(s) => Pin::new(s.as_mut()).poll_frame(cx),
            ProxyBody::Migrating(m) => Pin::new(m.as_mut()).poll_frame(cx),
            ProxyBody::Traced(t) => t.poll_frame(cx),
            ProxyBody::Held(b, hold) => {
                let frame = Pin::new(b.as_mut()).poll_frame(cx);
                if let Poll::Ready(Some(Ok(f))) = &frame {
                    hold.observe(f.data_ref().map_or(&[][..], |d| &d[..]));
                }
                frame
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(f) => f.is_end_stream(),
            ProxyBody::Stream(s) => s.is_end_stream(),
            ProxyBody::Migrating(m) => m.is_end_stream(),
            ProxyBody::Traced(t) => t.is_end_stream(),
            ProxyBody::Held(b, _) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(f) => f.size_hint(),
            ProxyBody::Stream(s) => s.size_hint(),
            ProxyBody::Traced(t) => t.size_hint(),
            ProxyBody::Migrating(_) => SizeHint::default(),
            ProxyBody::Held(b, _) => b.size_hint(),
        }
    }
}

/// The worker accepted: confirm the booking and stream its answer back.
pub(crate) fn respond(
    state: &Arc<State>,
    resp: Response<Upstream>,
    booking: Booking,
    ctx: Respond<'_>,
    permit: OwnedSemaphorePermit,
) -> Response<ProxyBody> {
    respond_first(state, resp, booking, ctx, permit, None)
}

/// [`respond`], with the body's first frame already read from `resp`.
pub(crate) fn respond_first(
    state: &Arc<State>,
    resp: Response<Upstream>,
    mut booking: Booking,
    ctx: Respond<'_>,
    permit: OwnedSemaphorePermit,
    first: Option<http_body::Frame<Bytes>>,
) -> Response<ProxyBody> {
    let Respond { model, arrived, deadline, prefill_worker } = ctx;
    let _ = booking.dispatched();
    let worker = booking.target().worker.0;
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.insert(WORKER_HEADER, HeaderValue::from(worker));
    // Only the proxy names workers: a worker's own header of that name never passes.
    match prefill_worker {
        Some(w) => parts.headers.insert(PREFILL_WORKER_HEADER, HeaderValue::from(w)),
        None => parts.headers.remove(PREFILL_WORKER_HEADER),
    };
    let sse = parts.headers.get(CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let injects_errors =
        sse && !parts.headers.contains_key(CONTENT_LENGTH) && !parts.headers.contains_key(CONTENT_ENCODING);
    let ctx = StreamCtx {
        state: state.clone(),
        model: model.to_string(),
        worker,
        status: parts.status.as_u16(),
        arrived,
        deadline,
        injects_errors,
        idle: idle_timeout(state),
    };
    let body = UpstreamBody::new(body, booking, ctx, Some(permit)).with_first(first);
    Response::from_parts(parts, ProxyBody::Stream(Box::new(body)))
}
