//! `kvroute-sim-server` runs one simulated GPU worker as a real server: an
//! OpenAI-compatible HTTP endpoint in front of the [`kvroute_sim::Engine`] model, running
//! in wall-clock time scaled by a speedup, that publishes its KV cache events over ZeroMQ
//! in vLLM's wire format.
//!
//! A router under test cannot tell it from a vLLM worker at the protocol level: the same
//! `/v1/completions` and `/v1/chat/completions` shapes (streaming and not), the same
//! `vllm:`-named Prometheus gauges, and the same `[topic, seq, payload]` ZeroMQ frames
//! with a replay ROUTER socket. It also serves what routers ask a vLLM server besides
//! generation: the render pair and `/tokenize` (whose ids are exactly the ids it hashes
//! into the blocks its events announce), `/detokenize`, `/version`, `/server_info` and
//! `/kv_event_sources`, and SGLang's `/get_load`. What it serves is filler text; what it models is when
//! tokens arrive and which KV blocks are cached (see the `kvroute-sim` crate).
//!
//! Shape: one engine task owns the [`kvroute_sim::Engine`] (requests reach it over a
//! channel; it sleeps until the engine's next pass boundary or the next request), one
//! publisher task owns the ZeroMQ sockets, and hyper serves HTTP/1.1 and h2c. Start it
//! with [`spawn`] (tests, in-process fleets) or [`run`] (the `kvroute sim-worker`
//! command, which also waits for ctrl-c or SIGTERM).
//!
//! What it leaves to others: real tokenization (plug a [`PromptTokenizer`]; the built-in
//! fallback maps UTF-8 bytes to ids), routing, and logging setup (it only emits
//! `tracing` events).
//!
//! Fidelity, and what is not modelled:
//! - Tokens reach clients at the pass ends the engine model computes, never earlier.
//!   Wake-ups ride tokio's millisecond timer, so at speedups where a pass lasts well
//!   under a millisecond of wall time tokens arrive in bursts; the model's clock is
//!   anchored to the wall clock, so lateness never accumulates.
//! - Per-token times between the first token and the finish are inferred from observed
//!   pass ends (see the engine task's docs); the first token and the finish are exact.
//! - A chat's images (for a vision-language model, [`SimMedia`]) are identified,
//!   expanded into placeholder tokens and hashed into their blocks as vLLM does, and
//!   stored blocks announce them in `extra_keys`; the vision encoder costs nothing.
//! - Every prompt hashes with the unsalted seed: LoRA adapters and `cache_salt` are
//!   ignored. No logprobs, stop sequences, or `n > 1`; output is always `max_tokens`
//!   long (`finish_reason: "length"`).
//! - A request whose client hangs up still runs to its end (the model has no abort).
//!
//! Disaggregated serving speaks both wire protocols. vLLM's NIXL style: a prefill-role
//! worker answers with `kv_transfer_params`, and a decode-role worker given them models
//! the KV transfer, then decodes. SGLang's bootstrap style: a prefill-role worker with a
//! bootstrap port serves `GET /bootstrap/{room}`, and a decode-role worker given
//! `bootstrap_host`, `bootstrap_port` and `bootstrap_room` waits there for the room's
//! prefill before it starts (an error answer if that prefill fails).
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod args;
mod bootstrap;
mod engine_task;
mod faults;
mod greedy;
mod http;
mod info;
mod ledger;
mod media;
mod metrics;
mod openai;
mod pooling;
mod preprocess;
mod publisher;
mod responses;
mod server;
mod sse;
mod tokenizer;
pub mod wire;

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

pub use args::{EngineArgs, RoleArg, SimWorkerArgs, SIM_WORKER_AFTER_HELP};
pub use faults::Faults;
pub use kvroute_sim::engine::{ConfigError, EngineConfig, EngineRole, KvTransfer};
pub use media::{HasherArg, ImagePlan, MediaArgs, SimMedia};
pub use server::{run, spawn, SimServerHandle, SPEEDUP_MAX};
pub use tokenizer::{fallback_chat, fallback_decode, fallback_text, FallbackTokenizer, PromptTokenizer, TokenizeError};

/// Everything one simulated worker needs; [`Default`] gives a loopback worker on
/// ephemeral ports with the mocker's engine defaults.
#[derive(Clone)]
pub struct SimServerConfig {
    /// Address the HTTP server binds; 127.0.0.1.
    pub host: IpAddr,
    /// HTTP port; 0 picks a free one (read it from [`SimServerHandle::http_addr`]).
    pub port: u16,
    /// Host the ZeroMQ PUB and replay sockets bind; "127.0.0.1".
    pub events_bind: String,
    /// ZeroMQ PUB port for KV events; 0 picks a free one.
    pub events_port: u16,
    /// ZeroMQ ROUTER port for replaying missed batches; `None` (no replay socket).
    /// `Some(0)` picks a free one.
    pub replay_port: Option<u16>,
    /// ZeroMQ topic frame of every published batch; "" (vLLM's default).
    pub topic: String,
    /// Model name served on `/v1/models` and echoed in responses; "kvroute-sim".
    pub model: String,
    /// The engine model: block size, capacity, batch limits, speedup, role.
    pub engine: EngineConfig,
    /// `data_parallel_rank` stamped on every event batch; 0.
    pub dp_rank: u32,
    /// Output length when a request sets neither `max_tokens` nor
    /// `max_completion_tokens`; 16.
    pub max_tokens_default: u32,
    /// Largest accepted `max_tokens`; 65,536.
    pub max_tokens_max: u32,
    /// Largest request body, bytes; 16 MiB.
    pub body_bytes_max: usize,
    /// Requests admitted at once (streaming or not); beyond it new ones get 503; 4,096.
    pub requests_in_flight_max: usize,
    /// Event batches kept for replay; 10,000 (vLLM's `buffer_steps`).
    pub replay_batches_max: usize,
    /// Event batches waiting for the publisher; beyond it batches are dropped and
    /// counted; 100,000 (vLLM's `max_queue_size`).
    pub event_queue_max: usize,
    /// How long shutdown waits for open connections to finish, ms; 5,000.
    pub shutdown_grace_ms: u64,
    /// Prefill role: the port of the SGLang-style bootstrap server; `None` (no server).
    /// `Some(0)` picks a free one.
    pub bootstrap_port: Option<u16>,
    /// Bootstrap rooms open at once; 65,536.
    pub bootstrap_rooms_max: usize,
    /// How long a decode request waits for its prefill's room, ms; 30,000.
    pub bootstrap_timeout_ms: u64,
    /// Turns prompts into token ids for prefix hashing; [`FallbackTokenizer`].
    pub tokenizer: Arc<dyn PromptTokenizer>,
    /// How the model reads images, for a vision-language model whose tokenizer renders
    /// one [`SimMedia::token_id`] per image; `None` (the tokenizer refuses images).
    pub media: Option<SimMedia>,
    /// Faults to inject, for tests; none by default. Keep a clone to change them while
    /// the worker runs.
    pub faults: Faults,
}

impl Default for SimServerConfig {
    fn default() -> Self {
        SimServerConfig {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            events_bind: "127.0.0.1".to_string(),
            events_port: 0,
            replay_port: None,
            topic: String::new(),
            model: "kvroute-sim".to_string(),
            engine: EngineConfig::default(),
            dp_rank: 0,
            max_tokens_default: 16,
            max_tokens_max: 65_536,
            body_bytes_max: 16 << 20,
            requests_in_flight_max: 4_096,
            replay_batches_max: 10_000,
            event_queue_max: 100_000,
            shutdown_grace_ms: 5_000,
            bootstrap_port: None,
            bootstrap_rooms_max: 65_536,
            bootstrap_timeout_ms: 30_000,
            tokenizer: Arc::new(FallbackTokenizer),
            media: None,
            faults: Faults::default(),
        }
    }
}

impl fmt::Debug for SimServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimServerConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("events_bind", &self.events_bind)
            .field("events_port", &self.events_port)
            .field("replay_port", &self.replay_port)
            .field("model", &self.model)
            .field("engine", &self.engine)
            .field("dp_rank", &self.dp_rank)
            .field("bootstrap_port", &self.bootstrap_port)
            .field("media", &self.media)
            .finish_non_exhaustive()
    }
}

/// Why a simulated worker could not start or stopped with an error.
#[derive(Debug)]
#[non_exhaustive]
pub enum SimServerError {
    /// The engine configuration was refused.
    Engine(ConfigError),
    /// A limit in the server configuration is zero or out of range.
    Config(&'static str),
    /// The HTTP listener could not bind.
    HttpBind(std::io::Error),
    /// The bootstrap server's listener could not bind.
    BootstrapBind(std::io::Error),
    /// A ZeroMQ socket could not bind.
    ZmqBind {
        /// Which socket: "events" or "replay".
        socket: &'static str,
        /// The endpoint it tried.
        endpoint: String,
        /// The ZeroMQ error, as text.
        message: String,
    },
    /// `--tokenizer` was given but the caller supplied no tokenizer for it.
    TokenizerMissing(std::path::PathBuf),
    /// The image settings are incomplete or disagree with the tokenizer.
    Media(String),
    /// Waiting for a shutdown signal failed.
    Signal(std::io::Error),
}

impl fmt::Display for SimServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimServerError::Engine(e) => write!(f, "engine configuration: {e}"),
            SimServerError::Config(what) => write!(f, "server configuration: {what}"),
            SimServerError::HttpBind(e) => write!(f, "cannot bind the HTTP listener: {e}"),
            SimServerError::BootstrapBind(e) => write!(f, "cannot bind the bootstrap listener: {e}"),
            SimServerError::ZmqBind { socket, endpoint, message } => {
                write!(f, "cannot bind the ZeroMQ {socket} socket on {endpoint}: {message}")
            }
            SimServerError::TokenizerMissing(dir) => {
                write!(f, "--tokenizer {} given but no tokenizer was loaded for it", dir.display())
            }
            SimServerError::Media(why) => write!(f, "images: {why}"),
            SimServerError::Signal(e) => write!(f, "cannot wait for a shutdown signal: {e}"),
        }
    }
}

impl std::error::Error for SimServerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SimServerError::Engine(e) => Some(e),
            SimServerError::HttpBind(e) | SimServerError::BootstrapBind(e) | SimServerError::Signal(e) => Some(e),
            _ => None,
        }
    }
}
