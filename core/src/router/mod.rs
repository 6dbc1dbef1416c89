//! The `Router` façade: every routing state machine behind one sans-IO surface. The
//! calling contract is stated once, on [`Router`].

mod disagg;
mod flights;
mod learn;
mod pipeline;
mod prompt_ends;
mod replica;
mod snapshot;
mod types;
mod warmth;

#[cfg(test)]
mod tests;

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use crate::admission::{AdmissionQueue, QueueConfig};
use crate::affinity::{AffinityConfig, AffinityOutput, AffinityTable, InitToken, LeaseId, WaitToken};
use crate::eligible::EligibilityConfig;
use crate::hash::BlockSize;
use crate::index::{ApplySummary, ApproxConfig, ApproxIndex, IndexConfig, IndexEvent, PrefixIndex};
use crate::learn::{CostLearner, LearnConfig};
use crate::load::{FleetLoad, LoadConfig};
use crate::select::{KvCostConfig, RouterMode, Selector};
use crate::worker::{Health, Taint, WorkerSpec, WorkerTable, WorkerTableConfig};
use crate::{Draw, Instant, Phase, RequestId, WorkerId, WorkerKey};

use flights::{Flight, FlightKey, Hold, Scratch, State};

pub use disagg::{BypassReason, DisaggConfig, DisaggPlan, DisaggStats};
pub use flights::ORPHANS_PER_CALL_MAX;
pub use replica::{ReplicaConfig, ReplicaError, ReplicaStats, ReplicaUpdate};
pub use snapshot::{KeySnapshot, RouterCounts, RouterSnapshot, WorkerSnapshot};
pub use types::*;

/// Everything the router can be configured with. `Default` gives the documented defaults.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// How workers are chosen.
    pub mode: RouterMode,
    /// Tokens per KV block; must match the engines'.
    pub block_size: BlockSize,
    /// The kv cost model's knobs.
    pub cost: KvCostConfig,
    /// Record predicted cache contents for workers that publish no KV events.
    pub approximate: bool,
    /// Where the request blocks' token ids come from, and so whether KV events can
    /// match them (default [`RequestTokens::Engine`]).
    pub request_tokens: RequestTokens,
    /// The exact prefix index.
    pub index: IndexConfig,
    /// The approximate (predicted) index.
    pub approx: ApproxConfig,
    /// The load tracker.
    pub load: LoadConfig,
    /// Session-affinity leases.
    pub affinity: AffinityConfig,
    /// The admission queue.
    pub queue: QueueConfig,
    /// Busy thresholds and taint penalties.
    pub eligibility: EligibilityConfig,
    /// The worker table's bounds.
    pub workers: WorkerTableConfig,
    /// Requests tracked at once: booked, dispatched, queued or waiting (default 65,536).
    pub requests_max: usize,
    /// Conditional disaggregation.
    pub disagg: DisaggConfig,
    /// Sharing load and bindings with other replicas (default: none, a lone router).
    pub replica: ReplicaConfig,
    /// Learned per-worker speeds and engine-reported load (default: fitted, not used).
    pub learn: LearnConfig,
    /// Prompt-end blocks the router remembers, oldest forgotten first, to tell a
    /// conversation's next turn from a new request that shares only a system prompt
    /// with others (see
    /// [`TtftWeights::keep_needs_prompt_end`](crate::TtftWeights::keep_needs_prompt_end)).
    /// 0 keeps none, and every short prefix on one worker is then read as a
    /// conversation's. Default 16,384 (under 0.5 MB).
    pub prompt_ends_max: usize,
    /// Blocks at the end of each routed prompt recorded as its end. Default 2: a
    /// conversation's next turn does not always repeat the last block of the one
    /// before (the Mooncake trace's do not); in replay of the conversation workload 1
    /// lost 2.5% of hits on 8 busy workers, and 2, 3 and 5 came out alike.
    pub prompt_end_blocks: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            mode: RouterMode::Kv,
            block_size: BlockSize::DEFAULT,
            cost: KvCostConfig::default(),
            approximate: false,
            request_tokens: RequestTokens::Engine,
            index: IndexConfig::default(),
            approx: ApproxConfig::default(),
            load: LoadConfig::default(),
            affinity: AffinityConfig::default(),
            queue: QueueConfig::default(),
            eligibility: EligibilityConfig::default(),
            workers: WorkerTableConfig::default(),
            requests_max: 65_536,
            disagg: DisaggConfig::default(),
            replica: ReplicaConfig::default(),
            learn: LearnConfig::default(),
            prompt_ends_max: 16_384,
            prompt_end_blocks: 2,
        }
    }
}

/// A change to the fleet.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum WorkerUpdate {
    /// A worker joined, or its configuration changed.
    Upsert(WorkerSpec),
    /// A worker left: its index entries, load and bindings are purged.
    Removed(WorkerId),
    /// The adapter's health view changed (ejection, draining, recovery).
    Health(WorkerId, Health),
    /// The worker's taints changed.
    Taints(WorkerId, Vec<Taint>),
}

/// Counters the adapters export as metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouterStats {
    /// Requests routed and confirmed.
    pub dispatched: u64,
    /// Bookings rolled back.
    pub dispatch_failed: u64,
    /// Requests that entered the admission queue.
    pub queued: u64,
    /// Requests the queue refused.
    pub rejected: u64,
    /// Queued requests that timed out.
    pub timed_out: u64,
    /// Lifecycle inputs naming no tracked request (ignored).
    pub unknown_requests: u64,
    /// KV events for workers that are not registered (dropped).
    pub events_unknown_worker: u64,
}

/// The sans-IO router: every routing state machine behind one surface. It does no I/O,
/// reads no clock and draws no random numbers; time comes in as `now` and randomness as a
/// [`Draw`].
///
/// # Calling contract
///
/// The router is driven the way quinn-proto and str0m are: **mutate, then drain, then
/// mutate again.** This section names every public method; they fall into five kinds.
///
/// 0. **Construction.** [`new`](Self::new) takes the [`RouterConfig`]; the fleet starts
///    empty, and a request can only go to workers registered before it arrives.
/// 1. **Inputs** (`handle_*`), each taking `now` where time matters:
///    * requests: [`handle_request`](Self::handle_request) (also takes a [`Draw`]);
///    * the request lifecycle, in this order for each phase of a routed request:
///      [`handle_dispatched`](Self::handle_dispatched) or
///      [`handle_dispatch_failed`](Self::handle_dispatch_failed), then
///      [`handle_prefill_done`](Self::handle_prefill_done) and
///      [`handle_decode_progress`](Self::handle_decode_progress) as it runs, and last
///      [`handle_finished`](Self::handle_finished) or [`handle_cancel`](Self::handle_cancel)
///      (which also withdraws a request still queued or waiting);
///    * KV events: [`handle_kv_event`](Self::handle_kv_event),
///      [`handle_kv_clear`](Self::handle_kv_clear) (the worker restarted, or its stream
///      could not be replayed), [`handle_overlap_trust`](Self::handle_overlap_trust)
///      (a stream has a gap: give the worker no prefix credit until it is filled),
///      [`handle_worker_tokens`](Self::handle_worker_tokens) (whether a worker's engine
///      tokenizes as the caller does, so whether its events can match);
///    * the fleet: [`handle_worker_update`](Self::handle_worker_update) (joins, removals,
///      health and taints);
///    * other replicas: [`handle_replica_update`](Self::handle_replica_update),
///      [`handle_replica_heartbeat`](Self::handle_replica_heartbeat),
///      [`handle_replica_gone`](Self::handle_replica_gone);
///    * measurements for the cost learner:
///      [`handle_observation`](Self::handle_observation) (a request's time to first
///      token, see [`Observation::first_token`](crate::Observation::first_token), or its
///      decode time) and [`handle_engine_load`](Self::handle_engine_load) (the load an
///      engine reports about itself);
///    * time: [`handle_timeout`](Self::handle_timeout) (see 3).
/// 2. **Outputs** (`poll_*`, `#[must_use]`). After *any* input, drain both queues until
///    `None`, in either order:
///    * [`poll_output`](Self::poll_output): decisions the router made on its own (queued
///      or waiting requests now routed, rejected or failed; queue time-outs; expired
///      leases and bookings);
///    * [`poll_replica_update`](Self::poll_replica_update): with
///      [`ReplicaConfig::id`] set, what to tell the other replicas, fire-and-forget. The
///      queue holds at most `updates_max` and drops its oldest when full; without an id
///      it stays empty.
/// 3. **Time.** [`poll_timeout`](Self::poll_timeout) is the next deadline. Sleep until
///    it or the next input, whichever comes first, then call
///    [`handle_timeout(now)`](Self::handle_timeout) and drain the outputs again. A
///    spurious or late call is harmless; time going backwards counts as no time passing.
///    Work per call is bounded (see [`crate::limits`]); while more is due, `poll_timeout`
///    stays at or before `now`.
/// 4. **Queries**, which change nothing and may be called at any time:
///    * plain-data views: [`snapshot`](Self::snapshot) (every worker and key; look one
///      up with [`RouterSnapshot::key`]), [`counts`](Self::counts),
///      [`stats`](Self::stats), [`replica_stats`](Self::replica_stats),
///      [`disagg_stats`](Self::disagg_stats), [`learned`](Self::learned) (the cost
///      learner's view of one key), [`config`](Self::config);
///    * one value each: [`requests_in_flight`](Self::requests_in_flight),
///      [`publishes_events`](Self::publishes_events),
///      [`session_binding`](Self::session_binding), [`booking`](Self::booking),
///      [`local_load`](Self::local_load), [`combined_load`](Self::combined_load),
///      [`index_entries`](Self::index_entries), [`find_matches`](Self::find_matches);
///    * what a request would get: [`plan_disagg_query`](Self::plan_disagg_query) and a
///      preview request ([`Request::preview`]). [`plan_disagg`](Self::plan_disagg) also
///      only reads, but counts its outcome;
///    * for tests and debugging: [`check_invariants`](Self::check_invariants), linear in
///      the requests in flight.
///
/// # Bookings
///
/// A [`Decision::Routed`] is a *booking*: load is reserved on the chosen worker so that
/// concurrent decisions see it, and a session's first binding is held open. Nothing
/// else learns of the worker until the adapter confirms with
/// [`handle_dispatched`](Self::handle_dispatched): only then is the session bound and
/// the prediction recorded (approximate mode).
/// [`handle_dispatch_failed`](Self::handle_dispatch_failed) rolls the booking back and
/// leaves no trace of it. Every booking ends in exactly one of `handle_dispatch_failed`,
/// `handle_finished`, `handle_cancel`, removal of its worker, or expiry after
/// `request_age_max_ms`, and each releases its load, lease and queue slot.
///
/// # Replicas
///
/// Other replicas' load and session bindings arrive through the `handle_replica_*`
/// inputs with the sender's id; any update counts as a heartbeat. Freed remote load can
/// release queued requests, so drain `poll_output` after those inputs too. Binding
/// stamps carry commit times: the adapter maps this router's `now` onto a clock all
/// replicas share (wall time) when it publishes, and back when it receives. Without
/// [`ReplicaConfig::id`] the router is alone and refuses remote input with
/// [`ReplicaError::Disabled`].
///
/// # Work per call
///
/// `handle_request` is linear in the prompt's blocks plus the number of workers.
/// Inputs that free capacity, and a request that moved its session's binding, re-try
/// queued requests in order and stop at the first one that still finds every worker
/// busy.
pub struct Router {
    cfg: RouterConfig,
    workers: WorkerTable,
    index: PrefixIndex,
    approx: ApproxIndex,
    load: FleetLoad,
    affinity: AffinityTable,
    queue: AdmissionQueue,
    selector: Selector,
    flights: BTreeMap<FlightKey, Flight>,
    tickets: BTreeMap<RequestId, FlightKey>,
    waiters: BTreeMap<WaitToken, FlightKey>,
    next_ticket: u64,
    event_workers: BTreeSet<WorkerId>,
    /// Workers whose engine tokenizes otherwise than the caller: bounded by the fleet.
    foreign_tokens: BTreeSet<WorkerId>,
    untrusted: BTreeSet<WorkerKey>,
    warmth: warmth::Warmth,
    /// A session binding was invalidated since the queue was last re-tried: a queued
    /// request of that session pinned to a worker but not a rank took its rank from it.
    unbound: bool,
    orphan_timers: BTreeSet<(Instant, FlightKey)>,
    disagg_stats: DisaggStats,
    draining_affinity: bool,
    outputs: alloc::collections::VecDeque<Output>,
    stats: RouterStats,
    scratch: Scratch,
    replica_out: alloc::collections::VecDeque<ReplicaUpdate>,
    replica_stats: ReplicaStats,
    learn: CostLearner,
    prompt_ends: prompt_ends::PromptEnds,
}

impl core::fmt::Debug for Router {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Router")
            .field("mode", &self.cfg.mode)
            .field("workers", &self.workers.len())
            .field("requests_in_flight", &self.flights.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Router {
    /// A router with no workers.
    pub fn new(cfg: RouterConfig) -> Self {
        Router {
            workers: WorkerTable::new(cfg.workers),
            index: PrefixIndex::new(cfg.index),
            approx: ApproxIndex::new(cfg.approx),
            load: FleetLoad::new(cfg.load, cfg.replica.remote),
            // Bindings committed here carry this replica's id.
            affinity: AffinityTable::new(AffinityConfig {
                replica: cfg.replica.id.unwrap_or_default(),
                ..cfg.affinity.clone()
            }),
            queue: AdmissionQueue::new(cfg.queue.clone()),
            selector: Selector::new(),
            flights: BTreeMap::new(),
            tickets: BTreeMap::new(),
            waiters: BTreeMap::new(),
            next_ticket: 0,
            event_workers: BTreeSet::new(),
            foreign_tokens: BTreeSet::new(),
            untrusted: BTreeSet::new(),
            warmth: warmth::Warmth::default(),
            unbound: false,
            orphan_timers: BTreeSet::new(),
            disagg_stats: DisaggStats::default(),
            draining_affinity: false,
            outputs: alloc::collections::VecDeque::new(),
            stats: RouterStats::default(),
            scratch: Scratch::default(),
            replica_out: alloc::collections::VecDeque::new(),
            replica_stats: ReplicaStats::default(),
            learn: CostLearner::new(cfg.learn),
            prompt_ends: prompt_ends::PromptEnds::new(cfg.prompt_ends_max, cfg.index.hash_seed),
            cfg,
        }
    }

    // ---- getters ----

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }
    /// Counters.
    pub fn stats(&self) -> RouterStats {
        self.stats
    }
    /// Requests tracked (booked, dispatched, queued or waiting).
    pub fn requests_in_flight(&self) -> usize {
        self.flights.len()
    }
    /// Whether `worker` has published KV events (so its overlap is exact).
    pub fn publishes_events(&self, worker: WorkerId) -> bool {
        self.event_workers.contains(&worker)
    }

    // ---- inputs ----

    /// Routes one phase of one request. See [`Decision`] for what each answer obliges the
    /// caller to do. A preview (`request.preview`) changes no state at all.
    pub fn handle_request(&mut self, now: Instant, request: Request, draw: Draw) -> Result<Decision, RouteError> {
        if request.preview {
            return self.preview(now, &request, draw).map(Decision::Routed);
        }
        let fk = FlightKey::new(request.id, request.phase.0);
        if self.flights.contains_key(&fk) {
            return Err(RouteError::DuplicateRequest { id: fk.id, phase: fk.phase });
        }
        if self.flights.len() >= self.cfg.requests_max {
            return Err(RouteError::TooManyRequests { requests_max: self.cfg.requests_max });
        }
        self.flights.insert(fk, Flight { req: request, draw, state: State::New, hold: Hold::None });
        let out = self.admit(now, fk);
        if out.is_err() {
            self.drop_flight(now, fk, false);
        }
        if self.unbound {
            self.drain_queue(now);
        }
        out
    }

    /// Applies one KV event from `key`'s worker. The first event from a worker makes its
    /// overlap exact: its approximate predictions are dropped.
    pub fn handle_kv_event(
        &mut self,
        _now: Instant,
        key: WorkerKey,
        event: IndexEvent<'_>,
    ) -> Result<ApplySummary, InputError> {
        if self.workers.get(key.worker).is_none() {
            self.stats.events_unknown_worker += 1;
            return Err(InputError::Worker(crate::worker::WorkerError::UnknownWorker { worker: key.worker }));
        }
        let applied = self.index.apply(key, event).map_err(InputError::Index)?;
        // Only an accepted event proves the worker publishes; then its predictions go,
        // unless its events may not match the requests' tokens.
        if self.event_workers.insert(key.worker) && !self.estimated(key.worker) {
            self.approx.remove_worker(key.worker);
        }
        Ok(applied)
    }

    /// Says whether `worker`'s engine tokenizes as the caller does (the caller asked it
    /// to tokenize a probe, say). One that does not publishes events that can never
    /// match the requests' blocks: until it agrees again it is routed as a pool with
    /// [`RequestTokens::Estimated`] routes every worker, on predictions from the
    /// router's own decisions as well as its events. Workers start agreeing; an unknown
    /// worker is ignored, and removing a worker forgets its answer.
    pub fn handle_worker_tokens(&mut self, worker: WorkerId, agrees: bool) {
        if agrees {
            // Its events now match: they alone describe its cache.
            if self.foreign_tokens.remove(&worker) && self.event_workers.contains(&worker) && !self.estimated(worker) {
                self.approx.remove_worker(worker);
            }
        } else if self.workers.get(worker).is_some() {
            self.foreign_tokens.insert(worker);
        }
    }

    /// Whether `worker`'s events may not match the requests' blocks, so that its cache is
    /// predicted as well.
    fn estimated(&self, worker: WorkerId) -> bool {
        estimated(&self.cfg, &self.foreign_tokens, worker)
    }

    /// Marks `key`'s overlap as trusted or not. While a worker's event stream has a gap
    /// (a replay is pending), its index entries may be stale, so the cost model gives it
    /// no prefix credit; its entries stay and count again once trusted.
    pub fn handle_overlap_trust(&mut self, key: WorkerKey, trusted: bool) {
        if trusted {
            self.untrusted.remove(&key);
        } else if self.workers.get(key.worker).is_some() {
            self.untrusted.insert(key);
        }
    }

    /// Clears everything the index knows about `key` (the worker restarted or its stream
    /// could not be replayed).
    pub fn handle_kv_clear(&mut self, key: WorkerKey) {
        self.index.clear_key(key);
    }

    /// Applies a fleet change. Removing a worker purges its entries and load, invalidates
    /// the sessions bound to it, and re-tries queued requests elsewhere.
    pub fn handle_worker_update(&mut self, now: Instant, update: WorkerUpdate) -> Result<(), InputError> {
        match update {
            WorkerUpdate::Upsert(spec) => {
                self.workers.upsert(spec).map_err(InputError::Worker)?;
            }
            WorkerUpdate::Removed(id) => self.remove_worker(now, id),
            WorkerUpdate::Health(id, h) => self.workers.set_health(id, h).map_err(InputError::Worker)?,
            WorkerUpdate::Taints(id, t) => self.workers.set_taints(id, t).map_err(InputError::Worker)?,
        }
        self.drain_queue(now);
        Ok(())
    }

    /// Confirms a booking: the request reached its worker. Commits a session's first
    /// binding and, in approximate mode, records the predicted cache contents.
    pub fn handle_dispatched(&mut self, now: Instant, id: RequestId, phase: Phase) -> Result<(), InputError> {
        let fk = FlightKey::new(id, phase);
        let Some(f) = self.flights.get_mut(&fk) else {
            return Err(self.unknown(fk));
        };
        let State::Booked(key) = f.state else {
            return Err(InputError::WrongState { id, phase });
        };
        f.state = State::Dispatched(key);
        let committing = matches!(f.hold, Hold::Init(_));
        if let Hold::Init(token) = f.hold {
            f.hold = match self.affinity.commit(now, token, key.worker, Some(key.rank)) {
                Ok((b, lease)) => Hold::Lease(lease, b.revision),
                Err(_) => {
                    // A refused commit (lease table full) must still end the initialization,
                    // or the session stays initializing and its waiters wait forever. The
                    // commit found the token live, and only commit or abort end one.
                    let aborted = self.affinity.abort(token);
                    debug_assert!(aborted.is_ok(), "abort after a refused commit: {aborted:?}");
                    Hold::None
                }
            };
        }
        let events = self.event_workers.contains(&key.worker);
        let estimated = estimated(&self.cfg, &self.foreign_tokens, key.worker);
        // Estimated tokens may never match a worker's events: predict its cache even
        // with `approximate` off, or a model without a tokenizer would route blind.
        let exact = events && !estimated;
        if (self.cfg.approximate && !exact) || (estimated && events) {
            self.approx.record(now, key, &f.req.blocks);
        }
        if committing && matches!(f.hold, Hold::Lease(..)) {
            self.publish_commit(fk);
        }
        self.stats.dispatched += 1;
        self.drain_affinity(now);
        Ok(())
    }

    /// Rolls a booking back: load released, a first session binding aborted, and for a
    /// worker failure the session's binding invalidated. No trace of the worker remains.
    pub fn handle_dispatch_failed(
        &mut self,
        now: Instant,
        id: RequestId,
        phase: Phase,
        why: DispatchFailure,
    ) -> Result<(), InputError> {
        let fk = FlightKey::new(id, phase);
        match self.flights.get(&fk).map(|f| f.state) {
            None => return Err(self.unknown(fk)),
            Some(State::Booked(_)) | Some(State::Dispatched(_)) | Some(State::Orphaned(_)) => {}
            Some(_) => return Err(InputError::WrongState { id, phase }),
        }
        self.stats.dispatch_failed += 1;
        self.drop_flight(now, fk, why == DispatchFailure::Worker);
        self.drain_queue(now);
        Ok(())
    }

    /// The request's prefill finished: its prompt tokens stop counting as prefill load.
    pub fn handle_prefill_done(&mut self, now: Instant, id: RequestId, phase: Phase) -> Result<(), InputError> {
        let fk = FlightKey::new(id, phase);
        match self.flights.get(&fk).map(|f| f.state) {
            None => return Err(self.unknown(fk)),
            Some(State::Booked(key)) | Some(State::Dispatched(key)) => self.warmth.prefill_done(key),
            Some(State::Orphaned(_)) => return Ok(()),
            Some(_) => return Err(InputError::WrongState { id, phase }),
        }
        self.publish_prefill_done(id, phase);
        let done = self.load.prefill_done(id, phase);
        debug_assert!(done.is_ok(), "a booked flight has a booking: {done:?}");
        self.drain_queue(now);
        Ok(())
    }

    /// The request produced `output_tokens` tokens so far: its predicted output shrinks.
    pub fn handle_decode_progress(
        &mut self,
        now: Instant,
        id: RequestId,
        phase: Phase,
        output_tokens: u32,
    ) -> Result<(), InputError> {
        let fk = FlightKey::new(id, phase);
        if !self.flights.contains_key(&fk) {
            return Err(self.unknown(fk));
        }
        if output_tokens > 0 {
            self.publish_prefill_done(id, phase);
        }
        // Only booked flights have a booking; progress on any other is a counted no-op.
        let _ = self.load.decode_progress(id, phase, output_tokens, self.cfg.block_size);
        // Any output ends the booking's prefill, which may free capacity for the queue.
        self.drain_queue(now);
        Ok(())
    }

    /// The request finished (successfully or not): load, lease and slot are released.
    pub fn handle_finished(&mut self, now: Instant, id: RequestId, phase: Phase) -> Result<(), InputError> {
        let fk = FlightKey::new(id, phase);
        match self.flights.get(&fk).map(|f| f.state) {
            None => return Err(self.unknown(fk)),
            Some(State::Booked(_)) | Some(State::Dispatched(_)) | Some(State::Orphaned(_)) => {}
            Some(_) => return Err(InputError::WrongState { id, phase }),
        }
        self.drop_flight(now, fk, false);
        self.drain_queue(now);
        Ok(())
    }

    /// The client went away, in whatever state the request was: queued, waiting, booked
    /// or streaming. Everything it held is released; its session binding stays.
    pub fn handle_cancel(&mut self, now: Instant, id: RequestId, phase: Phase) -> Result<(), InputError> {
        let fk = FlightKey::new(id, phase);
        if !self.flights.contains_key(&fk) {
            return Err(self.unknown(fk));
        }
        self.drop_flight(now, fk, false);
        self.drain_queue(now);
        Ok(())
    }

    /// Runs every timer due at `now`: queue time-outs, lease expiry, booking expiry and
    /// prediction expiry. Outputs go to [`Router::poll_output`].
    ///
    /// Work per call is bounded, so a clock jump of hours cannot stall the caller: at most
    /// [`BOOKINGS_EXPIRE_PER_CALL_MAX`](crate::limits::BOOKINGS_EXPIRE_PER_CALL_MAX)
    /// bookings, [`ORPHANS_PER_CALL_MAX`](crate::limits::ORPHANS_PER_CALL_MAX) orphans,
    /// [`SESSIONS_EXPIRE_PER_CALL_MAX`](crate::limits::SESSIONS_EXPIRE_PER_CALL_MAX) idle
    /// sessions, [`REMOTE_EXPIRE_PER_CALL_MAX`](crate::limits::REMOTE_EXPIRE_PER_CALL_MAX)
    /// peer entries and
    /// [`PREDICTIONS_EXPIRE_PER_CALL_MAX`](crate::limits::PREDICTIONS_EXPIRE_PER_CALL_MAX)
    /// predictions expire, plus every queued request
    /// that is due (at most `queued_max`). While more is due, [`Router::poll_timeout`]
    /// stays at or before `now`: call again at once.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.queue.handle_timeout(now);
        while let Some(e) = self.queue.poll_timed_out() {
            if let Some(fk) = self.tickets.remove(&e.req) {
                if let Some(f) = self.flights.get_mut(&fk) {
                    f.state = State::New; // the queue already dropped the slot
                }
                self.drop_flight(now, fk, false);
                self.stats.timed_out += 1;
                self.outputs.push_back(Output::TimedOut { id: fk.id, phase: fk.phase });
            }
        }
        self.load.handle_timeout(now);
        while let Some((id, phase)) = self.load.poll_expired() {
            let fk = FlightKey::new(id, phase);
            if let Some(f) = self.flights.get_mut(&fk) {
                f.state = State::New; // the tracker already dropped the booking
                self.drop_flight(now, fk, false);
                self.publish(ReplicaUpdate::Finished { id, phase });
                self.outputs.push_back(Output::BookingExpired { id, phase });
            }
        }
        self.expire_orphans(now);
        self.affinity.handle_timeout(now);
        self.approx.handle_timeout(now);
        self.drain_affinity(now);
        self.drain_queue(now);
    }

    // ---- outputs ----

    /// The next output, if any. Drain until `None` after every input.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// The earliest deadline at which [`Router::handle_timeout`] has work to do.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        let orphan = self.orphan_timers.first().map(|(t, _)| *t);
        [
            self.queue.poll_timeout(),
            self.load.poll_timeout(),
            self.affinity.poll_timeout(),
            self.approx.poll_timeout(),
            orphan,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn unknown(&mut self, fk: FlightKey) -> InputError {
        self.stats.unknown_requests += 1;
        InputError::UnknownRequest { id: fk.id, phase: fk.phase }
    }
}

/// [`Router::estimated`] over the fields it reads, for callers holding a flight mutably.
fn estimated(cfg: &RouterConfig, foreign_tokens: &BTreeSet<WorkerId>, worker: WorkerId) -> bool {
    cfg.request_tokens == RequestTokens::Estimated || foreign_tokens.contains(&worker)
}
