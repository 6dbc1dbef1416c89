//! Response bodies: a complete body for the proxy's own answers, and the streamed
//! passthrough of a worker's response.
//!
//! The passthrough forwards each upstream frame as it arrives, unchanged, and holds the
//! request's [`Booking`] until the stream ends. hyper polls it only when the client
//! connection can take more, so a slow client slows the read from the worker
//! (backpressure through the TCP windows) and nothing is buffered beyond one frame.
//! How the stream ends decides what the router hears:
//!
//! * upstream finished: `finish` (or, for a 5xx, a worker failure);
//! * upstream broke mid-stream: a worker failure, and an SSE client gets an `error`
//!   event instead of a clean `[DONE]`; other clients see the response cut short;
//! * the client went away (the body is dropped): the booking is cancelled;
//! * `request_timeout_ms` passed: cancelled, and an SSE client gets an `error` event.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use kvroute_driver::{Booking, DispatchFailure};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};

use crate::health;
use crate::state::State;

/// The error type of response bodies.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// Any response body the proxy sends.
pub enum ProxyBody {
    /// A complete body.
    Full(Full<Bytes>),
    /// A worker's response, streamed through.
    Stream(Box<UpstreamBody>),
}

impl ProxyBody {
    /// A complete body.
    pub fn full(b: impl Into<Bytes>) -> Self {
        ProxyBody::Full(Full::new(b.into()))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            ProxyBody::Full(f) => Pin::new(f).poll_frame(cx).map_err(|never| match never {}),
            ProxyBody::Stream(s) => Pin::new(s.as_mut()).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(f) => f.is_end_stream(),
            ProxyBody::Stream(s) => s.done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(f) => f.size_hint(),
            ProxyBody::Stream(s) if !s.injects_errors => s.inner.size_hint(),
            ProxyBody::Stream(_) => SizeHint::default(),
        }
    }
}

/// What the streamed response is part of.
pub struct StreamCtx {
    /// Shared proxy state.
    pub state: Arc<State>,
    /// The pool's name (metrics label).
    pub model: String,
    /// The worker serving it.
    pub worker: u64,
    /// The upstream status.
    pub status: u16,
    /// When the request arrived.
    pub arrived: Instant,
    /// When the whole request must be done.
    pub deadline: Instant,
    /// Whether the response is an SSE stream the proxy may append an error event to.
    pub injects_errors: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum End {
    Finished,
    Broken,
    TimedOut,
    Cancelled,
}

/// A worker's response body on its way to the client. See the module docs.
pub struct UpstreamBody {
    inner: Incoming,
    booking: Option<Booking>,
    ctx: StreamCtx,
    injects_errors: bool,
    deadline: Pin<Box<Sleep>>,
    last_chunk: Option<Instant>,
    /// Whether the bytes sent so far end at an SSE event boundary.
    at_boundary: bool,
    done: bool,
    _permit: Option<OwnedSemaphorePermit>,
}

impl UpstreamBody {
    /// Wraps `inner`; `booking` is released when the stream ends or is dropped.
    pub fn new(inner: Incoming, booking: Booking, ctx: StreamCtx, permit: Option<OwnedSemaphorePermit>) -> Self {
        UpstreamBody {
            inner,
            booking: Some(booking),
            injects_errors: ctx.injects_errors,
            deadline: Box::pin(tokio::time::sleep_until(ctx.deadline)),
            ctx,
            last_chunk: None,
            at_boundary: true,
            done: false,
            _permit: permit,
        }
    }

    fn on_data(&mut self, data: &Bytes) {
        if data.is_empty() {
            return;
        }
        let now = Instant::now();
        match self.last_chunk {
            None => {
                self.ctx.state.metrics.ttft(&self.ctx.model, now - self.ctx.arrived);
                if let Some(b) = &self.booking {
                    let _ = b.prefill_done();
                }
            }
            Some(prev) if self.injects_errors => self.ctx.state.metrics.itl(&self.ctx.model, now - prev),
            Some(_) => {}
        }
        self.last_chunk = Some(now);
        self.at_boundary = data.ends_with(b"\n\n") || data.ends_with(b"\r\n\r\n");
    }

    /// The stream ended: the router, the health tracker and the metrics hear how.
    fn end(&mut self, how: End) {
        self.done = true;
        let Some(booking) = self.booking.take() else { return };
        let c = &self.ctx;
        let outcome = match how {
            End::Finished if c.status >= 500 => {
                let _ = booking.fail(DispatchFailure::Worker);
                health::failure(&c.state, c.worker, "status_5xx");
                "upstream_error"
            }
            End::Finished => {
                let _ = booking.finish();
                health::success(&c.state, c.worker);
                if c.status >= 400 {
                    "upstream_error"
                } else {
                    "ok"
                }
            }
            End::Broken => {
                let _ = booking.fail(DispatchFailure::Worker);
                health::failure(&c.state, c.worker, "stream_broken");
                "stream_broken"
            }
            // Dropping the booking cancels it: the worker did nothing wrong.
            End::TimedOut => "timeout",
            End::Cancelled => "cancelled",
        };
        c.state.metrics.request(&c.model, Some(c.worker), outcome, c.status);
    }

    fn error_event(&self, code: &str, message: &str) -> Bytes {
        let body =
            serde_json::json!({ "error": { "message": message, "type": "server_error", "param": null, "code": code } });
        // A partial event is closed first so the error arrives as an event of its own.
        let sep = if self.at_boundary { "" } else { "\n\n" };
        Bytes::from(format!("{sep}event: error\ndata: {body}\n\n"))
    }

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            this.end(End::TimedOut);
            return this.fail_stream("timeout", "the request timed out mid-stream");
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                this.end(End::Finished);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.on_data(data);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                tracing::debug!(worker = this.ctx.worker, error = %e, "upstream stream broke");
                this.end(End::Broken);
                this.fail_stream("upstream_stream_broken", "the worker's stream broke before it finished")
            }
        }
    }

    fn fail_stream(&mut self, code: &str, message: &str) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if self.injects_errors {
            Poll::Ready(Some(Ok(Frame::data(self.error_event(code, message)))))
        } else {
            Poll::Ready(Some(Err(message.to_string().into())))
        }
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        if !self.done {
            self.end(End::Cancelled);
        }
    }
}
