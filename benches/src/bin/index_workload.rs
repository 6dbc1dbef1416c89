//! `index-workload`: the prefix-index workload (Mooncake conversation trace, 64-token
//! blocks), phases A (store), B (query), C (remove) and D (query again), printed as one
//! JSON line. See the workload description shipped with the traces for the exact rules.
//!
//! ```text
//! index-workload --trace PATH --workers W --remove all|dead-tails [--mode time|mem] [--only-a]
//! ```
//!
//! `--only-a` stops after phase A (for profiling ingest alone); its line has no
//! checksums. `--query-reps N` runs phases B and D N times (default 1) and adds
//! `b_min_p50_ns`/`b_min_p99_ns` (and `d_…`): percentiles of each query's fastest run,
//! which filter out preemption and interrupts on a busy machine (the first run's
//! figures stay the workload's).
//!
//! `--mode mem` runs phases A and C only, applying each event as soon as it is built,
//! and measures index memory with a counting allocator and VmRSS.
//!
//! `--reserve-blocks N` calls `PrefixIndex::reserve(N)` on the fresh index before phase
//! A (a capacity hint; without it the index grows on its own). `--a-reps N` repeats
//! phase A on fresh indexes (for profiling) and adds the median CPU rate of the repeats.
//! `a_minor_faults` counts the page faults taken during phase A.

// The result line is one large `json!` literal.
#![recursion_limit = "256"]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant as Clock;

use kvroute_benches::{cpu_time_ns, hash_requests, load_average_1m, load_trace, nearest_rank, vm_rss_bytes};
use router_core::{BlockHash, IndexConfig, IndexEvent, OverlapScores, PrefixIndex, SeqHash, Tier, WorkerKey};
use serde_json::{json, Value};

/// Counts live heap bytes so memory mode can attribute growth to the index.
struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

// SAFETY: defers every call to the system allocator unchanged; only counts sizes.
#[allow(unsafe_code)] // A global allocator can only be written with `unsafe`.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
            LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Plan {
    All,
    DeadTails,
}

impl Plan {
    fn as_str(self) -> &'static str {
        match self {
            Plan::All => "all",
            Plan::DeadTails => "dead-tails",
        }
    }
}

struct Args {
    trace: String,
    workers: usize,
    plan: Plan,
    mem: bool,
    only_a: bool,
    query_reps: usize,
    a_reps: usize,
    reserve_blocks: usize,
}

const USAGE: &str =
    "usage: index-workload --trace PATH --workers W --remove all|dead-tails [--mode time|mem] [--only-a] [--query-reps N] [--reserve-blocks N] [--a-reps N]";

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let (mut trace, mut workers, mut plan, mut mem, mut only_a, mut query_reps, mut a_reps, mut reserve_blocks) =
        (None, None, None, false, false, 1, 1, 0);
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--trace" => trace = Some(val()?),
            "--workers" => {
                let v = val()?;
                workers = Some(v.parse::<usize>().ok().filter(|&w| w > 0).ok_or(format!("bad --workers {v}"))?);
            }
            "--remove" => {
                plan = Some(match val()?.as_str() {
                    "all" => Plan::All,
                    "dead-tails" => Plan::DeadTails,
                    v => return Err(format!("bad --remove {v}")),
                })
            }
            "--mode" => {
                mem = match val()?.as_str() {
                    "time" => false,
                    "mem" => true,
                    v => return Err(format!("bad --mode {v}")),
                }
            }
            "--only-a" => only_a = true,
            "--query-reps" => {
                let v = val()?;
                query_reps = v.parse::<usize>().ok().filter(|&n| n > 0).ok_or(format!("bad --query-reps {v}"))?;
            }
            "--reserve-blocks" => {
                let v = val()?;
                reserve_blocks = v.parse::<usize>().map_err(|_| format!("bad --reserve-blocks {v}"))?;
            }
            "--a-reps" => {
                let v = val()?;
                a_reps = v.parse::<usize>().ok().filter(|&n| n > 0).ok_or(format!("bad --a-reps {v}"))?;
            }
            "-h" | "--help" => return Err(String::new()),
            _ => return Err(format!("unknown argument {a}")),
        }
    }
    Ok(Args {
        trace: trace.ok_or("--trace is required")?,
        workers: workers.ok_or("--workers is required")?,
        plan: plan.unwrap_or(Plan::DeadTails),
        mem,
        only_a,
        query_reps,
        a_reps,
        reserve_blocks,
    })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("index-workload: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let reqs = match load_trace(&args.trace) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("index-workload: {e}");
            return ExitCode::FAILURE;
        }
    };
    let chains = hash_requests(&reqs);
    drop(reqs);
    let out = if args.mem { run_mem(&args, &chains) } else { run_time(&args, &chains) };
    println!("{out}");
    ExitCode::SUCCESS
}

fn key_of(i: usize, workers: usize) -> WorkerKey {
    WorkerKey::new((i % workers) as u64, 0)
}

/// Phase C's lists: sequence hashes, last block first; `None` for no event.
fn removal_lists(chains: &[Vec<BlockHash>], workers: usize, plan: Plan) -> Vec<Option<Vec<SeqHash>>> {
    let half = chains.len() / 2;
    match plan {
        Plan::All => chains[..half].iter().map(|c| Some(c.iter().rev().map(|b| b.seq).collect())).collect(),
        Plan::DeadTails => {
            let mut later: Vec<HashSet<u64>> = vec![HashSet::new(); workers];
            let mut lists = vec![None; half];
            for i in (0..chains.len()).rev() {
                let seen = &mut later[i % workers];
                if i < half {
                    let dead: Vec<SeqHash> =
                        chains[i].iter().rev().map(|b| b.seq).filter(|s| !seen.contains(&s.0)).collect();
                    lists[i] = (!dead.is_empty()).then_some(dead);
                }
                seen.extend(chains[i].iter().map(|b| b.seq.0));
            }
            lists
        }
    }
}

#[derive(Default)]
struct Checksums {
    max_overlap_sum: u64,
    overlap_sum: u64,
    workers_matched_sum: u64,
}

impl Checksums {
    fn json(&self) -> Value {
        json!({
            "max_overlap_sum": self.max_overlap_sum,
            "overlap_sum": self.overlap_sum,
            "workers_matched_sum": self.workers_matched_sum,
        })
    }
    fn tuple(&self) -> [u64; 3] {
        [self.max_overlap_sum, self.overlap_sum, self.workers_matched_sum]
    }
}

/// Runs the query phase `reps` times: the first run's sorted latencies (ns) and
/// checksums, and the sorted per-query minimum over all runs.
fn query_phases(index: &PrefixIndex, queries: &[Vec<SeqHash>], reps: usize) -> (Vec<u64>, Checksums, Vec<u64>) {
    let (first, sums) = query_phase(index, queries);
    let mut min = first.clone();
    for _ in 1..reps {
        let (lat, _) = query_phase(index, queries);
        min.iter_mut().zip(lat).for_each(|(m, l)| *m = (*m).min(l));
    }
    let mut first = first;
    first.sort_unstable();
    min.sort_unstable();
    (first, sums, min)
}

/// Runs every query, timing each call; returns latencies (ns) in query order and
/// checksums.
fn query_phase(index: &PrefixIndex, queries: &[Vec<SeqHash>]) -> (Vec<u64>, Checksums) {
    let mut scores = OverlapScores::new();
    let mut lat = Vec::with_capacity(queries.len());
    let mut sums = Checksums::default();
    for q in queries {
        let t = Clock::now();
        index.find_matches(q, false, &mut scores);
        lat.push(t.elapsed().as_nanos() as u64);
        sums.max_overlap_sum += u64::from(scores.max_raw());
        for (_, o) in scores.iter() {
            sums.overlap_sum += u64::from(o.raw());
            sums.workers_matched_sum += 1;
        }
    }
    (lat, sums)
}

struct Reference {
    entries_a: u64,
    blocks_a: u64,
    b: [u64; 3],
    c_events: u64,
    c_listed: u64,
    c_removed: u64,
    c_left: u64,
    d: [u64; 3],
}

/// The workload's expected counts and checksums, where it gives them.
fn reference(workers: usize, plan: Plan) -> Option<Reference> {
    let (entries_a, b_sum, b_matched) = match workers {
        16 => (2_028_054, 6_968_402, 192_496),
        128 => (2_140_885, 18_795_681, 1_539_968),
        _ => return None,
    };
    let (c_events, c_listed, c_removed, c_left, d) = match (plan, workers) {
        (Plan::All, 16) => (6_015, 1_198_351, 1_088_641, 939_413, [0, 0, 0]),
        (Plan::All, _) => (6_015, 1_198_351, 1_140_577, 1_000_308, [0, 0, 0]),
        (Plan::DeadTails, 16) => (5_969, 1_064_548, 1_064_548, 963_506, [1_264_137, 4_186_621, 192_496]),
        (Plan::DeadTails, _) => (6_008, 1_136_369, 1_136_369, 1_004_516, [1_264_137, 15_305_271, 1_539_968]),
    };
    Some(Reference {
        entries_a,
        blocks_a: 1_411_425,
        b: [2_256_643, b_sum, b_matched],
        c_events,
        c_listed,
        c_removed,
        c_left,
        d,
    })
}

fn rate(n: u64, ns: u64) -> f64 {
    if ns == 0 {
        0.0
    } else {
        n as f64 * 1e9 / ns as f64
    }
}

/// CPU seconds since `start` (a [`cpu_time_ns`] reading), if both readings exist.
fn cpu_delta(start: Option<u64>) -> Option<f64> {
    Some(cpu_time_ns()?.saturating_sub(start?) as f64 / 1e9)
}

/// `n` per CPU second, or null without a CPU clock.
fn cpu_rate(n: u64, cpu_s: Option<f64>) -> Value {
    match cpu_s {
        Some(s) if s > 0.0 => json!(n as f64 / s),
        _ => Value::Null,
    }
}

fn run_time(args: &Args, chains: &[Vec<BlockHash>]) -> Value {
    let w = args.workers;
    let queries: Vec<Vec<SeqHash>> = chains.iter().map(|c| c.iter().map(|b| b.seq).collect()).collect();
    let removals = removal_lists(chains, w, args.plan);
    let blocks_listed: u64 = chains.iter().map(|c| c.len() as u64).sum();
    let load_before = load_average_1m();

    // Phase A (repeated with `--a-reps`, each on a fresh index; the first run counts).
    let mut reps_cpu_rate = Vec::new();
    let faults = minor_faults();
    let (mut index, t_a, cpu_a) = phase_a(chains, w, args.reserve_blocks);
    let faults_a = minor_faults().zip(faults).map(|(b, a)| b.saturating_sub(a));
    for _ in 1..args.a_reps {
        drop(index);
        let (again, _, cpu) = phase_a(chains, w, args.reserve_blocks);
        index = again;
        reps_cpu_rate.push(cpu.map_or(0.0, |s| blocks_listed as f64 / s));
    }
    let stats_a = index.stats();
    if args.only_a {
        reps_cpu_rate.sort_by(f64::total_cmp);
        return json!({
            "a_reps_blocks_per_cpu_s_median": reps_cpu_rate.get(reps_cpu_rate.len() / 2),
            "a_reps_blocks_per_cpu_s_best": reps_cpu_rate.last(),
            "a_minor_faults": faults_a,
            "reserve_blocks": args.reserve_blocks,
            "workers": w,
            "mode": "only-a",
            "a_events_per_s": rate(chains.len() as u64, t_a),
            "a_blocks_per_cpu_s": cpu_rate(blocks_listed, cpu_a),
            "a_blocks_per_s": rate(blocks_listed, t_a),
            "a_entries": stats_a.entries,
            "a_distinct_blocks": stats_a.blocks,
            "cpu_s": {"a": cpu_a},
        });
    }

    // Phase B.
    let cpu = cpu_time_ns();
    let (lat_b, sums_b, min_b) = query_phases(&index, &queries, args.query_reps);
    let cpu_b = cpu_delta(cpu);

    // Phase C.
    let (mut c_events, mut c_listed, mut c_removed) = (0u64, 0u64, 0u64);
    let cpu = cpu_time_ns();
    let t = Clock::now();
    for (i, list) in removals.iter().enumerate() {
        if let Some(list) = list {
            let ev = IndexEvent::Removed { blocks: list, tier: Tier::Device };
            if let Ok(s) = index.apply(key_of(i, w), ev) {
                c_removed += u64::from(s.removed);
            }
            c_events += 1;
            c_listed += list.len() as u64;
        }
    }
    let t_c = t.elapsed().as_nanos() as u64;
    let cpu_c = cpu_delta(cpu);
    let stats_c = index.stats();

    // Phase D.
    let cpu = cpu_time_ns();
    let (lat_d, sums_d, min_d) = query_phases(&index, &queries, args.query_reps);
    let cpu_d = cpu_delta(cpu);

    let matches = reference(w, args.plan).is_some_and(|r| {
        stats_a.entries == r.entries_a
            && stats_a.blocks == r.blocks_a
            && sums_b.tuple() == r.b
            && (c_events, c_listed, c_removed, stats_c.entries) == (r.c_events, r.c_listed, r.c_removed, r.c_left)
            && sums_d.tuple() == r.d
    });
    let n = chains.len() as u64;
    let mean = |l: &[u64]| l.iter().sum::<u64>() as f64 / l.len().max(1) as f64;
    json!({
        "workers": w,
        "remove_plan": args.plan.as_str(),
        "mode": "time",
        "a_events_per_s": rate(n, t_a),
        "a_blocks_per_cpu_s": cpu_rate(blocks_listed, cpu_a),
        "a_blocks_per_s": rate(blocks_listed, t_a),
        "a_entries": stats_a.entries,
        "a_distinct_blocks": stats_a.blocks,
        "a_holder_sets": stats_a.holder_sets,
        "a_heap_bytes": stats_a.heap_bytes,
        "a_minor_faults": faults_a,
        "reserve_blocks": args.reserve_blocks,
        "b_p50_ns": nearest_rank(&lat_b, 50.0),
        "b_p99_ns": nearest_rank(&lat_b, 99.0),
        "b_max_ns": lat_b.last().copied().unwrap_or(0),
        "b_mean_ns": mean(&lat_b),
        "b_queries_per_s": rate(n, lat_b.iter().sum()),
        "b_min_p50_ns": nearest_rank(&min_b, 50.0),
        "b_min_p99_ns": nearest_rank(&min_b, 99.0),
        "query_reps": args.query_reps,
        "c_events": c_events,
        "c_hashes_listed": c_listed,
        "c_entries_removed": c_removed,
        "c_entries_left": stats_c.entries,
        "c_blocks_per_s": rate(c_listed, t_c),
        "c_entries_removed_per_s": rate(c_removed, t_c),
        "c_blocks_per_cpu_s": cpu_rate(c_listed, cpu_c),
        "d_p50_ns": nearest_rank(&lat_d, 50.0),
        "d_p99_ns": nearest_rank(&lat_d, 99.0),
        "d_max_ns": lat_d.last().copied().unwrap_or(0),
        "d_min_p50_ns": nearest_rank(&min_d, 50.0),
        "d_min_p99_ns": nearest_rank(&min_d, 99.0),
        "d_mean_ns": mean(&lat_d),
        "bytes_per_entry": Value::Null,
        "b_checksums": sums_b.json(),
        "d_checksums": sums_d.json(),
        "checksums_match_reference": matches,
        "cpu_s": {"a": cpu_a, "b": cpu_b, "c": cpu_c, "d": cpu_d},
        "loadavg_1m": {"before": load_before, "after": load_average_1m()},
    })
}

/// Minor page faults of this process so far (`/proc/self/stat`), where available.
fn minor_faults() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces): state is field 3, minflt 10.
    s.rsplit_once(')')?.1.split_whitespace().nth(7)?.parse().ok()
}

/// Phase A on a fresh index: the index, wall ns and CPU seconds.
fn phase_a(chains: &[Vec<BlockHash>], w: usize, reserve_blocks: usize) -> (PrefixIndex, u64, Option<f64>) {
    let cpu = cpu_time_ns();
    let t = Clock::now();
    let mut index = PrefixIndex::new(IndexConfig::default());
    if reserve_blocks > 0 {
        index.reserve(reserve_blocks);
    }
    for (i, c) in chains.iter().enumerate() {
        let ev = IndexEvent::Stored { parent: None, blocks: c, tier: Tier::Device };
        let _ = index.apply(key_of(i, w), ev);
    }
    let t_a = t.elapsed().as_nanos() as u64;
    (index, t_a, cpu_delta(cpu))
}

/// Memory mode: phases A and C, each event built just before it is applied.
fn run_mem(args: &Args, chains: &[Vec<BlockHash>]) -> Value {
    let w = args.workers;
    let removals = removal_lists(chains, w, args.plan);
    // Events are re-built from this compact form one at a time, so no event list is
    // live while memory is read.
    let seqs: Vec<Box<[u64]>> = chains.iter().map(|c| c.iter().map(|b| b.seq.0).collect()).collect();
    let locals: Vec<Box<[u64]>> = chains.iter().map(|c| c.iter().map(|b| b.local.0).collect()).collect();
    let rss0 = vm_rss_bytes();
    let heap0 = LIVE_BYTES.load(Ordering::Relaxed);
    let mut index = PrefixIndex::new(IndexConfig::default());
    if args.reserve_blocks > 0 {
        index.reserve(args.reserve_blocks);
    }
    for i in 0..seqs.len() {
        let ev: Vec<BlockHash> = seqs[i]
            .iter()
            .zip(locals[i].iter())
            .map(|(&s, &l)| BlockHash { seq: SeqHash(s), local: router_core::LocalHash(l) })
            .collect();
        let _ = index.apply(key_of(i, w), IndexEvent::Stored { parent: None, blocks: &ev, tier: Tier::Device });
    }
    let heap_a = LIVE_BYTES.load(Ordering::Relaxed);
    let rss_a = vm_rss_bytes();
    let stats_a = index.stats();
    for (i, list) in removals.iter().enumerate() {
        if let Some(list) = list {
            let _ = index.apply(key_of(i, w), IndexEvent::Removed { blocks: list, tier: Tier::Device });
        }
    }
    let heap_c = LIVE_BYTES.load(Ordering::Relaxed);
    let stats_c = index.stats();
    let entries = stats_a.entries.max(1) as f64;
    let per = |grow: Option<u64>| grow.map(|g| g as f64 / entries);
    let rss_growth = rss0.zip(rss_a).map(|(a, b)| b.saturating_sub(a));
    let heap_growth = heap_a.saturating_sub(heap0) as u64;
    let matches =
        reference(w, args.plan).is_some_and(|r| stats_a.entries == r.entries_a && stats_c.entries == r.c_left);
    json!({
        "workers": w,
        "remove_plan": args.plan.as_str(),
        "mode": "mem",
        "a_entries": stats_a.entries,
        // VmRSS growth when available (it includes allocator overhead), else heap.
        "bytes_per_entry": per(rss_growth).unwrap_or(heap_growth as f64 / entries),
        "heap_bytes_per_entry": heap_growth as f64 / entries,
        "rss_bytes_per_entry": per(rss_growth),
        "heap_growth_bytes_a": heap_growth,
        "rss_growth_bytes_a": rss_growth,
        "index_heap_bytes_self_reported_a": stats_a.heap_bytes,
        "heap_bytes_after_c": heap_c.saturating_sub(heap0),
        "c_entries_left": stats_c.entries,
        "reserve_blocks": args.reserve_blocks,
        "checksums_match_reference": matches,
    })
}
