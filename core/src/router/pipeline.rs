//! The decision pipeline behind `handle_request`: session, pins, eligibility, prefix
//! match, selection, then booking or queueing; and the bookkeeping that undoes it.

use alloc::format;
use alloc::vec::Vec;
use core::mem;

use super::*;
use crate::admission::{AdmissionError, QueueEntry};
use crate::affinity::{Acquire, AffinityMode, Binding};
use crate::eligible::{self, Eligibility, EligibilityQuery, Verdict};
use crate::index::OverlapScores;
use crate::pin::{self, AffinityPin, PinResolution};
use crate::select::{Candidate, SelectRequest};
use crate::Overlap;

/// What placing a request came to.
enum Placed {
    Routed(Routed),
    AllBusy { cached_tokens: u32 },
}

impl Router {
    /// Session step, then placement, for a flight already in the table.
    pub(super) fn admit(&mut self, now: Instant, fk: FlightKey) -> Result<Decision, RouteError> {
        let binding = match self.session_step(now, fk)? {
            SessionStep::Wait => return Ok(Decision::Waiting),
            SessionStep::Go(b) => b,
        };
        let placed = match self.place(now, fk, binding, true) {
            Err(RouteError::Pin(_)) if self.soft_binding_only(fk, binding) => {
                // A soft binding is a preference: drop it and place the request afresh.
                self.drop_binding(now, fk);
                self.place(now, fk, None, true)?
            }
            other => other?,
        };
        match placed {
            Placed::Routed(r) => {
                self.set_state(fk, State::Booked(r.target));
                Ok(Decision::Routed(r))
            }
            Placed::AllBusy { cached_tokens } => self.enqueue(now, fk, cached_tokens),
        }
    }

    /// A query-only decision: reads bindings, books nothing, advances nothing.
    pub(super) fn preview(&mut self, now: Instant, req: &Request, draw: Draw) -> Result<Routed, RouteError> {
        let phase = req.phase.0;
        let binding = match &req.session {
            Some(s) => self.affinity.peek(s, phase),
            None => None,
        };
        let fk = (req.id, phase);
        // The pipeline reads the request from the flight table; a preview borrows a slot
        // there for the duration of the call and always gives it back.
        let saved = self.flights.insert(fk, Flight { req: req.clone(), draw, state: State::New, hold: Hold::None });
        let out = self.place(now, fk, binding, false);
        self.flights.remove(&fk);
        if let Some(prev) = saved {
            self.flights.insert(fk, prev);
        }
        match out? {
            Placed::Routed(r) => Ok(r),
            Placed::AllBusy { .. } => Err(RouteError::Eligibility(eligible::EligibilityError::NoWorkers { phase })),
        }
    }

    fn session_step(&mut self, now: Instant, fk: FlightKey) -> Result<SessionStep, RouteError> {
        let Some(session) = self.flights.get(&fk).and_then(|f| f.req.session.clone()) else {
            return Ok(SessionStep::Go(None));
        };
        // A binding whose worker can no longer serve the phase is re-initialized, in both
        // modes; two rounds are enough because the second acquire cannot find a binding.
        for _ in 0..2 {
            match self.affinity.acquire(now, &session, fk.1).map_err(RouteError::Affinity)? {
                Acquire::Initialize(token) => {
                    self.set_hold(fk, Hold::Init(token));
                    return Ok(SessionStep::Go(None));
                }
                Acquire::Wait(token) => {
                    self.set_state(fk, State::Waiting(token));
                    self.waiters.insert(token, fk);
                    return Ok(SessionStep::Wait);
                }
                Acquire::Bound { binding, lease } => {
                    // A binding to a worker that no longer exists in that shape (gone, another
                    // role, fewer ranks) or that takes nothing new (ejected, draining) has no
                    // cache to offer, in either mode: start over. `Hard` means the session
                    // never moves while its worker is available, not that it dies with it.
                    if !self.still_fits(binding, fk.1) || !self.can_serve(binding.worker, fk.1) {
                        let _ = self.affinity.release(now, lease);
                        self.invalidate_session(&session, fk.1, binding.revision);
                        continue;
                    }
                    self.set_hold(fk, Hold::Lease(lease, binding.revision));
                    return Ok(SessionStep::Go(Some(binding)));
                }
            }
        }
        Err(RouteError::WorkerGone)
    }

    /// True when the request's only pin is a soft session binding.
    fn soft_binding_only(&self, fk: FlightKey, binding: Option<Binding>) -> bool {
        self.cfg.affinity.mode == AffinityMode::Soft
            && binding.is_some()
            && self.flights.get(&fk).is_some_and(|f| pin::explicit_pin(fk.1, &f.req.hints).is_none())
    }

    /// Releases the flight's lease and invalidates the binding it was taken on.
    fn drop_binding(&mut self, now: Instant, fk: FlightKey) {
        let Some(f) = self.flights.get_mut(&fk) else { return };
        if let Hold::Lease(lease, revision) = f.hold {
            f.hold = Hold::None;
            if let Some(s) = f.req.session.clone() {
                self.invalidate_session(&s, fk.1, revision);
            }
            let _ = self.affinity.release(now, lease);
        }
    }

    /// The bound worker still exists, serves the phase, and has the bound rank.
    fn still_fits(&self, b: Binding, phase: Phase) -> bool {
        self.workers
            .get(b.worker)
            .is_some_and(|s| s.role.serves(phase) && b.rank.is_none_or(|r| s.dp_ranks.is_none_or(|n| r.0 < n)))
    }

    fn can_serve(&self, worker: WorkerId, phase: Phase) -> bool {
        matches!(self.workers.health(worker), Some(Health::Healthy))
            && self.workers.get(worker).is_some_and(|s| s.role.serves(phase))
    }

    /// Pins, eligibility, prefix match and selection. With `commit`, books the choice.
    fn place(
        &mut self,
        now: Instant,
        fk: FlightKey,
        binding: Option<Binding>,
        commit: bool,
    ) -> Result<Placed, RouteError> {
        let Some(flight) = self.flights.get(&fk) else {
            return Err(RouteError::WorkerGone);
        };
        let req = &flight.req;
        let mut draw = flight.draw;
        let phase = fk.1;
        let affinity = binding.map(|b| AffinityPin { worker: b.worker, rank: b.rank });
        let direct = self.cfg.mode == RouterMode::Direct;
        let pin =
            pin::resolve(phase, &req.hints, affinity, req.planned, &self.workers, direct).map_err(RouteError::Pin)?;

        let mut verdicts = mem::take(&mut self.scratch_verdicts);
        verdicts.clear();
        let (load, remote) = (&self.load, &self.remote);
        let q = EligibilityQuery {
            phase,
            hints: &req.hints,
            pin: &pin,
            failed: &req.failed_workers,
            ignore_overload: affinity.is_some() && pin::explicit_pin(phase, &req.hints).is_none(),
            same_label_as: req.same_label_as.as_ref().map(|(k, v)| (k.as_str(), v.as_str())),
        };
        let combined = |k| remote.combined(k, load.load(k));
        let filtered = eligible::filter(&q, &self.workers, &combined, &self.cfg.eligibility, &mut verdicts);
        if let Err(e) = filtered {
            self.scratch_verdicts = verdicts;
            return Err(RouteError::Eligibility(e));
        }

        let mut scores = mem::take(&mut self.scratch_scores);
        scores.clear();
        // Exact overlaps for every worker: an early exit would report the best one's overlap
        // as where the runner-up stopped, hiding how much its cache saves.
        self.index.find_matches(&req.blocks, false, &mut scores);
        if self.cfg.approximate {
            // A worker's overlap is the larger of its exact and predicted ones. With the
            // engines' tokens, predictions exist only for workers that publish no events
            // (exact overlap 0); with estimated tokens, both may exist and either may hit.
            let mut predicted = mem::take(&mut self.scratch_approx);
            self.approx.find_matches(now, &req.blocks, &mut predicted);
            for (key, o) in predicted.iter() {
                scores.raise_device(key, o.device);
            }
            self.scratch_approx = predicted;
        }
        let bs = self.cfg.block_size.tokens();
        let max_overlap_blocks = scores.max_raw();

        if eligible::all_overloaded(&verdicts) {
            let cached_tokens = max_overlap_blocks.saturating_mul(bs).min(req.isl_tokens);
            self.scratch_verdicts = verdicts;
            self.scratch_scores = scores;
            return Ok(Placed::AllBusy { cached_tokens });
        }
        // After the busy check: a pin to a worker that is only busy queues, it does not fail.
        if let Err(e) = pin::check_pinned(&pin, &verdicts) {
            self.scratch_verdicts = verdicts;
            self.scratch_scores = scores;
            return Err(RouteError::Pin(e));
        }

        let candidates: Vec<Candidate> = verdicts
            .iter()
            .filter_map(|v| match v.verdict {
                Verdict::Eligible { cost_factor } => {
                    let spec = self.workers.get(v.key.worker);
                    let progress = self.remote.combined_progress(v.key, self.load.prefill_progress(v.key));
                    let (new_decode_blocks, inflight_prefix_blocks) = self.inflight_blocks(v.key, &req.blocks);
                    let kv_blocks = spec.map_or(0, |s| s.kv_blocks);
                    let kv_resolved = if kv_blocks == 0 { self.cfg.cost.timing.kv_blocks_default } else { kv_blocks };
                    let own = self.combined_load(v.key);
                    Some(Candidate {
                        key: v.key,
                        load: self.learn.fold_load(now, v.key, own, progress.requests, kv_resolved),
                        overlap: if self.untrusted.contains(&v.key) { Overlap::default() } else { scores.get(v.key) },
                        new_decode_blocks,
                        inflight_prefix_blocks,
                        weight: spec.map_or(1, |s| s.weight),
                        cost_factor: cost_factor * self.learn.cost_scale(v.key, phase),
                        kv_blocks,
                        max_batched_tokens: spec.map_or(0, |s| s.max_batched_tokens),
                        prefill_requests: progress.requests,
                        prefill_busy_ms: progress.busy_since.map_or(0, |t| now.micros_since(t) / 1000),
                        prefill_done_tokens: progress.done_tokens,
                    })
                }
                Verdict::Excluded(_) => None,
            })
            .collect();
        let sreq = SelectRequest {
            mode: self.cfg.mode,
            phase,
            cost: self.cfg.cost.with(&req.cost),
            isl_tokens: req.isl_tokens,
            block_size: self.cfg.block_size,
            expected_output_blocks: expected_blocks(req.expected_output_tokens, bs),
            direct: match pin {
                PinResolution::Exact(k) => Some(k),
                _ => None,
            },
        };
        let selection = self.selector.select(&sreq, &candidates, &mut draw, commit);
        let explanation = explain(&verdicts, &scores, selection.as_ref().map(|s| &s.scores[..]).unwrap_or(&[]));
        self.scratch_verdicts = verdicts;
        self.scratch_scores = scores;
        let selection = selection.map_err(RouteError::Select)?;
        let target = selection.chosen;
        let overlap = explanation.iter().find(|r| r.key == target).map_or(Overlap::default(), |r| r.overlap);
        if commit {
            let req = &self.flights[&fk].req;
            // The booking counts what the index says is cached; the in-flight prefix only
            // informs the cost, so load accounting stays exact against the index.
            let cached = overlap.device.saturating_mul(bs).min(req.isl_tokens);
            let prefill_tokens = if phase == Phase::Decode { 0 } else { req.isl_tokens - cached };
            let out_blocks = expected_blocks(req.expected_output_tokens, bs);
            if let Err(_e) = self.load.add_with_remote(
                now,
                fk.0,
                phase,
                target,
                &req.blocks,
                prefill_tokens,
                out_blocks,
                &mut self.remote,
            ) {
                return Err(RouteError::TooManyRequests { requests_max: self.cfg.load.requests_max });
            }
            self.publish_added(fk, target, prefill_tokens, out_blocks);
        }
        let req = &self.flights[&fk].req;
        Ok(Placed::Routed(Routed {
            id: fk.0,
            phase,
            target,
            overlap,
            max_overlap_blocks,
            request_blocks: req.blocks.len() as u32,
            explanation,
            preview: !commit,
        }))
    }

    fn enqueue(&mut self, now: Instant, fk: FlightKey, cached_tokens: u32) -> Result<Decision, RouteError> {
        let ticket = RequestId(self.next_ticket);
        self.next_ticket += 1;
        let req = &self.flights[&fk].req;
        let entry = QueueEntry {
            req: ticket,
            strict_priority: req.priority.strict,
            priority_jump_ms: req.priority.jump_ms,
            isl_tokens: req.isl_tokens,
            cached_tokens,
            class: req.priority.class.clone(),
        };
        match self.queue.push(now, entry) {
            Ok(()) => {
                self.tickets.insert(ticket, fk);
                self.set_state(fk, State::Queued(ticket));
                self.stats.queued += 1;
                Ok(Decision::Queued)
            }
            Err(AdmissionError::Rejected(rej)) => {
                self.stats.rejected += 1;
                self.drop_flight(now, fk, false);
                Ok(Decision::Rejected(rej))
            }
            Err(_) => {
                self.drop_flight(now, fk, false);
                Err(RouteError::DuplicateRequest { id: fk.0, phase: fk.1 })
            }
        }
    }

    /// Re-tries queued requests in queue order until one still finds every worker busy.
    pub(super) fn drain_queue(&mut self, now: Instant) {
        while let Some(ticket) = self.queue.peek().map(|e| e.req) {
            let Some(&fk) = self.tickets.get(&ticket) else {
                let _ = self.queue.pop();
                continue;
            };
            let binding = self.binding_of(fk);
            let mut placed = self.place(now, fk, binding, true);
            if matches!(placed, Err(RouteError::Pin(_))) && self.soft_binding_only(fk, binding) {
                self.drop_binding(now, fk);
                placed = self.place(now, fk, None, true);
            }
            match placed {
                Ok(Placed::AllBusy { .. }) => return,
                Ok(Placed::Routed(r)) => {
                    let _ = self.queue.pop();
                    self.tickets.remove(&ticket);
                    self.set_state(fk, State::Booked(r.target));
                    self.outputs.push_back(Output::Routed(r));
                }
                Err(error) => {
                    let _ = self.queue.pop();
                    self.tickets.remove(&ticket);
                    self.set_state(fk, State::New);
                    self.drop_flight(now, fk, false);
                    self.outputs.push_back(Output::Failed { id: fk.0, phase: fk.1, error });
                }
            }
        }
    }

    /// Turns affinity outputs into router outputs; woken waiters go through the pipeline.
    ///
    /// Not re-entrant: a waiter's failure releases its hold, which can wake the next
    /// waiter; the outer loop picks that up instead of recursing once per waiter.
    pub(super) fn drain_affinity(&mut self, now: Instant) {
        if self.draining_affinity {
            return;
        }
        self.draining_affinity = true;
        while let Some(out) = self.affinity.poll_output() {
            match out {
                AffinityOutput::Woken(token) => self.wake(now, token),
                AffinityOutput::Expired { worker, phase } => {
                    self.outputs.push_back(Output::LeaseExpired { worker, phase })
                }
                _ => {}
            }
        }
        self.draining_affinity = false;
    }

    fn wake(&mut self, now: Instant, token: WaitToken) {
        let Some(fk) = self.waiters.remove(&token) else {
            return;
        };
        self.set_state(fk, State::New);
        match self.admit(now, fk) {
            Ok(Decision::Routed(r)) => self.outputs.push_back(Output::Routed(r)),
            Ok(Decision::Rejected(rejection)) => {
                self.outputs.push_back(Output::Rejected { id: fk.0, phase: fk.1, rejection })
            }
            Ok(_) => {}
            Err(error) => {
                self.drop_flight(now, fk, false);
                self.outputs.push_back(Output::Failed { id: fk.0, phase: fk.1, error });
            }
        }
    }

    fn binding_of(&self, fk: FlightKey) -> Option<Binding> {
        let f = self.flights.get(&fk)?;
        match f.hold {
            Hold::Lease(..) => f.req.session.as_ref().and_then(|s| self.affinity.peek(s, fk.1)),
            _ => None,
        }
    }

    /// Removes a flight and releases whatever it holds. `invalidate` drops the session's
    /// binding too (the worker failed it).
    pub(super) fn drop_flight(&mut self, now: Instant, fk: FlightKey, invalidate: bool) {
        let Some(f) = self.flights.remove(&fk) else { return };
        match f.state {
            State::Booked(_) | State::Dispatched(_) => {
                let _ = self.load.free_with_remote(fk.0, fk.1, &mut self.remote);
                self.publish(ReplicaUpdate::Finished { id: fk.0, phase: fk.1 });
            }
            State::Queued(ticket) => {
                let _ = self.queue.cancel(ticket);
                self.tickets.remove(&ticket);
            }
            State::Waiting(token) => {
                self.waiters.remove(&token);
                let _ = self.affinity.cancel_wait(token);
            }
            State::Orphaned(deadline) => {
                self.orphan_timers.remove(&(deadline, fk));
            }
            State::New => {}
        }
        match f.hold {
            Hold::None => {}
            Hold::Init(token) => {
                let _ = self.affinity.abort(token);
            }
            Hold::Lease(lease, revision) => {
                // The revision the lease was taken on: a newer binding survives a late failure.
                if let (true, Some(s)) = (invalidate, &f.req.session) {
                    self.invalidate_session(s, fk.1, revision);
                }
                // Only a request its worker took renews the binding's idle time.
                let _ = if matches!(f.state, State::Dispatched(_)) {
                    self.affinity.release(now, lease)
                } else {
                    self.affinity.release_unserved(now, lease)
                };
            }
        }
        self.drain_affinity(now);
    }

    pub(super) fn remove_worker(&mut self, now: Instant, id: WorkerId) {
        self.workers.remove(id);
        self.index.remove_worker(id);
        self.approx.remove_worker(id);
        self.load.remove_worker_with_remote(id, &mut self.remote);
        self.remote.remove_worker(id);
        self.affinity.invalidate_worker(id);
        self.event_workers.remove(&id);
        self.untrusted.retain(|k| k.worker != id);
        self.learn.remove_worker(id);
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
            self.publish(ReplicaUpdate::Finished { id: fk.0, phase: fk.1 });
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
            self.outputs.push_back(Output::BookingExpired { id: fk.0, phase: fk.1 });
        }
    }

    fn set_state(&mut self, fk: FlightKey, s: State) {
        if let Some(f) = self.flights.get_mut(&fk) {
            f.state = s;
        }
    }

    fn set_hold(&mut self, fk: FlightKey, h: Hold) {
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
        let total = self.load.total();
        if total.active_requests as usize != booked || self.load.len() != booked {
            return Err(InvariantViolation(format!(
                "load tracks {} requests ({} bookings), router has {booked} booked",
                total.active_requests,
                self.load.len()
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
        self.remote.check().map_err(InvariantViolation)?;
        self.remote.check_shared(&self.load).map_err(InvariantViolation)?;
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

/// Most orphaned requests one `handle_timeout` drops.
/// Most orphaned requests (bookings whose worker left) one [`Router::handle_timeout`]
/// call expires; `poll_timeout` stays due while more are.
pub const ORPHANS_PER_CALL_MAX: usize = 1024;

enum SessionStep {
    Wait,
    Go(Option<Binding>),
}

fn expected_blocks(tokens: Option<u32>, block_tokens: u32) -> u32 {
    tokens.map_or(0, |t| t.div_ceil(block_tokens))
}

fn explain(
    verdicts: &[Eligibility],
    scores: &OverlapScores,
    selected: &[crate::select::CandidateScore],
) -> Vec<ExplainRow> {
    verdicts
        .iter()
        .map(|v| ExplainRow {
            key: v.key,
            overlap: scores.get(v.key),
            score: selected.binary_search_by_key(&v.key, |s| s.key).ok().map(|i| selected[i]),
            excluded: match &v.verdict {
                Verdict::Excluded(r) => Some(r.clone()),
                Verdict::Eligible { .. } => None,
            },
        })
        .collect()
}
