//! The `kvroute sim-worker` command line, as a `clap::Args` struct the binary embeds.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, ValueEnum};
use kvroute_sim::engine::{EngineConfig, EngineRole, EngineTiming, KvTransfer};

use crate::{MediaArgs, PromptTokenizer, SimServerConfig, SimServerError};

/// Run one simulated GPU worker as an OpenAI-compatible server that publishes its KV
/// cache events over ZeroMQ, like a vLLM worker started with `--kv-events-config`.
///
/// The worker models a vLLM-style engine (paged KV blocks with prefix caching and LRU
/// eviction, chunked prefill, a fitted timing model) in real time divided by --speedup,
/// and answers with filler text. Point a router at several of these to test it against
/// a fleet without GPUs: /v1/completions and /v1/chat/completions (streaming or not),
/// /v1/models, /health and /metrics (vllm:num_requests_running and friends).
///
/// KV events: a ZeroMQ PUB socket on --events-port sends [topic, seq (8-byte big-endian),
/// msgpack batch] with BlockStored / BlockRemoved events whose block hashes are the
/// router's own chained block hashes. With --replay-port, a ROUTER socket resends missed
/// batches (the last 10,000) from a requested sequence number.
///
/// Prompts are tokenized like kvroute's routing fallback (four bytes per token) unless
/// a tokenizer is loaded with --tokenizer; a router must tokenize the same way to see
/// the same prefixes. [`SIM_WORKER_AFTER_HELP`] lists the other endpoints, with examples.
#[derive(Args, Debug, Clone)]
#[command(verbatim_doc_comment)]
pub struct SimWorkerArgs {
    /// HTTP port of the OpenAI-compatible API (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Address the HTTP server listens on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// ZeroMQ PUB port for KV events (vLLM's default is 5557).
    #[arg(long, default_value_t = 5557)]
    pub events_port: u16,
    /// Host or address the ZeroMQ sockets bind (use 0.0.0.0 to accept remote routers).
    #[arg(long, default_value = "127.0.0.1", value_name = "ADDR")]
    pub events_bind: String,
    /// ZeroMQ ROUTER port that replays buffered event batches on request (off if unset).
    #[arg(long)]
    pub replay_port: Option<u16>,
    /// ZeroMQ topic frame of every event message.
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Run K times faster than the modelled GPU (every pass takes 1/K of its time).
    #[arg(long, default_value_t = 1.0, value_name = "K")]
    pub speedup: f64,
    /// The engine's shape.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Model name served on /v1/models and echoed in responses.
    #[arg(long, default_value = "kvroute-sim")]
    pub model: String,
    /// Hugging Face tokenizer directory, for token ids that match a real model. When its
    /// config.json describes a vision-language model (LLaVA, Qwen2-VL), chat image parts
    /// are read as vLLM reads them (see "Images" below).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Images, for a vision-language model.
    #[command(flatten)]
    pub media: MediaArgs,
    /// Aggregated serves whole requests; prefill stops after the first token and returns
    /// kv_transfer_params; decode takes requests carrying kv_transfer_params and models
    /// the KV transfer before decoding.
    #[arg(long, value_enum, default_value_t = RoleArg::Aggregated)]
    pub role: RoleArg,
    /// Data-parallel rank stamped on every event batch (ports are not offset by it, unlike
    /// vLLM: give each rank its own --events-port).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub dp_rank: u32,
    /// Output length when a request sets no max_tokens.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub default_max_tokens: u32,
    /// KV bytes per token, for the prefill-to-decode transfer time.
    #[arg(long, default_value_t = 160 * 1024, value_name = "BYTES")]
    pub kv_bytes_per_token: u64,
    /// Prefill-to-decode link bandwidth, in GB/s.
    #[arg(long, default_value_t = 64.0, value_name = "GBPS")]
    pub kv_bandwidth_gbps: f64,
    /// Prefill role: serve SGLang-style bootstrap rooms on this port (GET /bootstrap/ROOM
    /// answers once that room's prefill finished); decode workers given bootstrap_host,
    /// bootstrap_port and bootstrap_room wait there before decoding.
    #[arg(long, value_name = "PORT")]
    pub bootstrap_port: Option<u16>,
    /// How long a decode request waits for its bootstrap room, in milliseconds.
    #[arg(long, default_value_t = 30_000, value_name = "MS")]
    pub bootstrap_timeout_ms: u64,
}

/// The end of `kvroute sim-worker --help`: the endpoints routers read besides
/// generation, and examples.
pub const SIM_WORKER_AFTER_HELP: &str = "\
What routers ask a vLLM server besides generation, in vLLM's shapes:
  POST /v1/completions/render, /v1/chat/completions/render   a request's token ids, not generated
  POST /tokenize, /detokenize
  GET  /version, /server_info (also /get_server_info), /kv_event_sources
  GET  /get_load                                             SGLang's load shape
The ids render and /tokenize return are the ids the worker hashes into the KV blocks its
events announce, so a router that tokenizes through them sees the worker's own prefixes.

Images: with a --tokenizer folder whose config.json has a vision_config (or with
--image-token and --image-tokens), a chat's image_url parts (data: URLs, or a uuid) are
read as vLLM reads them: each image's identifier is vLLM's digest of the client's bytes
and --mm-model-id, its placeholder becomes --image-tokens (or the model's count) tokens,
and its blocks hash with it, so the same image hits the cache and another image misses
from the first block it touches. BlockStored events carry vLLM's extra_keys, one
[identifier, offset] pair per image a block holds. A router in front (kvroute serve, with
the same folder as the model's `tokenizer` and `engine_model_id` = --mm-model-id) then
matches them. A bad image gets 400, one over the size limit 413.

Examples:
  kvroute sim-worker --port 8001 --events-port 5557
  kvroute sim-worker --port 8002 --events-port 5558 --replay-port 5568 --speedup 10
  kvroute sim-worker --port 8003 --events-port 5559 --role prefill
  kvroute sim-worker --port 8004 --events-port 5560 --role prefill --bootstrap-port 8998
  curl -s localhost:8001/v1/completions -d '{\"prompt\":\"hello\",\"max_tokens\":8}'
  curl -s localhost:8001/v1/completions/render -d '{\"prompt\":\"hello\"}'
  kvroute sim-worker --port 8005 --events-port 5561 --tokenizer ./llava-tokenizer \
      --mm-model-id llava-hf/llava-1.5-7b-hf";

/// The simulated engine's shape, as `kvroute sim-worker` and `kvroute replay` both take
/// it. The defaults are [`EngineConfig::default`]'s, so they live in one place.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct EngineArgs {
    /// Tokens per KV block (a power of two up to 1024); the router must use the same.
    #[arg(long, default_value_t = EngineConfig::default().block_size)]
    pub block_size: u32,
    /// KV cache capacity of each worker, in blocks.
    #[arg(long, default_value_t = EngineConfig::default().blocks_per_worker)]
    pub blocks_per_worker: u32,
    /// Token budget of one forward pass (chunked prefill splits longer prompts).
    #[arg(long, default_value_t = EngineConfig::default().max_batched_tokens)]
    pub max_batched_tokens: u32,
    /// Most requests running at once on a worker; more wait in its queue.
    #[arg(long, default_value_t = EngineConfig::default().max_num_seqs)]
    pub max_num_seqs: u32,
    /// How long passes take: a preset (mocker: a GPU, the default; vllm-cpu: vLLM's CPU
    /// build, one core) or a JSON file of timing coefficients.
    #[arg(long, default_value = "mocker", value_name = "PRESET|FILE", value_parser = parse_timing)]
    pub engine_timing: EngineTiming,
}

fn parse_timing(spec: &str) -> Result<EngineTiming, String> {
    EngineTiming::load(spec).map_err(|e| e.to_string())
}

impl Default for EngineArgs {
    fn default() -> Self {
        let e = EngineConfig::default();
        EngineArgs {
            block_size: e.block_size,
            blocks_per_worker: e.blocks_per_worker,
            max_batched_tokens: e.max_batched_tokens,
            max_num_seqs: e.max_num_seqs,
            engine_timing: e.timing,
        }
    }
}

impl EngineArgs {
    /// `base` with this shape.
    pub fn apply(&self, base: EngineConfig) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            blocks_per_worker: self.blocks_per_worker,
            max_batched_tokens: self.max_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            timing: self.engine_timing,
            ..base
        }
    }
}

/// A worker role as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    /// Prefill and decode on this worker.
    Aggregated,
    /// Prefill only; the response carries kv_transfer_params for a decode worker.
    Prefill,
    /// Decode only; prefill arrives from a prefill worker.
    Decode,
}

impl From<RoleArg> for EngineRole {
    fn from(r: RoleArg) -> Self {
        match r {
            RoleArg::Aggregated => EngineRole::Aggregated,
            RoleArg::Prefill => EngineRole::Prefill,
            RoleArg::Decode => EngineRole::Decode,
        }
    }
}

impl SimWorkerArgs {
    /// The server configuration these flags describe. `tokenizer` is the tokenizer the
    /// caller loaded from `--tokenizer`; it is required when that flag is set (this crate
    /// does not read tokenizer files) and used even without the flag if given. Images
    /// are the caller's too (it reads the model's files): see [`MediaArgs::plan`].
    pub fn into_config(self, tokenizer: Option<Arc<dyn PromptTokenizer>>) -> Result<SimServerConfig, SimServerError> {
        let defaults = SimServerConfig::default();
        let tokenizer = match (tokenizer, self.tokenizer) {
            (Some(t), _) => t,
            (None, Some(dir)) => return Err(SimServerError::TokenizerMissing(dir)),
            (None, None) if self.media.any_image_flag() => {
                return Err(SimServerError::Media(
                    "images need a --tokenizer whose vocabulary has the image token".into(),
                ))
            }
            (None, None) => defaults.tokenizer.clone(),
        };
        Ok(SimServerConfig {
            host: self.host,
            port: self.port,
            events_bind: self.events_bind,
            events_port: self.events_port,
            replay_port: self.replay_port,
            topic: self.topic,
            model: self.model,
            engine: self.engine.apply(EngineConfig {
                speedup: self.speedup,
                role: self.role.into(),
                kv_transfer: KvTransfer {
                    kv_bytes_per_token: self.kv_bytes_per_token,
                    bandwidth_bytes_per_s: self.kv_bandwidth_gbps * 1e9,
                },
                ..EngineConfig::default()
            }),
            dp_rank: self.dp_rank,
            max_tokens_default: self.default_max_tokens,
            bootstrap_port: self.bootstrap_port,
            bootstrap_timeout_ms: self.bootstrap_timeout_ms,
            tokenizer,
            ..defaults
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    #[command(after_help = SIM_WORKER_AFTER_HELP)]
    struct Cli {
        #[command(flatten)]
        args: SimWorkerArgs,
    }

    #[track_caller]
    fn parse(argv: &[&str]) -> SimWorkerArgs {
        Cli::try_parse_from(std::iter::once("sim-worker").chain(argv.iter().copied())).expect("valid flags").args
    }

    #[test]
    fn flags_reach_the_config() {
        let cfg = parse(&[
            "--port",
            "9",
            "--events-port",
            "10",
            "--replay-port",
            "11",
            "--speedup",
            "100",
            "--block-size",
            "16",
            "--blocks-per-worker",
            "64",
            "--max-batched-tokens",
            "512",
            "--max-num-seqs",
            "4",
            "--model",
            "m",
            "--role",
            "prefill",
            "--dp-rank",
            "2",
            "--bootstrap-port",
            "12",
            "--bootstrap-timeout-ms",
            "500",
        ])
        .into_config(None)
        .expect("no tokenizer needed");
        assert_eq!((cfg.port, cfg.events_port, cfg.replay_port, cfg.dp_rank), (9, 10, Some(11), 2));
        assert_eq!((cfg.bootstrap_port, cfg.bootstrap_timeout_ms), (Some(12), 500));
        assert_eq!(cfg.model, "m");
        let e = &cfg.engine;
        assert_eq!((e.block_size, e.blocks_per_worker, e.max_batched_tokens, e.max_num_seqs), (16, 64, 512, 4));
        assert_eq!((e.speedup, e.role), (100.0, EngineRole::Prefill));
    }

    #[test]
    fn engine_defaults_are_the_engines_own() {
        let cfg = parse(&[]).into_config(None).expect("defaults are valid");
        assert_eq!(cfg.engine, EngineConfig::default());
        assert_eq!(EngineArgs::default().apply(EngineConfig::default()), EngineConfig::default());
    }

    #[test]
    fn help_keeps_the_examples_on_their_own_lines() {
        use clap::CommandFactory;
        let help = Cli::command().render_long_help().to_string();
        assert!(help.lines().any(|l| l.trim() == "kvroute sim-worker --port 8001 --events-port 5557"), "{help}");
        for path in ["/v1/completions/render", "/v1/chat/completions/render", "/tokenize", "/version", "/server_info"] {
            assert!(help.contains(path), "{path} in {help}");
        }
    }

    #[test]
    fn engine_timing_is_a_preset_or_a_file() {
        let cfg = parse(&["--engine-timing", "vllm-cpu"]).into_config(None).expect("a preset");
        assert_eq!(cfg.engine.timing, EngineTiming::VLLM_CPU);
        let argv = ["sim-worker", "--engine-timing", "no-such-timing.json"];
        let err = Cli::try_parse_from(argv).err().expect("a missing file is refused").to_string();
        assert!(err.contains("neither a preset (mocker, vllm-cpu) nor a file"), "{err}");
    }

    #[test]
    fn a_tokenizer_dir_needs_a_loaded_tokenizer() {
        let args = parse(&["--tokenizer", "tok"]);
        assert!(matches!(args.clone().into_config(None), Err(SimServerError::TokenizerMissing(_))));
        assert!(args.into_config(Some(Arc::new(crate::FallbackTokenizer))).is_ok());
    }
}
