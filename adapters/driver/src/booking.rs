//! Guards that tie a request's router state to a Rust value: [`Booking`] for a routed
//! request and `Pending` for one waiting in the queue or behind a session's first request.
//! Dropping either releases everything the request holds in the router.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use router_core::{DispatchFailure, Instant, Observation, Output, Phase, RequestId, Routed, WorkerKey};
use tokio::sync::oneshot;

use crate::error::DriveError;
use crate::shared::{FlightKey, Shared};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Routed, not yet confirmed: dropping rolls the booking back.
    Booked,
    /// The worker accepted it: dropping cancels it.
    Dispatched,
    /// Finished or failed through a method: dropping does nothing.
    Done,
}

/// A routed request's hold on its worker: reserved load, and the session lease or first
/// binding. Dropped without [`Booking::finish`] or [`Booking::fail`], it releases all of
/// it as a cancellation (the session binding survives).
pub struct Booking {
    shared: Arc<Shared>,
    routed: Routed,
    state: State,
    waited: bool,
    /// What the router learns about the worker's speed from this request.
    timing: Timing,
}

/// A request's timings on its worker, reported to the router's cost learner: time to
/// first token once the first output arrives, decode time when it finishes.
#[derive(Debug, Default)]
struct Timing {
    isl_tokens: u32,
    /// When the request left for the worker ([`Booking::sending`]).
    sent: Option<Instant>,
    dispatched: Option<Instant>,
    /// The first token's time in microseconds plus one; 0 until it comes.
    first_token_us: AtomicU64,
    output_chunks: AtomicU32,
}

impl Timing {
    fn first_token(&self) -> Option<Instant> {
        let us = self.first_token_us.load(Ordering::Relaxed);
        us.checked_sub(1).map(Instant::from_micros)
    }
}

impl Booking {
    pub(crate) fn new(shared: Arc<Shared>, routed: Routed, waited: bool, isl_tokens: u32) -> Self {
        let timing = Timing { isl_tokens, ..Timing::default() };
        Booking { shared, routed, state: State::Booked, waited, timing }
    }

    /// Whether the request waited in the admission queue or behind a session's first
    /// request before it was routed.
    pub fn waited(&self) -> bool {
        self.waited
    }

    /// The request.
    pub fn id(&self) -> RequestId {
        self.routed.id
    }

    /// Its phase.
    pub fn phase(&self) -> Phase {
        self.routed.phase
    }

    /// The worker key it was routed to.
    pub fn target(&self) -> WorkerKey {
        self.routed.target
    }

    /// The full decision, with its explanation.
    pub fn routed(&self) -> &Routed {
        &self.routed
    }

    /// Whether [`Booking::dispatched`] succeeded.
    pub fn is_dispatched(&self) -> bool {
        self.state == State::Dispatched
    }

    /// The request is leaving for the worker now: its time to first token counts from
    /// here. Call it just before sending; [`Booking::dispatched`] comes once the worker
    /// answered, which for a stream may be after its first token.
    pub fn sending(&mut self) {
        self.timing.sent = Some(self.shared.now());
    }

    /// The worker accepted the request: commits a session's first binding. Call it once,
    /// when the upstream's response headers arrive.
    pub fn dispatched(&mut self) -> Result<(), DriveError> {
        if self.state != State::Booked {
            return Ok(());
        }
        let (id, phase) = self.key();
        let at = self.shared.with(|inner, now| inner.router.handle_dispatched(now, id, phase).map(|()| now))?;
        self.timing.dispatched = Some(at);
        self.state = State::Dispatched;
        Ok(())
    }

    /// The prompt's prefill finished (the first output token arrived). The first call
    /// also tells the router's cost learner how long that took since dispatch.
    pub fn prefill_done(&self) -> Result<(), DriveError> {
        let (id, phase) = self.key();
        self.shared.with(|inner, now| {
            self.observe_first_token(&mut inner.router, now);
            inner.router.handle_prefill_done(now, id, phase).map_err(DriveError::Input)
        })
    }

    /// The first output arrived, without [`Booking::prefill_done`] (the response ended
    /// with it): only tells the cost learner the time to first token.
    pub fn first_output(&self) {
        self.shared.with(|inner, now| self.observe_first_token(&mut inner.router, now));
    }

    /// The first call after dispatch reports the time to first token.
    fn observe_first_token(&self, router: &mut router_core::Router, now: Instant) {
        let t = &self.timing;
        let (None, Some(dispatched)) = (t.first_token(), t.dispatched) else { return };
        let at = t.sent.unwrap_or(dispatched);
        t.first_token_us.store(now.as_micros().saturating_add(1), Ordering::Relaxed);
        let obs = Observation::first_token(ms_between(now, at), &self.routed, t.isl_tokens, router.config().block_size);
        let _ = router.handle_observation(now, self.routed.target, obs);
    }

    /// `chunks` more output chunks (tokens, for a stream of one token per event) came
    /// from the worker after the first output; with the time since the first output,
    /// they are the decode time reported at [`Booking::finish`].
    pub fn output_chunks(&self, chunks: u32) {
        let c = &self.timing.output_chunks;
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n.saturating_add(chunks)));
    }

    /// The request produced `output_tokens` tokens so far.
    pub fn decode_progress(&self, output_tokens: u32) -> Result<(), DriveError> {
        let (id, phase) = self.key();
        self.shared
            .with(|inner, now| inner.router.handle_decode_progress(now, id, phase, output_tokens))
            .map_err(DriveError::Input)
    }

    /// The request ended normally: load, lease and slot are released.
    ///
    /// An error here means the router had already let the request go (its worker was
    /// removed or the booking outlived `request_age_max_ms`); nothing is left held.
    pub fn finish(mut self) -> Result<(), DriveError> {
        let (id, phase) = self.key();
        self.state = State::Done;
        let t = &self.timing;
        let (first, tokens) = (t.first_token(), t.output_chunks.load(Ordering::Relaxed));
        let target = self.routed.target;
        self.shared.with(|inner, now| {
            if let (Some(at), true) = (first, tokens > 0) {
                // Before the finish releases the request's blocks: the prediction reads the usage.
                let obs = Observation::Decode { ms: ms_between(now, at), tokens };
                let _ = inner.router.handle_observation(now, target, obs);
            }
            inner.router.handle_finished(now, id, phase).map_err(DriveError::Input)
        })
    }

    /// The request failed: rolled back, and with [`DispatchFailure::Worker`] the session's
    /// binding to this worker is dropped too.
    pub fn fail(mut self, why: DispatchFailure) -> Result<(), DriveError> {
        let (id, phase) = self.key();
        self.state = State::Done;
        self.shared
            .with(|inner, now| inner.router.handle_dispatch_failed(now, id, phase, why))
            .map_err(DriveError::Input)
    }

    fn key(&self) -> FlightKey {
        (self.routed.id, self.routed.phase)
    }
}

fn ms_between(later: Instant, earlier: Instant) -> f64 {
    later.micros_since(earlier) as f64 / 1000.0
}

impl Drop for Booking {
    fn drop(&mut self) {
        let (id, phase) = self.key();
        match self.state {
            State::Done => {}
            State::Booked => self.shared.with(|inner, now| {
                let _ = inner.router.handle_dispatch_failed(now, id, phase, DispatchFailure::Cancelled);
            }),
            State::Dispatched => self.shared.with(|inner, now| {
                let _ = inner.router.handle_cancel(now, id, phase);
            }),
        }
    }
}

impl fmt::Debug for Booking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Booking").field("id", &self.routed.id).field("target", &self.routed.target).finish()
    }
}

/// A request the router holds in its queue or behind a session initialization. The driver
/// removes the waiter entry when it delivers an output, so on drop the entry's presence
/// says who owns the outcome: still there, the router holds the request (cancel it);
/// gone, the output sits in the channel (roll back a routed one).
pub(crate) struct Pending {
    shared: Arc<Shared>,
    key: FlightKey,
    rx: oneshot::Receiver<Output>,
    armed: bool,
    isl_tokens: u32,
}

impl Pending {
    pub(crate) fn new(shared: Arc<Shared>, key: FlightKey, rx: oneshot::Receiver<Output>, isl_tokens: u32) -> Self {
        Pending { shared, key, rx, armed: true, isl_tokens }
    }

    pub(crate) async fn wait(mut self) -> Result<Booking, DriveError> {
        let out = (&mut self.rx).await;
        // From here to the return nothing awaits, so the outcome cannot be lost.
        self.armed = false;
        match out {
            Ok(Output::Routed(r)) => Ok(Booking::new(self.shared.clone(), r, true, self.isl_tokens)),
            Ok(Output::Failed { error, .. }) => Err(DriveError::Route(error)),
            Ok(Output::TimedOut { .. }) => Err(DriveError::QueueTimeout),
            Ok(Output::Rejected { rejection, .. }) => Err(DriveError::Rejected(rejection)),
            Ok(_) | Err(_) => Err(DriveError::Closed),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (id, phase) = self.key;
        let rx = &mut self.rx;
        self.shared.with(|inner, now| {
            if inner.waiters.remove(&(id, phase)).is_some() {
                let _ = inner.router.handle_cancel(now, id, phase);
            } else if let Ok(Output::Routed(_)) = rx.try_recv() {
                let _ = inner.router.handle_dispatch_failed(now, id, phase, DispatchFailure::Cancelled);
            }
        });
    }
}
