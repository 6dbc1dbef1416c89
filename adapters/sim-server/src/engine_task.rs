//! The engine task: owns the [`Engine`], runs it in wall-clock time, streams each
//! request's tokens to its handler and turns KV events into published batches.
//!
//! Time: engine milliseconds are wall milliseconds since the task started. The engine
//! divides every modelled duration by its speedup itself, so a pass that takes 30 ms at
//! speedup 1 ends 0.3 ms later at speedup 100. The task sleeps until the engine's next
//! pass boundary, a pending KV handoff, or a new request, then advances the engine one
//! boundary at a time up to now.
//!
//! Tokens: the engine reports a request's first token and its finish, not each token.
//! The task emits one more token for every decoding request at each pass end it
//! observes (the engine samples one token per scheduled request per pass), holds the
//! last token until the engine says the request finished, and then flushes whatever is
//! left. This is exact while a request is scheduled in every pass, which the engine does
//! for decoding requests unless a pass's token budget runs out or the request is
//! preempted; in those cases tokens arrive slightly early and the finish is still exact.
//! A decode-role worker whose request brings KV from a prefill worker emits the first
//! token when the request joins the batch (its KV arrived after the modelled transfer).
//!
//! What it leaves to others: HTTP (the handlers own their response shapes), sockets
//! (the publisher task). A handler that goes away does not stop its request: the engine
//! model has no abort, so the request runs to its end and its tokens are discarded.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_sim::engine::{Engine, EngineOutput, EngineRequest, EngineRole, KvEvent, RejectReason};
use kvroute_sim::prompt::{Prompt, PromptError};
use router_core::{BlockSize, HashSeed};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::ledger::{generated_token_id, Ledger, Registered};
use crate::media::PromptMedia;
use crate::metrics::Metrics;
use crate::publisher::Batch;
use crate::wire::WireEvent;

/// Engine boundaries processed per wake-up before yielding back to the runtime.
const STEPS_PER_WAKE_MAX: u32 = 100_000;

/// A request for the engine task.
pub(crate) struct Submit {
    pub(crate) tokens: Vec<u32>,
    /// The images `tokens` holds, placed.
    pub(crate) media: Option<Arc<PromptMedia>>,
    pub(crate) output_len: u32,
    /// Decode role only: the prompt's KV comes from a prefill worker (wait for the
    /// modelled transfer, then decode; the first token is already sampled).
    pub(crate) remote_prefill: bool,
    pub(crate) progress: mpsc::UnboundedSender<Progress>,
    pub(crate) accepted: oneshot::Sender<Result<(), SubmitError>>,
}

/// Why the engine refused a request.
#[derive(Debug)]
pub(crate) enum SubmitError {
    Prompt(PromptError),
    Engine(RejectReason),
}

/// What a handler hears about its request after acceptance.
#[derive(Debug)]
pub(crate) enum Progress {
    /// This many more tokens exist.
    Tokens(u32),
    /// The request is over; no message follows.
    Done(Done),
}

/// A finished request's figures.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Done {
    pub(crate) completion_tokens: u32,
    pub(crate) cached_tokens: u32,
    /// Full prompt blocks (what a decode worker would pull).
    pub(crate) prompt_blocks: u32,
}

struct Active {
    reg: Registered,
    progress: mpsc::UnboundedSender<Progress>,
    prompt_len: u32,
    /// Tokens the response carries in total.
    response_tokens: u32,
    emitted: u32,
    decoding: bool,
    paused: bool,
    admitted_once: bool,
    cached_tokens: u32,
    /// Decode role, KV handed over from a prefill worker.
    remote_prefill: bool,
}

pub(crate) struct EngineTask {
    engine: Engine,
    base: Instant,
    role: EngineRole,
    bs: BlockSize,
    ledger: Ledger,
    active: BTreeMap<u64, Active>,
    /// Decode-role requests waiting for their KV transfer, by due time (ms) then order.
    handoffs: BinaryHeap<Reverse<(u64, u64)>>,
    handoff_reqs: BTreeMap<u64, Submit>,
    next_id: u64,
    next_out_base: u32,
    in_flight: bool,
    out: Vec<EngineOutput>,
    events_tx: mpsc::Sender<Batch>,
    metrics: Metrics,
}

impl EngineTask {
    pub(crate) fn new(engine: Engine, events_tx: mpsc::Sender<Batch>, metrics: Metrics) -> Self {
        let cfg = engine.config();
        let role = cfg.role;
        // The engine validated its block size at construction.
        let bs = BlockSize::new(cfg.block_size).unwrap_or(BlockSize::DEFAULT);
        metrics.total_blocks.set(i64::from(cfg.blocks_per_worker));
        EngineTask {
            engine,
            base: Instant::now(),
            role,
            bs,
            ledger: Ledger::new(bs),
            active: BTreeMap::new(),
            handoffs: BinaryHeap::new(),
            handoff_reqs: BTreeMap::new(),
            next_id: 0,
            next_out_base: 0,
            in_flight: false,
            out: Vec::new(),
            events_tx,
            metrics,
        }
    }

    /// Serves submissions until `stop` turns true or every sender is gone.
    pub(crate) async fn run(mut self, mut rx: mpsc::Receiver<Submit>, mut stop: watch::Receiver<bool>) {
        loop {
            let deadline = self.next_deadline();
            tokio::select! {
                biased;
                _ = stop.changed() => break,
                s = rx.recv() => match s {
                    Some(s) => {
                        let now = self.now_ms();
                        self.step_to(now);
                        self.submit_or_hold(now, s);
                    }
                    None => break,
                },
                _ = sleep_until_opt(deadline) => {}
            }
            let now = self.now_ms();
            self.step_to(now);
        }
    }

    fn now_ms(&self) -> f64 {
        self.base.elapsed().as_secs_f64() * 1000.0
    }

    fn next_deadline(&self) -> Option<Instant> {
        let handoff = self.handoffs.peek().map(|Reverse((due, _))| f64::from_bits(*due));
        let ms = match (self.engine.next_wakeup(), handoff) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        let d = Duration::try_from_secs_f64((ms / 1000.0).max(0.0)).unwrap_or(Duration::from_secs(86_400 * 365));
        Some(self.base.checked_add(d).unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400)))
    }

    fn submit_or_hold(&mut self, now: f64, s: Submit) {
        if self.role == EngineRole::Decode && s.remote_prefill {
            let kv = &self.engine.config().kv_transfer;
            let delay_ms = if kv.bandwidth_bytes_per_s > 0.0 {
                s.tokens.len() as f64 * kv.kv_bytes_per_token as f64 / kv.bandwidth_bytes_per_s * 1000.0
                    / self.engine.config().speedup
            } else {
                0.0
            };
            let due = now + delay_ms.max(0.0);
            let key = self.next_id;
            self.next_id += 1;
            // Non-negative finite f64s order like their bit patterns.
            self.handoffs.push(Reverse((due.to_bits(), key)));
            self.handoff_reqs.insert(key, s);
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.submit(now, id, s);
    }

    fn submit(&mut self, now: f64, id: u64, s: Submit) {
        let prompt = match &s.media {
            Some(m) => Prompt::from_tokens_with_media(&s.tokens, self.bs, HashSeed::DEFAULT, &m.items),
            None => Prompt::from_tokens(&s.tokens, self.bs, HashSeed::DEFAULT),
        };
        let prompt = match prompt {
            Ok(p) => p,
            Err(e) => {
                let _ = s.accepted.send(Err(SubmitError::Prompt(e)));
                return;
            }
        };
        let prompt_len = prompt.len_tokens();
        let output_len = s.output_len.max(1);
        let remote = self.role == EngineRole::Decode && s.remote_prefill;
        let req = EngineRequest { id, prompt, output_len, generated_before: u32::from(remote) };
        if let Err(r) = self.engine.submit(now, req) {
            let _ = s.accepted.send(Err(SubmitError::Engine(r)));
            return;
        }
        // Mirror the engine's output-id ranges: `target` ids per accepted request.
        let target = if self.role == EngineRole::Prefill { 1 } else { output_len };
        let out_base = self.next_out_base;
        self.next_out_base = self.next_out_base.wrapping_add(target);
        let generated = (0..target - 1).map(|k| generated_token_id(out_base, k));
        let reg = self.ledger.register(&s.tokens, s.media.as_ref(), generated);
        self.metrics.prompt_tokens.inc_by(u64::from(prompt_len));
        let response_tokens = if self.role == EngineRole::Prefill { 1 } else { output_len };
        self.active.insert(
            id,
            Active {
                reg,
                progress: s.progress,
                prompt_len,
                response_tokens,
                emitted: 0,
                decoding: false,
                paused: false,
                admitted_once: false,
                cached_tokens: 0,
                remote_prefill: remote,
            },
        );
        let _ = s.accepted.send(Ok(()));
    }

    /// Processes every handoff and engine boundary due by `now`, earliest first.
    fn step_to(&mut self, now: f64) {
        for _ in 0..STEPS_PER_WAKE_MAX {
            let wake = self.engine.next_wakeup().filter(|&w| w <= now);
            let handoff = self.handoffs.peek().map(|Reverse((due, _))| f64::from_bits(*due)).filter(|&d| d <= now);
            match (wake, handoff) {
                (_, Some(due)) if wake.is_none_or(|w| due <= w) => {
                    if let Some(Reverse((_, key))) = self.handoffs.pop() {
                        if let Some(s) = self.handoff_reqs.remove(&key) {
                            self.submit(due, key, s);
                        }
                    }
                }
                (Some(w), _) => self.advance_one(w),
                _ => return,
            }
        }
        tracing::warn!("engine step limit reached; continuing on the next wake-up");
    }

    fn advance_one(&mut self, w: f64) {
        let pass_ended = self.in_flight;
        let mut out = std::mem::take(&mut self.out);
        out.clear();
        self.engine.advance(w, &mut out);
        self.in_flight = self.engine.next_wakeup().is_some();
        // Gauges first: a handler that hears "done" may be asked for /metrics at once.
        self.update_gauges();
        if pass_ended {
            self.sweep_pass_end();
        }
        let mut events = Vec::new();
        for o in &out {
            self.apply(o, &mut events);
        }
        self.out = out;
        if !events.is_empty() {
            let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
            if self.events_tx.try_send(Batch { ts, events }).is_err() {
                self.metrics.event_batches_dropped.inc();
            }
        }
    }

    /// One token for each decoding request at a pass end, holding back the last.
    fn sweep_pass_end(&mut self) {
        for a in self.active.values_mut() {
            if a.decoding && !a.paused && a.emitted + 1 < a.response_tokens {
                a.emitted += 1;
                let _ = a.progress.send(Progress::Tokens(1));
            }
        }
    }

    fn apply(&mut self, o: &EngineOutput, events: &mut Vec<WireEvent>) {
        match o {
            EngineOutput::Kv { event, .. } => self.kv_event(event, events),
            EngineOutput::Admitted { id, cached_tokens, readmission, .. } => {
                let remote = self.role == EngineRole::Decode;
                let Some(a) = self.active.get_mut(id) else { return };
                a.paused = false;
                if !*readmission && !a.admitted_once {
                    a.admitted_once = true;
                    a.cached_tokens = (*cached_tokens).min(a.prompt_len);
                    self.metrics.prefix_queries.inc_by(u64::from(a.prompt_len));
                    self.metrics.prefix_hits.inc_by(u64::from(a.cached_tokens));
                }
                if remote && !a.decoding {
                    a.decoding = true;
                    // A handed-off request's first token was sampled by the prefill worker.
                    if a.remote_prefill && a.emitted == 0 && a.response_tokens > 1 {
                        a.emitted = 1;
                        let _ = a.progress.send(Progress::Tokens(1));
                    }
                }
            }
            EngineOutput::FirstToken { id, .. } => {
                if let Some(a) = self.active.get_mut(id) {
                    a.decoding = true;
                    if a.emitted == 0 && a.response_tokens > 1 {
                        a.emitted = 1;
                        let _ = a.progress.send(Progress::Tokens(1));
                    }
                }
            }
            EngineOutput::Preempted { id, .. } => {
                if let Some(a) = self.active.get_mut(id) {
                    a.paused = true;
                }
            }
            EngineOutput::Finished { id, .. } => {
                let Some(a) = self.active.remove(id) else { return };
                self.ledger.release(&a.reg);
                let left = a.response_tokens.saturating_sub(a.emitted);
                if left > 0 {
                    let _ = a.progress.send(Progress::Tokens(left));
                }
                self.metrics.finished.inc();
                self.metrics.generation_tokens.inc_by(u64::from(a.response_tokens));
                let _ = a.progress.send(Progress::Done(Done {
                    completion_tokens: a.response_tokens,
                    cached_tokens: a.cached_tokens,
                    prompt_blocks: a.prompt_len / self.bs.tokens(),
                }));
            }
        }
    }

    fn kv_event(&mut self, event: &KvEvent, events: &mut Vec<WireEvent>) {
        match event {
            KvEvent::Stored { parent, blocks } => {
                let mut token_ids = Vec::with_capacity(blocks.len() * self.bs.tokens() as usize);
                let mut block_hashes = Vec::with_capacity(blocks.len());
                let mut extra_keys = Vec::with_capacity(blocks.len());
                let mut keys = Vec::new();
                for b in blocks {
                    if !self.ledger.block_of(b.seq, &mut token_ids, &mut keys) {
                        // Only the exact prefix of the chain is published.
                        self.metrics.events_missing_tokens.inc();
                        tracing::warn!(hash = b.seq.0, "stored block with unknown tokens; truncating the event");
                        break;
                    }
                    block_hashes.push(b.seq.0);
                    extra_keys.push(std::mem::take(&mut keys));
                }
                if !block_hashes.is_empty() {
                    events.push(WireEvent::BlockStored {
                        block_hashes,
                        parent_block_hash: parent.map(|p| p.0),
                        token_ids,
                        block_size: self.bs.tokens(),
                        extra_keys,
                    });
                }
            }
            KvEvent::Removed { blocks } => {
                events.push(WireEvent::BlockRemoved { block_hashes: blocks.iter().map(|b| b.0).collect() });
            }
        }
    }

    fn update_gauges(&self) {
        let e = &self.engine;
        let m = &self.metrics;
        m.running.set(e.running_len() as i64);
        m.waiting.set((e.waiting_len() + self.handoff_reqs.len()) as i64);
        m.active_blocks.set(i64::from(e.active_blocks()));
        m.inactive_blocks.set(i64::from(e.inactive_blocks()));
        let cap = f64::from(e.config().blocks_per_worker);
        m.kv_usage.set(f64::from(e.active_blocks()) / cap);
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
