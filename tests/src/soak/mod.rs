//! A deterministic whole-system soak: the `Router` façade, a fleet of `kvroute_sim`
//! engines serving what it routes, and the engines' KV events travelling through
//! `kvroute_events`' wire format and ingestion core (sequencer, replay, translation)
//! into the router, all on one thread and virtual time.
//!
//! Each step draws one operation from a seeded SplitMix64: requests (single, or a flood
//! at one instant, with or without a session), cancellations, time ticks, jumps of
//! minutes to hours, the router's clock stepping back, workers joining, leaving and
//! restarting (a new engine and publisher under the same id), health changes, lost and
//! repeated event batches, garbage frames, and replays answered late, partly or not at
//! all. Then the engines run to the current time, their events are published and
//! delivered, their first tokens and finishes are reported, timers fire, and the
//! checks in [`checks`] run. A final settle ends every stream and waits out every
//! deadline; the router must then hold nothing.
//!
//! What it leaves to others: routing quality (the sim's replay reports), sockets and
//! tokio (the adapters' loopback tests), and the façade's finer rules (the core's own
//! simulation, `core/tests/simulation.rs`).
//!
//! A failure is an `Err` naming the step; `tests/it/soak.rs` prints `SIM_SEED=<n>` so
//! `SIM_SEED=<n> cargo test -p kvroute-tests soak` replays it.

mod checks;
mod events;
mod fleet;
mod requests;
mod world;

pub use world::{run, Failure};

use std::collections::BTreeMap;

use kvroute_events::sequence::SequencerConfig;
use kvroute_events::{IngestConfig, IngestCore, StreamConfig};
use kvroute_sim::rng::SplitMix64;
use kvroute_sim::EngineConfig;
use router_core::{
    AffinityConfig, AffinityMode, BlockSize, Health, Instant, LoadConfig, QueueConfig, Router, RouterConfig, WorkerId,
    WorkerKey, WorkerRole, WorkerSpec, WorkerUpdate,
};

use events::{IndexModel, PendingReplay, ReplayMode};
use fleet::SimWorker;
use requests::Req;

/// Tokens per KV block, for engines and router alike.
const BLOCK_TOKENS: u32 = 16;

/// Counts of what a run did, so a test can tell that each path was reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub steps: u64,
    pub requests: u64,
    pub routed: u64,
    pub queued: u64,
    pub waiting: u64,
    pub refused: u64,
    pub timed_out: u64,
    pub cancelled: u64,
    pub finished: u64,
    pub dispatch_failed: u64,
    pub booking_expired: u64,
    pub orphaned: u64,
    pub reports_lost: u64,
    pub joins: u64,
    pub leaves: u64,
    pub restarts: u64,
    pub jumps: u64,
    pub clock_back: u64,
    pub batches: u64,
    pub batches_lost: u64,
    pub batches_repeated: u64,
    pub garbage: u64,
    pub replays_served: u64,
    pub replays_failed: u64,
    pub replays_deferred: u64,
    pub seq_resets: u64,
    pub index_full_checks: u64,
    pub subset_checks: u64,
    pub equal_checks: u64,
}

impl Tally {
    /// Adds `o` to `self`, field by field.
    pub fn add(&mut self, o: &Tally) {
        macro_rules! sum { ($($f:ident)*) => { $( self.$f += o.$f; )* } }
        sum!(steps requests routed queued waiting refused timed_out cancelled finished dispatch_failed
            booking_expired orphaned reports_lost joins leaves restarts jumps clock_back batches batches_lost
            batches_repeated garbage replays_served replays_failed replays_deferred seq_resets
            index_full_checks subset_checks equal_checks);
    }
}

/// The run's shape, drawn from the seed.
#[derive(Clone, Copy, Debug)]
pub struct Knobs {
    pub workers_initial: u64,
    pub workers_max: u64,
    pub engine_blocks: u32,
    pub batch_tokens: u32,
    pub replay_buffer: usize,
    pub loss_pct: u64,
    pub repeat_pct: u64,
    pub lost_report_pct: u64,
    pub connect_fail_pct: u64,
    pub sessions_max: usize,
    pub lease_ttl_ms: u64,
    pub queue_timeout_ms: u64,
    pub queued_max: usize,
    pub requests_max: usize,
    pub request_age_max_ms: u64,
    pub replay_timeout_ms: u64,
    pub soft_affinity: bool,
    pub approximate: bool,
}

impl Knobs {
    fn draw(rng: &mut SplitMix64) -> Self {
        let mut r = |lo: u64, hi: u64| lo + rng.below(hi - lo + 1);
        let workers_initial = r(1, 4);
        Knobs {
            workers_initial,
            workers_max: workers_initial + r(1, 4),
            engine_blocks: r(48, 256) as u32,
            batch_tokens: r(128, 1024) as u32,
            replay_buffer: r(4, 64) as usize,
            loss_pct: r(0, 10),
            repeat_pct: r(0, 5),
            lost_report_pct: r(0, 2),
            connect_fail_pct: r(0, 5),
            sessions_max: r(4, 64) as usize,
            lease_ttl_ms: r(500, 60_000),
            queue_timeout_ms: r(200, 5_000),
            queued_max: r(4, 128) as usize,
            requests_max: r(128, 1024) as usize,
            request_age_max_ms: r(20_000, 300_000),
            replay_timeout_ms: r(100, 2_000),
            soft_affinity: r(0, 1) == 1,
            approximate: r(0, 1) == 1,
        }
    }

    fn router_config(&self, seed: u64) -> RouterConfig {
        let mut cfg = RouterConfig {
            block_size: BlockSize::new(BLOCK_TOKENS).expect("valid block size"),
            approximate: self.approximate,
            requests_max: self.requests_max,
            load: LoadConfig { request_age_max_ms: self.request_age_max_ms, ..LoadConfig::default() },
            affinity: AffinityConfig {
                sessions_max: self.sessions_max,
                lease_ttl_ms: self.lease_ttl_ms,
                mode: if self.soft_affinity { AffinityMode::Soft } else { AffinityMode::Hard },
                hash_seed: seed.rotate_left(13),
                ..AffinityConfig::default()
            },
            queue: QueueConfig {
                queued_max: self.queued_max,
                queue_timeout_ms: self.queue_timeout_ms,
                ..QueueConfig::default()
            },
            ..RouterConfig::default()
        };
        cfg.index.hash_seed = seed.rotate_left(29);
        cfg
    }

    fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            blocks_per_worker: self.engine_blocks,
            block_size: BLOCK_TOKENS,
            max_batched_tokens: self.batch_tokens,
            max_num_seqs: 32,
            ..EngineConfig::default()
        }
    }
}

/// One worker of the fleet and what the checks need to know about its stream.
pub struct Member {
    pub sim: SimWorker,
    pub health: Health,
    /// Sequencer resets and dropped events when this incarnation started: more since
    /// means the index may under-report.
    pub resets_base: u64,
    pub dropped_base: u64,
}

/// The whole simulated system.
pub struct Soak {
    pub knobs: Knobs,
    rng: SplitMix64,
    pub router: Router,
    pub ingest: IngestCore,
    pub model: IndexModel,
    pub fleet: BTreeMap<WorkerId, Member>,
    pub reqs: BTreeMap<u64, Req>,
    replays: Vec<PendingReplay>,
    replay_mode: ReplayMode,
    /// Batches each worker's wire will lose next.
    drop_next: BTreeMap<WorkerId, u64>,
    /// Virtual time in ms; engines see it, and it never goes back.
    clock_ms: u64,
    /// How far the router's clock lags behind (its clock stepping back).
    skew_ms: u64,
    next_worker: u64,
    next_request: u64,
    /// Prompt prefixes shared between requests, so caches overlap.
    docs: Vec<Vec<u32>>,
    pub tally: Tally,
}

impl Soak {
    pub fn new(seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let knobs = Knobs::draw(&mut rng);
        let ingest_cfg = IngestConfig {
            sequencer: SequencerConfig { replay_timeout_ms: knobs.replay_timeout_ms, ..SequencerConfig::default() },
            map_seed: seed.rotate_left(41),
            ..IngestConfig::default()
        };
        let docs = (0..6).map(|d| (0..rng.range_u32(16, 256)).map(|i| 1 + d * 10_000 + i).collect()).collect();
        let mut soak = Soak {
            router: Router::new(knobs.router_config(seed)),
            ingest: IngestCore::new(ingest_cfg),
            model: IndexModel::default(),
            fleet: BTreeMap::new(),
            reqs: BTreeMap::new(),
            replays: Vec::new(),
            replay_mode: ReplayMode::Serve,
            drop_next: BTreeMap::new(),
            clock_ms: 1_000,
            skew_ms: 0,
            next_worker: 1,
            next_request: 1,
            docs,
            tally: Tally::default(),
            knobs,
            rng,
        };
        for _ in 0..knobs.workers_initial {
            soak.join().expect("no request is tracked yet, so no output can be wrong");
        }
        soak
    }

    /// The router's and the ingestion core's `now`.
    pub fn now(&self) -> Instant {
        Instant::from_millis(self.clock_ms.saturating_sub(self.skew_ms))
    }

    fn pct(&mut self, p: u64) -> bool {
        self.rng.below(100) < p
    }

    /// One operation, then the system runs to the current time; then the checks.
    pub fn step(&mut self) -> Result<(), String> {
        self.tally.steps += 1;
        match self.rng.below(100) {
            0..=29 => self.arrive(1)?,
            30..=31 => {
                let n = 10 + self.rng.below(150);
                self.arrive(n)?;
            }
            32..=36 => self.cancel_one()?,
            37..=66 => self.clock_ms += 1 + self.rng.below(50),
            67..=68 => self.jump(),
            69 => self.clock_back(),
            70 => self.join()?,
            71 => self.leave()?,
            72 => self.restart()?,
            73..=74 => self.flip_health()?,
            75..=77 => self.lose_batches(),
            78..=79 => self.garbage(),
            80..=82 => {
                self.replay_mode = [ReplayMode::Serve, ReplayMode::Defer, ReplayMode::Fail][self.rng.below(3) as usize]
            }
            _ => self.clock_ms += self.rng.below(5),
        }
        self.run_to_now()?;
        self.check()
    }

    /// Engines to the current time, their events delivered, their ends reported, timers
    /// fired, replays answered, booked requests dispatched.
    fn run_to_now(&mut self) -> Result<(), String> {
        let ids: Vec<WorkerId> = self.fleet.keys().copied().collect();
        for id in ids {
            self.advance_worker(id)?;
        }
        self.service_replays();
        self.fire_timers()?;
        self.dispatch_booked()
    }

    fn jump(&mut self) {
        self.tally.jumps += 1;
        self.clock_ms += 60_000 * (1 + self.rng.below(180));
    }

    fn clock_back(&mut self) {
        self.tally.clock_back += 1;
        self.skew_ms = if self.skew_ms == 0 { 1 + self.rng.below(10_000) } else { 0 };
    }

    fn join(&mut self) -> Result<(), String> {
        if self.fleet.len() as u64 >= self.knobs.workers_max {
            return Ok(());
        }
        self.tally.joins += 1;
        let id = WorkerId(self.next_worker);
        self.next_worker += 1;
        let now = self.now();
        let mut spec = WorkerSpec::new(id, WorkerRole::Aggregated);
        spec.max_batched_tokens = self.knobs.batch_tokens;
        spec.kv_blocks = self.knobs.engine_blocks;
        self.router.handle_worker_update(now, WorkerUpdate::Upsert(spec)).expect("a new worker fits");
        let stream = StreamConfig {
            key: WorkerKey::new(id.0, 0),
            block_size: BlockSize::new(BLOCK_TOKENS).expect("valid block size"),
            cache_salt: None,
            blocks_max: 4 * self.knobs.engine_blocks as usize,
            has_replay: true,
        };
        self.ingest.add_stream(now, stream).expect("a new stream fits");
        let sim = SimWorker::new(self.knobs.engine_config(), id.0 as u32, self.knobs.replay_buffer);
        self.fleet.insert(id, Member { sim, health: Health::Healthy, resets_base: 0, dropped_base: 0 });
        // A new worker takes queued requests at once.
        self.drain_router_checked()
    }

    fn pick_worker(&mut self) -> Option<WorkerId> {
        let n = self.fleet.len() as u64;
        (n > 0).then(|| *self.fleet.keys().nth(self.rng.below(n) as usize).expect("in range"))
    }

    fn flip_health(&mut self) -> Result<(), String> {
        let Some(id) = self.pick_worker() else { return Ok(()) };
        let h = [Health::Healthy, Health::Healthy, Health::Ejected, Health::Draining][self.rng.below(4) as usize];
        if let Some(m) = self.fleet.get_mut(&id) {
            m.health = h;
        }
        let now = self.now();
        self.router.handle_worker_update(now, WorkerUpdate::Health(id, h)).map_err(|e| format!("health: {e}"))?;
        self.drain_router_checked()
    }

    /// The next one to four batches of a worker never arrive.
    fn lose_batches(&mut self) {
        if let Some(id) = self.pick_worker() {
            let k = 1 + self.rng.below(4);
            self.drop_next.insert(id, k);
        }
    }

    fn garbage(&mut self) {
        let Some(id) = self.pick_worker() else { return };
        self.tally.garbage += 1;
        let frames = events::garbage(self.rng.next_u64());
        let now = self.now();
        let mut sink = events::Sink { router: &mut self.router, model: &mut self.model, now };
        let r = self.ingest.handle_live(now, WorkerKey::new(id.0, 0), &frames, &mut sink);
        assert!(r.is_err(), "a malformed message was accepted");
    }
}
