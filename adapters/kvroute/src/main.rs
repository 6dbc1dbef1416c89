//! `kvroute`: the command-line front end of the kvroute router.
//!
//! Each subcommand is a thin adapter around `router-core`; no routing policy lives here.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod demo;
mod dispatch;
mod plot;
mod replay_cmd;
mod report;

/// KV-cache-aware request router for LLM inference fleets (vLLM, SGLang, TensorRT-LLM).
///
/// kvroute sends each request to the worker that serves it fastest, weighing which
/// worker already holds the prompt's prefix in its KV cache, how loaded each worker is,
/// and which worker a session or caller is pinned to.
///
/// Start with `kvroute demo`: it runs the router in front of a simulated GPU fleet and
/// compares KV-aware routing with round-robin on a bundled slice of a real trace.
#[derive(Parser, Debug)]
#[command(name = "kvroute", version, propagate_version = true, max_term_width = 100)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the router in front of a simulated fleet and compare policies (start here).
    Demo(demo::DemoArgs),
    /// Replay a request trace through the router and simulated GPU workers, offline.
    ///
    /// Every arrival goes through the real router-core at the simulated time; KV events,
    /// prefill completions and finishes flow back through the same calls the proxy uses.
    /// The simulated workers follow a vLLM-style reference model: KV blocks with LRU
    /// reuse, a chunked-prefill scheduler, fitted prefill and decode timings. The same
    /// inputs and seed give the same report.
    #[command(after_help = replay_cmd::EXAMPLES)]
    Replay(replay_cmd::ReplayArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Demo(a) => demo::run(&a),
        Cmd::Replay(a) => replay_cmd::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute: error: {e}");
            ExitCode::from(2)
        }
    }
}
