//! `kvroute`: the command-line front end of the kvroute router.
//!
//! Each subcommand is a thin adapter around `router-core`; no routing policy lives here.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod demo;
mod discover;
mod epp;
mod live;
mod load;
mod plot;
mod replay_cmd;
mod replay_learn;
mod report;
mod serve;
mod tok;

/// KV-cache-aware request router for LLM inference fleets (tested against vLLM).
///
/// kvroute sends each request to the worker that serves it fastest, weighing which
/// worker already holds the prompt's prefix in its KV cache, how loaded each worker is,
/// and which worker a session or caller is pinned to.
///
/// Start with `kvroute demo`: it runs the router in front of a simulated GPU fleet and
/// compares KV-aware routing with round-robin on a bundled slice of a real trace.
///
/// Log lines go to stderr; `RUST_LOG` sets their level (default `info` for `serve`, `epp`
/// and `sim-worker`, `warn` otherwise).
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
    /// Route requests to a fleet of OpenAI-compatible workers (the production proxy).
    ///
    /// Serves /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models in
    /// front of vLLM, other OpenAI-compatible or `kvroute sim-worker` servers, choosing a
    /// worker per request by prefix cache, load and session affinity. Workers that name a
    /// `kv_events` endpoint feed the exact prefix index over ZeroMQ; the others are
    /// predicted. Events match only when a model's `tokenizer` is its engine's: each such
    /// worker is asked to tokenize a probe text (POST /tokenize), and one that differs is
    /// logged and shown in /workers. Admin: GET/POST /workers, DELETE /workers/{id},
    /// POST /route/preview, GET /metrics, /health, /ready. SIGTERM drains in-flight
    /// streams, then exits. With `[tls]` (or --tls-cert and --tls-key) clients connect
    /// over TLS (HTTP/2 or HTTP/1.1 by ALPN); `https://` workers and collectors are
    /// reached over TLS.
    Serve(serve::ServeArgs),
    /// Pick endpoints for a Kubernetes Gateway (Gateway API Inference Extension).
    ///
    /// Serves Envoy's external-processing gRPC protocol: for each request the gateway
    /// (Envoy Gateway, Istio, kgateway) sends the headers and body, kvroute makes the same
    /// decision as `serve` (prefix cache, load, sessions, pins, admission queue) and answers
    /// with the worker's ip:port in the x-gateway-destination-endpoint header and the
    /// envoy.lb dynamic metadata; the gateway proxies the bytes. The response's end releases
    /// the load. A full queue answers 429, no worker 503, a bad body 400. Endpoints come
    /// from the config's workers or, with --pool, from the ready pods of an InferencePool.
    /// gRPC health: liveness, readiness, envoy.service.ext_proc.v3.ExternalProcessor.
    #[command(after_help = epp::EXAMPLES)]
    Epp(epp::EppArgs),
    /// Run one simulated GPU worker: an OpenAI-compatible server that publishes KV events.
    ///
    /// The worker runs the same vLLM-style model as `replay`, in real time scaled by
    /// --speedup, serves /v1/chat/completions, /v1/completions (streaming or not),
    /// /v1/models, /health and /metrics, vLLM's render pair, /tokenize, /detokenize,
    /// /version and /server_info, and publishes its KV-cache events over ZeroMQ in vLLM's
    /// wire format, so `kvroute serve` and peer routers route to it as to a real engine.
    #[command(after_help = kvroute_sim_server::SIM_WORKER_AFTER_HELP)]
    SimWorker(kvroute_sim_server::SimWorkerArgs),
    /// Replay a request trace through the router and simulated GPU workers, offline.
    ///
    /// Every arrival goes through the real router-core at the simulated time; KV events,
    /// prefill completions and finishes flow back through the same calls the proxy uses.
    /// The simulated workers follow a vLLM-style reference model: KV blocks with LRU
    /// reuse, a chunked-prefill scheduler, fitted prefill and decode timings. The same
    /// inputs and seed give the same report.
    #[command(after_help = replay_cmd::EXAMPLES)]
    Replay(Box<replay_cmd::ReplayArgs>),
}

fn sim_worker(a: kvroute_sim_server::SimWorkerArgs) -> Result<(), String> {
    let (tokenizer, media) = match &a.tokenizer {
        Some(dir) => {
            let (t, m) = tok::sim_worker_tokenizer(dir, &a.media)?;
            (Some(std::sync::Arc::new(t) as std::sync::Arc<dyn kvroute_sim_server::PromptTokenizer>), m)
        }
        None => (None, None),
    };
    let mut cfg = a.into_config(tokenizer).map_err(|e| e.to_string())?;
    cfg.media = media;
    let rt = tokio::runtime::Runtime::new().map_err(|e| format!("cannot start the async runtime: {e}"))?;
    rt.block_on(async move {
        let w = kvroute_sim_server::spawn(cfg).await.map_err(|e| e.to_string())?;
        // The bound addresses, so that port 0 (a free port) is usable.
        eprintln!("kvroute sim-worker: serving http://{} with KV events on {}", w.http_addr(), w.events_endpoint());
        serve::shutdown_signal().await;
        w.shutdown().await;
        Ok(())
    })
}

/// Sends the libraries' log lines to stderr: `info` and up for the servers, only warnings
/// for the commands whose output is a report. `RUST_LOG` overrides it
/// (for example `RUST_LOG=kvroute_proxy=debug`).
fn init_logs(cmd: &Cmd) {
    let default = match cmd {
        Cmd::Serve(_) | Cmd::Epp(_) | Cmd::SimWorker(_) => "info",
        Cmd::Demo(_) | Cmd::Replay(_) => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logs(&cli.cmd);
    let result = match cli.cmd {
        Cmd::Demo(a) => demo::run(&a),
        Cmd::Replay(a) => replay_cmd::run(&a),
        Cmd::SimWorker(a) => sim_worker(a),
        Cmd::Serve(a) => serve::run(&a),
        Cmd::Epp(a) => epp::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute: error: {e}");
            ExitCode::from(2)
        }
    }
}
