//! Replay reports: the JSON object and the human-readable table.

use serde::Serialize;

use kvroute_sim::replay::ReplayReport;
use kvroute_sim::stats::Dist;
use router_core::DisaggStats;

fn disagg_json<S: serde::Serializer>(d: &DisaggStats, s: S) -> Result<S::Ok, S::Error> {
    serde::Serialize::serialize(
        &serde_json::json!({
            "split": d.split,
            "bypass_short_prompt": d.bypass_short_prompt,
            "bypass_prefill_busy": d.bypass_prefill_busy,
            "bypass_no_prefill_workers": d.bypass_no_prefill_workers,
        }),
        s,
    )
}

/// Mean and percentiles, as the report prints them.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Ttft {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// Mean, median and tail.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Short {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

/// The fleet-LRU lower bound on TTFT (see `kvroute_sim::bound`), ms.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Bound {
    pub p50: f64,
    pub p99: f64,
}

/// How far a run falls short of the bounds: reuse below the pooled ceiling, TTFT above
/// the fleet-LRU lower bound.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Regret {
    pub reuse: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
}

/// One per-worker load sample, for plots.
#[derive(Clone, Copy, Debug)]
pub struct LoadPoint {
    pub t_s: f64,
    pub worker: u32,
    pub active_blocks: u32,
}

/// One policy's replay, shaped as `kvroute replay --json` prints it.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub policy: String,
    pub workers: u32,
    /// Of `workers`, how many prefill (0: an aggregated fleet).
    pub prefill_workers: u32,
    /// Split and bypass counts in a disaggregated fleet.
    #[serde(serialize_with = "disagg_json")]
    pub disagg: DisaggStats,
    pub requests: usize,
    pub completed: u64,
    pub rejected: u64,
    pub unfinished: u64,
    pub routing_errors: u64,
    pub prefix_reuse_ratio: f64,
    pub pooled_reuse_ratio: f64,
    pub infinite_reuse_ratio: f64,
    /// TTFT if every request ran alone on an idle worker of one fleet-sized LRU cache.
    pub ttft_lower_bound_ms: Bound,
    /// Gaps to the pooled reuse ceiling and the TTFT lower bound.
    pub regret: Regret,
    pub ttft_ms: Ttft,
    pub itl_ms: Short,
    pub e2e_ms: Short,
    pub output_tokens_per_s: f64,
    pub preemptions: u64,
    /// Requests each worker served, in worker order.
    pub worker_requests: Vec<u64>,
    pub sim_duration_s: f64,
    pub wall_s: f64,
    #[serde(skip)]
    pub ttft_samples_ms: Vec<f64>,
    #[serde(skip)]
    pub loads: Vec<LoadPoint>,
}

fn round(x: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (x * m).round() / m
}

fn ttft(d: &Dist) -> Ttft {
    Ttft {
        mean: round(d.mean, 3),
        p50: round(d.p50, 3),
        p90: round(d.p90, 3),
        p99: round(d.p99, 3),
        max: round(d.max, 3),
    }
}

fn short(d: &Dist) -> Short {
    Short { mean: round(d.mean, 3), p50: round(d.p50, 3), p99: round(d.p99, 3) }
}

impl RunReport {
    /// Builds the report of one replay.
    pub fn new(
        policy: String,
        workers: u32,
        requests: usize,
        rep: &ReplayReport,
        wall_s: f64,
        routing_errors: u64,
        loads: Vec<LoadPoint>,
    ) -> Self {
        let s = &rep.summary;
        RunReport {
            policy,
            workers,
            prefill_workers: 0,
            disagg: DisaggStats::default(),
            requests,
            completed: s.completed,
            rejected: s.rejected,
            unfinished: s.unfinished,
            routing_errors,
            prefix_reuse_ratio: round(s.prefix_reuse_ratio, 6),
            pooled_reuse_ratio: 0.0,
            infinite_reuse_ratio: 0.0,
            ttft_lower_bound_ms: Bound::default(),
            regret: Regret::default(),
            ttft_ms: ttft(&s.ttft_ms),
            itl_ms: short(&s.itl_ms),
            e2e_ms: short(&s.e2e_ms),
            output_tokens_per_s: round(s.output_tokens_per_s, 3),
            preemptions: s.preemptions,
            worker_requests: rep.workers.iter().map(|w| w.requests).collect(),
            sim_duration_s: round(rep.end_ms / 1000.0, 3),
            wall_s: round(wall_s, 3),
            ttft_samples_ms: rep.records.iter().filter_map(|r| r.ttft_ms()).collect(),
            loads,
        }
    }

    /// Records the bounds every run of one workload shares, and the run's gap to them.
    pub fn set_bounds(&mut self, pooled: f64, infinite: f64, ttft: &Dist) {
        self.pooled_reuse_ratio = pooled;
        self.infinite_reuse_ratio = infinite;
        self.ttft_lower_bound_ms = Bound { p50: round(ttft.p50, 3), p99: round(ttft.p99, 3) };
        self.regret = Regret {
            reuse: round(pooled - self.prefix_reuse_ratio, 6),
            ttft_p50_ms: round(self.ttft_ms.p50 - self.ttft_lower_bound_ms.p50, 3),
            ttft_p99_ms: round(self.ttft_ms.p99 - self.ttft_lower_bound_ms.p99, 3),
        };
    }
}

/// Prints the runs side by side.
pub fn print_table(runs: &[RunReport]) {
    let Some(first) = runs.first() else { return };
    println!(
        "{} requests on {} workers; cache ceilings: pooled LRU {:.3}, infinite {:.3}\n",
        first.requests, first.workers, first.pooled_reuse_ratio, first.infinite_reuse_ratio
    );
    // Fits 100 columns; the JSON report has every percentile and the wall time.
    println!(
        "{:<13} {:>9} {:>8} {:>6} {:>9} {:>9} {:>9} {:>8} {:>9} {:>8}",
        "policy",
        "completed",
        "rejected",
        "reuse",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "ITL mean",
        "E2E mean",
        "tok/s"
    );
    for r in runs {
        println!(
            "{:<13} {:>9} {:>8} {:>6.3} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>9.1} {:>8.1}",
            r.policy,
            r.completed,
            r.rejected,
            r.prefix_reuse_ratio,
            r.ttft_ms.mean,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.itl_ms.mean,
            r.e2e_ms.mean,
            r.output_tokens_per_s,
        );
    }
    for line in shortfall_lines(runs) {
        println!("{line}");
    }
    print_regret(runs);
    if let Some(base) = runs.iter().find(|r| r.policy == "round-robin") {
        for r in runs.iter().filter(|r| r.policy != "round-robin") {
            println!(
                "\n{} vs round-robin: reuse {:.2}x, TTFT mean {:.2}x, TTFT p99 {:.2}x",
                r.policy,
                ratio(r.prefix_reuse_ratio, base.prefix_reuse_ratio),
                ratio(r.ttft_ms.mean, base.ttft_ms.mean),
                ratio(r.ttft_ms.p99, base.ttft_ms.p99)
            );
        }
    }
}

/// A line per run and kind of request that did not complete, with its count; none
/// when every request completed.
fn shortfall_lines(runs: &[RunReport]) -> Vec<String> {
    let mut lines = Vec::new();
    for r in runs {
        let kinds = [
            (r.rejected, "rejected (refused by the admission queue or a worker)"),
            (r.routing_errors, "routing errors (the router found no worker to take it)"),
            (r.unfinished, "unfinished when the replay ended"),
        ];
        for (n, what) in kinds.into_iter().filter(|&(n, _)| n > 0) {
            lines.push(format!("{:<13} {n:>9} {what}", r.policy));
        }
    }
    if !lines.is_empty() {
        lines.insert(0, String::new());
    }
    lines
}

/// Each run's distance from the bounds no router can beat on this fleet.
fn print_regret(runs: &[RunReport]) {
    let Some(first) = runs.first() else { return };
    let b = first.ttft_lower_bound_ms;
    println!(
        "\nregret against the bounds: pooled LRU reuse {:.3}; fleet-LRU TTFT p50 {:.1}, p99 {:.1} ms",
        first.pooled_reuse_ratio, b.p50, b.p99
    );
    println!("{:<13} {:>10} {:>14} {:>14}", "policy", "reuse gap", "TTFT p50 +ms", "TTFT p99 +ms");
    for r in runs {
        let g = r.regret;
        println!("{:<13} {:>10.3} {:>14.1} {:>14.1}", r.policy, g.reuse, g.ttft_p50_ms, g.ttft_p99_ms);
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        0.0
    } else {
        a / b
    }
}
