//! The replay's router: drives the real `router-core` façade from the replay loop: the simulated fleet's
//! arrivals, KV events and completions go through the same `handle_*` calls the proxy
//! makes, so a replay measures exactly the policy that serves production traffic.

use router_core::{
    Decision, DisaggPlan, Draw, EngineLoad, IndexEvent, Instant, Observation, Output, Phase, PhaseField, Request,
    RequestId, Routed, Router, RouterConfig, SeqHash, Tier, WorkerId, WorkerKey, WorkerRole, WorkerSpec, WorkerUpdate,
};

use crate::engine::KvEvent;
use crate::replay::{Dispatch, Dispatcher, SimRequest, WorkerLoadSample};

/// A [`Dispatcher`] backed by a [`Router`]. Worker `i` of the replay is `WorkerId(i)`.
pub struct CoreDispatcher {
    router: Router,
    seed: u64,
    /// Feed the router the workers' KV events (false: approximate mode).
    kv_events: bool,
    /// Attach the trace's session ids to requests (session affinity).
    sessions: bool,
    /// Requests that arrived so far, for progress reporting.
    pub arrivals: u64,
    /// Requests the router refused with an error.
    pub errors: u64,
    /// Where the routed requests' cache went: see [`Placements`].
    pub placements: Placements,
    scratch: Vec<SeqHash>,
    /// Workers `0..prefill_workers` prefill; the rest decode. 0: an aggregated fleet.
    prefill_workers: u32,
    /// Requests currently split across a prefill and a decode worker.
    split: std::collections::HashSet<u64>,
    /// Timings of routed requests, kept only while the router is fed observations.
    observing: Option<Observing>,
    /// KV capacity of each worker, in blocks (for engine-reported usage).
    kv_blocks: u32,
}

/// How routed requests used the cache the router saw when it placed them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placements {
    /// Requests routed.
    pub routed: u64,
    /// Requests some worker held a prefix of, by the router's index.
    pub with_prefix: u64,
    /// Of those, requests sent to a worker holding less of it than the best holder.
    pub moved: u64,
    /// Prompt blocks the best holders had cached beyond the chosen workers'.
    pub blocks_left: u64,
    /// Of the moved requests, those whose best holder was not eligible (overloaded).
    pub moved_holder_excluded: u64,
}

/// The simulated fleet the dispatcher routes over.
#[derive(Clone, Copy, Debug)]
pub struct Fleet {
    /// Number of workers.
    pub workers: u32,
    /// Of which the first this many are prefill workers and the rest decode workers;
    /// 0 means every worker is aggregated.
    pub prefill_workers: u32,
    /// KV capacity of each, in blocks.
    pub kv_blocks: u32,
    /// Token budget of one forward pass.
    pub max_batched_tokens: u32,
}

impl CoreDispatcher {
    /// A router over the simulated `fleet`.
    pub fn new(cfg: RouterConfig, fleet: Fleet, seed: u64, kv_events: bool, sessions: bool) -> Self {
        let mut router = Router::new(cfg);
        for w in 0..fleet.workers {
            let role = match fleet.prefill_workers {
                0 => WorkerRole::Aggregated,
                p if w < p => WorkerRole::Prefill,
                _ => WorkerRole::Decode,
            };
            let spec = WorkerSpec {
                kv_blocks: fleet.kv_blocks,
                max_batched_tokens: fleet.max_batched_tokens,
                ..WorkerSpec::new(WorkerId(u64::from(w)), role)
            };
            // The worker table's bounds are far above any replay fleet.
            let _ = router.handle_worker_update(Instant::ZERO, WorkerUpdate::Upsert(spec));
        }
        CoreDispatcher {
            router,
            seed,
            kv_events,
            sessions: sessions && fleet.prefill_workers == 0,
            arrivals: 0,
            errors: 0,
            placements: Placements::default(),
            scratch: Vec::new(),
            prefill_workers: fleet.prefill_workers,
            split: Default::default(),
            observing: None,
            kv_blocks: fleet.kv_blocks,
        }
    }

    /// Feed the router what the simulated workers show: each request's time to first
    /// token and decode time (aggregated fleets only) and the workers' own load reports.
    pub fn observe(&mut self, on: bool) {
        self.observing = on.then(Observing::default);
    }

    /// Which phase of `req` worker `w` serves.
    fn phase_on(&self, w: u32, req: u64) -> Phase {
        if w < self.prefill_workers {
            Phase::Prefill
        } else if self.split.contains(&req) {
            Phase::Decode
        } else {
            Phase::Aggregated
        }
    }

    /// Routes one phase and confirms it at once (simulated workers never refuse a
    /// connection). Anything but an immediate route is rolled back.
    fn route_now(&mut self, now: Instant, request: Request, draw: Draw) -> Option<WorkerKey> {
        let (id, phase) = (request.id, request.phase.0);
        match self.router.handle_request(now, request, draw) {
            Ok(Decision::Routed(r)) => self.router.handle_dispatched(now, id, phase).ok().map(|()| r.target),
            Ok(Decision::Queued) | Ok(Decision::Waiting) => {
                let _ = self.router.handle_cancel(now, id, phase);
                None
            }
            _ => None,
        }
    }

    /// Plans and routes a request in a disaggregated fleet.
    fn arrive_disagg(&mut self, now: Instant, request: Request, draw: Draw) -> Dispatch {
        match self.router.plan_disagg(&request) {
            DisaggPlan::Split => {
                let id = request.id;
                let mut pre = request.clone();
                pre.phase = PhaseField(Phase::Prefill);
                let Some(p) = self.route_now(now, pre, draw) else { return Dispatch::Reject };
                let mut dec = request;
                dec.phase = PhaseField(Phase::Decode);
                let Some(d) = self.route_now(now, dec, Draw(draw.0.rotate_left(17))) else {
                    let _ = self.router.handle_finished(now, id, Phase::Prefill);
                    return Dispatch::Reject;
                };
                self.split.insert(id.0);
                Dispatch::Split { prefill: p.worker.0 as u32, decode: d.worker.0 as u32 }
            }
            DisaggPlan::Bypass(_) => match self.route_now(now, request, draw) {
                Some(k) => Dispatch::To(k.worker.0 as u32),
                None => Dispatch::Reject,
            },
        }
    }

    /// Disaggregation counters (all zero for an aggregated fleet).
    pub fn disagg_stats(&self) -> router_core::DisaggStats {
        self.router.disagg_stats()
    }

    fn confirm(&mut self, now: Instant, r: &Routed) -> Dispatch {
        match self.router.handle_dispatched(now, r.id, Phase::Aggregated) {
            Ok(()) => {
                let p = &mut self.placements;
                p.routed += 1;
                let best = u64::from(r.max_overlap_blocks);
                let got = u64::from(r.overlap.device);
                p.with_prefix += u64::from(best > 0);
                p.moved += u64::from(got < best);
                p.blocks_left += best.saturating_sub(got);
                let holder_out =
                    r.explanation.iter().any(|e| e.excluded.is_some() && u64::from(e.overlap.device) > got);
                p.moved_holder_excluded += u64::from(got < best && holder_out);
                if let Some(o) = &mut self.observing {
                    o.dispatched(now, r, self.router.config().block_size);
                }
                Dispatch::To(r.target.worker.0 as u32)
            }
            Err(_) => Dispatch::Reject,
        }
    }
}

fn at(now_ms: f64) -> Instant {
    Instant::from_micros((now_ms.max(0.0) * 1000.0) as u64)
}

impl Dispatcher for CoreDispatcher {
    fn on_arrival(&mut self, now_ms: f64, req: &SimRequest) -> Dispatch {
        self.arrivals += 1;
        let now = at(now_ms);
        let request = Request {
            id: RequestId(req.id),
            blocks: req.prompt.blocks().iter().map(|b| b.seq).collect(),
            isl_tokens: req.prompt.len_tokens(),
            session: if self.sessions { req.session_id.as_ref().map(|s| s.as_bytes().to_vec()) } else { None },
            ..Request::default()
        };
        let draw = Draw(self.seed ^ req.id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        if let Some(o) = self.observing.as_mut().filter(|_| self.prefill_workers == 0) {
            o.arrived.insert(req.id, (req.prompt.len_tokens(), req.output_len));
        }
        if self.prefill_workers > 0 {
            return self.arrive_disagg(now, request, draw);
        }
        match self.router.handle_request(now, request, draw) {
            Ok(Decision::Routed(r)) => self.confirm(now, &r),
            Ok(Decision::Queued) | Ok(Decision::Waiting) => Dispatch::Queued,
            Ok(_) => Dispatch::Reject,
            Err(_) => {
                self.errors += 1;
                Dispatch::Reject
            }
        }
    }

    fn on_kv_event(&mut self, now_ms: f64, worker: u32, _event_id: u64, event: &KvEvent) {
        if !self.kv_events {
            return;
        }
        let key = WorkerKey::new(u64::from(worker), 0);
        let ev = match event {
            KvEvent::Stored { parent, blocks } => IndexEvent::Stored { parent: *parent, blocks, tier: Tier::Device },
            KvEvent::Removed { blocks } => {
                self.scratch.clear();
                self.scratch.extend_from_slice(blocks);
                IndexEvent::Removed { blocks: &self.scratch, tier: Tier::Device }
            }
        };
        let _ = self.router.handle_kv_event(at(now_ms), key, ev);
    }

    fn on_prefill_done(&mut self, now_ms: f64, worker: u32, req_id: u64) {
        let phase = self.phase_on(worker, req_id);
        let _ = self.router.handle_prefill_done(at(now_ms), RequestId(req_id), phase);
        if let Some((key, obs)) = self.observing.as_mut().and_then(|o| o.first_token(at(now_ms), req_id)) {
            let _ = self.router.handle_observation(at(now_ms), key, obs);
        }
    }

    fn on_finished(&mut self, now_ms: f64, worker: u32, req_id: u64) {
        let phase = self.phase_on(worker, req_id);
        // Before the finish releases its blocks: the decode prediction reads the usage.
        if let Some((key, obs)) = self.observing.as_mut().and_then(|o| o.finished(at(now_ms), req_id)) {
            let _ = self.router.handle_observation(at(now_ms), key, obs);
        }
        let _ = self.router.handle_finished(at(now_ms), RequestId(req_id), phase);
        if phase == Phase::Decode {
            self.split.remove(&req_id);
        }
    }

    fn on_worker_load(&mut self, now_ms: f64, worker: u32, load: WorkerLoadSample) {
        if self.observing.is_some() {
            let kv_usage = (f64::from(load.active_blocks) / f64::from(self.kv_blocks.max(1))).min(1.0);
            let report = EngineLoad { waiting: load.waiting, running: load.running, kv_usage };
            let _ = self.router.handle_engine_load(at(now_ms), WorkerKey::new(u64::from(worker), 0), report);
        }
    }

    fn poll_dispatch(&mut self, now_ms: f64) -> Option<(u64, Dispatch)> {
        let now = at(now_ms);
        while let Some(out) = self.router.poll_output() {
            match out {
                Output::Routed(r) => return Some((r.id.0, self.confirm(now, &r))),
                Output::Failed { id, .. } | Output::TimedOut { id, .. } | Output::Rejected { id, .. } => {
                    return Some((id.0, Dispatch::Reject))
                }
                _ => {}
            }
        }
        None
    }

    fn next_timeout(&self) -> Option<f64> {
        self.router.poll_timeout().map(|t| t.as_micros() as f64 / 1000.0)
    }

    fn on_timeout(&mut self, now_ms: f64) {
        self.router.handle_timeout(at(now_ms));
    }
}

/// A routed request's timings, until it finishes.
#[derive(Clone, Copy, Debug)]
struct Timing {
    key: WorkerKey,
    dispatched: Instant,
    /// The first-token observation, its time filled in when the token comes.
    first: Observation,
    first_token: Option<Instant>,
}

/// The dispatcher's record of routed requests, for observations.
#[derive(Debug, Default)]
struct Observing {
    timings: std::collections::HashMap<u64, Timing>,
    /// Prompt and output lengths by request id, taken at arrival.
    arrived: std::collections::HashMap<u64, (u32, u32)>,
}

fn ms_between(later: Instant, earlier: Instant) -> f64 {
    later.micros_since(earlier) as f64 / 1000.0
}

impl Observing {
    fn dispatched(&mut self, now: Instant, r: &Routed, block_size: router_core::BlockSize) {
        let Some(&(isl, _)) = self.arrived.get(&r.id.0) else { return };
        let first = Observation::first_token(0.0, r, isl, block_size);
        self.timings.insert(r.id.0, Timing { key: r.target, dispatched: now, first, first_token: None });
    }

    fn first_token(&mut self, now: Instant, id: u64) -> Option<(WorkerKey, Observation)> {
        let t = self.timings.get_mut(&id)?;
        t.first_token = Some(now);
        match t.first {
            Observation::FirstToken { uncached_tokens, queued_tokens, .. } => {
                let ttft_ms = ms_between(now, t.dispatched);
                Some((t.key, Observation::FirstToken { ttft_ms, uncached_tokens, queued_tokens }))
            }
            _ => None,
        }
    }

    fn finished(&mut self, now: Instant, id: u64) -> Option<(WorkerKey, Observation)> {
        let t = self.timings.remove(&id)?;
        let tokens = self.arrived.remove(&id)?.1.saturating_sub(1);
        let first_token = t.first_token.filter(|_| tokens > 0)?;
        Some((t.key, Observation::Decode { ms: ms_between(now, first_token), tokens }))
    }
}
