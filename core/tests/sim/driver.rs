//! [`Driver`]: applies one [`Op`] to a `Router`, mirrors its effect in a plain model,
//! drains every output, runs due timers, and checks the router against the model.

use std::collections::{BTreeMap, VecDeque};

use router_core::admission::QueueOrder;
use router_core::affinity::AffinityMode;
use router_core::eligible::ExclusionReason;
use router_core::hash::SeqHash;
use router_core::index::{IndexEvent, OverlapScores};
use router_core::pin::{PinError, RoutingHints};
use router_core::router::{
    Decision, DispatchFailure, InputError, Output, PhaseField, Priority, Request, RouteError, Router, RouterConfig,
    WorkerUpdate,
};
use router_core::worker::{Health, Taint, TaintEffect, Toleration, WorkerError, WorkerRole, WorkerSpec};
use router_core::{DpRank, Draw, Instant, Phase, RequestId, Tier, WorkerId, WorkerKey, WorkerLoad};

use super::index_model::IndexModel;
use super::ops::{
    avoid_known_bugs, block, chain_blocks, private_block, with_local, Knobs, Op, ReqOp, CHAIN_BLOCKS, SESSIONS, WORKERS,
};

/// Where the model believes a tracked request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MState {
    /// Routed, not yet confirmed: load is booked on the key.
    Booked(WorkerKey),
    /// Confirmed with `handle_dispatched`.
    Dispatched(WorkerKey),
    /// Its worker was removed while it was booked or dispatched; no load remains.
    Orphaned,
    /// Queued or waiting for its session. A waiter may move into the queue without an
    /// output, so only `seen_queued` ones are known to be queued.
    Pending { seen_queued: bool },
}

#[derive(Clone, Debug)]
pub struct MReq {
    pub state: MState,
    /// The session id, when it is one the affinity table accepts.
    pub session: Option<Vec<u8>>,
    pub chain: u8,
    pub len: u8,
    /// When it was last booked, or queued: its expiry or time-out counts from here.
    pub since: Instant,
    /// Its prompt's blocks and length, for the load it books.
    pub blocks: Vec<SeqHash>,
    pub isl_tokens: u32,
    pub expected_out_blocks: u32,
    /// While booked: uncached prompt tokens not yet prefilled, and output blocks made.
    pub prefill_left: u32,
    pub generated_blocks: u32,
    /// Where it sorts in a FCFS queue, when seen queued: lower leaves first.
    pub fcfs: Option<(i32, i128, u64)>,
}

/// Tokens per block in every configuration the driver builds.
const BLOCK_TOKENS: u32 = 64;

impl MReq {
    /// The booking `Routed` with `overlap` makes: the tokens the cache does not cover.
    fn book(&mut self, key: WorkerKey, device_blocks: u32, phase: Phase, now: Instant) {
        let cached = device_blocks.saturating_mul(BLOCK_TOKENS).min(self.isl_tokens);
        self.state = MState::Booked(key);
        self.since = now;
        self.prefill_left = if phase == Phase::Decode { 0 } else { self.isl_tokens - cached };
        self.generated_blocks = 0;
    }
}

/// How often each thing happened, to show a run exercised what it claims to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub requests: u64,
    pub routed: u64,
    pub queued: u64,
    pub waiting: u64,
    pub rejected: u64,
    pub refused: u64,
    pub previews: u64,
    pub routed_later: u64,
    pub failed_later: u64,
    pub timed_out: u64,
    pub booking_expired: u64,
    pub lease_expired: u64,
    pub orphaned: u64,
    pub dispatched: u64,
    pub dispatch_failed: u64,
    pub finished: u64,
    pub cancelled: u64,
    pub wrong_state: u64,
    pub late: u64,
    pub kv_applied: u64,
    pub kv_refused: u64,
    pub queries: u64,
    pub worker_updates: u64,
    pub timer_calls: u64,
}

impl Tally {
    pub fn add(&mut self, o: &Tally) {
        macro_rules! sum { ($($f:ident)*) => { $(self.$f += o.$f;)* } }
        sum!(requests routed queued waiting rejected refused previews routed_later failed_later timed_out
            booking_expired lease_expired orphaned dispatched dispatch_failed finished cancelled wrong_state
            late kv_applied kv_refused queries worker_updates timer_calls);
    }
}

/// Ended requests remembered for [`Op::Late`].
const ENDED_KEPT: usize = 64;
/// Rounds of `settle` (each ends what it can and moves to the next deadline).
const SETTLE_ROUNDS_MAX: usize = 10_000;
/// `handle_timeout` calls one step may need before nothing is due.
const TIMER_CALLS_MAX: usize = 64;

pub struct Driver {
    pub router: Router,
    cfg: RouterConfig,
    now: Instant,
    workers: BTreeMap<WorkerId, (WorkerSpec, Health)>,
    index: IndexModel,
    reqs: BTreeMap<(RequestId, Phase), MReq>,
    ended: VecDeque<(RequestId, Phase)>,
    next_id: u64,
    steps: u64,
    /// Bumped on every model transition; `settle` uses it to spot a stuck router.
    transitions: u64,
    /// Requests seen queued so far (their push order).
    pushes: u64,
    pub tally: Tally,
    scores: OverlapScores,
}

type Check = Result<(), String>;

impl Driver {
    pub fn new(knobs: Knobs) -> Self {
        let cfg = knobs.config();
        Driver {
            router: Router::new(cfg.clone()),
            index: IndexModel::new(cfg.index),
            cfg,
            now: Instant::from_millis(1_000_000),
            workers: BTreeMap::new(),
            reqs: BTreeMap::new(),
            ended: VecDeque::new(),
            next_id: 1,
            steps: 0,
            transitions: 0,
            pushes: 0,
            tally: Tally::default(),
            scores: OverlapScores::new(),
        }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// Requests in flight that were confirmed, with the prompt they carry: what an
    /// engine would publish KV events about.
    pub fn dispatched(&self) -> Vec<(WorkerKey, u8, u8)> {
        let on = |s: MState| match s {
            MState::Dispatched(k) => Some(k),
            _ => None,
        };
        self.reqs.values().filter_map(|r| on(r.state).map(|k| (k, r.chain, r.len))).collect()
    }

    pub fn in_flight(&self) -> usize {
        self.reqs.len()
    }

    /// Applies `op`, drains outputs, runs due timers, then checks everything.
    pub fn step(&mut self, op: Op) -> Check {
        self.steps += 1;
        self.apply(op)
            .and_then(|()| self.run_timers())
            .and_then(|()| self.check())
            .map_err(|e| format!("step {} ({op:?}) at {:?}: {e}", self.steps, self.now))
    }

    /// Ends every request and lets every deadline pass; then the router must hold
    /// nothing: no request, booking, queue entry, lease or session binding. Time moves
    /// forward to each next deadline, however far (after a step back in time, a
    /// deadline set earlier can lie far ahead).
    pub fn settle(&mut self) -> Check {
        for _ in 0..SETTLE_ROUNDS_MAX {
            let before = (self.transitions, self.router.poll_timeout());
            let booked: Vec<u16> = (0..self.reqs.len() as u16)
                .filter(|&i| {
                    let r = self.reqs.values().nth(i as usize).map(|r| r.state);
                    !matches!(r, Some(MState::Pending { .. }) | None)
                })
                .collect();
            // Finish from the back so earlier picks keep their positions.
            for &i in booked.iter().rev() {
                self.step(Op::Finished { pick: i })?;
            }
            let next = self.router.poll_timeout().unwrap_or(self.now);
            self.now = self.now.add_ms(3_600_000).max(next);
            self.step(Op::Timeout)?;
            if self.reqs.is_empty() && self.router.poll_timeout().is_none() {
                return self.check_empty();
            }
            if (self.transitions, self.router.poll_timeout()) == before {
                return Err(format!("settle: stuck with requests {:?}", self.reqs));
            }
        }
        Err(format!("settle: not done after {SETTLE_ROUNDS_MAX} rounds: {:?}", self.reqs))
    }

    fn check_empty(&self) -> Check {
        let r = &self.router;
        let leftovers = [
            ("requests", r.requests_in_flight()),
            ("queued", r.queue().len()),
            ("bookings", r.load().len()),
            ("leases", r.affinity().live_leases()),
            ("sessions", r.affinity().len()),
        ];
        for (what, n) in leftovers {
            if n != 0 {
                return Err(format!("settle: {n} {what} left after everything ended and every deadline passed"));
            }
        }
        Ok(())
    }

    fn apply(&mut self, op: Op) -> Check {
        match op {
            Op::Upsert { worker, role, ranks, weight, small_kv, zone, taint } => {
                self.upsert(worker, role, ranks, weight, small_kv, zone, taint)
            }
            Op::Remove { worker } => self.remove(worker),
            Op::Health { worker, health } => {
                let h = [Health::Healthy, Health::Ejected, Health::Draining][health as usize % 3];
                self.simple_update(worker, WorkerUpdate::Health(worker_id(worker), h), Some(h))
            }
            Op::Taints { worker, taints } => {
                self.simple_update(worker, WorkerUpdate::Taints(worker_id(worker), taints_of(taints)), None)
            }
            Op::Stored { worker, rank, chain, start, len, parent, tier } => {
                self.stored(key_of(worker, rank), chain, start, len, parent, tier)
            }
            Op::Removed { worker, rank, chain, start, len, tier } => {
                self.removed(key_of(worker, rank), chain, start, len, tier)
            }
            Op::Cleared { worker, rank } => self.cleared(key_of(worker, rank)),
            Op::KvClear { worker, rank } => {
                let key = key_of(worker, rank);
                self.router.handle_kv_clear(key);
                self.index.clear_key(key);
                self.check_index(&chain_blocks(rank, 0, CHAIN_BLOCKS))
            }
            Op::Trust { worker, rank, trusted } => {
                self.router.handle_overlap_trust(key_of(worker, rank), trusted);
                Ok(())
            }
            Op::Request(r) => self.request(r),
            Op::Dispatched { pick } => self.lifecycle(pick, Life::Dispatched),
            Op::DispatchFailed { pick, worker_fault } => self.lifecycle(pick, Life::Failed(worker_fault)),
            Op::PrefillDone { pick } => self.lifecycle(pick, Life::PrefillDone),
            Op::Progress { pick, tokens } => self.lifecycle(pick, Life::Progress(tokens)),
            Op::Finished { pick } => self.lifecycle(pick, Life::Finished),
            Op::Cancel { pick } => self.lifecycle(pick, Life::Cancel),
            Op::Late { pick, kind } => self.late(pick, kind),
            Op::Advance { ms } => {
                self.now = self.now.add_ms(u64::from(ms));
                Ok(())
            }
            Op::Back { ms } => {
                self.now = Instant::from_micros(self.now.as_micros().saturating_sub(u64::from(ms) * 1000));
                Ok(())
            }
            Op::Jump { hours } => {
                self.now = if hours == u16::MAX { Instant::MAX } else { self.now.add_ms(u64::from(hours) * 3_600_000) };
                Ok(())
            }
            Op::Timeout => {
                self.router.handle_timeout(self.now);
                self.tally.timer_calls += 1;
                self.drain()
            }
            Op::Query { chain, len, twist } => {
                let mut q = chain_blocks(chain, 0, u32::from(len) % (CHAIN_BLOCKS + 1));
                match twist % 4 {
                    1 => q.push(private_block(7, 0)),
                    2 => q.extend(q.clone()),
                    3 if !q.is_empty() => {
                        q.remove(0);
                    }
                    _ => {}
                }
                self.tally.queries += 1;
                self.check_index(&q)
            }
        }
    }

    // ---- workers ----

    #[allow(clippy::too_many_arguments)]
    fn upsert(&mut self, worker: u8, role: u8, ranks: u8, weight: u8, small_kv: bool, zone: u8, taint: u8) -> Check {
        let id = worker_id(worker);
        let role = [WorkerRole::Aggregated, WorkerRole::Aggregated, WorkerRole::Prefill, WorkerRole::Decode]
            [role as usize % 4];
        let mut spec = WorkerSpec::new(id, role);
        spec.dp_ranks = match ranks % 7 {
            0 => None,
            5 => Some(0),
            6 => Some(self.cfg.workers.dp_ranks_max + 1),
            n => Some(u32::from(n)),
        };
        spec.weight = u32::from(weight % 4);
        if small_kv {
            spec.kv_blocks = 16;
            spec.max_batched_tokens = 128;
        }
        spec.labels = vec![("zone".into(), format!("z{}", zone % 2))];
        spec.taints = taints_of(taint);
        let valid = !matches!(spec.dp_ranks, Some(0))
            && spec.dp_ranks.unwrap_or(1) <= self.cfg.workers.dp_ranks_max
            && spec.weight > 0
            && (self.workers.contains_key(&id) || self.workers.len() < self.cfg.workers.workers_max);
        let res = self.router.handle_worker_update(self.now, WorkerUpdate::Upsert(spec.clone()));
        self.tally.worker_updates += 1;
        if res.is_ok() != valid {
            return Err(format!("upsert of {spec:?} answered {res:?}; the model expected ok = {valid}"));
        }
        if valid {
            let health = self.workers.get(&id).map_or(Health::Healthy, |w| w.1);
            self.workers.insert(id, (spec, health));
        }
        self.drain()
    }

    fn remove(&mut self, worker: u8) -> Check {
        let id = worker_id(worker);
        let res = self.router.handle_worker_update(self.now, WorkerUpdate::Removed(id));
        self.tally.worker_updates += 1;
        if res.is_err() {
            return Err(format!("removing worker {} answered {res:?}", id.0));
        }
        self.workers.remove(&id);
        self.index.remove_worker(id);
        for r in self.reqs.values_mut() {
            if let MState::Booked(k) | MState::Dispatched(k) = r.state {
                if k.worker == id {
                    r.state = MState::Orphaned;
                    self.transitions += 1;
                    self.tally.orphaned += 1;
                }
            }
        }
        self.drain()?;
        self.check_index(&chain_blocks(worker, 0, CHAIN_BLOCKS))
    }

    fn simple_update(&mut self, worker: u8, update: WorkerUpdate, health: Option<Health>) -> Check {
        let id = worker_id(worker);
        let res = self.router.handle_worker_update(self.now, update);
        self.tally.worker_updates += 1;
        let want = if self.workers.contains_key(&id) {
            Ok(())
        } else {
            Err(InputError::Worker(WorkerError::UnknownWorker { worker: id }))
        };
        if res != want {
            return Err(format!("worker update answered {res:?}, want {want:?}"));
        }
        if let (Some(h), Some(w)) = (health, self.workers.get_mut(&id)) {
            w.1 = h;
        }
        self.drain()
    }

    // ---- KV events ----

    fn stored(&mut self, key: WorkerKey, chain: u8, start: u8, len: u8, parent: bool, tier: u8) -> Check {
        let start = u32::from(start) % CHAIN_BLOCKS;
        let seqs = chain_blocks(chain, start, u32::from(len) % 17);
        let blocks = with_local(&seqs);
        let parent = match (parent, start) {
            (false, _) => None,
            (true, 0) => Some(private_block(999, 0)), // a parent nobody stored
            (true, s) => Some(block(chain, s - 1)),
        };
        let tier = tier_of(tier);
        let got = self.router.handle_kv_event(self.now, key, IndexEvent::Stored { parent, blocks: &blocks, tier });
        let want = if self.workers.contains_key(&key.worker) {
            self.index.store(key, parent, &blocks, tier).map_err(InputError::Index)
        } else {
            Err(unknown_worker(key))
        };
        self.kv_result(got, want)?;
        let mut q = chain_blocks(chain, 0, CHAIN_BLOCKS);
        q.truncate(q.len().min(start as usize + seqs.len() + 1));
        self.check_index(&q)
    }

    fn removed(&mut self, key: WorkerKey, chain: u8, start: u8, len: u8, tier: u8) -> Check {
        let seqs = chain_blocks(chain, u32::from(start) % CHAIN_BLOCKS, u32::from(len) % 17);
        let tier = tier_of(tier);
        let got = self.router.handle_kv_event(self.now, key, IndexEvent::Removed { blocks: &seqs, tier });
        let want = if self.workers.contains_key(&key.worker) {
            Ok(self.index.remove(key, &seqs, tier))
        } else {
            Err(unknown_worker(key))
        };
        self.kv_result(got, want)?;
        self.check_index(&chain_blocks(chain, 0, CHAIN_BLOCKS))
    }

    fn cleared(&mut self, key: WorkerKey) -> Check {
        let got = self.router.handle_kv_event(self.now, key, IndexEvent::Cleared);
        let want = if self.workers.contains_key(&key.worker) {
            self.index.clear_key(key);
            Ok(Default::default())
        } else {
            Err(unknown_worker(key))
        };
        self.kv_result(got, want)?;
        self.check_index(&chain_blocks(key.rank.0 as u8, 0, CHAIN_BLOCKS))
    }

    fn kv_result<T: PartialEq + std::fmt::Debug>(
        &mut self,
        got: Result<T, InputError>,
        want: Result<T, InputError>,
    ) -> Check {
        if got != want {
            return Err(format!("kv event answered {got:?}, the model says {want:?}"));
        }
        if got.is_ok() {
            self.tally.kv_applied += 1;
        } else {
            self.tally.kv_refused += 1;
        }
        Ok(())
    }

    // ---- requests ----

    fn request(&mut self, r: ReqOp) -> Check {
        let dup = r.duplicate && !r.preview && !self.reqs.is_empty();
        let (id, phase) = if dup {
            *self.reqs.keys().nth((r.draw % self.reqs.len() as u64) as usize).expect("in range")
        } else {
            self.next_id += 1;
            (
                RequestId(self.next_id),
                [Phase::Aggregated, Phase::Aggregated, Phase::Prefill, Phase::Decode][r.phase as usize % 4],
            )
        };
        let (req, valid_session) = self.build(id, phase, &r);
        let session = req.session.clone().filter(|_| valid_session);
        let mut m = MReq {
            state: MState::Orphaned,
            session: session.clone(),
            chain: r.chain,
            len: r.len,
            since: self.now,
            blocks: req.blocks.clone(),
            isl_tokens: req.isl_tokens,
            expected_out_blocks: req.expected_output_tokens.map_or(0, |t| t.div_ceil(BLOCK_TOKENS)),
            prefill_left: 0,
            generated_blocks: 0,
            fcfs: None,
        };
        let fcfs = (-req.priority.strict, i128::from(self.now.as_micros()) - i128::from(req.priority.jump_ms) * 1000);
        let replay = req.clone();
        // Only an unpinned request must follow its session's binding.
        let follows = session.as_ref().filter(|_| r.pin == 0 && r.planned == 0);
        let bound_before = follows.and_then(|s| self.router.affinity().peek(s, phase));
        let before = fingerprint(&self.router);
        let res = self.router.handle_request(self.now, req, Draw(r.draw));
        self.tally.requests += 1;
        if r.preview {
            self.tally.previews += 1;
            if let Ok(d) = &res {
                match d {
                    Decision::Routed(rt) if rt.preview => self.check_target(rt.target, phase)?,
                    other => return Err(format!("a preview answered {other:?}")),
                }
            }
            if fingerprint(&self.router) != before {
                return Err(format!("a preview changed state: {before:?} -> {:?}", fingerprint(&self.router)));
            }
            if let Some(o) = self.router.poll_output() {
                return Err(format!("a preview produced output {o:?}"));
            }
            return match res {
                Ok(Decision::Routed(p)) if replay.session.is_none() => self.commit_preview(replay, r.draw, p.target),
                _ => Ok(()),
            };
        }
        if dup {
            if res != Err(RouteError::DuplicateRequest { id, phase }) || fingerprint(&self.router) != before {
                return Err(format!("a duplicate of a tracked request answered {res:?}"));
            }
            return self.drain();
        }
        let state = match res {
            Ok(Decision::Routed(rt)) => {
                if rt.id != id || rt.phase != phase || rt.preview {
                    return Err(format!("routed the wrong request: {rt:?}"));
                }
                self.check_target(rt.target, phase)?;
                let bound_after = follows.and_then(|s| self.router.affinity().peek(s, phase));
                if let (Some(b), Some(a)) = (bound_before, bound_after) {
                    if a.revision == b.revision
                        && (b.worker != rt.target.worker || b.rank.is_some_and(|r| r != rt.target.rank))
                    {
                        return Err(format!("session bound to {b:?} was routed to {}", rt.target));
                    }
                }
                self.tally.routed += 1;
                m.book(rt.target, rt.overlap.device, phase, self.now);
                Some(m.state)
            }
            Ok(Decision::Queued) => {
                self.tally.queued += 1;
                self.pushes += 1;
                m.fcfs = Some((fcfs.0, fcfs.1, self.pushes));
                Some(MState::Pending { seen_queued: true })
            }
            Ok(Decision::Waiting) => {
                if !valid_session {
                    return Err("a request without a valid session was told to wait".into());
                }
                self.tally.waiting += 1;
                Some(MState::Pending { seen_queued: false })
            }
            Ok(Decision::Rejected(_)) => {
                self.tally.rejected += 1;
                None
            }
            Ok(other) => return Err(format!("unexpected decision {other:?}")),
            Err(e) => {
                self.refusal(&e, &r, valid_session)?;
                self.tally.refused += 1;
                None
            }
        };
        match state {
            Some(state) => {
                m.state = state;
                self.reqs.insert((id, phase), m);
                self.transitions += 1;
            }
            None => self.remember_ended((id, phase)),
        }
        self.drain()
    }

    /// Sends a previewed request for real, with the same draw and nothing changed in
    /// between: it must go where the preview said.
    fn commit_preview(&mut self, mut req: Request, draw: u64, previewed: WorkerKey) -> Check {
        self.next_id += 1;
        req.id = RequestId(self.next_id);
        req.preview = false;
        let (id, phase) = (req.id, req.phase.0);
        let mut m = MReq {
            state: MState::Orphaned,
            session: None,
            chain: 0,
            len: 0,
            since: self.now,
            blocks: req.blocks.clone(),
            isl_tokens: req.isl_tokens,
            expected_out_blocks: req.expected_output_tokens.map_or(0, |t| t.div_ceil(BLOCK_TOKENS)),
            prefill_left: 0,
            generated_blocks: 0,
            fcfs: None,
        };
        match self.router.handle_request(self.now, req, Draw(draw)) {
            Ok(Decision::Routed(rt)) if rt.target == previewed => {
                m.book(rt.target, rt.overlap.device, phase, self.now);
                self.reqs.insert((id, phase), m);
                self.transitions += 1;
                self.tally.routed += 1;
                self.drain()
            }
            // A preview holds no slot, so only the real request meets the limit.
            Err(RouteError::TooManyRequests { .. }) => {
                self.remember_ended((id, phase));
                Ok(())
            }
            other => Err(format!("previewed {previewed}, then the same request answered {other:?}")),
        }
    }

    /// Refusals that contradict a documented rule.
    fn refusal(&self, e: &RouteError, r: &ReqOp, valid_session: bool) -> Check {
        if avoid_known_bugs() {
            return Ok(()); // Both rules below are broken today: see sim_regressions.rs.
        }
        if let RouteError::Pin(PinError::Ineligible { reason: ExclusionReason::Overloaded { .. }, .. }) = e {
            return Err(format!("a request pinned to a busy worker must queue, it failed: {e:?}"));
        }
        let soft = self.cfg.affinity.mode == AffinityMode::Soft;
        if soft && valid_session && r.pin == 0 && r.planned == 0 && matches!(e, RouteError::Pin(_)) {
            return Err(format!("a soft session binding acted as a pin: {e:?}"));
        }
        Ok(())
    }

    fn build(&self, id: RequestId, phase: Phase, r: &ReqOp) -> (Request, bool) {
        let mut blocks = chain_blocks(r.chain, 0, u32::from(r.len) % (CHAIN_BLOCKS + 1));
        blocks.extend((0..u32::from(r.tail % 4)).map(|i| private_block(id.0, i)));
        let session = match r.session {
            0 => None,
            1 => Some(Vec::new()),
            2 => Some(vec![b'x'; self.cfg.affinity.session_id_bytes_max + 1]),
            n => Some(format!("s{}", (n - 3) % SESSIONS).into_bytes()),
        };
        let valid_session = r.session >= 3;
        let hints = RoutingHints {
            backend_instance_id: (r.pin > 0).then(|| WorkerId(u64::from(r.pin - 1) % (u64::from(WORKERS) + 1))),
            dp_rank: (r.pin_rank > 0).then(|| DpRank(u32::from(r.pin_rank - 1) % 5)),
            allowed_worker_ids: (r.allow > 0).then(|| {
                (0..8u64).filter(|b| r.allow & (1 << b) != 0 && *b < u64::from(WORKERS)).map(WorkerId).collect()
            }),
            tolerations: if r.tolerate {
                vec![Toleration { key: String::new(), value: None, effect: None }]
            } else {
                Vec::new()
            },
            ..RoutingHints::default()
        };
        let req = Request {
            id,
            phase: PhaseField(phase),
            isl_tokens: blocks.len() as u32 * 64 + (r.draw % 64) as u32,
            blocks,
            session,
            hints,
            priority: Priority {
                strict: i32::from(r.strict % 3),
                jump_ms: i64::from(r.jump_ms),
                class: match r.class % 3 {
                    0 => None,
                    1 => Some("a".into()),
                    _ => Some(format!("x{}", id.0 % 100)),
                },
            },
            expected_output_tokens: (r.expected_out > 0).then_some(u32::from(r.expected_out)),
            planned: (r.planned > 0).then(|| WorkerKey::new(u64::from(r.planned - 1) % u64::from(WORKERS), 0)),
            same_label_as: (r.label > 0).then(|| ("zone".into(), format!("z{}", r.label % 2))),
            preview: r.preview,
            ..Request::default()
        };
        (req, valid_session)
    }

    /// A routed key must exist, be healthy, serve the phase and be one of its ranks.
    fn check_target(&self, key: WorkerKey, phase: Phase) -> Check {
        let Some((spec, health)) = self.workers.get(&key.worker) else {
            return Err(format!("routed to {key}, which is not in the fleet"));
        };
        if *health != Health::Healthy || !spec.role.serves(phase) {
            return Err(format!("routed {phase} to {key}: {health:?} {:?}", spec.role));
        }
        if spec.dp_ranks.is_some_and(|n| key.rank.0 >= n) {
            return Err(format!("routed to {key}, beyond its {:?} ranks", spec.dp_ranks));
        }
        Ok(())
    }

    // ---- lifecycle ----

    fn lifecycle(&mut self, pick: u16, life: Life) -> Check {
        if self.reqs.is_empty() {
            return self.late(pick, life.kind());
        }
        let fk = *self.reqs.keys().nth(pick as usize % self.reqs.len()).expect("in range");
        let state = self.reqs[&fk].state;
        let (id, phase) = fk;
        let wrong = Err(InputError::WrongState { id, phase });
        let booked = matches!(state, MState::Booked(_) | MState::Dispatched(_) | MState::Orphaned);
        // What the input must answer, and what the request becomes (None: it ended).
        let (want, next): (Result<(), InputError>, Option<MState>) = match (life, state) {
            (Life::Dispatched, MState::Booked(k)) => (Ok(()), Some(MState::Dispatched(k))),
            (Life::Dispatched, s) => (wrong, Some(s)),
            (Life::Failed(_) | Life::Finished, _) if booked => (Ok(()), None),
            (Life::PrefillDone, s) if booked => (Ok(()), Some(s)),
            (Life::Progress(_), s) => (Ok(()), Some(s)),
            (Life::Cancel, _) => (Ok(()), None),
            (_, s) => (wrong, Some(s)),
        };
        let session = self.reqs[&fk].session.clone();
        let peek = |r: &Router| session.as_ref().and_then(|s| r.affinity().peek(s, phase));
        let bound_before = peek(&self.router);
        let got = match life {
            Life::Dispatched => self.router.handle_dispatched(self.now, id, phase),
            Life::Failed(worker_fault) => {
                let why = if worker_fault { DispatchFailure::Worker } else { DispatchFailure::Cancelled };
                self.router.handle_dispatch_failed(self.now, id, phase, why)
            }
            Life::PrefillDone => self.router.handle_prefill_done(self.now, id, phase),
            Life::Progress(t) => self.router.handle_decode_progress(self.now, id, phase, u32::from(t)),
            Life::Finished => self.router.handle_finished(self.now, id, phase),
            Life::Cancel => self.router.handle_cancel(self.now, id, phase),
        };
        if got != want {
            return Err(format!("{life:?} of {fk:?} in state {state:?} answered {got:?}, want {want:?}"));
        }
        if let (Life::Dispatched, Ok(()), MState::Booked(k)) = (life, &got, state) {
            // A binding that appeared (or changed) was committed by this dispatch.
            if let Some(b) = peek(&self.router).filter(|a| bound_before.is_none_or(|b| b.revision != a.revision)) {
                if b.worker != k.worker || b.rank != Some(k.rank) {
                    return Err(format!("dispatch to {k} committed the session to {b:?}"));
                }
            }
        }
        match (got.is_ok(), next) {
            (false, _) => self.tally.wrong_state += 1,
            (true, Some(s)) => {
                if s != state {
                    self.transitions += 1;
                    self.tally.dispatched += 1;
                }
                if let Some(r) = self.reqs.get_mut(&fk) {
                    r.state = s;
                    let holds_load = matches!(s, MState::Booked(_) | MState::Dispatched(_));
                    match life {
                        Life::PrefillDone if holds_load => r.prefill_left = 0,
                        Life::Progress(t) if holds_load => {
                            if t > 0 {
                                r.prefill_left = 0;
                            }
                            r.generated_blocks = r.generated_blocks.max(u32::from(t).div_ceil(BLOCK_TOKENS));
                        }
                        _ => {}
                    }
                }
            }
            (true, None) => {
                match life {
                    Life::Failed(_) => self.tally.dispatch_failed += 1,
                    Life::Cancel => self.tally.cancelled += 1,
                    _ => self.tally.finished += 1,
                }
                self.end(fk);
            }
        }
        self.drain()
    }

    fn late(&mut self, pick: u16, kind: u8) -> Check {
        let (id, phase) = if self.ended.is_empty() {
            (RequestId(u64::MAX - u64::from(pick)), Phase::Aggregated)
        } else {
            self.ended[pick as usize % self.ended.len()]
        };
        let now = self.now;
        let r = &mut self.router;
        let got = match kind % 6 {
            0 => r.handle_dispatched(now, id, phase),
            1 => r.handle_dispatch_failed(now, id, phase, DispatchFailure::Worker),
            2 => r.handle_prefill_done(now, id, phase),
            3 => r.handle_decode_progress(now, id, phase, 5),
            4 => r.handle_finished(now, id, phase),
            _ => r.handle_cancel(now, id, phase),
        };
        let want = Err(InputError::UnknownRequest { id, phase });
        if got != want {
            return Err(format!("a late input for ended request {id:?} {phase} answered {got:?}"));
        }
        self.tally.late += 1;
        self.drain()
    }

    fn end(&mut self, fk: (RequestId, Phase)) {
        self.reqs.remove(&fk);
        self.transitions += 1;
        self.remember_ended(fk);
    }

    fn remember_ended(&mut self, fk: (RequestId, Phase)) {
        if self.ended.len() >= ENDED_KEPT {
            self.ended.pop_front();
        }
        self.ended.push_back(fk);
    }

    // ---- outputs and timers ----

    fn drain(&mut self) -> Check {
        while let Some(out) = self.router.poll_output() {
            self.output(out)?;
        }
        Ok(())
    }

    fn output(&mut self, out: Output) -> Check {
        let fk = match &out {
            Output::Routed(r) => (r.id, r.phase),
            Output::Failed { id, phase, .. }
            | Output::TimedOut { id, phase }
            | Output::BookingExpired { id, phase } => (*id, *phase),
            Output::LeaseExpired { .. } => {
                self.tally.lease_expired += 1;
                return Ok(());
            }
            other => return Err(format!("unexpected output {other:?}")),
        };
        let Some(state) = self.reqs.get(&fk).map(|r| r.state) else {
            return Err(format!("output {out:?} names a request that is not in flight (ended twice?)"));
        };
        let pending = matches!(state, MState::Pending { .. });
        if matches!(out, Output::Routed(_) | Output::Failed { .. }) {
            self.check_fcfs(fk)?;
        }
        match out {
            Output::Routed(r) if pending && !r.preview => {
                self.check_target(r.target, r.phase)?;
                self.tally.routed_later += 1;
                self.transitions += 1;
                let now = self.now;
                if let Some(m) = self.reqs.get_mut(&fk) {
                    m.book(r.target, r.overlap.device, r.phase, now);
                }
            }
            Output::Failed { .. } if pending => {
                self.tally.failed_later += 1;
                self.end(fk);
            }
            Output::TimedOut { .. } if pending => {
                self.tally.timed_out += 1;
                self.end(fk);
            }
            Output::BookingExpired { .. } if matches!(state, MState::Booked(_) | MState::Dispatched(_)) => {
                self.tally.booking_expired += 1;
                self.end(fk);
            }
            out => return Err(format!("output {out:?} for a request in state {state:?}")),
        }
        Ok(())
    }

    /// A FCFS queue lets requests out in order: none seen queued ahead of `fk` may still
    /// wait when `fk` leaves (by routing or failure; time-outs and cancels leave anywhere).
    fn check_fcfs(&self, fk: (RequestId, Phase)) -> Check {
        if self.cfg.queue.order != QueueOrder::Fcfs {
            return Ok(());
        }
        let Some(mine) = self.reqs.get(&fk).and_then(|m| m.fcfs) else { return Ok(()) };
        let ahead = self.reqs.iter().find(|(k, m)| {
            **k != fk && matches!(m.state, MState::Pending { seen_queued: true }) && m.fcfs.is_some_and(|f| f < mine)
        });
        match ahead {
            Some((k, m)) => Err(format!("{fk:?} left the queue at {mine:?} before {k:?} at {:?}", m.fcfs)),
            None => Ok(()),
        }
    }

    fn run_timers(&mut self) -> Check {
        for _ in 0..TIMER_CALLS_MAX {
            match self.router.poll_timeout() {
                Some(t) if t <= self.now => {
                    self.router.handle_timeout(self.now);
                    self.tally.timer_calls += 1;
                    self.drain()?;
                }
                _ => return Ok(()),
            }
        }
        Err(format!("still due after {TIMER_CALLS_MAX} handle_timeout calls: {:?}", self.router.poll_timeout()))
    }

    // ---- checks ----

    fn check(&mut self) -> Check {
        let r = &self.router;
        r.check_invariants().map_err(|v| format!("check_invariants: {}", v.0))?;
        if r.requests_in_flight() != self.reqs.len() {
            return Err(format!(
                "router tracks {} requests, the model {}: {:?}",
                r.requests_in_flight(),
                self.reqs.len(),
                self.reqs
            ));
        }
        let mut per_key: BTreeMap<WorkerKey, u32> = BTreeMap::new();
        let mut loads: BTreeMap<WorkerKey, (u64, std::collections::BTreeSet<SeqHash>, u64)> = BTreeMap::new();
        let (mut seen_queued, mut pending, mut sessions) = (0, 0, 0);
        let (queue_ms, age_ms) = (self.cfg.queue.queue_timeout_ms, self.cfg.load.request_age_max_ms);
        for (&(id, phase), m) in &self.reqs {
            let overdue = match m.state {
                MState::Pending { seen_queued: true } => m.since.add_ms(queue_ms) <= self.now,
                MState::Booked(_) | MState::Dispatched(_) => m.since.add_ms(age_ms) <= self.now,
                _ => false,
            };
            if overdue {
                return Err(format!("{id:?} {phase} is {:?} since {:?}, past its deadline", m.state, m.since));
            }
            let want = match m.state {
                MState::Booked(k) | MState::Dispatched(k) => {
                    *per_key.entry(k).or_default() += 1;
                    let l = loads.entry(k).or_default();
                    l.0 += u64::from(m.prefill_left);
                    if phase != Phase::Prefill {
                        l.1.extend(m.blocks.iter().copied());
                        l.2 += u64::from(m.expected_out_blocks.max(m.generated_blocks));
                    }
                    Some(k)
                }
                MState::Pending { seen_queued: s } => {
                    pending += 1;
                    seen_queued += usize::from(s);
                    None
                }
                MState::Orphaned => None,
            };
            sessions += usize::from(m.session.is_some());
            if r.load().booking(id, phase) != want {
                return Err(format!(
                    "{id:?} {phase} is {:?} but its booking is {:?}",
                    m.state,
                    r.load().booking(id, phase)
                ));
            }
        }
        let booked: u32 = per_key.values().sum();
        for (&k, &n) in &per_key {
            let got = r.load().load(k);
            let (prefill, blocks, out) = &loads[&k];
            let want = WorkerLoad {
                active_prefill_tokens: *prefill,
                active_decode_blocks: blocks.len() as u64 + out,
                active_requests: n,
            };
            if got != want {
                return Err(format!("{k} carries {got:?}, the model books {want:?}"));
            }
        }
        if r.load().len() != booked as usize || r.load().total().active_requests != booked {
            return Err(format!("load tracks {} bookings, the model {booked}", r.load().len()));
        }
        if booked == 0 && r.load().total() != WorkerLoad::default() {
            return Err(format!("no bookings but load {:?}", r.load().total()));
        }
        if r.affinity().len() > self.cfg.affinity.sessions_max {
            return Err(format!("{} sessions, limit {}", r.affinity().len(), self.cfg.affinity.sessions_max));
        }
        if !(seen_queued..=pending).contains(&r.queue().len()) {
            return Err(format!(
                "queue holds {}, the model {seen_queued} queued of {pending} pending",
                r.queue().len()
            ));
        }
        let leases = r.affinity().live_leases();
        if leases > sessions {
            return Err(format!("{leases} live leases but only {sessions} requests with a session in flight"));
        }
        let stats = r.index().stats();
        if stats.entries != self.index.total_entries() || stats.workers as usize != self.index.keys().count() {
            return Err(format!(
                "index holds {} entries over {} keys, the model {} over {}",
                stats.entries,
                stats.workers,
                self.index.total_entries(),
                self.index.keys().count()
            ));
        }
        Ok(())
    }

    /// Compares the index with the model: per-key sizes, and the answer to `query`, both
    /// exact and with early exit (where one key may stop short).
    fn check_index(&mut self, query: &[router_core::hash::SeqHash]) -> Check {
        for k in self.index.keys() {
            let (got, want) = (self.router.index().worker_entries(k), self.index.entries(k));
            if got != want {
                return Err(format!("index: {k} holds {got} blocks, the model {want}"));
            }
        }
        let want = self.index.find_matches(query);
        self.router.index().find_matches(query, false, &mut self.scores);
        let got: Vec<_> = self.scores.iter().collect();
        if got != want {
            return Err(format!("index query of {} blocks answered {got:?}, the model {want:?}", query.len()));
        }
        self.router.index().find_matches(query, true, &mut self.scores);
        let early: Vec<_> = self.scores.iter().collect();
        let short: Vec<_> = want
            .iter()
            .filter(|(k, o)| self.scores.get(*k) != *o)
            .map(|(k, o)| (*k, o.raw(), self.scores.get(*k).raw()))
            .collect();
        let extra = early.iter().any(|(k, _)| !want.iter().any(|(w, _)| w == k));
        if extra || short.len() > 1 || short.iter().any(|&(_, full, got)| got > full || got == 0) {
            return Err(format!("early-exit query answered {early:?}, the full answer is {want:?}"));
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    Dispatched,
    Failed(bool),
    PrefillDone,
    Progress(u16),
    Finished,
    Cancel,
}

impl Life {
    fn kind(self) -> u8 {
        match self {
            Life::Dispatched => 0,
            Life::Failed(_) => 1,
            Life::PrefillDone => 2,
            Life::Progress(_) => 3,
            Life::Finished => 4,
            Life::Cancel => 5,
        }
    }
}

/// Everything a preview or a refused duplicate must leave untouched.
fn fingerprint(r: &Router) -> (usize, usize, usize, usize, usize, WorkerLoad, u64) {
    (
        r.requests_in_flight(),
        r.affinity().len(),
        r.affinity().live_leases(),
        r.queue().len(),
        r.load().len(),
        r.load().total(),
        r.stats().dispatched + r.stats().queued + r.stats().rejected,
    )
}

fn worker_id(w: u8) -> WorkerId {
    // One id past the pool is never registered by the generator's fleet.
    WorkerId(u64::from(w % (WORKERS + 1)))
}

fn key_of(worker: u8, rank: u8) -> WorkerKey {
    WorkerKey { worker: worker_id(worker), rank: DpRank(u32::from(rank % 4)) }
}

fn tier_of(t: u8) -> Tier {
    [Tier::Device, Tier::Host, Tier::Disk][t as usize % 3]
}

fn unknown_worker(key: WorkerKey) -> InputError {
    InputError::Worker(WorkerError::UnknownWorker { worker: key.worker })
}

fn taints_of(bits: u8) -> Vec<Taint> {
    let mut t = Vec::new();
    if bits & 1 != 0 {
        t.push(Taint { key: "maint".into(), value: String::new(), effect: TaintEffect::NoSchedule });
    }
    if bits & 2 != 0 {
        t.push(Taint { key: "spot".into(), value: "yes".into(), effect: TaintEffect::PreferNoSchedule });
    }
    t
}
