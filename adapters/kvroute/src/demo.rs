//! `kvroute demo`: the embedded default. The router in front of a simulated fleet,
//! replaying the bundled trace slice under KV-aware routing and under round-robin.

use clap::Args;
use serde_json::json;

use crate::replay_cmd::{load_requests, run_all, Policy, ReplayArgs};
use router_core::select::RouterMode;

/// Run the router in front of a simulated fleet and compare kv routing with round-robin.
///
/// Replays the bundled 1,500-request slice of the Mooncake conversation trace (real
/// arrival times, prompt lengths and prefix structure) through router-core and a fleet
/// of simulated vLLM-style workers, once with KV-aware routing and once with
/// round-robin, then prints both side by side. Runs offline in a few seconds.
#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Number of simulated workers.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Divide trace timestamps by K (more load as K grows).
    #[arg(long, default_value_t = 2.0, value_name = "K")]
    pub speedup: f64,
    /// Replay only the first N requests of the slice.
    #[arg(long, value_name = "N")]
    pub requests: Option<usize>,
    /// Print the summary as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `kvroute demo`.
pub fn run(d: &DemoArgs) -> Result<(), String> {
    let args = ReplayArgs {
        trace: None,
        synthetic: false,
        bundled: true,
        workers: d.workers.max(1),
        policy: Policy(RouterMode::Kv),
        compare: vec![Policy(RouterMode::Kv), Policy(RouterMode::RoundRobin)],
        speedup: d.speedup,
        requests: d.requests,
        block_size: 64,
        blocks_per_worker: 16_384,
        max_batched_tokens: 8_192,
        max_num_seqs: 256,
        kv_event_lag_ms: 0.0,
        no_kv_events: false,
        sessions: false,
        prefill_load_scale: None,
        overlap_credit: None,
        active_request_weight: None,
        temperature: None,
        model: Default::default(),
        seed: 0,
        json: d.json,
        plot: None,
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
        println!("kvroute demo: {} workers, bundled Mooncake conversation slice, timestamps / {}\n", args.workers, args.speedup);
        crate::report::print_table(&runs);
    }
    Ok(())
}
