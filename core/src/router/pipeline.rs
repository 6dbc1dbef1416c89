//! The decision pipeline behind `handle_request`: session, pins, eligibility, prefix
//! match, selection, then booking or queueing. Ending a flight lives in `flights`.

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
        let binding = self.unless_refused(fk, binding);
        let placed = match self.place(now, fk, self.placing(fk, binding), true) {
            Err(RouteError::Pin(_)) if self.soft_binding_only(fk, binding) => self.place_afresh(now, fk)?,
            other => other?,
        };
        match placed {
            Placed::Routed(r) => {
                self.follow(now, fk, binding, &r);
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
        let fk = FlightKey::new(req.id, phase);
        // The pipeline reads the request from the flight table; a preview borrows a slot
        // there for the duration of the call and always gives it back.
        let hold = Hold::Preview(req.session.is_some() && binding.is_none());
        let saved = self.flights.insert(fk, Flight { req: req.clone(), draw, state: State::New, hold });
        let binding = self.placing(fk, binding);
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
            match self.affinity.acquire(now, &session, fk.phase).map_err(RouteError::Affinity)? {
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
                    if !self.still_fits(binding, fk.phase) || !self.can_serve(binding.worker, fk.phase) {
                        let released = self.affinity.release(now, lease);
                        debug_assert!(released.is_ok(), "a lease just acquired is known: {released:?}");
                        self.invalidate_session(&session, fk.phase, binding.revision);
                        continue;
                    }
                    self.set_hold(fk, Hold::Lease(lease, binding.revision));
                    return Ok(SessionStep::Go(Some(binding)));
                }
            }
        }
        Err(RouteError::WorkerGone)
    }

    /// The binding to place by: none when its worker already refused this request (a
    /// retry) and no explicit pin names it. The flight keeps its lease, so the binding
    /// stays where it is and this one request goes elsewhere.
    fn unless_refused(&self, fk: FlightKey, binding: Option<Binding>) -> Option<Binding> {
        let refused = |b: &Binding| {
            self.flights.get(&fk).is_some_and(|f| {
                f.req.failed_workers.contains(&b.worker) && pin::explicit_pin(fk.phase, &f.req.hints).is_none()
            })
        };
        binding.filter(|b| !refused(b))
    }

    /// True when the request's only pin is a soft session binding.
    fn soft_binding_only(&self, fk: FlightKey, binding: Option<Binding>) -> bool {
        self.cfg.affinity.mode == AffinityMode::Soft && self.binding_only(fk, binding)
    }

    /// True when the request has a session binding and no explicit pin.
    fn binding_only(&self, fk: FlightKey, binding: Option<Binding>) -> bool {
        binding.is_some() && self.flights.get(&fk).is_some_and(|f| pin::explicit_pin(fk.phase, &f.req.hints).is_none())
    }

    /// The binding the request is placed by: none in [`AffinityMode::Cost`] when it is
    /// the only pin (the selector weighs the bound worker like the others).
    fn placing(&self, fk: FlightKey, binding: Option<Binding>) -> Option<Binding> {
        if self.cfg.affinity.mode == AffinityMode::Cost && self.binding_only(fk, binding) {
            return None;
        }
        binding
    }

    /// In [`AffinityMode::Cost`], a request placed away from its session's worker
    /// releases the binding: the session's next request binds where it goes.
    fn follow(&mut self, now: Instant, fk: FlightKey, binding: Option<Binding>, r: &Routed) {
        let moved = binding.is_some_and(|b| b.worker != r.target.worker);
        if moved && self.cfg.affinity.mode == AffinityMode::Cost && self.binding_only(fk, binding) {
            self.drop_binding(now, fk);
        }
    }

    /// Places a request whose soft binding could not take it as if it had none. A soft
    /// binding is a preference: it is dropped once the request can go elsewhere, and kept
    /// when it cannot (a failed request leaves no trace, and a queued request of the same
    /// session may still be placed by it).
    fn place_afresh(&mut self, now: Instant, fk: FlightKey) -> Result<Placed, RouteError> {
        let placed = self.place(now, fk, None, true)?;
        self.drop_binding(now, fk);
        Ok(placed)
    }

    /// Releases the flight's lease and invalidates the binding it was taken on.
    fn drop_binding(&mut self, now: Instant, fk: FlightKey) {
        let Some(f) = self.flights.get_mut(&fk) else { return };
        if let Hold::Lease(lease, revision) = f.hold {
            f.hold = Hold::None;
            if let Some(s) = f.req.session.clone() {
                self.invalidate_session(&s, fk.phase, revision);
            }
            let released = self.affinity.release(now, lease);
            debug_assert!(released.is_ok(), "a held lease is known: {released:?}");
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
        let mut scratch = mem::take(&mut self.scratch);
        let placed = self.place_with(now, fk, binding, commit, &mut scratch);
        self.scratch = scratch;
        placed
    }

    /// [`Self::place`] with the reusable buffers lent out.
    fn place_with(
        &mut self,
        now: Instant,
        fk: FlightKey,
        binding: Option<Binding>,
        commit: bool,
        scratch: &mut Scratch,
    ) -> Result<Placed, RouteError> {
        let Some(flight) = self.flights.get(&fk) else {
            return Err(RouteError::WorkerGone);
        };
        let req = &flight.req;
        let mut draw = flight.draw;
        let phase = fk.phase;
        // The first request of a session places every later one (a preview of it too).
        let starts_session = matches!(flight.hold, Hold::Init(_) | Hold::Preview(true));
        let affinity = binding.map(|b| AffinityPin { worker: b.worker, rank: b.rank });
        let direct = self.cfg.mode == RouterMode::Direct;
        let pin =
            pin::resolve(phase, &req.hints, affinity, req.planned, &self.workers, direct).map_err(RouteError::Pin)?;

        let Scratch { verdicts, scores, approx: predicted } = scratch;
        verdicts.clear();
        let q = EligibilityQuery {
            phase,
            hints: &req.hints,
            pin: &pin,
            failed: &req.failed_workers,
            ignore_overload: affinity.is_some() && pin::explicit_pin(phase, &req.hints).is_none(),
            same_label_as: req.same_label_as.as_ref().map(|(k, v)| (k.as_str(), v.as_str())),
        };
        let load = &self.load;
        let combined = |k| load.combined(k);
        eligible::filter(&q, &self.workers, &combined, &self.cfg.eligibility, verdicts)
            .map_err(RouteError::Eligibility)?;

        scores.clear();
        // Exact overlaps for every worker: an early exit would report the best one's overlap
        // as where the runner-up stopped, hiding how much its cache saves.
        self.index.find_matches(&req.blocks, false, scores);
        let foreign = !self.foreign_tokens.is_empty();
        if self.cfg.approximate || self.cfg.request_tokens == RequestTokens::Estimated || foreign {
            // A worker's overlap is the larger of its exact and predicted ones. With the
            // engines' tokens, predictions exist only for workers that publish no events
            // (exact overlap 0) or whose tokens differ; with estimated tokens, both may
            // exist and either may hit.
            self.approx.find_matches(now, &req.blocks, predicted);
            for (key, o) in predicted.iter() {
                scores.raise_device(key, o.device);
            }
        }
        let bs = self.cfg.block_size.tokens();
        let max_overlap_blocks = scores.max_raw();

        if eligible::all_overloaded(verdicts) {
            let cached_tokens = max_overlap_blocks.saturating_mul(bs).min(req.isl_tokens);
            return Ok(Placed::AllBusy { cached_tokens });
        }
        // After the busy check: a pin to a worker that is only busy queues, it does not fail.
        eligible::check_pinned(&pin, verdicts).map_err(RouteError::Pin)?;

        let mut candidates: Vec<Candidate> = verdicts
            .iter()
            .filter_map(|v| match v.verdict {
                Verdict::Eligible { cost_factor } => {
                    let spec = self.workers.get(v.key.worker);
                    let progress = self.load.combined_progress(v.key);
                    let (new_decode_blocks, inflight_prefix_blocks) = self.inflight_blocks(v.key, &req.blocks);
                    let kv_blocks = spec.map_or(0, |s| s.kv_blocks);
                    let kv_resolved = if kv_blocks == 0 { self.cfg.cost.timing.kv_blocks_default } else { kv_blocks };
                    let own = self.combined_load(v.key);
                    let scales = self.learn.cost_scales(now, v.key, phase);
                    Some(Candidate {
                        key: v.key,
                        load: self.learn.fold_load(now, v.key, own, progress.requests, kv_resolved),
                        overlap: if self.untrusted.contains(&v.key) { Overlap::default() } else { scores.get(v.key) },
                        new_decode_blocks,
                        inflight_prefix_blocks,
                        prefix_best_blocks: 0,
                        weight: spec.map_or(1, |s| s.weight),
                        cost_factor: cost_factor * scales.factor,
                        kv_blocks,
                        cached_blocks: self.index.worker_entries(v.key),
                        max_batched_tokens: spec.map_or(0, |s| s.max_batched_tokens),
                        prefill_requests: progress.requests,
                        prefill_busy_ms: progress.busy_since.map_or(0, |t| now.micros_since(t) / 1000),
                        prefill_done_tokens: progress.done_tokens,
                        prefill_scale: scales.prefill_scale,
                        decode_weight: scales.decode_weight,
                        cold_ms: self.warmth.cold_ms(&self.cfg.cost.timing, now, v.key, own.active_requests)
                            * self.learn.cold_weight(&scales),
                    })
                }
                Verdict::Excluded(_) => None,
            })
            .collect();
        if starts_session {
            self.count_returning(now, phase, &mut candidates);
        }
        let held = |c: &Candidate| c.overlap.device.max(c.inflight_prefix_blocks);
        let best = candidates.iter().map(held).max().unwrap_or(0);
        let holders = candidates.iter().filter(|c| held(c) == best).count();
        for c in &mut candidates {
            c.prefix_best_blocks = best;
            // A holder of the longest prefix pays no cold wait: leaving it costs hits a
            // cold pass only delays (in replay of the real fleet's agentic workload it
            // kept every trace's hits at the text-tree rule's, for 2% of the TTFT).
            if best > 0 && held(c) == best {
                c.cold_ms = 0.0;
            }
        }
        let mut cost = self.cfg.cost.with(&req.cost);
        cost.ttft = if starts_session {
            cost.ttft.session_start()
        } else {
            let prefix = req.blocks.get(..best as usize).unwrap_or(&req.blocks);
            cost.ttft.for_holding(best, holders, req.blocks.len(), || self.prompt_ends.continued(prefix))
        };
        let sreq = SelectRequest {
            mode: self.cfg.mode,
            phase,
            cost,
            isl_tokens: req.isl_tokens,
            block_size: self.cfg.block_size,
            expected_output_blocks: expected_blocks(req.expected_output_tokens, bs),
            direct: match pin {
                PinResolution::Exact(k) => Some(k),
                _ => None,
            },
            decode_time_floor_ms: 0.0, // The selector works it out.
        };
        let selection = self.selector.select(&sreq, &candidates, &mut draw, commit);
        let explanation = explain(verdicts, scores, selection.as_ref().map(|s| &s.scores[..]).unwrap_or(&[]));
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
            // Asked only with a cold term on: no lookup on the hot path otherwise.
            let load = &self.load;
            let running = || load.combined(target).active_requests;
            let was_idle = self.warmth.tracks(&self.cfg.cost.timing) && running() == 0;
            if let Err(_e) = self.load.add(now, fk.id, phase, target, &req.blocks, prefill_tokens, out_blocks) {
                return Err(RouteError::TooManyRequests { requests_max: self.cfg.load.requests_max });
            }
            if was_idle {
                self.warmth.began_idle(&self.cfg.cost.timing, now, target);
            }
            self.prompt_ends.record(&req.blocks, self.cfg.prompt_end_blocks);
            self.publish_added(fk, target, prefill_tokens, out_blocks);
        }
        let req = &self.flights[&fk].req;
        Ok(Placed::Routed(Routed {
            id: fk.id,
            phase,
            target,
            overlap,
            max_overlap_blocks,
            request_blocks: req.blocks.len() as u32,
            explanation,
            preview: !commit,
        }))
    }

    /// Adds to each candidate's requests the sessions bound there whose last request
    /// ended within `session_return_ms`: for a session's start, they are requests due.
    /// With `session_return_scaled`, only the share of them the fleet's load says will
    /// be running (see [`running_share`]).
    fn count_returning(&self, now: Instant, phase: Phase, candidates: &mut [Candidate]) {
        let weights = &self.cfg.cost.ttft;
        if weights.session_return_ms == 0 {
            return;
        }
        let mut returning = Vec::new();
        self.affinity.returning(now, phase, weights.session_return_ms, &mut returning);
        let share = if weights.session_return_scaled { running_share(candidates, &returning) } else { 1.0 };
        for c in candidates {
            if let Some(&(_, n)) = returning.iter().find(|(w, _)| *w == c.key.worker) {
                // Rounded down: a session is counted only when one is expected back.
                let due = (f64::from(n) * share) as u32;
                c.load.active_requests = c.load.active_requests.saturating_add(due);
            }
        }
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
            tenant: req.tenant,
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
                Err(RouteError::DuplicateRequest { id: fk.id, phase: fk.phase })
            }
        }
    }

    /// Re-tries queued requests in queue order until one still finds every worker busy.
    pub(super) fn drain_queue(&mut self, now: Instant) {
        self.unbound = false;
        while let Some(ticket) = self.queue.peek().map(|e| e.req) {
            let Some(&fk) = self.tickets.get(&ticket) else {
                self.pop_peeked();
                continue;
            };
            let binding = self.unless_refused(fk, self.binding_of(fk));
            let mut placed = self.place(now, fk, self.placing(fk, binding), true);
            if matches!(placed, Err(RouteError::Pin(_))) && self.soft_binding_only(fk, binding) {
                placed = self.place_afresh(now, fk);
            }
            match placed {
                Ok(Placed::AllBusy { .. }) => return,
                Ok(Placed::Routed(r)) => {
                    self.follow(now, fk, binding, &r);
                    self.pop_peeked();
                    self.tickets.remove(&ticket);
                    self.set_state(fk, State::Booked(r.target));
                    self.outputs.push_back(Output::Routed(r));
                }
                Err(error) => {
                    self.pop_peeked();
                    self.tickets.remove(&ticket);
                    self.set_state(fk, State::New);
                    self.drop_flight(now, fk, false);
                    self.outputs.push_back(Output::Failed { id: fk.id, phase: fk.phase, error });
                }
            }
        }
    }

    /// Pops the entry `drain_queue` just peeked at.
    fn pop_peeked(&mut self) {
        let popped = self.queue.pop();
        debug_assert!(popped.is_some(), "the queue's head was just peeked");
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
                self.outputs.push_back(Output::Rejected { id: fk.id, phase: fk.phase, rejection })
            }
            Ok(_) => {}
            Err(error) => {
                self.drop_flight(now, fk, false);
                self.outputs.push_back(Output::Failed { id: fk.id, phase: fk.phase, error });
            }
        }
    }

    fn binding_of(&self, fk: FlightKey) -> Option<Binding> {
        let f = self.flights.get(&fk)?;
        match f.hold {
            Hold::Lease(..) => f.req.session.as_ref().and_then(|s| self.affinity.peek(s, fk.phase)),
            _ => None,
        }
    }
}

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

/// The share of the fleet's sessions that are in a request rather than between calls:
/// the candidates' running requests over those plus the sessions `returning` counts.
/// 0 on an idle fleet.
fn running_share(candidates: &[Candidate], returning: &[(WorkerId, u32)]) -> f64 {
    let running: f64 = candidates.iter().map(|c| f64::from(c.load.active_requests)).sum();
    let between: f64 = returning.iter().map(|&(_, n)| f64::from(n)).sum();
    if running > 0.0 {
        running / (running + between)
    } else {
        0.0
    }
}
