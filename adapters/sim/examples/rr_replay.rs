//! Round-robin replay of a Mooncake trace on default engines, printing the summary.
//!
//! `cargo run --release -p kvroute-sim --example rr_replay -- TRACE WORKERS SPEEDUP [REQUESTS]`
//!
//! SPEEDUP divides the trace timestamps. Prints the summary as JSON, the cache
//! ceilings for the same fleet, and wall times per stage.

use std::time::Instant;

use kvroute_sim::ceiling::reuse_ratio;
use kvroute_sim::replay::{replay, ReplayConfig, RoundRobin};
use kvroute_sim::trace::{read_trace, to_requests, LoadOptions, TraceLimits};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: rr_replay TRACE WORKERS SPEEDUP [REQUESTS]");
        std::process::exit(2);
    }
    let workers: u32 = args[2].parse()?;
    let speedup: f64 = args[3].parse()?;
    let requests_max = args.get(4).map(|s| s.parse()).transpose()?;

    let t0 = Instant::now();
    let file = std::io::BufReader::new(std::fs::File::open(&args[1])?);
    let records = read_trace(file, &TraceLimits::default())?;
    let t_parse = t0.elapsed();
    let opts = LoadOptions { speedup, requests_max, ..LoadOptions::default() };
    let reqs = to_requests(&records, &opts)?;
    let t_hash = t0.elapsed() - t_parse;

    let cfg = ReplayConfig { workers, ..ReplayConfig::default() };
    let t1 = Instant::now();
    let report = replay(&cfg, &reqs, &mut RoundRobin::new(workers))?;
    let t_replay = t1.elapsed();

    let fleet_blocks = u64::from(workers) * u64::from(cfg.engine.blocks_per_worker);
    let pooled = reuse_ratio(&reqs, Some(fleet_blocks), true);
    let infinite = reuse_ratio(&reqs, None, true);
    let infinite_plain = reuse_ratio(&reqs, None, false);
    let coarse = to_requests(&records, &LoadOptions { block_size: 512, ..opts.clone() })?;
    let coarse_plain = reuse_ratio(&coarse, None, false);

    println!("{}", serde_json::to_string_pretty(&report.summary)?);
    println!("workers: {}", serde_json::to_string(&report.workers)?);
    println!(
        "requests {} | sim end {:.1} s | steps {} | truncated {}",
        reqs.len(),
        report.end_ms / 1000.0,
        report.steps,
        report.truncated
    );
    println!(
        "ceilings: pooled LRU {pooled:.4} | infinite {infinite:.4} | infinite, no last-block rule {infinite_plain:.4} | \
         512-token trace blocks, infinite {:.4}",
        coarse_plain
    );
    println!(
        "wall: parse {:.3} s, hash {:.3} s, replay {:.3} s, total {:.3} s",
        t_parse.as_secs_f64(),
        t_hash.as_secs_f64(),
        t_replay.as_secs_f64(),
        (t_parse + t_hash + t_replay).as_secs_f64()
    );
    Ok(())
}
