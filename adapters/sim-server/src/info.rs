//! What routers read about a worker besides its metrics: the version, the server's
//! configuration, its KV event sources and its load.
//!
//! - `GET /version`: `{"version"}`, vLLM's. SMG takes a worker that answers it for vLLM
//!   (and then reads its load from `/metrics`), else for a generic server it cannot
//!   read load from.
//! - `GET /server_info` (and `/get_server_info`): vLLM's `{"vllm_config": {...}}` as
//!   `?config_format=json` gives it (vllm-router reads `model_config.model` and
//!   `cache_config.block_size`), plus the top-level keys vllm-router's worker discovery
//!   reads (`model_id`, `instance_id`, `kv_block_size`) and SGLang's that SMG and
//!   sglang-router read (`model_path`, `dp_size`, `context_length`, ...).
//! - `GET /kv_event_sources`: `{"<dp rank>": {"endpoint", "replay_endpoint", "topic",
//!   "publisher": "zmq", "encoding": "msgpack", "schema_version": 1, ...}}`, which
//!   vllm-router's `kv_aware` subscribes from when given no static sources.
//! - `GET /get_load`: SGLang's `[{"dp_rank", "num_reqs", "num_waiting_reqs",
//!   "num_tokens"}]`, which sglang-router's load monitor sums (for `power_of_two`).

use serde_json::{json, Value};

use crate::metrics::Metrics;
use crate::server::bracket;
use crate::SimServerConfig;

/// The vLLM release whose API shapes this worker follows; `/version` answers it.
pub(crate) const VLLM_API_VERSION: &str = "0.32.0";

/// The fixed facts a worker reports, taken from its configuration and bound ports.
pub(crate) struct Facts {
    model: String,
    instance_id: String,
    block_size: u32,
    blocks: u32,
    max_num_seqs: u32,
    max_batched_tokens: u32,
    dp_rank: u32,
    events_endpoint: String,
    replay_endpoint: Option<String>,
    topic: String,
    replay_batches_max: usize,
}

impl Facts {
    pub(crate) fn new(cfg: &SimServerConfig, instance_id: String, events_port: u16, replay_port: Option<u16>) -> Self {
        let host = bracket(&cfg.events_bind);
        Facts {
            model: cfg.model.clone(),
            instance_id,
            block_size: cfg.engine.block_size,
            blocks: cfg.engine.blocks_per_worker,
            max_num_seqs: cfg.engine.max_num_seqs,
            max_batched_tokens: cfg.engine.max_batched_tokens,
            dp_rank: cfg.dp_rank,
            events_endpoint: format!("tcp://{host}:{events_port}"),
            replay_endpoint: replay_port.map(|p| format!("tcp://{host}:{p}")),
            topic: cfg.topic.clone(),
            replay_batches_max: cfg.replay_batches_max,
        }
    }

    /// Tokens the KV cache holds, which is also the longest prompt plus output.
    pub(crate) fn max_model_len(&self) -> u64 {
        u64::from(self.blocks) * u64::from(self.block_size)
    }
}

pub(crate) fn version() -> Value {
    json!({"version": VLLM_API_VERSION, "kvroute_sim": env!("CARGO_PKG_VERSION")})
}

pub(crate) fn server_info(f: &Facts) -> Value {
    let len = f.max_model_len();
    json!({
        "vllm_config": {
            "model_config": {"model": f.model, "served_model_name": f.model, "max_model_len": len},
            "cache_config": {"block_size": f.block_size, "num_gpu_blocks": f.blocks, "enable_prefix_caching": true},
            "scheduler_config": {"max_num_seqs": f.max_num_seqs, "max_num_batched_tokens": f.max_batched_tokens},
            "parallel_config": {"data_parallel_rank": f.dp_rank, "data_parallel_size": 1, "tensor_parallel_size": 1},
            "kv_events_config": event_source(f),
        },
        "model_id": f.model,
        "instance_id": f.instance_id,
        "kv_block_size": f.block_size,
        "model_path": f.model,
        "served_model_name": f.model,
        "tp_size": 1,
        "dp_size": 1,
        "context_length": len,
        "max_total_tokens": len,
        "max_running_requests": f.max_num_seqs,
        "page_size": f.block_size,
        "version": VLLM_API_VERSION,
    })
}

pub(crate) fn kv_event_sources(f: &Facts) -> Value {
    json!({ f.dp_rank.to_string(): event_source(f) })
}

fn event_source(f: &Facts) -> Value {
    json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "encoding": "msgpack",
        "schema_version": 1,
        "endpoint": f.events_endpoint,
        "replay_endpoint": f.replay_endpoint,
        "topic": f.topic,
        "buffer_steps": f.replay_batches_max,
    })
}

/// One rank's load as the engine task last set it: requests running and waiting, and
/// the tokens their KV blocks hold.
pub(crate) fn get_load(f: &Facts, m: &Metrics) -> Value {
    let (running, waiting) = (m.running.get().max(0), m.waiting.get().max(0));
    let tokens = m.active_blocks.get().max(0).saturating_mul(i64::from(f.block_size));
    json!([{"dp_rank": f.dp_rank, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": tokens}])
}
