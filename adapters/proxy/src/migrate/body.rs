//! The client's body of a stream that may migrate: forwards the worker's events through
//! [`Stream`], and when the worker's stream breaks or stays silent past the idle
//! timeout, releases its booking as the worker's failure and continues on another
//! worker through the same tries as the first ([`tries::first_answer`]).
//!
//! The booking is held while a worker streams; the client going away drops the body,
//! which cancels it. How the body ends decides what the router, the health tracker and
//! the metrics hear, as for [`crate::body::UpstreamBody`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_LENGTH};
use http::Response;
use http_body::{Body, Frame};
use kvroute_driver::{Booking, DispatchFailure};
use router_core::Request;
use router_core::WorkerId;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Duration, Instant, Sleep};

use super::plan::Plan;
use super::sse::Stream;
use crate::error::ApiError;
use crate::fleet::Pool;
use crate::health;
use crate::prepared::{Bodies, Prepared};
use crate::state::State;
use crate::stream::{idle_timeout, BodyError, Respond};
use crate::tries::{self, Answered, Tries};
use crate::upstream::{strip_hop_by_hop, Upstream, PREFILL_WORKER_HEADER, WORKER_HEADER};

/// What a continuation's tries need, shared with the futures that make them.
struct Shared {
    state: Arc<State>,
    pool: Arc<Pool>,
    p: Prepared,
    plan: Plan,
    arrived: Instant,
    deadline: Instant,
}

type Resume = Pin<Box<dyn Future<Output = Result<(Answered, Request, Vec<WorkerId>), ApiError>> + Send>>;

enum Phase {
    Streaming(Box<Upstream>),
    /// A continuation is being tried; `by` is its migration deadline.
    Resuming {
        fut: Resume,
        reason: &'static str,
        by: Instant,
    },
    Ended,
}

/// A stream that may continue on another worker. See the module docs.
pub struct MigratingBody {
    shared: Arc<Shared>,
    phase: Phase,
    booking: Option<Booking>,
    worker: u64,
    request: Request,
    tried: Vec<WorkerId>,
    stream: Stream,
    /// Breaks handled so far (continued or not).
    attempts: u32,
    /// Fires at the idle timeout or the request's deadline, whichever is first.
    timer: Pin<Box<Sleep>>,
    idle: Option<Duration>,
    /// When the last bytes went to the client.
    last_sent: Option<Instant>,
    /// Bytes (and their event count) read before the body was first polled.
    held: Option<(Bytes, u32)>,
    _permit: OwnedSemaphorePermit,
}

/// Streams `a` (a 2xx from a worker, with its first frame read) to the client, ready to
/// continue it elsewhere by `plan`.
#[allow(clippy::too_many_arguments)] // the pieces of one request, handed over once
pub(crate) fn respond(
    state: &Arc<State>,
    a: Answered,
    plan: Plan,
    p: Prepared,
    request: Request,
    tried: Vec<WorkerId>,
    ctx: Respond<'_>,
    permit: OwnedSemaphorePermit,
) -> Response<MigratingBody> {
    let Answered { mut booking, resp, first } = a;
    let _ = booking.dispatched();
    let worker = booking.target().worker.0;
    let (mut parts, upstream) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // The body is rewritten: its length is no longer the worker's.
    parts.headers.remove(CONTENT_LENGTH);
    parts.headers.insert(WORKER_HEADER, HeaderValue::from(worker));
    parts.headers.remove(PREFILL_WORKER_HEADER);
    let idle = idle_timeout(state);
    let stream = Stream::new(plan.is_chat(), plan.client_ids);
    let shared = Arc::new(Shared {
        state: state.clone(),
        pool: p.pool.clone(),
        p,
        plan,
        arrived: ctx.arrived,
        deadline: ctx.deadline,
    });
    let mut body = MigratingBody {
        timer: Box::pin(tokio::time::sleep_until(ctx.deadline)),
        shared,
        phase: Phase::Streaming(Box::new(upstream)),
        booking: Some(booking),
        worker,
        request,
        tried,
        stream,
        attempts: 0,
        idle,
        last_sent: None,
        held: None,
        _permit: permit,
    };
    body.rearm();
    let pending = first.and_then(|f| f.into_data().ok()).map(|d| body.stream.feed(&d));
    body.held = pending.filter(|(b, _)| !b.is_empty());
    Response::from_parts(parts, body)
}

impl MigratingBody {
    /// The timer fires at the idle timeout from now, or the request's deadline.
    fn rearm(&mut self) {
        let at = self.idle.map_or(self.shared.deadline, |d| (Instant::now() + d).min(self.shared.deadline));
        self.timer.as_mut().reset(at);
    }

    fn model(&self) -> &str {
        &self.shared.pool.name
    }

    /// `events` events for the client went out: time to first token, then the gaps
    /// between events (zero between events that left together).
    fn sent(&mut self, events: u32) {
        if events == 0 {
            return;
        }
        let now = Instant::now();
        let (m, model) = (&self.shared.state.metrics, &self.shared.pool.name);
        match self.last_sent {
            None => {
                m.ttft(model, now - self.shared.arrived);
                if let Some(b) = &self.booking {
                    let _ = b.prefill_done();
                }
            }
            Some(prev) => {
                m.itl(model, now - prev);
                // Events after the first send time the decode for the cost learner.
                if let Some(b) = &self.booking {
                    b.output_chunks(events);
                }
            }
        }
        for _ in 1..events {
            m.itl(model, Duration::ZERO);
        }
        self.last_sent = Some(now);
    }

    /// The worker's stream ended cleanly.
    fn finish(&mut self) {
        self.phase = Phase::Ended;
        if let Some(b) = self.booking.take() {
            let _ = b.finish();
            health::success(&self.shared.state, self.worker);
        }
        self.shared.state.metrics.request(self.model(), Some(self.worker), "ok", 200);
    }

    /// Ends the client's stream with an error event `code`; the request counts as
    /// `outcome`.
    fn fail(&mut self, code: &str, outcome: &str, message: &str) -> (Bytes, u32) {
        self.phase = Phase::Ended;
        drop(self.booking.take());
        self.shared.state.metrics.request(self.model(), Some(self.worker), outcome, 200);
        let body = serde_json::json!({
            "error": { "message": message, "type": "server_error", "param": null, "code": code }
        });
        // A partial event that went out is closed first, so the error is an event of its own.
        let sep = if self.stream.at_boundary { "" } else { "\n\n" };
        (Bytes::from(format!("{sep}event: error\ndata: {body}\n\n")), 1)
    }

    /// The worker's stream broke (`reason`): continue it elsewhere if the plan allows,
    /// else end with an error event (returned).
    fn broke(&mut self, reason: &'static str) -> Option<(Bytes, u32)> {
        if self.stream.done || self.stream.finished {
            // Everything was generated; only the end was lost, which the client still gets:
            // the usage it asked for (from what is known) and `[DONE]`.
            let mut tail = Vec::new();
            if !self.stream.done {
                if self.shared.plan.include_usage && !self.stream.usage_seen {
                    tail.extend_from_slice(&self.stream.usage_chunk().unwrap_or_default());
                }
                tail.extend_from_slice(b"data: [DONE]\n\n");
            }
            let events = memchr::memmem::find_iter(&tail, b"\n\n").count().max(1) as u32;
            self.finish();
            return Some((Bytes::from(tail), events));
        }
        if let Some(b) = self.booking.take() {
            let _ = b.fail(DispatchFailure::Worker);
            health::failure(&self.shared.state, self.worker, reason);
        }
        let m = &self.shared.state.metrics;
        let plan = &self.shared.plan;
        let refused = |outcome: &'static str| {
            m.migration(&self.shared.pool.name, reason, outcome);
            outcome
        };
        let parsed = self.stream.parsed_output.then_some(("reasoning or tool-call output", "refused_fidelity"));
        if let Some((why, outcome)) = plan.refusal.or(parsed) {
            refused(outcome);
            let msg = format!("the worker's stream broke; a request with {why} cannot be continued on another worker");
            return Some(self.fail("migration_refused", "stream_broken", &msg));
        }
        let Some(prompt_ids) = self.stream.prompt_ids.clone() else {
            refused("unsupported");
            let msg = "the worker's stream broke before it finished (it sent no token ids to continue from)";
            return Some(self.fail("upstream_stream_broken", "stream_broken", msg));
        };
        if self.attempts >= plan.attempts_max {
            refused("attempts_exhausted");
            let msg = format!("the stream broke {} times; no more migrations", self.attempts + 1);
            return Some(self.fail("migration_limit", "stream_broken", &msg));
        }
        let now = Instant::now();
        if now >= self.shared.deadline {
            refused("deadline");
            return Some(self.fail("timeout", "timeout", "the request timed out mid-stream"));
        }
        let Some((path, body)) = plan.continuation(&self.shared.p.path_and_query, &prompt_ids, &self.stream.generated)
        else {
            refused("complete");
            self.finish();
            return Some((Bytes::from_static(b"data: [DONE]\n\n"), 1));
        };
        self.attempts += 1;
        self.stream.seam();
        let by = (now + Duration::from_millis(plan.deadline_ms)).min(self.shared.deadline);
        // The continuation prefills the prompt and everything generated so far: its
        // first-byte timeout and its booking are sized for both.
        let mut request = self.request.clone();
        request.isl_tokens = u32::try_from(prompt_ids.len() + self.stream.generated.len()).unwrap_or(u32::MAX);
        let fut = resume(self.shared.clone(), request, &self.tried, path, body, by);
        self.phase = Phase::Resuming { fut, reason, by };
        None
    }

    /// No continuation answered: by the migration's deadline `by`, or at all.
    fn not_resumed(&mut self, reason: &'static str, by: Instant, e: &ApiError) -> (Bytes, u32) {
        let m = &self.shared.state.metrics;
        if Instant::now() >= by && by < self.shared.deadline {
            m.migration(&self.shared.pool.name, reason, "deadline");
            let msg = format!(
                "the worker's stream broke and no other worker continued it within migration.deadline_ms ({} ms)",
                self.shared.plan.deadline_ms
            );
            return self.fail("migration_deadline", "stream_broken", &msg);
        }
        if Instant::now() >= self.shared.deadline {
            m.migration(&self.shared.pool.name, reason, "deadline");
            return self.fail("timeout", "timeout", "the request timed out mid-stream");
        }
        m.migration(&self.shared.pool.name, reason, "no_worker");
        let msg = format!("the worker's stream broke and no other worker continued it: {}", e.message);
        self.fail("migration_failed", "stream_broken", &msg)
    }

    /// A continuation answered: stream it.
    fn resumed(&mut self, a: Answered, request: Request, tried: Vec<WorkerId>, reason: &'static str) -> (Bytes, u32) {
        let Answered { mut booking, resp, first } = a;
        let _ = booking.dispatched();
        self.worker = booking.target().worker.0;
        self.booking = Some(booking);
        self.request = request;
        self.tried = tried;
        self.shared.state.metrics.migration(&self.shared.pool.name, reason, "resumed");
        self.phase = Phase::Streaming(Box::new(resp.into_body()));
        self.rearm();
        first.and_then(|f| f.into_data().ok()).map_or((Bytes::new(), 0), |d| self.stream.feed(&d))
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<(Bytes, u32)>> {
        loop {
            match &mut self.phase {
                Phase::Ended => return Poll::Ready(None),
                Phase::Resuming { fut, reason, by } => {
                    let (reason, by) = (*reason, *by);
                    match fut.as_mut().poll(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok((a, request, tried))) => {
                            let out = self.resumed(a, request, tried, reason);
                            if !out.0.is_empty() {
                                return Poll::Ready(Some(out));
                            }
                        }
                        Poll::Ready(Err(e)) => return Poll::Ready(Some(self.not_resumed(reason, by, &e))),
                    }
                }
                Phase::Streaming(up) => match Pin::new(up.as_mut()).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        let Ok(data) = frame.into_data() else { continue };
                        self.rearm();
                        let out = self.stream.feed(&data);
                        if !out.0.is_empty() {
                            return Poll::Ready(Some(out));
                        }
                    }
                    Poll::Ready(end) => {
                        if end.is_none() && self.stream.done {
                            self.finish();
                            return Poll::Ready(None);
                        }
                        if let Some(out) = self.broke("stream_broken") {
                            return Poll::Ready(Some(out).filter(|(b, _)| !b.is_empty()));
                        }
                    }
                    Poll::Pending => {
                        if self.timer.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        if Instant::now() >= self.shared.deadline {
                            drop(self.booking.take());
                            return Poll::Ready(Some(self.fail(
                                "timeout",
                                "timeout",
                                "the request timed out mid-stream",
                            )));
                        }
                        if let Some(out) = self.broke("idle_timeout") {
                            return Poll::Ready(Some(out).filter(|(b, _)| !b.is_empty()));
                        }
                    }
                },
            }
        }
    }
}

/// The tries of a continuation, as a future that owns what it needs.
fn resume(
    shared: Arc<Shared>,
    mut request: Request,
    tried: &[WorkerId],
    path: String,
    body: Bytes,
    by: Instant,
) -> Resume {
    let mut tried = tried.to_vec();
    Box::pin(async move {
        let t = Tries {
            state: &shared.state,
            pool: &shared.pool,
            p: &shared.p,
            body: Bodies::text(body),
            path: Some(path),
            deadline: by,
            // A continuation streams: its timeout is the first-byte one.
            shape: crate::prepared::BodyShape { stream: true, max_output_tokens: None },
        };
        let a = tries::first_answer(&t, &mut request, &mut tried).await?;
        if !a.resp.status().is_success() {
            return Err(ApiError::upstream(format!("the continuation was answered {}", a.resp.status())));
        }
        Ok((a, request, tried))
    })
}

impl Body for MigratingBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let inner = self.get_mut();
        let next = match inner.held.take() {
            Some(b) => Poll::Ready(Some(b)),
            None => inner.poll_next(cx),
        };
        next.map(|o| {
            o.map(|(b, events)| {
                inner.sent(events);
                Ok(Frame::data(b))
            })
        })
    }
}

impl MigratingBody {
    /// Whether nothing more will come.
    pub fn is_end_stream(&self) -> bool {
        matches!(self.phase, Phase::Ended) && self.held.is_none()
    }
}

impl Drop for MigratingBody {
    fn drop(&mut self) {
        if !matches!(self.phase, Phase::Ended) {
            // The client went away: dropping the booking cancels it.
            self.shared.state.metrics.request(&self.shared.pool.name, Some(self.worker), "cancelled", 200);
        }
    }
}
