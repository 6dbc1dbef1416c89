//! The discrete-event replay loop: requests arrive, a [`Dispatcher`] picks workers,
//! engines run passes on virtual time, KV events reach the dispatcher after a lag.
//!
//! One thread, one time-ordered queue, no clock. At equal times the order is fixed:
//! KV event deliveries, dispatcher timeouts, arrivals and KV handoffs, then engine
//! pass boundaries (so every request arriving at `t` joins the pass starting at `t`);
//! remaining ties go by insertion order. A request that [`Follow`]s another arrives
//! when that one ends (finished or refused) plus its delay, not at its `arrival_ms`.
//! The same inputs therefore give the same report, byte for byte. The routing policy
//! is left to the `Dispatcher`.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::engine::{ConfigError, Engine, EngineConfig, EngineOutput, EngineRequest, EngineRole, EngineStats, KvEvent};
use crate::prompt::Prompt;
use crate::stats::{summarize, RequestRecord, Summary};

/// A request to replay.
#[derive(Clone, Debug)]
pub struct SimRequest {
    /// Unique id.
    pub id: u64,
    /// Arrival, virtual ms.
    pub arrival_ms: f64,
    /// The hashed prompt (hashed once; the dispatcher and the engines share it).
    pub prompt: Prompt,
    /// Tokens to generate.
    pub output_len: u32,
    /// Conversation id, if known.
    pub session_id: Option<Arc<str>>,
    /// Caller priority, if known.
    pub priority: Option<i64>,
    /// The request this one waits for, if any: it arrives then, not at `arrival_ms`.
    pub follows: Option<Follow>,
}

/// A request sent only after an earlier one finished: a conversation's next turn, or an
/// agent's next call, from a client that waits for each answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Follow {
    /// Id of the request waited for.
    pub after: u64,
    /// Wait after it finishes (or is refused), virtual ms.
    pub delay_ms: f64,
}

/// A dispatcher's answer for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dispatch {
    /// Serve it whole on this worker (aggregated role, or decode role for a bypass).
    To(u32),
    /// Prefill on a prefill-role worker, then hand the KV to a decode-role worker.
    Split {
        /// Prefill worker.
        prefill: u32,
        /// Decode worker.
        decode: u32,
    },
    /// Hold it; it comes back later through [`Dispatcher::poll_dispatch`].
    Queued,
    /// Refuse it.
    Reject,
}

/// A routing policy under replay. Workers are numbered `0..workers`.
///
/// Calling order: each arrival gets `on_arrival`; engine notifications arrive as they
/// happen, KV events after the configured lag; after every step the loop drains
/// `poll_dispatch` until `None` and re-reads `next_timeout`. Only `on_arrival` is
/// required.
pub trait Dispatcher {
    /// A request arrived at `now_ms`: where should it go?
    fn on_arrival(&mut self, now_ms: f64, req: &SimRequest) -> Dispatch;

    /// The replay's call at an arrival, with every engine as it stands at `now_ms`. Only
    /// reference dispatchers that see what no router can (see [`crate::lookahead`])
    /// override it; the default asks [`Dispatcher::on_arrival`].
    fn on_arrival_seeing(&mut self, now_ms: f64, req: &SimRequest, _engines: &[Engine]) -> Dispatch {
        self.on_arrival(now_ms, req)
    }

    /// A worker's KV event, delivered `kv_event_lag_ms` after it happened.
    fn on_kv_event(&mut self, _now_ms: f64, _worker: u32, _event_id: u64, _event: &KvEvent) {}

    /// A request's prompt is computed on `worker` (its first token exists).
    fn on_prefill_done(&mut self, _now_ms: f64, _worker: u32, _req_id: u64) {}

    /// A request left `worker`: finished there, handed off after prefill, or refused by
    /// its engine at submission (too long for the pool).
    fn on_finished(&mut self, _now_ms: f64, _worker: u32, _req_id: u64) {}

    /// A worker's load after one of its pass boundaries (delivered without lag, as a
    /// worker's per-pass metrics publication).
    fn on_worker_load(&mut self, _now_ms: f64, _worker: u32, _load: WorkerLoadSample) {}

    /// A queued request that may now be dispatched (`To`, `Split` or `Reject`).
    fn poll_dispatch(&mut self, _now_ms: f64) -> Option<(u64, Dispatch)> {
        None
    }

    /// When the dispatcher next wants [`Dispatcher::on_timeout`].
    fn next_timeout(&self) -> Option<f64> {
        None
    }

    /// Its timeout came due (a spurious call must be harmless).
    fn on_timeout(&mut self, _now_ms: f64) {}
}

/// The baseline policy: request `i` goes to worker `i mod n`, in arrival order. It needs
/// no router, so the simulator can be checked against published round-robin figures.
#[derive(Clone, Copy, Debug)]
pub struct RoundRobin {
    n: u32,
    next: u32,
}

impl RoundRobin {
    /// Round robin over `workers` workers (at least one), starting at worker 0.
    pub fn new(workers: u32) -> Self {
        RoundRobin { n: workers.max(1), next: 0 }
    }
}

impl Dispatcher for RoundRobin {
    fn on_arrival(&mut self, _now_ms: f64, _req: &SimRequest) -> Dispatch {
        let w = self.next;
        self.next = (self.next + 1) % self.n;
        Dispatch::To(w)
    }
}

/// A worker's load as it publishes it once per pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerLoadSample {
    /// KV blocks held by running requests (including partial blocks).
    pub active_blocks: u32,
    /// Cached blocks no request holds.
    pub inactive_blocks: u32,
    /// Requests in the running batch.
    pub running: u32,
    /// Requests waiting for admission.
    pub waiting: u32,
}

/// Replay parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplayConfig {
    /// Number of workers; 8.
    pub workers: u32,
    /// Every engine's configuration.
    pub engine: EngineConfig,
    /// Per-worker roles; empty means every worker takes `engine.role`.
    pub roles: Vec<EngineRole>,
    /// Delay between a KV change and the dispatcher seeing it, ms; 0.
    pub kv_event_lag_ms: f64,
    /// Loop steps before giving up (a livelock guard); 10^9.
    pub steps_max: u64,
    /// Per-worker speed factors multiplying `engine.speedup` (2.0 runs twice as fast);
    /// empty (the default) or missing entries mean 1.0. A fleet the router does not know
    /// the speeds of.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub speeds: Vec<f64>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            workers: 8,
            engine: EngineConfig::default(),
            roles: Vec::new(),
            kv_event_lag_ms: 0.0,
            steps_max: 1_000_000_000,
            speeds: Vec::new(),
        }
    }
}

/// One worker's share of the replay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// Worker index.
    pub worker: u32,
    /// Its role.
    pub role: EngineRole,
    /// Requests sent to it.
    pub requests: u64,
    /// Its engine counters.
    pub engine: EngineStats,
}

/// Everything a replay measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplayReport {
    /// Headline figures.
    pub summary: Summary,
    /// Per-worker figures.
    pub workers: Vec<WorkerReport>,
    /// Virtual time of the last step, ms.
    pub end_ms: f64,
    /// Loop steps taken.
    pub steps: u64,
    /// Stopped at `steps_max` with work left.
    pub truncated: bool,
    /// Dispatcher answers naming an unknown worker or request, or a worker of the
    /// wrong role (treated as rejects).
    pub invalid_dispatches: u64,
    /// Per-request records, in input order.
    pub records: Vec<RequestRecord>,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    KvDeliver(u32),
    Timeout,
    Handoff {
        req: usize,
        decode: u32,
    },
    /// A request that [`Follow`]s another arrives.
    Arrive(usize),
    Wake(u32),
}

impl Kind {
    fn rank(&self) -> u64 {
        match self {
            Kind::KvDeliver(_) => 0,
            Kind::Timeout => 1,
            Kind::Handoff { .. } | Kind::Arrive(_) => RANK_ARRIVAL,
            Kind::Wake(_) => 3,
        }
    }
}

/// Arrivals and handoffs share a rank; arrivals (kept out of the heap, in a sorted
/// list) go first among equals.
const RANK_ARRIVAL: u64 = 2;

/// Maps an f64 to a u64 with the same total order, so heap comparisons are integer ones.
fn time_key(t: f64) -> u64 {
    let b = t.to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | (1 << 63)
    }
}

struct Entry {
    key: u64,
    /// Rank in the top byte, insertion sequence below.
    tie: u64,
    t: f64,
    kind: Kind,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.key, self.tie) == (o.key, o.tie)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> Ordering {
        (self.key, self.tie).cmp(&(o.key, o.tie))
    }
}

/// Which leg of a request an engine is serving.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Leg {
    Whole,
    Prefill { decode: u32 },
    Decode,
}

struct Loop<'a, D: Dispatcher> {
    cfg: &'a ReplayConfig,
    reqs: &'a [SimRequest],
    d: &'a mut D,
    engines: Vec<Engine>,
    heap: BinaryHeap<Reverse<Entry>>,
    seq: u64,
    arrivals: Vec<usize>,
    /// Per request, the requests that follow it.
    followers: HashMap<usize, Vec<usize>>,
    wake_at: Vec<Option<f64>>,
    kv_queues: Vec<VecDeque<(f64, u64, KvEvent)>>,
    timeout_at: Option<f64>,
    index: HashMap<u64, usize>,
    legs: Vec<Option<Leg>>,
    records: Vec<RequestRecord>,
    worker_requests: Vec<u64>,
    queued: usize,
    invalid: u64,
    outs: Vec<EngineOutput>,
}

/// Replays `reqs` through `dispatcher` on `cfg.workers` engines.
///
/// Work is linear in the engine passes run plus the events delivered; `steps_max`
/// bounds it.
pub fn replay<D: Dispatcher>(
    cfg: &ReplayConfig,
    reqs: &[SimRequest],
    dispatcher: &mut D,
) -> Result<ReplayReport, ConfigError> {
    let mut engines = Vec::with_capacity(cfg.workers as usize);
    for w in 0..cfg.workers {
        let mut ec = cfg.engine.clone();
        if let Some(&role) = cfg.roles.get(w as usize) {
            ec.role = role;
        }
        if let Some(&speed) = cfg.speeds.get(w as usize) {
            ec.speedup *= speed;
        }
        engines.push(Engine::new(ec, w)?);
    }
    let n = cfg.workers as usize;
    let index: HashMap<u64, usize> = reqs.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
    let mut lp = Loop {
        cfg,
        reqs,
        d: dispatcher,
        engines,
        heap: BinaryHeap::with_capacity(16 * n + 16),
        seq: 0,
        arrivals: sorted_arrivals(reqs, &index),
        followers: followers(reqs, &index),
        wake_at: vec![None; n],
        kv_queues: (0..n).map(|_| VecDeque::new()).collect(),
        timeout_at: None,
        index,
        legs: vec![None; reqs.len()],
        records: reqs
            .iter()
            .map(|r| RequestRecord {
                id: r.id,
                arrival_ms: r.arrival_ms,
                prompt_tokens: r.prompt.len_tokens(),
                ..RequestRecord::default()
            })
            .collect(),
        worker_requests: vec![0; n],
        queued: 0,
        invalid: 0,
        outs: Vec::new(),
    };
    let (steps, end_ms, truncated) = lp.run();
    let workers = lp
        .engines
        .iter()
        .enumerate()
        .map(|(w, e)| WorkerReport {
            worker: w as u32,
            role: e.config().role,
            requests: lp.worker_requests[w],
            engine: e.stats(),
        })
        .collect();
    Ok(ReplayReport {
        summary: summarize(&lp.records),
        workers,
        end_ms,
        steps,
        truncated,
        invalid_dispatches: lp.invalid,
        records: lp.records,
    })
}

/// The index of the request `r` waits for, if it names one that is in the replay.
fn leader(r: &SimRequest, index: &HashMap<u64, usize>) -> Option<usize> {
    r.follows.and_then(|f| index.get(&f.after).copied())
}

/// Indices of the requests that arrive on time, by arrival time, ties by input order.
fn sorted_arrivals(reqs: &[SimRequest], index: &HashMap<u64, usize>) -> Vec<usize> {
    let mut v: Vec<usize> = (0..reqs.len()).filter(|&i| leader(&reqs[i], index).is_none()).collect();
    v.sort_by(|&a, &b| reqs[a].arrival_ms.total_cmp(&reqs[b].arrival_ms).then(a.cmp(&b)));
    v
}

/// Per request, the ones that wait for it, in input order.
fn followers(reqs: &[SimRequest], index: &HashMap<u64, usize>) -> HashMap<usize, Vec<usize>> {
    let mut m: HashMap<usize, Vec<usize>> = HashMap::new();
    for (i, r) in reqs.iter().enumerate() {
        if let Some(l) = leader(r, index) {
            m.entry(l).or_default().push(i);
        }
    }
    m
}

impl<D: Dispatcher> Loop<'_, D> {
    fn push(&mut self, t: f64, kind: Kind) {
        self.seq += 1;
        let tie = kind.rank() << 56 | self.seq;
        self.heap.push(Reverse(Entry { key: time_key(t), tie, t, kind }));
    }

    fn run(&mut self) -> (u64, f64, bool) {
        let mut steps = 0;
        let mut now = 0.0f64;
        let mut next_arrival = 0;
        loop {
            let arrival = self.arrivals.get(next_arrival).map(|&i| (time_key(self.reqs[i].arrival_ms), i));
            let from_heap = match (self.heap.peek(), arrival) {
                (None, None) => break,
                (None, Some(_)) => false,
                (Some(_), None) => true,
                (Some(Reverse(top)), Some((key, _))) => (top.key, top.tie) < (key, RANK_ARRIVAL << 56),
            };
            if steps >= self.cfg.steps_max {
                return (steps, now, true);
            }
            steps += 1;
            if !from_heap {
                let i = self.arrivals[next_arrival];
                next_arrival += 1;
                now = now.max(self.reqs[i].arrival_ms);
                let decision = self.d.on_arrival_seeing(now, &self.reqs[i], &self.engines);
                self.dispatch(now, i, decision);
                self.drain_dispatcher(now);
                continue;
            }
            let Some(Reverse(e)) = self.heap.pop() else {
                break;
            };
            now = now.max(e.t);
            match e.kind {
                Kind::KvDeliver(w) => self.deliver_kv(w, now),
                Kind::Timeout => {
                    if self.timeout_at == Some(e.t) {
                        self.timeout_at = None;
                        self.d.on_timeout(now);
                    }
                }
                Kind::Handoff { req, decode } => self.submit(now, req, decode, Leg::Decode),
                Kind::Arrive(i) => {
                    self.records[i].arrival_ms = now;
                    let decision = self.d.on_arrival_seeing(now, &self.reqs[i], &self.engines);
                    self.dispatch(now, i, decision);
                }
                Kind::Wake(w) => {
                    if self.wake_at[w as usize] == Some(e.t) {
                        self.wake_at[w as usize] = None;
                        self.advance(w, now);
                    }
                }
            }
            self.drain_dispatcher(now);
        }
        (steps, now, false)
    }

    fn drain_dispatcher(&mut self, now: f64) {
        // Each queued request leaves at most once, so this loop is bounded.
        for _ in 0..=self.queued {
            let Some((id, decision)) = self.d.poll_dispatch(now) else {
                break;
            };
            match self.index.get(&id).copied() {
                Some(i) if self.legs[i].is_none() && !self.records[i].rejected && decision != Dispatch::Queued => {
                    self.queued = self.queued.saturating_sub(1);
                    self.dispatch(now, i, decision);
                }
                _ => self.invalid += 1,
            }
        }
        let next = self.d.next_timeout();
        if next != self.timeout_at {
            self.timeout_at = next;
            if let Some(t) = next {
                self.push(t.max(now), Kind::Timeout);
                self.timeout_at = Some(t.max(now));
            }
        }
    }

    fn role(&self, w: u32) -> Option<EngineRole> {
        self.engines.get(w as usize).map(|e| e.config().role)
    }

    fn dispatch(&mut self, now: f64, i: usize, decision: Dispatch) {
        match decision {
            // A decode worker may serve a whole request: a disaggregation bypass.
            Dispatch::To(w) if matches!(self.role(w), Some(EngineRole::Aggregated | EngineRole::Decode)) => {
                self.submit(now, i, w, Leg::Whole)
            }
            Dispatch::Split { prefill, decode }
                if self.role(prefill) == Some(EngineRole::Prefill) && self.role(decode) == Some(EngineRole::Decode) =>
            {
                self.submit(now, i, prefill, Leg::Prefill { decode })
            }
            Dispatch::Queued => self.queued += 1,
            Dispatch::Reject => self.refuse(now, i),
            _ => {
                self.invalid += 1;
                self.refuse(now, i);
            }
        }
    }

    fn refuse(&mut self, now: f64, i: usize) {
        self.records[i].rejected = true;
        self.release_followers(now, i);
    }

    /// Request `i` ended at `at_ms`: those waiting for it arrive after their delays.
    fn release_followers(&mut self, at_ms: f64, i: usize) {
        for j in self.followers.remove(&i).unwrap_or_default() {
            let delay = self.reqs[j].follows.map_or(0.0, |f| f.delay_ms.max(0.0));
            self.push(at_ms + delay, Kind::Arrive(j));
        }
    }

    fn submit(&mut self, now: f64, i: usize, w: u32, leg: Leg) {
        let r = &self.reqs[i];
        let r_id = r.id;
        let req = EngineRequest {
            id: r.id,
            prompt: r.prompt.clone(),
            output_len: r.output_len,
            generated_before: u32::from(leg == Leg::Decode),
        };
        self.worker_requests[w as usize] += 1;
        match self.engines[w as usize].submit(now, req) {
            Ok(()) => {
                self.legs[i] = Some(leg);
                self.records[i].worker = Some(w);
                self.reschedule(w);
            }
            Err(_) => {
                self.refuse(now, i);
                // The dispatcher counted it against `w`; tell it the request left.
                self.d.on_finished(now, w, r_id);
            }
        }
    }

    fn reschedule(&mut self, w: u32) {
        let next = self.engines[w as usize].next_wakeup();
        if next != self.wake_at[w as usize] {
            self.wake_at[w as usize] = next;
            if let Some(t) = next {
                self.push(t, Kind::Wake(w));
            }
        }
    }

    fn advance(&mut self, w: u32, now: f64) {
        let mut outs = std::mem::take(&mut self.outs);
        outs.clear();
        self.engines[w as usize].advance(now, &mut outs);
        for o in outs.drain(..) {
            self.on_output(w, o);
        }
        self.outs = outs;
        let e = &self.engines[w as usize];
        let load = WorkerLoadSample {
            active_blocks: e.active_blocks(),
            inactive_blocks: e.inactive_blocks(),
            running: e.running_len() as u32,
            waiting: e.waiting_len() as u32,
        };
        self.d.on_worker_load(now, w, load);
        self.reschedule(w);
    }

    fn on_output(&mut self, w: u32, o: EngineOutput) {
        let lag = self.cfg.kv_event_lag_ms.max(0.0);
        match o {
            EngineOutput::Kv { at_ms, event_id, event } => {
                let t = at_ms + lag;
                let q = &mut self.kv_queues[w as usize];
                let new_time = q.back().is_none_or(|b| b.0 != t);
                q.push_back((t, event_id, event));
                if new_time {
                    self.push(t, Kind::KvDeliver(w));
                }
            }
            EngineOutput::Admitted { id, at_ms, cached_tokens, readmission } => {
                if let Some(i) = self.lookup(id) {
                    if !readmission && self.legs[i] != Some(Leg::Decode) {
                        self.records[i].cached_tokens.get_or_insert(cached_tokens);
                        self.records[i].admitted_ms.get_or_insert(at_ms);
                    }
                }
            }
            EngineOutput::FirstToken { id, at_ms } => {
                if let Some(i) = self.lookup(id) {
                    self.records[i].first_token_ms.get_or_insert(at_ms);
                }
                self.d.on_prefill_done(at_ms, w, id);
            }
            EngineOutput::Preempted { id, .. } => {
                if let Some(i) = self.lookup(id) {
                    self.records[i].preemptions += 1;
                }
            }
            EngineOutput::Finished { id, at_ms, tokens, kv_transfer_ms, .. } => {
                let Some(i) = self.lookup(id) else { return };
                let rec = &mut self.records[i];
                rec.output_tokens += tokens;
                match self.legs[i] {
                    Some(Leg::Prefill { decode }) if self.reqs[i].output_len > 1 => {
                        self.push(at_ms + kv_transfer_ms, Kind::Handoff { req: i, decode });
                    }
                    _ => {
                        rec.last_token_ms = Some(at_ms);
                        rec.completed = true;
                        self.release_followers(at_ms, i);
                    }
                }
                self.d.on_finished(at_ms, w, id);
            }
        }
    }

    fn lookup(&self, id: u64) -> Option<usize> {
        self.index.get(&id).copied()
    }

    fn deliver_kv(&mut self, w: u32, now: f64) {
        while let Some(front) = self.kv_queues[w as usize].front() {
            if front.0 > now {
                break;
            }
            if let Some((_, event_id, ev)) = self.kv_queues[w as usize].pop_front() {
                self.d.on_kv_event(now, w, event_id, &ev);
            }
        }
    }
}
