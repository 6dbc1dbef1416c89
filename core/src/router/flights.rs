//! Flight bookkeeping: what the router tracks per request and phase, and the paths that
//! end a flight and release everything it holds. The decision pipeline (`pipeline`)
//! creates and advances flights; every way out of one goes through [`Router::drop_flight`].

use alloc::format;
use alloc::vec::Vec;

use super::*;
use crate::eligible::Eligibility;
use crate::index::OverlapScores;

/// A request's phase: the key of everything the router tracks per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct FlightKey {
    /// The request.
    pub(super) id: RequestId,
    /// Which of its phases.
    pub(super) phase: Phase,
}

impl FlightKey {
    pub(super) fn new(id: RequestId, phase: Phase) -> Self {
        FlightKey { id, phase }
    }
}

/// What a flight holds in the affinity table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Hold {
    None,
    Init(InitToken),
    /// A lease, and the binding revision it was taken on.
    Lease(LeaseId, u64),
    /// A preview's borrowed slot, which holds nothing: true when the session it asks
    /// about has no binding yet, so the preview places as its first request would.
    Preview(bool),
}

/// Where a flight is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    New,
    Waiting(WaitToken),
    Queued(RequestId),
    Booked(WorkerKey),
    Dispatched(WorkerKey),
    /// Its worker was removed: load and lease are already gone. It is dropped at this
    /// deadline if the adapter never reports its end.
    Orphaned(Instant),
}

/// One tracked request phase.
#[derive(Clone, Debug)]
pub(super) struct Flight {
    pub(super) req: Request,
    pub(super) draw: Draw,
    pub(super) state: State,
    pub(super) hold: Hold,
}

/// Buffers `place` reuses from call to call, so a decision allocates only what it returns.
/// The pipeline takes the whole struct for the duration of a call and puts it back once,
/// whichever way the call ends.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) verdicts: Vec<Eligibility>,
    pub(super) scores: OverlapScores,
    pub(super) approx: OverlapScores,
}

/// Most orphaned requests (bookings whose worker left) one [`Router::handle_timeout`]
/// call expires; `poll_timeout` stays due while more are.
pub const ORPHANS_PER_CALL_MAX: usize = 1024;

impl Router {
    /// Removes a flight and releases whatever it holds. `invalidate` drops the session's
    /// binding too (the worker failed it).
    pub(super) fn drop_flight(&mut self, now: Instant, fk: FlightKey, invalidate: bool) {
        let Some(f) = self.flights.remove(&fk) else { return };
        match f.state {
            State::Booked(key) | State::Dispatched(key) => {
                if matches!(f.state, State::Dispatched(_)) {
                    // It ran there; a booking rolled back before dispatch warmed nothing.
                    self.warmth.ended(&self.cfg.cost.timing, now, key);
                }
                let freed = self.load.free(fk.id, fk.phase);
                debug_assert!(freed.is_ok(), "a booked flight has a booking: {freed:?}");
                self.publish(ReplicaUpdate::Finished { id: fk.id, phase: fk.phase });
            }
            State::Queued(ticket) => {
                let cancelled = self.queue.cancel(ticket);
                debug_assert!(cancelled.is_some(), "a queued flight has a queue slot");
                self.tickets.remove(&ticket);
            }
            State::Waiting(token) => {
                self.waiters.remove(&token);
                // A waiter woken but not yet drained is already unknown to the table.
                let _ = self.affinity.cancel_wait(token);
            }
            State::Orphaned(deadline) => {
                self.orphan_timers.remove(&(deadline, fk));
            }
            State::New => {}
        }
        match f.hold {
            Hold::None | Hold::Preview(_) => {}
            Hold::Init(token) => {
                // A held token is live: only this flight's commit or abort ends it.
                let aborted = self.affinity.abort(token);
                debug_assert!(aborted.is_ok(), "abort of a held init token: {aborted:?}");
            }
            Hold::Lease(lease, revision) => {
                // The revision the lease was taken on: a newer binding survives a late failure.
                if let (true, Some(s)) = (invalidate, &f.req.session) {
                    self.invalidate_session(s, fk.phase, revision);
                }
                // Only a request its worker took renews the binding's idle time.
                let released = if matches!(f.state, State::Dispatched(_)) {
                    self.affinity.release(now, lease)
                } else {
                    self.affinity.release_unserved(now, lease)
                };
                debug_assert!(released.is_ok(), "a held lease is known: {released:?}");
            }
        }
        self.drain_affinity(now);
    }

    pub(super) fn remove_worker(&mut self, now: Instant, id: WorkerId) {
        self.workers.remove(id);
        self.index.remove_worker(id);
        self.approx.remove_worker(id);
        self.load.remove_worker(id);
        self.affinity.invalidate_worker(id);
        self.learn.remove_worker(id);
        self.event_workers.remove(&id);
        self.foreign_tokens.remove(&id);
        self.untrusted.retain(|k| k.worker != id);
        self.warmth.remove_worker(id);
        let gone: Vec<FlightKey> = self
            .flights
            .iter()
            .filter(|(_, f)| matches!(f.state, State::Booked(k) | State::Dispatched(k) if k.worker == id))
            .map(|(k, _)| *k)
            .collect();
        // A lost end report must not hold a slot forever: orphans age out like bookings.
        let deadline = now.add_ms(self.cfg.load.request_age_max_ms);
        for fk in gone {
            self.set_state(fk, State::Orphaned(deadline));
            self.orphan_timers.insert((deadline, fk));
            self.publish(ReplicaUpdate::Finished { id: fk.id, phase: fk.phase });
        }
    }

    /// Drops orphaned requests whose deadline passed, at most `ORPHANS_PER_CALL_MAX` per
    /// call (`poll_timeout` stays due while more are).
    pub(super) fn expire_orphans(&mut self, now: Instant) {
        for _ in 0..ORPHANS_PER_CALL_MAX {
            let Some(&(deadline, fk)) = self.orphan_timers.first() else { return };
            if deadline > now {
                return;
            }
            self.drop_flight(now, fk, false);
            self.orphan_timers.remove(&(deadline, fk));
            self.outputs.push_back(Output::BookingExpired { id: fk.id, phase: fk.phase });
        }
    }

    pub(super) fn set_state(&mut self, fk: FlightKey, s: State) {
        if let Some(f) = self.flights.get_mut(&fk) {
            f.state = s;
        }
    }

    pub(super) fn set_hold(&mut self, fk: FlightKey, h: Hold) {
        if let Some(f) = self.flights.get_mut(&fk) {
            f.hold = h;
        }
    }

    /// Checks the router's global invariants; a violation is always a bug.
    ///
    /// Linear in the number of tracked requests; meant for tests, fuzzing and simulation.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let booked =
            self.flights.values().filter(|f| matches!(f.state, State::Booked(_) | State::Dispatched(_))).count();
        let local = self.load.local();
        let total = local.total();
        if total.active_requests as usize != booked || local.len() != booked {
            return Err(InvariantViolation(format!(
                "load tracks {} requests ({} bookings), router has {booked} booked",
                total.active_requests,
                local.len()
            )));
        }
        let queued = self.flights.values().filter(|f| matches!(f.state, State::Queued(_))).count();
        if self.queue.len() != queued || self.tickets.len() != queued {
            return Err(InvariantViolation(format!(
                "queue holds {} ({} tickets), router has {queued} queued",
                self.queue.len(),
                self.tickets.len()
            )));
        }
        let waiting = self.flights.values().filter(|f| matches!(f.state, State::Waiting(_))).count();
        if self.waiters.len() != waiting {
            return Err(InvariantViolation(format!(
                "{} waiter tokens, router has {waiting} waiting",
                self.waiters.len()
            )));
        }
        let leases = self.flights.values().filter(|f| matches!(f.hold, Hold::Lease(..))).count();
        if self.affinity.live_leases() != leases {
            return Err(InvariantViolation(format!(
                "affinity has {} live leases, router holds {leases}",
                self.affinity.live_leases()
            )));
        }
        self.load.check().map_err(InvariantViolation)?;
        if let Some(k) = self.warmth.stray(|w| self.workers.get(w).is_some()) {
            return Err(InvariantViolation(format!("warmth kept for {k:?}, whose worker is gone")));
        }
        if self.flights.len() > self.cfg.requests_max {
            return Err(InvariantViolation(format!(
                "{} requests tracked, limit {}",
                self.flights.len(),
                self.cfg.requests_max
            )));
        }
        Ok(())
    }
}
