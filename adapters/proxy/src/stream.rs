//! The stream layer: a worker's response body on its way to the client ([`UpstreamBody`]),
//! with the idle timeout and the request's deadline. What it is part of comes in as
//! [`StreamCtx`]; it knows nothing of the tries that found the worker.
//!
//! The passthrough forwards the worker's bytes as they arrive, unchanged, and holds the
//! request's [`Booking`] until the stream ends. Chunks the worker sent together leave
//! in one frame (up to [`COALESCE_BYTES_MAX`]); a chunk that is ready is never held
//! back waiting for another. hyper polls the body only when the client connection can
//! take more, so a slow client slows the read from the worker (backpressure through the
//! TCP windows) and nothing is buffered beyond one frame. Time to first byte and the
//! gaps between frames sent are observed per frame.
//! How the stream ends decides what the router hears:
//!
//! * upstream finished: `finish` (or, for a 5xx, a worker failure);
//! * upstream broke mid-stream: a worker failure, and an SSE client gets an `error`
//!   event instead of a clean `[DONE]`; other clients see the response cut short;
//! * upstream went silent for `retry.idle_stream_timeout_ms` after its first byte: a
//!   worker failure like a broken stream, and an SSE client gets an `error` event
//!   (`stream_stalled`) and `[DONE]`. Streams that may migrate have their own timer
//!   ([`crate::migrate`]); this one covers the rest (several choices, migration off,
//!   workers that send no token ids, disaggregated decode);
//! * the client went away (the body is dropped): the booking is cancelled;
//! * `request_timeout_ms` passed: cancelled, and an SSE client gets an `error` event.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use kvroute_driver::{Booking, DispatchFailure};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};

use crate::health;
use crate::state::State;
use crate::upstream::Upstream;

/// The error type of response bodies.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// What the response to a worker's answer needs from the path that found the worker:
/// the pool, the request's times and, for a split request, its prefill worker.
pub(crate) struct Respond<'a> {
    /// The pool's name.
    pub model: &'a str,
    /// When the request arrived.
    pub arrived: Instant,
    /// When it must be done.
    pub deadline: Instant,
    /// The prefill worker of a split request, named in `x-kvroute-prefill-worker`.
    pub prefill_worker: Option<u64>,
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
    /// Longest silence after the first byte (for SSE, after the response began), `None`
    /// when unbounded.
    pub idle: Option<Duration>,
}

/// Largest frame [`UpstreamBody`] makes of upstream chunks that were ready together.
pub const COALESCE_BYTES_MAX: usize = 16 << 10;

/// What the worker's body yields next.
enum Next {
    Frame(Frame<Bytes>),
    End,
    Broken(hyper::Error),
}

impl From<Option<Result<Frame<Bytes>, hyper::Error>>> for Next {
    fn from(r: Option<Result<Frame<Bytes>, hyper::Error>>) -> Self {
        match r {
            None => Next::End,
            Some(Ok(f)) => Next::Frame(f),
            Some(Err(e)) => Next::Broken(e),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum End {
    Finished,
    Broken,
    Stalled,
    TimedOut,
    Cancelled,
}

/// A worker's response body on its way to the client. See the module docs.
pub struct UpstreamBody {
    inner: Upstream,
    booking: Option<Booking>,
    ctx: StreamCtx,
    injects_errors: bool,
    /// Fires at the request's deadline or, after the first byte, the idle timeout.
    /// Armed the first time the worker makes the client wait: a response that is ready
    /// at once never touches the timer.
    timer: Option<Pin<Box<Sleep>>>,
    last_chunk: Option<Instant>,
    /// Since when this body has been waiting on the worker with nothing to send: set
    /// when the worker's body is not ready, cleared when it yields. Time the client
    /// spends not reading is not counted. An SSE stream waits from its first poll, so a
    /// stream whose headers came but whose first token never does (a disaggregated
    /// decode) is bounded too; another body only after its first byte.
    waiting_since: Option<Instant>,
    /// Whether the bytes sent so far end at an SSE event boundary.
    at_boundary: bool,
    /// What followed the chunks sent in the last frame, for the next poll.
    held: Option<Next>,
    done: bool,
    _permit: Option<OwnedSemaphorePermit>,
}

impl UpstreamBody {
    /// Wraps `inner`; `booking` is released when the stream ends or is dropped.
    pub fn new(inner: Upstream, booking: Booking, ctx: StreamCtx, permit: Option<OwnedSemaphorePermit>) -> Self {
        UpstreamBody {
            inner,
            booking: Some(booking),
            injects_errors: ctx.injects_errors,
            timer: None,
            waiting_since: None,
            ctx,
            last_chunk: None,
            at_boundary: true,
            held: None,
            done: false,
            _permit: permit,
        }
    }

    /// Sends `first`, a frame already read from `inner`, before reading on.
    pub(crate) fn with_first(mut self, first: Option<Frame<Bytes>>) -> Self {
        if let Some(f) = first {
            self.held = Some(Next::Frame(f));
        }
        self
    }

    /// A frame of `chunks` non-empty upstream chunks goes out; `last` when the worker's
    /// body ended with it. Chunks that arrived together are zero apart.
    fn on_data(&mut self, data: &Bytes, chunks: u32, last: bool) {
        if data.is_empty() || chunks == 0 {
            return;
        }
        let now = Instant::now();
        let m = &self.ctx.state.metrics;
        // Chunks after the first frame time the decode (those in it came at once).
        if let (Some(_), Some(b)) = (self.last_chunk, &self.booking) {
            b.output_chunks(chunks);
        }
        match self.last_chunk {
            None => {
                m.ttft(&self.ctx.model, now - self.ctx.arrived);
                // A body that ends with its first frame is finished at once, which
                // releases the prefill load too; a stream's first frame still times
                // its first token.
                match &self.booking {
                    Some(b) if !last => {
                        let _ = b.prefill_done();
                    }
                    Some(b) if self.injects_errors => b.first_output(),
                    _ => {}
                }
            }
            Some(prev) if self.injects_errors => m.itl(&self.ctx.model, now - prev),
            Some(_) => {}
        }
        if self.injects_errors {
            for _ in 1..chunks {
                m.itl(&self.ctx.model, Duration::ZERO);
            }
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
            // A stall is a broken stream that did not say so.
            End::Stalled => {
                let _ = booking.fail(DispatchFailure::Worker);
                health::failure(&c.state, c.worker, "idle_timeout");
                "stream_broken"
            }
            // Dropping the booking cancels it: the worker did nothing wrong.
            End::TimedOut => "timeout",
            End::Cancelled => "cancelled",
        };
        c.state.metrics.request(&c.model, Some(c.worker), outcome, c.status);
        c.state.metrics.request_duration(&c.model, c.worker, c.arrived.elapsed());
    }

    fn error_event(&self, code: &str, message: &str) -> Bytes {
        let body =
            serde_json::json!({ "error": { "message": message, "type": "server_error", "param": null, "code": code } });
        // A partial event is closed first so the error arrives as an event of its own.
        let sep = if self.at_boundary { "" } else { "\n\n" };
        Bytes::from(format!("{sep}event: error\ndata: {body}\n\n"))
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self;
        if this.done {
            return Poll::Ready(None);
        }
        // Only the deadline ends a stream before the worker is asked: after a client that
        // stopped reading, the worker's data may be waiting, so a stall is judged below,
        // when the worker has nothing.
        if this.timer.is_some() && this.poll_timer(cx) == Some(End::TimedOut) {
            return this.expire(End::TimedOut);
        }
        let next = match this.held.take() {
            Some(h) => Poll::Ready(h),
            None => Pin::new(&mut this.inner).poll_frame(cx).map(Next::from),
        };
        if next.is_ready() {
            this.waiting_since = None;
        }
        match next {
            Poll::Pending => {
                if this.waiting_since.is_none() && (this.ctx.injects_errors || this.last_chunk.is_some()) {
                    this.waiting_since = Some(Instant::now());
                }
                match this.poll_timer(cx) {
                    Some(how) => this.expire(how),
                    None => Poll::Pending,
                }
            }
            Poll::Ready(Next::End) => {
                this.end(End::Finished);
                Poll::Ready(None)
            }
            Poll::Ready(Next::Broken(e)) => {
                tracing::debug!(worker = this.ctx.worker, error = %e, "upstream stream broke");
                this.end(End::Broken);
                this.fail_stream("upstream_stream_broken", "the worker's stream broke before it finished")
            }
            Poll::Ready(Next::Frame(frame)) => match frame.into_data() {
                Ok(first) => {
                    let (data, chunks) = this.gather(first, cx);
                    let last = matches!(this.held, Some(Next::End));
                    this.on_data(&data, chunks, last);
                    if last {
                        // Ending now lets the server finish the response with this frame.
                        this.held = None;
                        this.end(End::Finished);
                    }
                    Poll::Ready(Some(Ok(Frame::data(data))))
                }
                Err(trailers) => Poll::Ready(Some(Ok(trailers))),
            },
        }
    }

    /// `first` and the data frames the worker has already sent after it, as one frame
    /// of at most [`COALESCE_BYTES_MAX`] bytes (one write to the client instead of one
    /// per chunk). Never waits: it stops at the first frame that is not ready, and keeps
    /// an end, an error or trailers for the next poll. Also returns how many non-empty
    /// chunks the frame holds.
    fn gather(&mut self, first: Bytes, cx: &mut Context<'_>) -> (Bytes, u32) {
        let mut joined: Option<BytesMut> = None;
        let mut len = first.len();
        let mut chunks = u32::from(!first.is_empty());
        while len < COALESCE_BYTES_MAX {
            let next = match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => break,
                Poll::Ready(r) => Next::from(r),
            };
            let frame = match next {
                Next::Frame(f) => f,
                other => {
                    self.held = Some(other);
                    break;
                }
            };
            match frame.into_data() {
                Ok(d) => {
                    len += d.len();
                    chunks += u32::from(!d.is_empty());
                    joined
                        .get_or_insert_with(|| {
                            let mut b = BytesMut::with_capacity(COALESCE_BYTES_MAX.max(len));
                            b.extend_from_slice(&first);
                            b
                        })
                        .extend_from_slice(&d);
                }
                Err(trailers) => {
                    self.held = Some(Next::Frame(trailers));
                    break;
                }
            }
        }
        (joined.map_or(first, BytesMut::freeze), chunks)
    }

    /// When the timer is due: the idle timeout after the body began waiting on the
    /// worker, or the request's deadline if sooner.
    fn due(&self) -> Instant {
        let idle = self.waiting_since.zip(self.ctx.idle).map(|(at, idle)| at + idle);
        idle.map_or(self.ctx.deadline, |at| at.min(self.ctx.deadline))
    }

    /// Arms or moves the timer to [`Self::due`] and polls it: how the stream ends if it
    /// fired.
    fn poll_timer(&mut self, cx: &mut Context<'_>) -> Option<End> {
        let at = self.due();
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
        if timer.deadline() != at {
            timer.as_mut().reset(at);
        }
        timer.as_mut().poll(cx).is_ready().then(|| {
            if Instant::now() >= self.ctx.deadline {
                End::TimedOut
            } else {
                End::Stalled
            }
        })
    }

    fn expire(&mut self, how: End) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.end(how);
        if how != End::Stalled {
            return self.fail_stream("timeout", "the request timed out mid-stream");
        }
        tracing::debug!(worker = self.ctx.worker, "upstream stream stalled past the idle timeout");
        let msg = "the worker's stream stalled past retry.idle_stream_timeout_ms";
        if !self.injects_errors {
            return Poll::Ready(Some(Err(msg.into())));
        }
        // The stream ends cleanly: the client hears why, then the usual end.
        let mut b = BytesMut::from(self.error_event("stream_stalled", msg));
        b.extend_from_slice(b"data: [DONE]\n\n");
        Poll::Ready(Some(Ok(Frame::data(b.freeze()))))
    }

    fn fail_stream(&mut self, code: &str, message: &str) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if self.injects_errors {
            Poll::Ready(Some(Ok(Frame::data(self.error_event(code, message)))))
        } else {
            Poll::Ready(Some(Err(message.to_string().into())))
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.get_mut().poll_next(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        // A body the proxy may append an error event to has no known length.
        if self.injects_errors {
            SizeHint::default()
        } else {
            self.inner.size_hint()
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

/// Time a stream may stay silent after its first byte, `None` when unbounded.
pub(crate) fn idle_timeout(state: &State) -> Option<Duration> {
    let ms = state.cfg.retry.idle_stream_timeout_ms;
    (ms > 0).then(|| Duration::from_millis(ms))
}
