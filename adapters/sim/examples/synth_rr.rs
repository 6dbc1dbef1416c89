//! Round-robin replay of the default synthetic workload, printing the summary and the
//! cache ceilings: a quick look at how much a prefix-aware router could gain.
//!
//! `cargo run --release -p kvroute-sim --example synth_rr -- [WORKERS] [SEED]`

use kvroute_sim::ceiling::reuse_ratio;
use kvroute_sim::replay::{replay, ReplayConfig, RoundRobin};
use kvroute_sim::synth::{generate, SynthConfig};
use kvroute_sim::trace::{to_requests, LoadOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let workers: u32 = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let seed: u64 = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(1);
    let records = generate(&SynthConfig { seed, ..SynthConfig::default() });
    let reqs = to_requests(&records, &LoadOptions::default())?;
    let cfg = ReplayConfig { workers, ..ReplayConfig::default() };
    let report = replay(&cfg, &reqs, &mut RoundRobin::new(workers))?;
    println!("{}", serde_json::to_string_pretty(&report.summary)?);
    let prompt_tokens: u64 = reqs.iter().map(|r| u64::from(r.prompt.len_tokens())).sum();
    println!(
        "requests {} | prompt tokens {} | sim end {:.1} s | ceilings: pooled {:.3}, infinite {:.3}",
        reqs.len(),
        prompt_tokens,
        report.end_ms / 1000.0,
        reuse_ratio(&reqs, Some(u64::from(workers) * u64::from(cfg.engine.blocks_per_worker)), true),
        reuse_ratio(&reqs, None, true)
    );
    Ok(())
}
