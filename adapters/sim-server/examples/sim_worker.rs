//! `kvroute sim-worker` without the kvroute binary: the same flags, the fallback
//! tokenizer, logs to stderr. `cargo run -p kvroute-sim-server --example sim_worker -- --help`

use std::process::ExitCode;

use clap::Parser;
use kvroute_sim_server::{run, SimWorkerArgs};

#[derive(Parser)]
#[command(name = "sim-worker", max_term_width = 100)]
struct Cli {
    #[command(flatten)]
    args: SimWorkerArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.args.into_config(None) {
        Ok(cfg) => run(cfg).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sim-worker: error: {e}");
            ExitCode::from(2)
        }
    }
}
