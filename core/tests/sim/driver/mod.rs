//! [`Driver`]: applies one [`Op`] to a `Router`, mirrors its effect in a plain model,
//! drains every output, runs due timers, and checks the router against the model.

use std::collections::{BTreeMap, VecDeque};

use router_core::{
    AffinityMode, Decision, DispatchFailure, DpRank, Draw, ExclusionReason, Health, IndexEvent, InputError, Instant,
    Observation, Output, OverlapScores, Phase, PhaseField, PinError, Priority, QueueOrder, Request, RequestId,
    RouteError, Routed, Router, RouterConfig, RouterMode, RoutingHints, SeqHash, Taint, TaintEffect, Tier, Toleration,
    WorkerError, WorkerId, WorkerKey, WorkerLoad, WorkerRole, WorkerSpec, WorkerUpdate,
};

mod checks;
mod fleet;
mod requests;

use super::index_model::IndexModel;
use super::ops::{
    avoid, block, chain_blocks, private_block, with_local, Bug, Knobs, Op, ReqOp, CHAIN_BLOCKS, SESSIONS, WORKERS,
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
    /// It has a session and no pin of its own, so its session binding decides.
    pub follows_binding: bool,
    /// The revision of the session binding it holds a lease on, when seen.
    pub lease_rev: Option<u64>,
}

/// Tokens per block in every configuration the driver builds.
const BLOCK_TOKENS: u32 = 64;

impl MReq {
    /// The model of `req` before its first decision: no session, no chain, not booked.
    fn unrouted(req: &Request, now: Instant) -> Self {
        MReq {
            state: MState::Orphaned,
            session: None,
            chain: 0,
            len: 0,
            since: now,
            blocks: req.blocks.clone(),
            isl_tokens: req.isl_tokens,
            expected_out_blocks: req.expected_output_tokens.map_or(0, |t| t.div_ceil(BLOCK_TOKENS)),
            prefill_left: 0,
            generated_blocks: 0,
            fcfs: None,
            follows_binding: false,
            lease_rev: None,
        }
    }

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
    /// Registered workers said to tokenize otherwise: predicted beside their events.
    foreign: std::collections::BTreeSet<WorkerId>,
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
            foreign: std::collections::BTreeSet::new(),
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
            .and_then(|()| self.check_settled())
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
                return Err(format!("settle: stuck with requests {:?}", self.states()));
            }
        }
        Err(format!("settle: not done after {SETTLE_ROUNDS_MAX} rounds: {:?}", self.states()))
    }

    fn states(&self) -> Vec<((RequestId, Phase), MState)> {
        self.reqs.iter().map(|(&k, m)| (k, m.state)).collect()
    }

    fn check_empty(&self) -> Check {
        let r = &self.router;
        let counts = r.counts();
        let leftovers = [
            ("requests", r.requests_in_flight()),
            ("queued", counts.queue_depth),
            ("bookings", counts.bookings),
            ("leases", counts.affinity_live_leases),
            ("sessions", counts.affinity_sessions),
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
            Op::Observe { worker, rank, slowdown, tokens } => {
                let ttft_ms =
                    if slowdown == 0 { f64::NAN } else { f64::from(slowdown) / 4.0 * (1.0 + f64::from(tokens)) };
                let obs = Observation::FirstToken { ttft_ms, uncached_tokens: u32::from(tokens), queued_tokens: 0 };
                // An unknown worker or a NaN is refused and counted; nothing to mirror.
                let _ = self.router.handle_observation(self.now, key_of(worker, rank), obs);
                Ok(())
            }
            Op::Tokens { worker, agrees } => {
                let id = worker_id(worker);
                self.router.handle_worker_tokens(id, agrees);
                if agrees {
                    self.foreign.remove(&id);
                } else if self.workers.contains_key(&id) {
                    self.foreign.insert(id);
                }
                Ok(())
            }
            Op::Request(r) => self.request(r),
            Op::Dispatched { pick } => self.lifecycle(pick, Life::Dispatched),
            Op::DispatchFailed { pick, failure } => {
                let why = [DispatchFailure::Cancelled, DispatchFailure::Worker, DispatchFailure::Refused];
                self.lifecycle(pick, Life::Failed(why[usize::from(failure % 3)]))
            }
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
            | Output::Rejected { id, phase, .. }
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
                let blocks = self.reqs.get(&fk).map(|m| m.blocks.clone()).unwrap_or_default();
                self.check_routed(&r, &blocks)?;
                self.tally.routed_later += 1;
                self.transitions += 1;
                let now = self.now;
                if let Some(m) = self.reqs.get_mut(&fk) {
                    m.book(r.target, r.overlap.device, r.phase, now);
                }
            }
            Output::Failed { error: RouteError::Pin(e), .. }
                if pending && !avoid(Bug::SoftBinding) && self.soft_affinity() && self.reqs[&fk].follows_binding =>
            {
                return Err(format!("a soft session binding failed a waiting request: {e:?}"));
            }
            Output::Failed { .. } if pending => {
                self.tally.failed_later += 1;
                self.end(fk);
            }
            Output::TimedOut { .. } if pending => {
                self.tally.timed_out += 1;
                self.end(fk);
            }
            // A session waiter the queue refused once its session's binding was settled.
            Output::Rejected { .. } if matches!(state, MState::Pending { seen_queued: false }) => {
                self.tally.rejected += 1;
                self.end(fk);
            }
            Output::BookingExpired { .. }
                if matches!(state, MState::Booked(_) | MState::Dispatched(_) | MState::Orphaned) =>
            {
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    Dispatched,
    Failed(DispatchFailure),
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
    let counts = r.counts();
    (
        r.requests_in_flight(),
        counts.affinity_sessions,
        counts.affinity_live_leases,
        counts.queue_depth,
        counts.bookings,
        counts.load_total,
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
