//! `kvroute demo`: the embedded default. The router in front of a simulated fleet,
//! replaying the bundled trace slice under KV-aware routing and under round-robin:
//! live over real HTTP and ZeroMQ by default, or offline on virtual time.

use clap::Args;
use serde_json::json;

use crate::replay_cmd::{load_requests, run_all, Policy, ReplayArgs};
use kvroute_frontend::config::QueueOrderName;
use router_core::{QueueOrder, RouterMode};

/// Run the router in front of a simulated fleet and compare kv routing with round-robin.
///
/// Starts two fleets of simulated vLLM-style workers on loopback (real HTTP servers that
/// publish KV events over ZeroMQ), a kvroute proxy in front of each (one routing by KV
/// cache and load, one round-robin), and sends both the bundled 1,500-request slice of
/// the Mooncake conversation trace at once, printing a live table. With --offline it
/// replays the same slice on virtual time instead, in a few seconds.
#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Number of simulated workers behind each router.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Wall-clock budget of the live demo, seconds.
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    pub duration: f64,
    /// Load relative to the trace: arrivals this many times faster than the engines.
    #[arg(long, default_value_t = 2.0, value_name = "K")]
    pub speedup: f64,
    /// Replay offline on virtual time instead of live over HTTP.
    #[arg(long)]
    pub offline: bool,
    /// Replay only the first N requests of the slice.
    #[arg(long, value_name = "N")]
    pub requests: Option<usize>,
    /// Print the summary as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `kvroute demo`.
pub fn run(d: &DemoArgs) -> Result<(), String> {
    if !(d.speedup.is_finite() && d.speedup > 0.0) {
        return Err(format!("--speedup must be a positive number, got {}", d.speedup));
    }
    if d.offline {
        offline(d)
    } else {
        live(d)
    }
}

fn live(d: &DemoArgs) -> Result<(), String> {
    if !(d.duration.is_finite() && d.duration >= 5.0) {
        return Err(format!("--duration must be at least 5 seconds, got {}", d.duration));
    }
    let o = crate::live::LiveOptions {
        workers: d.workers.max(1),
        duration_s: d.duration,
        load_factor: d.speedup,
        requests: d.requests,
        table: !d.json,
    };
    let rt = tokio::runtime::Runtime::new().map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let results = rt.block_on(crate::live::run(o))?;
    let mut policies = serde_json::Map::new();
    for r in &results {
        let s = &r.stats;
        let k = r.speedup;
        policies.insert(
            r.policy.to_string(),
            json!({
                "requests": s.sent,
                "completed": s.done,
                "errors": s.errors,
                "errors_by_kind": s.error_kinds,
                "unfinished": s.unfinished(),
                "prefix_reuse_ratio": (s.reuse() * 1e6).round() / 1e6,
                "ttft_ms": { "mean": s.ttft_mean() * k, "p50": s.ttft_pct(50.0) * k, "p99": s.ttft_pct(99.0) * k },
            }),
        );
    }
    if d.json {
        println!("{}", json!({ "mode": "live", "workers": d.workers, "policies": policies }));
    } else {
        println!("\nfinal (TTFT in model ms):");
        println!(
            "{:<12} {:>8} {:>9} {:>7} {:>7} {:>10} {:>10} {:>10}",
            "policy", "sent", "completed", "errors", "reuse", "TTFT mean", "TTFT p50", "TTFT p99"
        );
        for r in &results {
            let s = &r.stats;
            let k = r.speedup;
            println!(
                "{:<12} {:>8} {:>9} {:>7} {:>7.3} {:>10.0} {:>10.0} {:>10.0}",
                r.policy,
                s.sent,
                s.done,
                s.errors,
                s.reuse(),
                s.ttft_mean() * k,
                s.ttft_pct(50.0) * k,
                s.ttft_pct(99.0) * k
            );
        }
        for line in error_lines(&results) {
            println!("{line}");
        }
    }
    Ok(())
}

/// What each policy's errors were, a line per kind with its count, and the requests
/// still open when the budget ran out (abandoned, not failed).
fn error_lines(results: &[crate::live::LiveResult]) -> Vec<String> {
    let mut lines = vec![String::new()];
    for r in results {
        if r.stats.error_kinds.is_empty() {
            lines.push(format!("{:<12} no errors", r.policy));
        }
        for (kind, n) in &r.stats.error_kinds {
            lines.push(format!("{:<12} {n:>7} x {kind}", r.policy));
        }
    }
    let open: Vec<String> = results
        .iter()
        .filter(|r| r.stats.unfinished() > 0)
        .map(|r| format!("{} {}", r.policy, r.stats.unfinished()))
        .collect();
    if !open.is_empty() {
        lines.push(format!("still streaming at the deadline, abandoned: {}", open.join(", ")));
    }
    lines
}

fn offline(d: &DemoArgs) -> Result<(), String> {
    let args = ReplayArgs {
        trace: None,
        synthetic: false,
        bundled: true,
        workers: d.workers.max(1),
        prefill_workers: None,
        decode_workers: None,
        disagg_isl_min_tokens: 2_048,
        policy: Policy(RouterMode::Kv),
        compare: vec![Policy(RouterMode::Kv), Policy(RouterMode::RoundRobin)],
        speedup: d.speedup,
        requests: d.requests,
        trace_block_tokens: kvroute_sim::trace::MOONCAKE_BLOCK_TOKENS,
        input_scale: 1.0,
        output_scale: 1.0,
        engine: Default::default(),
        kv_event_lag_ms: 0.0,
        no_kv_events: false,
        sessions: false,
        prefill_load_scale: None,
        overlap_credit: None,
        active_request_weight: None,
        router_knows_timing: false,
        temperature: None,
        model: Default::default(),
        busy_prefill_batches: None,
        busy_kv_share: 0.0,
        queue_order: QueueOrderName(QueueOrder::Fcfs),
        seed: 0,
        json: d.json,
        text_tree: false,
        plot: None,
        learn: Default::default(),
    };
    let reqs = load_requests(&args)?;
    let runs = run_all(&args, &args.compare, &reqs)?;
    if d.json {
        let mut policies = serde_json::Map::new();
        for r in &runs {
            policies.insert(
                r.policy.clone(),
                json!({
                    "requests": r.requests,
                    "errors": r.rejected + r.routing_errors,
                    "prefix_reuse_ratio": r.prefix_reuse_ratio,
                    "ttft_ms": { "mean": r.ttft_ms.mean, "p50": r.ttft_ms.p50, "p99": r.ttft_ms.p99 },
                }),
            );
        }
        println!("{}", json!({ "policies": policies }));
    } else {
        println!(
            "kvroute demo: {} workers, bundled Mooncake conversation slice, timestamps / {}\n",
            args.workers, args.speedup
        );
        crate::report::print_table(&runs);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::live::LiveResult;
    use crate::load::LiveStats;

    /// One policy's figures: its name, errors by kind, requests sent and done.
    type Policy = (&'static str, &'static [(&'static str, u64)], u64, u64);

    /// The lines after the table for these policies.
    #[track_caller]
    fn check(policies: &[Policy], want: &[&str]) {
        let results: Vec<LiveResult> = policies
            .iter()
            .map(|&(policy, kinds, sent, done)| {
                let error_kinds = kinds.iter().map(|&(k, n)| (k.to_string(), n)).collect();
                let errors = kinds.iter().map(|&(_, n)| n).sum();
                LiveResult {
                    policy,
                    stats: LiveStats { sent, done, errors, error_kinds, ..Default::default() },
                    speedup: 1.0,
                }
            })
            .collect();
        let got = super::error_lines(&results);
        assert_eq!(got[1..], want.iter().map(|s| s.to_string()).collect::<Vec<_>>()[..], "{got:#?}");
    }

    #[test]
    fn each_error_kind_gets_a_line_with_its_count() {
        check(
            &[("kv", &[], 10, 10), ("round-robin", &[], 10, 10)],
            &["kv           no errors", "round-robin  no errors"],
        );
        check(
            &[
                ("kv", &[("HTTP 503 no_worker_available", 1), ("stream broke", 2)], 1500, 1497),
                ("round-robin", &[], 1500, 1490),
            ],
            &[
                "kv                 1 x HTTP 503 no_worker_available",
                "kv                 2 x stream broke",
                "round-robin  no errors",
                "still streaming at the deadline, abandoned: round-robin 10",
            ],
        );
    }
}
