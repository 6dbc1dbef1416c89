//! `kvroute replay`: drive the real router through simulated workers on virtual time.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant as WallClock;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use kvroute_frontend::config::QueueOrderName;
use kvroute_sim::bound::fleet_lru_ttft_bound;
use kvroute_sim::ceiling::{infinite_reuse_ratio, pooled_reuse_ratio};
use kvroute_sim::engine::{EngineConfig, EngineRole};
use kvroute_sim::peer::{TextTreeConfig, TextTreeRule};
use kvroute_sim::replay::{replay, Dispatch, Dispatcher, ReplayConfig, SimRequest, WorkerLoadSample};
use kvroute_sim::router::{CoreDispatcher, Fleet};
use kvroute_sim::synth::{generate, SynthConfig};
use kvroute_sim::trace::{read_trace, to_requests, LoadOptions, TraceLimits, TraceRecord};
use kvroute_sim_server::EngineArgs;
use router_core::{BlockSize, KvCostModel, RouterConfig, RouterMode, TtftModel};

use crate::replay_learn::LearnArgs;
use crate::report::{LoadPoint, RunReport};

/// The bundled slice of the Mooncake conversation trace (see fixtures/PROVENANCE.md in
/// the kvroute-sim crate).
pub const BUNDLED_TRACE: &str = include_str!("../../sim/fixtures/mooncake_conversation_head.jsonl");

/// Worked examples for `kvroute replay --help`.
pub const EXAMPLES: &str = "Examples:
  kvroute replay --bundled --compare kv,round-robin
  kvroute replay --trace conversation_trace.jsonl --workers 8 --policy kv --json
  kvroute replay --synthetic --sessions --workers 4 --compare kv,least-loaded,random --plot out.svg
  kvroute replay --trace conversation_trace.jsonl --prefill-workers 2 --decode-workers 6";

/// Replay a request trace through the router and simulated GPU workers, offline.
///
/// Every arrival goes through the real router-core façade at the simulated time; KV
/// events, prefill completions and finishes flow back through the same calls the proxy
/// uses. The simulated workers follow the vLLM-style reference model (KV blocks with LRU
/// reuse, chunked-prefill scheduler, fitted prefill and decode timings).
#[derive(Args, Debug, Clone)]
pub struct ReplayArgs {
    /// Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids;
    /// optional session_id, priority, and delay: a later turn of a session with a delay is
    /// sent that many ms after the session's turn before finishes).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["synthetic", "bundled"])]
    pub trace: Option<PathBuf>,
    /// Use the built-in synthetic workload (shared-prefix groups, multi-turn sessions).
    #[arg(long)]
    pub synthetic: bool,
    /// Use the bundled 1,500-request slice of the Mooncake conversation trace.
    #[arg(long)]
    pub bundled: bool,
    /// Number of simulated workers (aggregated: each does prefill and decode).
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
    /// Disaggregated fleet: this many prefill workers (use with --decode-workers; replaces --workers).
    #[arg(long, value_name = "P", requires = "decode_workers")]
    pub prefill_workers: Option<u32>,
    /// Disaggregated fleet: this many decode workers.
    #[arg(long, value_name = "D", requires = "prefill_workers")]
    pub decode_workers: Option<u32>,
    /// Disaggregated fleet: uncached prompts shorter than this run aggregated on a decode worker.
    #[arg(long, default_value_t = 2_048, value_name = "TOKENS")]
    pub disagg_isl_min_tokens: u32,
    /// Routing policy: kv, round-robin, random, power-of-two, least-loaded or weighted (every
    /// worker weighs 1). Not direct: a trace names no workers.
    #[arg(long, default_value = "kv")]
    pub policy: Policy,
    /// Run several policies on the same trace and print them side by side, e.g. kv,round-robin.
    #[arg(long, value_delimiter = ',', value_name = "POLICIES")]
    pub compare: Vec<Policy>,
    /// Divide trace timestamps by K (K > 1 means faster arrivals, more load).
    #[arg(long, default_value_t = 1.0, value_name = "K")]
    pub speedup: f64,
    /// Replay only the first N requests.
    #[arg(long, value_name = "N")]
    pub requests: Option<usize>,
    /// Multiply every prompt length by K (with --trace-block-tokens 128 on a Mooncake
    /// trace, 0.25 keeps each id's share of the prompt).
    #[arg(long, default_value_t = 1.0, value_name = "K")]
    pub input_scale: f64,
    /// Multiply every output length by K.
    #[arg(long, default_value_t = 1.0, value_name = "K")]
    pub output_scale: f64,
    /// Prompt tokens each trace hash id stands for (Mooncake traces: 512).
    #[arg(long, default_value_t = kvroute_sim::trace::MOONCAKE_BLOCK_TOKENS, value_name = "TOKENS")]
    pub trace_block_tokens: u32,
    /// The simulated engines' shape (the same flags and defaults as `sim-worker`).
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Delay before the router sees a worker's KV event, in milliseconds.
    #[arg(long, default_value_t = 0.0)]
    pub kv_event_lag_ms: f64,
    /// Ignore KV events: the router predicts cache contents from its own decisions.
    #[arg(long)]
    pub no_kv_events: bool,
    /// Use the trace's session ids for session affinity.
    #[arg(long)]
    pub sessions: bool,
    /// kv cost: weight of the prefill term.
    #[arg(long, value_name = "X")]
    pub prefill_load_scale: Option<f64>,
    /// kv cost: credit per cached block.
    #[arg(long, value_name = "X")]
    pub overlap_credit: Option<f64>,
    /// kv cost: weight of each active request.
    #[arg(long, value_name = "X")]
    pub active_request_weight: Option<f64>,
    /// kv cost model knobs.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Hold requests in the router's queue while every eligible worker has more than this
    /// many batches (--max-batched-tokens) of prefill queued (serve's
    /// `prefill_tokens_frac_of_batch`). Off by default (and at 0): the engines queue
    /// internally.
    #[arg(long, value_name = "BATCHES", value_parser = batches)]
    pub busy_prefill_batches: Option<f64>,
    /// Pass over a worker whose booked decode blocks exceed this share of its KV while
    /// another is not: serve's `decode_blocks_frac_of_kv`, and its default (0 turns it
    /// off). A saturated fleet run is predicted only with it: on the fleet benchmark's
    /// saturated conversation run kv measured 0.172 hits; replay gave 0.197 without it
    /// and 0.186 with 0.95.
    #[arg(long, value_name = "SHARE", value_parser = kv_share, default_value_t = kvroute_frontend::config::RoutingConfig::default().decode_blocks_frac_of_kv)]
    pub busy_kv_share: f64,
    /// The router queue's order when requests are held: fcfs or wspt (short uncached
    /// prompts first).
    #[arg(long, value_name = "ORDER", default_value = "fcfs")]
    pub queue_order: QueueOrderName,
    /// kv cost: predict prefill and decode times with the simulated engines' timing
    /// (--engine-timing) instead of the router's default (the mocker's GPU polynomial).
    #[arg(long)]
    pub router_knows_timing: bool,
    /// kv cost: sampling temperature (0 picks the cheapest worker).
    #[arg(long, value_name = "T")]
    pub temperature: Option<f64>,
    /// Seed for the router's random draws and the synthetic workload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print exactly one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also replay the text-tree routers' rule (the `cache_aware` policy of vllm-router,
    /// SGLang's router and SMG: the longest prefix they sent a worker, unless the fleet
    /// is imbalanced), as a reference run named `text-tree`.
    #[arg(long)]
    pub text_tree: bool,
    /// Draw TTFT CDFs, load imbalance over time and a worker x time load heatmap to an SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Heterogeneous fleets and cost learning.
    #[command(flatten)]
    pub learn: LearnArgs,
}

/// A routing policy name as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy(pub RouterMode);

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.parse::<RouterMode>() {
            Ok(RouterMode::Direct) => Err(format!("{DIRECT_IN_REPLAY} {}", replay_modes())),
            Ok(m) => Ok(Policy(m)),
            Err(_) => Err(format!("unknown policy {s:?}; expected one of {}", replay_modes())),
        }
    }
}

/// Why `direct` cannot be replayed.
const DIRECT_IN_REPLAY: &str = "policy \"direct\" sends each request to the worker its caller names \
    (x-worker-id); a trace names no workers, so a replay cannot use it. Expected one of";

/// The modes a replay accepts: every serve mode but `direct`.
fn replay_modes() -> String {
    let modes: Vec<&str> = RouterMode::ALL.iter().filter(|&&m| m != RouterMode::Direct).map(|m| m.as_str()).collect();
    modes.join(", ")
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.as_str())
    }
}

/// Flags of the kv cost model beyond the blocks formula's weights.
#[derive(Args, Debug, Clone, Default)]
pub struct ModelArgs {
    /// kv cost model: ttft (predicted time to first token, the default) or blocks
    /// (prefill plus decode blocks).
    #[arg(long, value_name = "MODEL")]
    pub cost_model: Option<CostModel>,
    /// ttft model: share of a busy worker's predicted prefill progress credited (0..1).
    #[arg(long, value_name = "X")]
    pub progress_credit: Option<f64>,
    /// ttft model: share of the pass under way still credited once the timing runs more
    /// than three passes ahead of a worker's first tokens (0..1; 1 trusts the timing).
    #[arg(long, value_name = "SHARE", value_parser = pass_share)]
    pub overdue_pass_share: Option<f64>,
    /// ttft model: weight of the delay a request adds to those queued before it.
    #[arg(long, value_name = "X")]
    pub others_delay_weight: Option<f64>,
    /// ttft model: weight of the compute a request adds (its own prefill time).
    #[arg(long, value_name = "X")]
    pub work_weight: Option<f64>,
    /// ttft model: wait charged per KV block a worker would hold past --memory-kv-share
    /// of its capacity, ms.
    #[arg(long, value_name = "MS")]
    pub memory_ms_per_block: Option<f64>,
    /// ttft model: share of a worker's KV blocks above which the memory term charges.
    #[arg(long, value_name = "SHARE")]
    pub memory_kv_share: Option<f64>,
    /// ttft model: weight of the decode time a placement costs (the request's own steps,
    /// the slowdown its blocks add to every request there, and the prefill passes they
    /// wait out).
    #[arg(long, value_name = "X")]
    pub decode_time_weight: Option<f64>,
    /// ttft model: most the decode time term charges above the least any worker has, ms.
    #[arg(long, value_name = "MS")]
    pub decode_time_ms_max: Option<f64>,
    /// ttft model: charge per request a worker runs beyond --excess-over-mean times the
    /// workers' mean, and beyond --excess-requests-min, ms (default 20; 0 is off).
    #[arg(long, value_name = "MS")]
    pub excess_ms_per_request: Option<f64>,
    /// ttft model: multiple of the workers' mean of running requests past which
    /// --excess-ms-per-request charges (default 3).
    #[arg(long, value_name = "X")]
    pub excess_over_mean: Option<f64>,
    /// ttft model: running requests a worker must pass before --excess-ms-per-request
    /// charges it, however low the mean (default 36).
    #[arg(long, value_name = "REQUESTS")]
    pub excess_requests_min: Option<u32>,
    /// ttft model: the workers' mean of running requests past which
    /// --excess-requests-min falls with the square of this over the mean (default 4.5;
    /// 0 keeps it fixed).
    #[arg(long, value_name = "REQUESTS")]
    pub excess_floor_mean_requests: Option<f64>,
    /// ttft model: output tokens expected of a request that names none.
    #[arg(long, value_name = "TOKENS")]
    pub output_tokens_default: Option<u32>,
    /// ttft model: charge per cached block a placement would evict there, ms.
    #[arg(long, value_name = "MS")]
    pub store_ms_per_block: Option<f64>,
    /// ttft model: charge per leading prompt block the best holder has and a worker
    /// lacks, ms (what moving a conversation off its cache leaves behind).
    #[arg(long, value_name = "MS")]
    pub keep_ms_per_block: Option<f64>,
    /// ttft model: most the keep term charges one placement, ms.
    #[arg(long, value_name = "MS")]
    pub keep_ms_max: Option<f64>,
}

/// A kv cost model name as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CostModel(pub KvCostModel);

impl FromStr for CostModel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ttft" => Ok(CostModel(KvCostModel::Ttft)),
            "blocks" => Ok(CostModel(KvCostModel::Blocks)),
            _ => Err(format!("unknown cost model {s:?}; expected ttft or blocks")),
        }
    }
}

/// Loads the workload the arguments name, hashed at the engines' block size.
pub fn load_requests(a: &ReplayArgs) -> Result<Vec<SimRequest>, String> {
    let records: Vec<TraceRecord> = if let Some(path) = &a.trace {
        let file = std::fs::File::open(path).map_err(|e| format!("cannot open trace {}: {e}", path.display()))?;
        read_trace(std::io::BufReader::new(file), &TraceLimits::default())
            .map_err(|e| format!("{}: {e}", path.display()))?
    } else if a.synthetic {
        generate(&SynthConfig { seed: a.seed.max(1), ..SynthConfig::default() })
    } else if a.bundled {
        read_trace(BUNDLED_TRACE.as_bytes(), &TraceLimits::default()).map_err(|e| format!("bundled trace: {e}"))?
    } else {
        return Err("choose a workload: --trace FILE, --bundled or --synthetic (see --help)".into());
    };
    for (flag, k) in [("--input-scale", a.input_scale), ("--output-scale", a.output_scale)] {
        if !(k.is_finite() && k > 0.0) {
            return Err(format!("{flag} must be a positive number, got {k}"));
        }
    }
    if !(a.speedup.is_finite() && a.speedup > 0.0) {
        return Err(format!("--speedup must be a positive number, got {}", a.speedup));
    }
    let opts = LoadOptions {
        speedup: a.speedup,
        requests_max: a.requests,
        block_size: a.engine.block_size,
        trace_block_tokens: a.trace_block_tokens,
        input_scale: a.input_scale,
        output_scale: a.output_scale,
        ..LoadOptions::default()
    };
    to_requests(&records, &opts).map_err(|e| format!("trace: {e}"))
}

fn batches(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(b) if b.is_finite() && b >= 0.0 => Ok(b),
        _ => Err(format!("{s}: expected a number of batches, 0 or more (0 turns holding off)")),
    }
}

fn kv_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 0.0 => Ok(f),
        _ => Err(format!("{s}: expected a share of KV blocks, 0 or more (0 turns it off)")),
    }
}

fn pass_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("{s}: expected a share of a pass, from 0 to 1 (1 trusts the timing)")),
    }
}

/// The router configuration for one policy.
pub fn router_config(a: &ReplayArgs, policy: Policy) -> Result<RouterConfig, String> {
    let mut cfg = RouterConfig { mode: policy.0, approximate: a.no_kv_events, ..RouterConfig::default() };
    cfg.block_size = BlockSize::new(a.engine.block_size).map_err(|e| e.to_string())?;
    let c = &mut cfg.cost;
    c.prefill_load_scale = a.prefill_load_scale.unwrap_or(c.prefill_load_scale);
    c.overlap_credit = a.overlap_credit.unwrap_or(c.overlap_credit);
    c.active_request_weight = a.active_request_weight.unwrap_or(c.active_request_weight);
    c.temperature = a.temperature.unwrap_or(c.temperature);
    c.model = a.model.cost_model.map_or(c.model, |m| m.0);
    c.ttft.progress_credit = a.model.progress_credit.unwrap_or(c.ttft.progress_credit);
    c.ttft.overdue_pass_share = a.model.overdue_pass_share.unwrap_or(c.ttft.overdue_pass_share);
    c.ttft.others_delay_weight = a.model.others_delay_weight.unwrap_or(c.ttft.others_delay_weight);
    c.ttft.work_weight = a.model.work_weight.unwrap_or(c.ttft.work_weight);
    c.ttft.memory_ms_per_block = a.model.memory_ms_per_block.unwrap_or(c.ttft.memory_ms_per_block);
    c.ttft.memory_kv_share = a.model.memory_kv_share.unwrap_or(c.ttft.memory_kv_share);
    c.ttft.decode_time_weight = a.model.decode_time_weight.unwrap_or(c.ttft.decode_time_weight);
    c.ttft.decode_time_ms_max = a.model.decode_time_ms_max.unwrap_or(c.ttft.decode_time_ms_max);
    c.ttft.excess_ms_per_request = a.model.excess_ms_per_request.unwrap_or(c.ttft.excess_ms_per_request);
    c.ttft.excess_over_mean = a.model.excess_over_mean.unwrap_or(c.ttft.excess_over_mean);
    c.ttft.excess_requests_min = a.model.excess_requests_min.unwrap_or(c.ttft.excess_requests_min);
    let floor_mean = a.model.excess_floor_mean_requests;
    c.ttft.excess_floor_mean_requests = floor_mean.unwrap_or(c.ttft.excess_floor_mean_requests);
    c.ttft.output_tokens_default = a.model.output_tokens_default.unwrap_or(c.ttft.output_tokens_default);
    c.ttft.store_ms_per_block = a.model.store_ms_per_block.unwrap_or(c.ttft.store_ms_per_block);
    c.ttft.keep_ms_per_block = a.model.keep_ms_per_block.unwrap_or(c.ttft.keep_ms_per_block);
    c.ttft.keep_ms_max = a.model.keep_ms_max.unwrap_or(c.ttft.keep_ms_max);
    if a.router_knows_timing {
        let t = &a.engine.engine_timing;
        c.timing = TtftModel {
            prefill_ms_per_token_squared: t.prefill_ms_per_token_squared,
            prefill_ms_per_token: t.prefill_ms_per_token,
            prefill_ms_per_pass: t.prefill_ms_per_pass,
            decode_ms_per_step: t.decode_ms_per_step,
            decode_ms_per_usage: t.decode_ms_per_usage,
            decode_ms_per_usage_squared: t.decode_ms_per_usage_squared,
            decode_ms_min: t.decode_ms_min,
            cold_ms_per_idle_s: t.cold_ms_per_idle_s,
            cold_ms_max: t.cold_ms_max,
            ..c.timing
        };
    }
    // Replay engines queue internally, as real ones do: the router holds requests back
    // only when --busy-prefill-batches asks it to.
    cfg.eligibility.prefill_tokens_frac_of_batch = a.busy_prefill_batches.filter(|b| *b > 0.0);
    cfg.eligibility.decode_blocks_frac_of_kv = (a.busy_kv_share > 0.0).then_some(a.busy_kv_share);
    cfg.queue.order = a.queue_order.0;
    cfg.approx.blocks_max_per_worker = a.engine.blocks_per_worker;
    cfg.disagg.isl_min_tokens = a.disagg_isl_min_tokens;
    cfg.learn = a.learn.config();
    Ok(cfg)
}

/// Runs one policy over `reqs` and reports it.
pub fn run_policy(
    a: &ReplayArgs,
    policy: Policy,
    reqs: &[SimRequest],
    progress: &ProgressBar,
) -> Result<RunReport, String> {
    let (workers, prefill_workers) = fleet_shape(a);
    let rcfg = replay_config(a)?;
    let fleet = Fleet {
        workers,
        prefill_workers,
        kv_blocks: a.engine.blocks_per_worker,
        max_batched_tokens: a.engine.max_batched_tokens,
    };
    let mut core = CoreDispatcher::new(router_config(a, policy)?, fleet, a.seed, !a.no_kv_events, a.sessions);
    core.observe(a.learn.observing());
    let mut d = Observed {
        inner: core,
        progress,
        loads: Vec::new(),
        last_sample_ms: vec![f64::NEG_INFINITY; workers as usize],
    };
    progress.set_message(policy.to_string());
    progress.set_position(0);
    let t0 = WallClock::now();
    let rep = replay(&rcfg, reqs, &mut d).map_err(|e| format!("simulator configuration: {e}"))?;
    let wall_s = t0.elapsed().as_secs_f64();
    let mut run = RunReport::new(policy.to_string(), workers, reqs.len(), &rep, wall_s, d.inner.errors, d.loads);
    run.prefill_workers = prefill_workers;
    run.disagg = d.inner.disagg_stats();
    Ok(run)
}

/// The simulated fleet the arguments describe: its engines, roles, speeds and event lag.
fn replay_config(a: &ReplayArgs) -> Result<ReplayConfig, String> {
    let engine = a.engine.apply(EngineConfig::default());
    let (workers, prefill_workers) = fleet_shape(a);
    let roles = match prefill_workers {
        0 => Vec::new(),
        p => (0..workers).map(|w| if w < p { EngineRole::Prefill } else { EngineRole::Decode }).collect(),
    };
    let speeds = a.learn.speeds()?;
    Ok(ReplayConfig { workers, engine, roles, kv_event_lag_ms: a.kv_event_lag_ms, speeds, ..ReplayConfig::default() })
}

/// The text-tree routers' rule over the same fleet (aggregated only).
fn run_text_tree(a: &ReplayArgs, reqs: &[SimRequest]) -> Result<RunReport, String> {
    let (workers, prefill_workers) = fleet_shape(a);
    if prefill_workers > 0 {
        return Err("--text-tree replays an aggregated fleet only (the peers' rule splits no request)".into());
    }
    let rcfg = replay_config(a)?;
    let mut rule = TextTreeRule::new(workers, TextTreeConfig::default());
    let t0 = WallClock::now();
    let rep = replay(&rcfg, reqs, &mut rule).map_err(|e| format!("simulator configuration: {e}"))?;
    Ok(RunReport::new("text-tree".into(), workers, reqs.len(), &rep, t0.elapsed().as_secs_f64(), 0, Vec::new()))
}

/// Total workers and how many of them prefill (0 for an aggregated fleet).
pub fn fleet_shape(a: &ReplayArgs) -> (u32, u32) {
    match (a.prefill_workers, a.decode_workers) {
        (Some(p), Some(d)) => (p + d, p),
        _ => (a.workers, 0),
    }
}

/// Wraps the core dispatcher with progress reporting and load sampling for plots.
struct Observed<'a> {
    inner: CoreDispatcher,
    progress: &'a ProgressBar,
    loads: Vec<LoadPoint>,
    last_sample_ms: Vec<f64>,
}

/// Load samples closer together than this are dropped, to keep plots small.
const LOAD_SAMPLE_MS: f64 = 1_000.0;

impl Dispatcher for Observed<'_> {
    fn on_arrival(&mut self, now_ms: f64, req: &SimRequest) -> Dispatch {
        if self.inner.arrivals.is_multiple_of(64) {
            self.progress.set_position(self.inner.arrivals);
        }
        self.inner.on_arrival(now_ms, req)
    }
    fn on_kv_event(&mut self, now_ms: f64, worker: u32, id: u64, ev: &kvroute_sim::engine::KvEvent) {
        self.inner.on_kv_event(now_ms, worker, id, ev)
    }
    fn on_prefill_done(&mut self, now_ms: f64, worker: u32, req: u64) {
        self.inner.on_prefill_done(now_ms, worker, req)
    }
    fn on_finished(&mut self, now_ms: f64, worker: u32, req: u64) {
        self.inner.on_finished(now_ms, worker, req)
    }
    fn on_worker_load(&mut self, now_ms: f64, worker: u32, load: WorkerLoadSample) {
        self.inner.on_worker_load(now_ms, worker, load);
        let last = &mut self.last_sample_ms[worker as usize];
        if now_ms - *last >= LOAD_SAMPLE_MS {
            *last = now_ms;
            self.loads.push(LoadPoint { t_s: now_ms / 1000.0, worker, active_blocks: load.active_blocks });
        }
    }
    fn poll_dispatch(&mut self, now_ms: f64) -> Option<(u64, Dispatch)> {
        self.inner.poll_dispatch(now_ms)
    }
    fn next_timeout(&self) -> Option<f64> {
        self.inner.next_timeout()
    }
    fn on_timeout(&mut self, now_ms: f64) {
        self.inner.on_timeout(now_ms)
    }
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn progress_bar(total: usize) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} requests ({elapsed})")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    pb.set_style(style);
    pb
}

/// Runs every policy over `reqs` with a progress bar, and fills in the bounds: the
/// cache ceilings and the TTFT lower bound.
pub fn run_all(a: &ReplayArgs, policies: &[Policy], reqs: &[SimRequest]) -> Result<Vec<RunReport>, String> {
    let pb = progress_bar(reqs.len());
    let mut runs = Vec::new();
    for &p in policies {
        runs.push(run_policy(a, p, reqs, &pb)?);
    }
    pb.finish_and_clear();
    if a.text_tree {
        runs.push(run_text_tree(a, reqs)?);
    }
    let fleet_blocks = u64::from(fleet_shape(a).0) * u64::from(a.engine.blocks_per_worker);
    let pooled = pooled_reuse_ratio(reqs, fleet_blocks);
    let infinite = infinite_reuse_ratio(reqs);
    let ttft = fleet_lru_ttft_bound(reqs, fleet_blocks, a.engine.max_batched_tokens, &a.engine.engine_timing);
    for r in &mut runs {
        r.set_bounds(pooled, infinite, &ttft);
    }
    Ok(runs)
}

/// `kvroute replay`.
pub fn run(a: &ReplayArgs) -> Result<(), String> {
    let reqs = load_requests(a)?;
    if reqs.is_empty() {
        return Err("the workload has no requests".into());
    }
    match (a.prefill_workers, a.decode_workers, a.workers) {
        (Some(0), _, _) | (_, Some(0), _) => {
            return Err("--prefill-workers and --decode-workers must be at least 1".into())
        }
        (None, None, 0) => return Err("--workers must be at least 1".into()),
        _ => {}
    }
    let policies = if a.compare.is_empty() { vec![a.policy] } else { a.compare.clone() };
    let runs = run_all(a, &policies, &reqs)?;
    if let Some(path) = &a.plot {
        crate::plot::draw(path, &runs).map_err(|e| format!("cannot draw {}: {e}", path.display()))?;
    }
    if a.json {
        let out = if runs.len() == 1 {
            serde_json::to_string(&runs[0])
        } else {
            serde_json::to_string(&serde_json::json!({ "runs": runs }))
        };
        println!("{}", out.map_err(|e| e.to_string())?);
    } else {
        crate::report::print_table(&runs);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(name: &str, want: Result<RouterMode, &str>) {
        match (name.parse::<Policy>(), want) {
            (Ok(p), Ok(m)) => assert_eq!(p.0, m, "{name}"),
            (Err(e), Err(part)) => assert!(e.contains(part), "{name}: {e:?} lacks {part:?}"),
            (got, want) => panic!("{name}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn replay_accepts_every_serve_mode_but_direct() {
        for m in RouterMode::ALL.into_iter().filter(|&m| m != RouterMode::Direct) {
            check(m.as_str(), Ok(m));
        }
        check("weighted", Ok(RouterMode::Weighted));
        check("direct", Err("a trace names no workers"));
        check("direct", Err("weighted"));
        check("fastest", Err("unknown policy \"fastest\"; expected one of random, round-robin"));
    }
}
