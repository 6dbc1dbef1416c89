//! Requests in the soak: arrivals, the router's answers and outputs, dispatch to an
//! engine, cancellation, and the harness's view of where each request stands. Every
//! router answer is checked against that view, so a request ends exactly once.

use router_core::{
    hash_tokens, BlockSize, Decision, DispatchFailure, Draw, HashSeed, Output, Phase, Request, RequestId, WorkerId,
};

use super::{Soak, BLOCK_TOKENS};

const AGG: Phase = Phase::Aggregated;

/// Where a request stands, as the adapter (the harness) knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum St {
    /// In the admission queue, or behind its session's first request (a woken waiter
    /// may enter the queue without an output, so the adapter cannot tell which).
    Pending,
    /// Routed to a worker, not dispatched yet.
    Booked(WorkerId),
    /// Streaming from the worker.
    Running(WorkerId),
    /// Finished on the worker, but the report never reached the router.
    Lost(WorkerId),
    /// Its worker left and its end was never reported.
    Orphan,
}

/// One request the router tracks.
#[derive(Clone, Debug)]
pub struct Req {
    pub tokens: Vec<u32>,
    pub output_len: u32,
    pub session: bool,
    pub st: St,
}

impl Req {
    /// Whether the router holds a booking for it on `w` (load counted there).
    pub fn booked_on(&self) -> Option<WorkerId> {
        match self.st {
            St::Booked(w) | St::Running(w) | St::Lost(w) => Some(w),
            _ => None,
        }
    }

    /// Whether it is a stream the adapter has not ended (it may hold a lease).
    pub fn is_stream(&self) -> bool {
        self.booked_on().is_some() || self.st == St::Orphan
    }
}

impl Soak {
    pub(super) fn arrive(&mut self, n: u64) -> Result<(), String> {
        for _ in 0..n {
            self.arrive_one()?;
        }
        Ok(())
    }

    fn arrive_one(&mut self) -> Result<(), String> {
        let id = self.next_request;
        self.next_request += 1;
        self.tally.requests += 1;
        let doc = &self.docs[self.rng.below(self.docs.len() as u64) as usize];
        let keep = doc.len() / 2 + self.rng.below(doc.len() as u64 / 2 + 1) as usize;
        let mut tokens = doc[..keep].to_vec();
        let tail = self.rng.below(48);
        tokens.extend((0..tail).map(|_| 60_000 + self.rng.below(30_000) as u32));
        let output_len = 1 + self.rng.below(48) as u32;
        let session = match self.rng.below(10) {
            0..=3 => None,
            4..=7 => Some(format!("hot-{}", self.rng.below(8))),
            _ => Some(format!("cold-{id}")),
        };
        let mut blocks = Vec::new();
        let bs = BlockSize::new(BLOCK_TOKENS).expect("valid block size");
        hash_tokens(&tokens, bs, HashSeed::DEFAULT, &[], &mut blocks);
        let request = Request {
            id: RequestId(id),
            blocks: blocks.iter().map(|b| b.seq).collect(),
            isl_tokens: tokens.len() as u32,
            session: session.clone().map(String::into_bytes),
            expected_output_tokens: (self.rng.below(2) == 0).then_some(output_len),
            ..Request::default()
        };
        let draw = Draw(self.rng.next_u64());
        let decision = self.router.handle_request(self.now(), request, draw);
        let st = match decision {
            Ok(Decision::Routed(r)) => {
                self.tally.routed += 1;
                self.check_target(id, r.target.worker)?;
                Some(St::Booked(r.target.worker))
            }
            Ok(Decision::Queued) => {
                self.tally.queued += 1;
                Some(St::Pending)
            }
            Ok(Decision::Waiting) => {
                self.tally.waiting += 1;
                Some(St::Pending)
            }
            Ok(_) | Err(_) => {
                self.tally.refused += 1;
                None
            }
        };
        if let Some(st) = st {
            self.reqs.insert(id, Req { tokens, output_len, session: session.is_some(), st });
        }
        self.drain_router_checked()
    }

    /// A routed request goes to a worker of the fleet that takes new work.
    fn check_target(&self, id: u64, w: WorkerId) -> Result<(), String> {
        match self.fleet.get(&w) {
            Some(m) if m.health == router_core::Health::Healthy => Ok(()),
            Some(m) => Err(format!("request {id} routed to {w:?}, which is {:?}", m.health)),
            None => Err(format!("request {id} routed to {w:?}, which is not in the fleet")),
        }
    }

    /// Applies every router output to the harness's view; an output that does not fit
    /// the request's state is a failure.
    pub(super) fn drain_router_checked(&mut self) -> Result<(), String> {
        while let Some(out) = self.router.poll_output() {
            let (id, allowed): (u64, &[&str]) = match &out {
                Output::Routed(r) => (r.id.0, &["Pending"]),
                Output::Failed { id, .. } => (id.0, &["Pending"]),
                Output::Rejected { id, .. } => (id.0, &["Pending"]),
                Output::TimedOut { id, .. } => (id.0, &["Pending"]),
                Output::BookingExpired { id, .. } => (id.0, &["Booked", "Running", "Lost", "Orphan"]),
                _ => continue,
            };
            let Some(req) = self.reqs.get_mut(&id) else {
                return Err(format!("output {out:?} for a request the adapter no longer has"));
            };
            let name = format!("{:?}", req.st);
            if !allowed.iter().any(|a| name.starts_with(a)) {
                return Err(format!("output {out:?} for request {id} in state {name}"));
            }
            match out {
                Output::Routed(r) => {
                    req.st = St::Booked(r.target.worker);
                    self.tally.routed += 1;
                    self.check_target(id, r.target.worker)?;
                }
                Output::TimedOut { .. } => {
                    self.tally.timed_out += 1;
                    self.reqs.remove(&id);
                }
                Output::BookingExpired { .. } => {
                    self.tally.booking_expired += 1;
                    self.reqs.remove(&id);
                }
                _ => {
                    self.tally.refused += 1;
                    self.reqs.remove(&id);
                }
            }
        }
        Ok(())
    }

    /// The client of a random tracked request goes away, whatever its state.
    pub(super) fn cancel_one(&mut self) -> Result<(), String> {
        let n = self.reqs.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let id = *self.reqs.keys().nth(self.rng.below(n) as usize).expect("in range");
        let st = self.reqs[&id].st;
        self.router.handle_cancel(self.now(), RequestId(id), AGG).map_err(|e| format!("cancel {id} ({st:?}): {e}"))?;
        self.reqs.remove(&id);
        self.tally.cancelled += 1;
        self.drain_router_checked()
    }

    /// Booked requests reach their engine (most at once, some a step later); a few
    /// fail to connect.
    pub(super) fn dispatch_booked(&mut self) -> Result<(), String> {
        let booked: Vec<(u64, WorkerId)> = self
            .reqs
            .iter()
            .filter_map(|(&id, r)| match r.st {
                St::Booked(w) => Some((id, w)),
                _ => None,
            })
            .collect();
        for (id, w) in booked {
            if self.rng.below(5) == 0 || self.reqs.get(&id).map(|r| r.st) != Some(St::Booked(w)) {
                continue;
            }
            let now = self.now();
            let clock = self.clock_ms as f64;
            let fail = self.pct(self.knobs.connect_fail_pct);
            let req = &self.reqs[&id];
            let sent =
                !fail && self.fleet.get_mut(&w).is_some_and(|m| m.sim.submit(clock, id, &req.tokens, req.output_len));
            if sent {
                self.router.handle_dispatched(now, RequestId(id), AGG).map_err(|e| format!("dispatched {id}: {e}"))?;
                self.reqs.get_mut(&id).expect("present").st = St::Running(w);
            } else {
                self.router
                    .handle_dispatch_failed(now, RequestId(id), AGG, DispatchFailure::Worker)
                    .map_err(|e| format!("dispatch failed {id}: {e}"))?;
                self.reqs.remove(&id);
                self.tally.dispatch_failed += 1;
            }
            self.drain_router_checked()?;
        }
        Ok(())
    }

    /// The engine of `w` produced its first token for `id`.
    pub(super) fn first_token(&mut self, w: WorkerId, id: u64) -> Result<(), String> {
        if self.reqs.get(&id).is_some_and(|r| r.st == St::Running(w)) {
            self.router
                .handle_prefill_done(self.now(), RequestId(id), AGG)
                .map_err(|e| format!("prefill {id}: {e}"))?;
            self.drain_router_checked()?;
        }
        Ok(())
    }

    /// The engine of `w` finished `id`; the report is sometimes lost.
    pub(super) fn finished(&mut self, w: WorkerId, id: u64) -> Result<(), String> {
        if !self.reqs.get(&id).is_some_and(|r| r.st == St::Running(w)) {
            return Ok(());
        }
        if self.pct(self.knobs.lost_report_pct) {
            self.tally.reports_lost += 1;
            self.reqs.get_mut(&id).expect("present").st = St::Lost(w);
            return Ok(());
        }
        self.end_stream(id)
    }

    /// Reports the end of a booked or streaming request (finished, or its stream broke).
    pub(super) fn end_stream(&mut self, id: u64) -> Result<(), String> {
        let Some(req) = self.reqs.remove(&id) else { return Ok(()) };
        let now = self.now();
        let r = match req.st {
            St::Booked(_) => {
                self.tally.dispatch_failed += 1;
                self.router.handle_dispatch_failed(now, RequestId(id), AGG, DispatchFailure::Worker)
            }
            _ => {
                self.tally.finished += 1;
                self.router.handle_finished(now, RequestId(id), AGG)
            }
        };
        r.map_err(|e| format!("end of {id} ({:?}): {e}", req.st))?;
        self.drain_router_checked()
    }
}
