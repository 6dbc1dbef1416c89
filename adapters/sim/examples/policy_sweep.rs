//! Replays one workload through kv cost variants and the text-tree routers' rule, at
//! several loads, and prints one JSON line per run: the study tool behind the default
//! kv weights.
//!
//! ```text
//! cargo run --release -p kvroute-sim --example policy_sweep -- \
//!     --workers 8 --blocks 2462 --speedups 1,2 --variants 'kv;dtw=1;dtw=1,store=5'
//! ```
//!
//! The workload is the bundled Mooncake slice with each hash id as 128 tokens and
//! lengths ÷ 4 (the fleet benchmark's conversation workload), or `--trace FILE`.
//! A variant is `oracle` or `oracle-e2e` (the clairvoyant greedy references of
//! `kvroute_sim::lookahead`, sending each request where its first or last token comes
//! soonest), `partition` (each shared document or opening on one worker, balanced with
//! the whole trace in hand), `search[-e2e|-hits][-free][=MOVES]` (`kvroute_sim::search`:
//! kv's choices improved offline for TTFT mean, end-to-end mean with `-e2e` or hit rate
//! with `-hits`, replaying the whole trace per move, with the other figures held to kv's
//! own unless `-free`),
//! `kv`
//! (the defaults) or comma-separated `key=value` overrides of the ttft
//! weights: `dtw` (decode_time_weight), `dtmax` (decode_time_ms_max), `sdtw`
//! (session_decode_time_weight, at a session's first request), `sret`
//! (session_return_ms), `sscaled` (1 or 0: session_return_scaled), `memshare`
//! (memory_kv_share), `mem` (memory_ms_per_block), `out` (output_tokens_default), `store`
//! (store_ms_per_block), `keep` (keep_ms_per_block), `keepmax` (keep_ms_max), `keepshare`
//! (keep_share_min), `keepholders` (keep_holders_max), `keepend` (1 or 0:
//! keep_needs_prompt_end), `ends` (the router's prompt_ends_max), `endblocks`
//! (prompt_end_blocks), `work`,
//! `others`, `credit` (progress_credit), `overdue` (overdue_pass_share), `costs` and `doubt` (the learner's `costs` as 1 or 0, and
//! `doubt_scale_min`), `arw` (active_request_weight), `xs` (excess_ms_per_request), `xm`
//! (excess_over_mean), `xmin` (excess_requests_min), `xref` (excess_floor_mean_requests), `cold` and `coldmax` (the timing's
//! cold_ms_per_idle_s and cold_ms_max), `pls` (prefill_load_scale), `mode` (`rr`,
//! `ll` for round-robin or least-loaded), `frac` (the eligibility's
//! `decode_blocks_frac_of_kv`; 0 turns it off). The router keeps `kvroute serve`'s
//! eligibility (a worker whose booked decode blocks pass 0.95 of its KV is passed over
//! while another is not), as the fleet benchmark runs it: without it, a saturated
//! conversation replay kept 0.197 hits where the fleet measured 0.172. `--seeds N`
//! runs each variant with router seeds 0..N (its tie-breaking draws), one line each.
//! `--regret FILE` appends, for every request of each kv run, the worker it chose and the
//! worker where its first token would have come soonest given the fleet's state then
//! (`kvroute_sim::lookahead::Regret`), with both times.
//! `--sessions 1` sends the trace's `session_id`s as the session header (hard affinity
//! unless a variant says `aff=soft` or `aff=cost`); the text-tree rule ignores them.
//! `--engine-speedup X` runs the workers X times faster than the timing model the router
//! predicts with (the fleet benchmark's sim-workers run at 0.5 when saturated); pass
//! `--speedups` times X to keep the load, and latencies are then in the workers' time.
//! `--engine-timing vllm-cpu` runs the workers on the vLLM CPU build's fitted timing and
//! has kv predict with it (`engine_timing = "vllm-cpu"` in a config); `mocker`, the GPU
//! reference, is the default.

use kvroute_sim::engine::{EngineConfig, EngineTiming};
use kvroute_sim::lookahead::{Choice, Goal, Lookahead, Regret};
use kvroute_sim::peer::{TextTreeConfig, TextTreeRule};
use kvroute_sim::replay::{replay, Dispatcher, ReplayConfig, ReplayReport, SimRequest};
use kvroute_sim::router::{CoreDispatcher, Fleet};
use kvroute_sim::search::{Aim, Assigned, SearchConfig};
use kvroute_sim::trace::{read_trace, to_requests, LoadOptions, TraceLimits};
use router_core::{AffinityMode, BlockSize, RouterConfig, RouterMode, TtftModel};

const BUNDLED: &str = include_str!("../fixtures/mooncake_conversation_head.jsonl");

struct Args {
    workers: u32,
    blocks: u32,
    speedups: Vec<f64>,
    variants: Vec<String>,
    trace: Option<String>,
    tokens_per_id: u32,
    scale: f64,
    seeds: u64,
    records: Option<String>,
    regret: Option<String>,
    engine_speedup: f64,
    sessions: bool,
    cpu: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        workers: 8,
        blocks: 2462,
        speedups: vec![1.0],
        variants: vec!["kv".into()],
        trace: None,
        tokens_per_id: 128,
        scale: 0.25,
        seeds: 1,
        records: None,
        regret: None,
        engine_speedup: 1.0,
        sessions: false,
        cpu: false,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let [k, v] = pair else { return Err(format!("{} needs a value", pair[0])) };
        let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{k}: {e}"));
        match k.as_str() {
            "--workers" => a.workers = num(v)? as u32,
            "--blocks" => a.blocks = num(v)? as u32,
            "--speedups" => a.speedups = v.split(',').map(num).collect::<Result<_, _>>()?,
            "--variants" => a.variants = v.split(';').map(String::from).collect(),
            "--trace" => a.trace = Some(v.clone()),
            "--tokens-per-id" => a.tokens_per_id = num(v)? as u32,
            "--scale" => a.scale = num(v)?,
            "--seeds" => a.seeds = num(v)?.max(1.0) as u64,
            "--records" => a.records = Some(v.clone()),
            "--regret" => a.regret = Some(v.clone()),
            "--engine-speedup" => a.engine_speedup = num(v)?,
            "--sessions" => a.sessions = num(v)? != 0.0,
            "--engine-timing" => {
                a.cpu = match v.as_str() {
                    "vllm-cpu" => true,
                    "mocker" => false,
                    _ => return Err(format!("--engine-timing {v}: mocker or vllm-cpu")),
                }
            }
            _ => return Err(format!("unknown flag {k}")),
        }
    }
    Ok(a)
}

fn requests(a: &Args, speedup: f64) -> Result<Vec<SimRequest>, String> {
    let text = match &a.trace {
        Some(p) => std::fs::read_to_string(p).map_err(|e| format!("cannot read {p}: {e}"))?,
        None => BUNDLED.to_string(),
    };
    let records = read_trace(text.as_bytes(), &TraceLimits::default()).map_err(|e| e.to_string())?;
    let opts = LoadOptions {
        speedup,
        trace_block_tokens: a.tokens_per_id,
        input_scale: a.scale,
        output_scale: a.scale,
        ..LoadOptions::default()
    };
    to_requests(&records, &opts).map_err(|e| e.to_string())
}

/// `cfg` predicting with the workers' timing when they run the CPU build's.
fn timed(a: &Args, mut cfg: RouterConfig) -> RouterConfig {
    if a.cpu {
        cfg.cost.timing = TtftModel::vllm_cpu();
    }
    cfg
}

fn config(a: &Args, variant: &str) -> Result<RouterConfig, String> {
    let mut cfg = timed(a, RouterConfig { mode: RouterMode::Kv, ..RouterConfig::default() });
    if variant == "kv" {
        return Ok(cfg);
    }
    for kv in variant.split(',') {
        let (k, v) = kv.split_once('=').ok_or_else(|| format!("{kv}: expected key=value"))?;
        if k == "mode" {
            cfg.mode = match v {
                "rr" => RouterMode::RoundRobin,
                "ll" => RouterMode::LeastLoaded,
                _ => return Err(format!("mode {v}")),
            };
            continue;
        }
        if k == "aff" {
            cfg.affinity.mode = match v {
                "hard" => AffinityMode::Hard,
                "soft" => AffinityMode::Soft,
                "cost" => AffinityMode::Cost,
                _ => return Err(format!("aff {v}")),
            };
            continue;
        }
        let x: f64 = v.parse().map_err(|e| format!("{kv}: {e}"))?;
        if k == "endblocks" {
            cfg.prompt_end_blocks = x as usize;
            continue;
        }
        if k == "ends" {
            cfg.prompt_ends_max = x as usize;
            continue;
        }
        if k == "costs" {
            cfg.learn.costs = x != 0.0;
            continue;
        }
        if k == "doubt" {
            cfg.learn.doubt_scale_min = x;
            continue;
        }
        if k == "frac" {
            cfg.eligibility.decode_blocks_frac_of_kv = (x > 0.0).then_some(x);
            continue;
        }
        let c = &mut cfg.cost;
        match k {
            "dtw" => c.ttft.decode_time_weight = x,
            "dtmax" => c.ttft.decode_time_ms_max = x,
            "sdtw" => c.ttft.session_decode_time_weight = x,
            "sret" => c.ttft.session_return_ms = x as u64,
            "sscaled" => c.ttft.session_return_scaled = x != 0.0,
            "memshare" => c.ttft.memory_kv_share = x,
            "mem" => c.ttft.memory_ms_per_block = x,
            "out" => c.ttft.output_tokens_default = x as u32,
            "store" => c.ttft.store_ms_per_block = x,
            "keep" => c.ttft.keep_ms_per_block = x,
            "keepmax" => c.ttft.keep_ms_max = x,
            "keepshare" => c.ttft.keep_share_min = x,
            "keepholders" => c.ttft.keep_holders_max = x as u32,
            "keepend" => c.ttft.keep_needs_prompt_end = x != 0.0,
            "work" => c.ttft.work_weight = x,
            "others" => c.ttft.others_delay_weight = x,
            "credit" => c.ttft.progress_credit = x,
            "overdue" => c.ttft.overdue_pass_share = x,
            "grace" => c.ttft.overdue_grace_passes = x,
            "arw" => c.active_request_weight = x,
            "pls" => c.prefill_load_scale = x,
            "xs" => c.ttft.excess_ms_per_request = x,
            "xm" => c.ttft.excess_over_mean = x,
            "xmin" => c.ttft.excess_requests_min = x as u32,
            "xref" => c.ttft.excess_floor_mean_requests = x,
            "cold" => c.timing.cold_ms_per_idle_s = x,
            "coldmax" => c.timing.cold_ms_max = x,
            _ => return Err(format!("unknown weight {k}")),
        }
    }
    Ok(cfg)
}

/// A clairvoyant partition (`partition`): requests are grouped by their prompt's ninth
/// block (a shared document, or a conversation's opening), and the groups, heaviest first
/// by their output tokens over the whole trace, go to the worker with the least so far.
/// Every group lives on one worker, so nothing is computed twice that a single copy
/// would hold: what the best balance of whole groups gives.
struct Partition {
    of: std::collections::HashMap<u64, u32>,
}

impl Partition {
    fn new(reqs: &[SimRequest], workers: u32) -> Self {
        let mut weight = std::collections::HashMap::<u64, u64>::new();
        for r in reqs {
            *weight.entry(Self::key(r)).or_default() += u64::from(r.output_len);
        }
        let mut groups: Vec<(u64, u64)> = weight.into_iter().collect();
        groups.sort_by_key(|&(k, w)| (std::cmp::Reverse(w), k));
        let mut load = vec![0u64; workers.max(1) as usize];
        let mut of = std::collections::HashMap::new();
        for (k, w) in groups {
            let (i, _) = load.iter().enumerate().min_by_key(|&(i, l)| (*l, i)).expect("a worker");
            load[i] += w;
            of.insert(k, i as u32);
        }
        Partition { of }
    }

    fn key(r: &SimRequest) -> u64 {
        kvroute_sim::search::opening_key(r)
    }
}

impl Dispatcher for Partition {
    fn on_arrival(&mut self, _now_ms: f64, req: &SimRequest) -> kvroute_sim::Dispatch {
        kvroute_sim::Dispatch::To(self.of.get(&Self::key(req)).copied().unwrap_or(0))
    }
}

/// Passes a lookahead copy may run before it gives up on a worker.
const LOOKAHEAD_PASSES_MAX: u32 = 100_000;

/// The clairvoyant references (`kvroute_sim::lookahead`): deterministic, so one run each.
fn lookahead_goal(variant: &str) -> Option<Goal> {
    match variant {
        "oracle" => Some(Goal::FirstToken),
        "oracle-e2e" => Some(Goal::LastToken),
        _ => None,
    }
}

/// The offline search (`search[-e2e|-hits][-free][=MOVES]`, default 1,000 moves): from
/// kv's choices (router seed 0), it keeps moves that lower the TTFT (or end-to-end) mean,
/// or raise the hit rate, while the other figures stay at least as good as kv's own: the
/// headroom a rule that gives up nothing kv has could find. `-free` drops those limits:
/// how far the figure goes at any cost.
fn search(
    a: &Args,
    rcfg: &ReplayConfig,
    fleet: Fleet,
    reqs: &[SimRequest],
    spec: &str,
    speedup: f64,
) -> Result<(), String> {
    let (aim, moves) = if let Some(rest) = spec.strip_prefix("-e2e") {
        (Aim::Time(Goal::LastToken), rest)
    } else if let Some(rest) = spec.strip_prefix("-hits") {
        (Aim::Hits, rest)
    } else {
        (Aim::Time(Goal::FirstToken), spec)
    };
    let (free, moves) = match moves.strip_prefix("-free") {
        Some(rest) => (true, rest),
        None => (false, moves),
    };
    let moves_max = match moves.strip_prefix('=') {
        Some(n) => n.parse().map_err(|e| format!("search={n}: {e}"))?,
        None if moves.is_empty() => 1_000,
        None => return Err(format!("search{moves}: expected search[-e2e|-hits][-free][=MOVES]")),
    };
    let mut d = CoreDispatcher::new(config(a, "kv")?, fleet, 0, true, a.sessions);
    let kv = run(rcfg, reqs, &mut d)?;
    let start: Vec<u32> = kv.records.iter().map(|r| r.worker.unwrap_or(0)).collect();
    let k = &kv.summary;
    let s = match free {
        true => SearchConfig::unlimited(aim, moves_max),
        false => SearchConfig {
            hits_min: k.prefix_reuse_ratio,
            ttft_mean_max_ms: k.ttft_ms.mean,
            e2e_mean_max_ms: k.e2e_ms.mean,
            ..SearchConfig::unlimited(aim, moves_max)
        },
    };
    let progress = |tried: u32, kept: u32, best: &kvroute_sim::Summary| {
        if tried.is_multiple_of(50) {
            eprintln!(
                "search: {tried}/{moves_max} moves, {kept} kept; ttft mean {:.1}, e2e mean {:.1}, hits {:.4}",
                best.ttft_ms.mean, best.e2e_ms.mean, best.prefix_reuse_ratio
            );
        }
    };
    let found = kvroute_sim::search::search(rcfg, reqs, start, &s, progress).map_err(|e| e.to_string())?;
    let best = run(rcfg, reqs, &mut Assigned::new(reqs, &found.assignment))?;
    // The variant as given, less its moves: `search-hits-free=500` is `search-hits-free`.
    let name = format!("search{}", spec.split('=').next().unwrap_or_default());
    let name = name.as_str();
    line(name, speedup, &best);
    if let Some(path) = &a.records {
        dump(path, name, speedup, &best)?;
    }
    println!(
        "{{\"variant\":\"{name}\",\"tried\":{},\"kept\":{},\"limited\":{},\"start_ttft_mean\":{:.1},\"start_hits\":{:.4},\"start_e2e_mean\":{:.1}}}",
        found.tried, found.kept, found.limited, found.start.ttft_ms.mean, found.start.prefix_reuse_ratio, found.start.e2e_ms.mean
    );
    Ok(())
}

fn run<D: Dispatcher>(cfg: &ReplayConfig, reqs: &[SimRequest], d: &mut D) -> Result<ReplayReport, String> {
    replay(cfg, reqs, d).map_err(|e| e.to_string())
}

fn line(name: &str, speedup: f64, r: &ReplayReport) {
    let s = &r.summary;
    let counts: Vec<u64> = r.workers.iter().map(|w| w.requests).collect();
    println!(
        "{{\"variant\":\"{name}\",\"speedup\":{speedup},\"hits\":{:.4},\"ttft_mean\":{:.1},\"ttft_p99\":{:.1},\
         \"e2e_mean\":{:.1},\"e2e_p99\":{:.1},\"out_tps\":{:.1},\"per_worker\":{counts:?}}}",
        s.prefix_reuse_ratio, s.ttft_ms.mean, s.ttft_ms.p99, s.e2e_ms.mean, s.e2e_ms.p99, s.output_tokens_per_s
    );
}

/// Appends every request of a run to `path`, one JSON line each.
fn dump(path: &str, name: &str, speedup: f64, r: &ReplayReport) -> Result<(), String> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(|e| format!("{path}: {e}"))?;
    fn js<T: std::fmt::Display>(x: Option<T>) -> String {
        x.map_or_else(|| "null".into(), |v| v.to_string())
    }
    for q in &r.records {
        let ttft = q.first_token_ms.map(|t| t - q.arrival_ms);
        let e2e = q.last_token_ms.map(|t| t - q.arrival_ms);
        writeln!(
            f,
            "{{\"variant\":\"{name}\",\"speedup\":{speedup},\"id\":{},\"arrival_ms\":{},\"worker\":{},\"prompt\":{},\"cached\":{},\"output\":{},\"ttft_ms\":{},\"e2e_ms\":{}}}",
            q.id, q.arrival_ms, js(q.worker), q.prompt_tokens, js(q.cached_tokens), q.output_tokens, js(ttft), js(e2e)
        )
        .map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}

/// Appends each arrival's choice against the lookahead's best worker to `path`.
fn dump_regret(path: &str, name: &str, seed: u64, choices: &[Choice]) -> Result<(), String> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(|e| format!("{path}: {e}"))?;
    for c in choices {
        let (w, ms) = (c.chosen.map_or(-1, i64::from), c.chosen_ms.unwrap_or(f64::NAN));
        writeln!(
            f,
            "{{\"variant\":\"{name}\",\"seed\":{seed},\"id\":{},\"chosen\":{w},\"chosen_ms\":{},\"best\":{},\"best_ms\":{},\"chosen_cached\":{},\"best_cached\":{}}}",
            c.id,
            if ms.is_finite() { ms.to_string() } else { "null".into() },
            c.best,
            c.best_ms,
            c.chosen_cached,
            c.best_cached
        )
        .map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}

fn main() -> Result<(), String> {
    let a = parse()?;
    let engine = EngineConfig {
        blocks_per_worker: a.blocks,
        block_size: BlockSize::DEFAULT.tokens(),
        speedup: a.engine_speedup,
        timing: if a.cpu { EngineTiming::VLLM_CPU } else { EngineConfig::default().timing },
        ..EngineConfig::default()
    };
    let rcfg = ReplayConfig { workers: a.workers, engine: engine.clone(), ..ReplayConfig::default() };
    let fleet = Fleet {
        workers: a.workers,
        prefill_workers: 0,
        kv_blocks: engine.blocks_per_worker,
        max_batched_tokens: engine.max_batched_tokens,
    };
    for &speedup in &a.speedups {
        let reqs = requests(&a, speedup)?;
        let floor = kvroute_sim::stats::Dist::of(&mut kvroute_sim::bound::ttft_lower_bounds_ms(
            &reqs,
            Some(u64::from(a.workers) * u64::from(a.blocks)),
            engine.max_batched_tokens,
            &engine.timing,
        ));
        println!(
            "{{\"floor\":true,\"speedup\":{speedup},\"ttft_mean\":{:.1},\"ttft_p99\":{:.1}}}",
            floor.mean, floor.p99
        );
        let rep = run(&rcfg, &reqs, &mut TextTreeRule::new(a.workers, TextTreeConfig::default()))?;
        line("text-tree", speedup, &rep);
        if let Some(path) = &a.records {
            dump(path, "text-tree", speedup, &rep)?;
        }
        for v in &a.variants {
            if let Some(moves) = v.strip_prefix("search") {
                search(&a, &rcfg, fleet, &reqs, moves, speedup)?;
                continue;
            }
            if v == "partition" {
                let rep = run(&rcfg, &reqs, &mut Partition::new(&reqs, a.workers))?;
                line(v, speedup, &rep);
                continue;
            }
            if let Some(goal) = lookahead_goal(v) {
                let mut d = Lookahead::new(goal, LOOKAHEAD_PASSES_MAX);
                let rep = run(&rcfg, &reqs, &mut d)?;
                line(v, speedup, &rep);
                if let Some(path) = &a.records {
                    dump(path, v, speedup, &rep)?;
                }
                println!("{{\"variant\":\"{v}\",\"unresolved\":{}}}", d.unresolved);
                continue;
            }
            for seed in 0..a.seeds {
                let mut d = CoreDispatcher::new(config(&a, v)?, fleet, seed, true, a.sessions);
                // The timing's doubt needs first tokens, and moves only a timing with a
                // cold term, as `kvroute serve` has it.
                d.observe(a.cpu);
                let rep = match &a.regret {
                    Some(path) => {
                        let mut r = Regret::new(d, Goal::FirstToken, LOOKAHEAD_PASSES_MAX);
                        let rep = run(&rcfg, &reqs, &mut r)?;
                        dump_regret(path, v, seed, &r.choices)?;
                        d = r.inner;
                        rep
                    }
                    None => run(&rcfg, &reqs, &mut d)?,
                };
                line(v, speedup, &rep);
                if let Some(path) = &a.records {
                    dump(path, v, speedup, &rep)?;
                }
                let p = d.placements;
                println!(
                    "{{\"variant\":\"{v}\",\"seed\":{seed},\"routed\":{},\"with_prefix\":{},\"moved\":{},\"blocks_left\":{},\"moved_holder_excluded\":{}}}",
                    p.routed, p.with_prefix, p.moved, p.blocks_left, p.moved_holder_excluded
                );
            }
        }
    }
    Ok(())
}
