//! The proxy's configuration: a TOML file (see `kvroute.example.toml`), every field
//! defaulted, unknown keys refused, and every error naming its key and line.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::str::FromStr;

use router_core::{
    AffinityMode, BlockSize, QueueOrder, RouterMode, Taint, TaintEffect, WorkerId, WorkerRole, WorkerSpec,
};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::trust::Cidr;

/// Everything `kvroute serve` can be configured with. `Default` is a proxy on
/// `127.0.0.1:8080` with no models and no workers.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Address to listen on (default `127.0.0.1:8080`; port 0 picks a free port).
    pub listen: SocketAddr,
    /// Header carrying the session id (default `x-session-id`).
    pub session_header: String,
    /// Header telling a multi-rank worker which dp rank to use (default
    /// `x-data-parallel-rank`); sent only to workers with more than one rank.
    pub dp_rank_header: String,
    /// Pool for requests whose `model` names no configured model (default none: 404).
    pub default_model: Option<String>,
    /// Seed of routing draws and hash tables; `None` (default) draws one at startup.
    pub seed: Option<u64>,
    /// Request and connection limits.
    pub limits: LimitsConfig,
    /// Which clients may pin workers, preview decisions and set priorities.
    pub trust: TrustConfig,
    /// Retries before the first byte.
    pub retry: RetryConfig,
    /// Continuing broken streams on another worker.
    pub migration: MigrationConfig,
    /// Outlier ejection after consecutive failures.
    pub ejection: EjectionConfig,
    /// Active health checks.
    pub health_check: HealthCheckConfig,
    /// Routing policy shared by every model.
    pub router: RoutingConfig,
    /// The models served; each is one pool of workers with its own router.
    pub models: Vec<ModelConfig>,
    /// The workers known at startup; more can be added through `POST /workers`.
    pub workers: Vec<WorkerConfig>,
    /// Sharing load and session bindings with other replicas over NATS; absent
    /// (default), this proxy routes alone.
    pub replica: Option<ReplicaConfig>,
    /// Learned worker speeds and engine load scraped from the workers' metrics.
    pub learn: crate::learn::LearnSection,
    /// Workers found in a cluster besides `workers` (default none).
    pub discovery: DiscoverySection,
    /// Distributed tracing over OpenTelemetry; absent (default), no spans are made and
    /// trace headers pass through untouched.
    pub tracing: Option<TracingConfig>,
    /// The tenants and their API keys (default none: the gateway is open).
    pub tenants: Vec<crate::tenants::TenantConfig>,
    /// Limits on the images of chat requests, and the `http://` prefixes images may be
    /// fetched from (default none).
    pub media: crate::media::MediaSection,
    /// Serving clients over TLS; absent (default), plaintext HTTP.
    pub tls: Option<TlsConfig>,
    /// How `https` workers and collectors are verified (default: the system's roots).
    pub upstream_tls: UpstreamTlsConfig,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            session_header: "x-session-id".into(),
            dp_rank_header: "x-data-parallel-rank".into(),
            default_model: None,
            seed: None,
            limits: LimitsConfig::default(),
            trust: TrustConfig::default(),
            retry: RetryConfig::default(),
            migration: MigrationConfig::default(),
            ejection: EjectionConfig::default(),
            health_check: HealthCheckConfig::default(),
            router: RoutingConfig::default(),
            models: Vec::new(),
            workers: Vec::new(),
            replica: None,
            learn: crate::learn::LearnSection::default(),
            discovery: DiscoverySection::default(),
            tracing: None,
            tenants: Vec::new(),
            media: crate::media::MediaSection::default(),
            tls: None,
            upstream_tls: UpstreamTlsConfig::default(),
        }
    }
}

/// Request and connection limits.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request body accepted, in bytes (default 8 MiB); larger gets 413.
    pub body_bytes_max: u64,
    /// Time a client has to send its request headers, in ms (default 10,000).
    pub header_read_timeout_ms: u64,
    /// Proxied requests in progress at once (default 4,096); more get 503.
    pub concurrent_requests_max: usize,
    /// Time from arrival to the end of the response, in ms (default 600,000).
    pub request_timeout_ms: u64,
    /// Time to open a connection to a worker, in ms (default 2,000).
    pub connect_timeout_ms: u64,
    /// How long idle upstream connections are kept, in ms (default 90,000).
    pub upstream_idle_timeout_ms: u64,
    /// How long shutdown waits for in-flight requests, in seconds (default 30).
    pub shutdown_grace_s: u64,
    /// Client connections open at once (default 10,000). A connection past the cap is
    /// answered 503 and closed at once, before its request is read.
    pub connections_max: usize,
    /// Longest session id accepted, in bytes (default 256); a longer, empty or
    /// non-UTF-8 session id gets a 400.
    pub session_id_bytes_max: usize,
    /// Buffer of each HTTP/1 connection, each way, in bytes (default 65,536; at least
    /// 8,192). It bounds what the proxy holds of a stream whose client reads slowly (the
    /// worker is then held back through TCP), and it is also the largest request head
    /// accepted (431 beyond it).
    pub connection_buffer_bytes_max: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            body_bytes_max: 8 << 20,
            header_read_timeout_ms: 10_000,
            concurrent_requests_max: 4096,
            request_timeout_ms: 600_000,
            connect_timeout_ms: 2_000,
            upstream_idle_timeout_ms: 90_000,
            shutdown_grace_s: 30,
            connections_max: 10_000,
            session_id_bytes_max: 256,
            connection_buffer_bytes_max: 64 << 10,
        }
    }
}

/// Trusted clients may send pins, the preview flag and priority fields; from anyone
/// else these are stripped and counted.
#[derive(Clone, Debug, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrustConfig {
    /// Source networks trusted by address, e.g. `["10.0.0.0/8", "::1/128"]` (default none).
    pub cidrs: Vec<Cidr>,
    /// Header carrying the shared token (default `x-kvroute-token`).
    pub token_header: Option<String>,
    /// The shared token; a request carrying it is trusted (default none).
    pub token: Option<String>,
}

/// Retries before the first byte reached the client: after a connect failure, a reset,
/// a 5xx, a 429 or a first-byte timeout (see `crate::retry`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Retries per request, each on a worker not yet tried (default 2).
    pub retries_max: u32,
    /// Retries earned per request, as a fraction (default 0.2).
    pub budget_ratio: f64,
    /// Retries available at startup (default 10).
    pub budget_initial: u32,
    /// Most retries banked (default 100).
    pub budget_max: u32,
    /// Ceiling of the first retry's jittered wait, in ms, doubling per retry (default 25).
    pub backoff_base_ms: u64,
    /// Largest ceiling of a retry's jittered wait, in ms (default 1,000).
    pub backoff_max_ms: u64,
    /// Longest wait a worker's `Retry-After` can ask for, in ms (default 5,000).
    pub retry_after_max_ms: u64,
    /// Time a streaming try has to produce its first byte, in ms, before the prefill of
    /// its uncached prompt tokens (default 15,000).
    pub first_byte_timeout_base_ms: u64,
    /// Time added to the first-byte timeout per uncached prompt token, in µs (default
    /// 1,000: a 100,000-token prompt gets 115 s).
    pub first_byte_timeout_per_token_us: u64,
    /// Longest silence of a stream after its first byte (an SSE stream that cannot
    /// migrate: after its headers), in ms, before it is treated as broken: handed to
    /// migration, or, for a stream that cannot migrate, ended with a `stream_stalled`
    /// error event (default 60,000; 0 disables). Only time spent waiting on the worker
    /// counts, not time a client takes to read.
    pub idle_stream_timeout_ms: u64,
    /// Time a non-streaming try has to answer, per output token it asks for
    /// (`max_tokens` or `max_completion_tokens`), in ms, on top of its first-byte timeout
    /// (default 100; 0 disables). A request that names no limit waits until its worker
    /// is ejected, or its own deadline, `limits.request_timeout_ms`.
    pub answer_timeout_per_output_token_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            retries_max: 2,
            budget_ratio: 0.2,
            budget_initial: 10,
            budget_max: 100,
            backoff_base_ms: 25,
            backoff_max_ms: 1_000,
            retry_after_max_ms: 5_000,
            first_byte_timeout_base_ms: 15_000,
            first_byte_timeout_per_token_us: 1_000,
            idle_stream_timeout_ms: 60_000,
            answer_timeout_per_output_token_ms: 100,
        }
    }
}

/// Mid-stream migration: a stream that breaks after tokens reached the client continues
/// on another worker (see `crate::migrate`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MigrationConfig {
    /// Breaks one stream may be continued across (default 3; 0 turns migration off).
    pub attempts_max: u32,
    /// Time from a break until a continuation's first byte, in ms (default 30,000).
    pub deadline_ms: u64,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        MigrationConfig { attempts_max: 3, deadline_ms: 30_000 }
    }
}

/// Outlier ejection: a worker failing this many requests in a row is taken out of
/// rotation for a back-off that doubles with every failed probe, up to a cap. After the
/// back-off one probe (`GET` of the health-check path) readmits it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EjectionConfig {
    /// Consecutive failures that eject a worker (default 5; 0 disables ejection).
    pub consecutive_failures: u32,
    /// First back-off, in ms (default 1,000).
    pub base_ms: u64,
    /// Longest back-off, in ms (default 60,000).
    pub max_ms: u64,
}

impl Default for EjectionConfig {
    fn default() -> Self {
        EjectionConfig { consecutive_failures: 5, base_ms: 1_000, max_ms: 60_000 }
    }
}

/// Active health checks: `GET` of `path` on every worker. A failed check counts as a
/// failure towards ejection; a passed one resets the count.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthCheckConfig {
    /// Time between checks, in ms (default 5,000; 0 disables active checks, probes of
    /// ejected workers still run).
    pub interval_ms: u64,
    /// Time a check may take, in ms (default 1,000).
    pub timeout_ms: u64,
    /// Path checked (default `/health`).
    pub path: String,
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        HealthCheckConfig { interval_ms: 5_000, timeout_ms: 1_000, path: "/health".into() }
    }
}

/// The routing policy every model's router starts from.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// `kv` (default), `round-robin`, `random`, `power-of-two`, `least-loaded`,
    /// `weighted` or `direct`.
    #[serde(deserialize_with = "from_str")]
    pub mode: RouterMode,
    /// Tokens per KV block; must match the engines' (default 64).
    pub block_size: u32,
    /// Predict cache contents of workers that publish no KV events (default true).
    pub approximate: bool,
    /// Longest wait in the admission queue, in ms (default 30,000).
    pub queue_timeout_ms: u64,
    /// Most requests queued per model (default 4,096).
    pub queued_max: usize,
    /// `fcfs` (default) or `wspt` (short uncached prompts first).
    #[serde(deserialize_with = "from_str")]
    pub queue_order: QueueOrderName,
    /// Named request classes with their own queue limits.
    pub classes: Vec<ClassConfig>,
    /// Most sessions remembered per model (default 65,536).
    pub sessions_max: usize,
    /// How long an idle session stays bound, in ms (default 300,000).
    pub lease_ttl_ms: u64,
    /// `hard` (default: a session never moves while its worker is available, and
    /// re-binds when it is ejected, draining or gone), `soft` (also re-binds when the
    /// worker is ineligible for a request) or `cost` (the binding places nothing: the kv
    /// cost weighs the session's worker, whose cache already counts, against the others,
    /// and the session follows its latest request).
    #[serde(deserialize_with = "from_str")]
    pub affinity_mode: AffinityModeName,
    /// Requests tracked per model: booked, streaming, queued or waiting (default 65,536).
    pub requests_max: usize,
    /// Prompt-end blocks remembered per model, to tell a conversation's next turn from a
    /// new one that shares only a system prompt (default 16,384; 0 remembers none and
    /// reads every short prefix on one worker as a conversation's).
    pub prompt_ends_max: usize,
    /// A booking older than this is dropped as if finished, in ms (default 900,000);
    /// keep it above `limits.request_timeout_ms`.
    pub request_age_max_ms: u64,
    /// A worker with more queued prefill tokens than this is busy (default 0: no bound).
    pub prefill_tokens_max: u64,
    /// A worker with more queued prefill tokens than this many batches is busy
    /// (default 4.0; 0 disables).
    pub prefill_tokens_frac_of_batch: f64,
    /// A worker holding more than this fraction of its KV blocks is busy (default 0.95;
    /// 0 disables).
    pub decode_blocks_frac_of_kv: f64,
    /// Blocks of prefill credited per cached block (default 1.0; 0 ignores the cache).
    pub overlap_credit: f64,
    /// Weight of the prefill term of the kv cost (default 1.0).
    pub prefill_load_scale: f64,
    /// Share of the prefill pass under way the kv cost still credits a worker with once
    /// the engine timing runs more than three passes ahead of its first tokens, 0 to 1
    /// (default 0.5): an engine far slower than its timing is not where the timing puts
    /// it. 1 trusts the timing.
    pub overdue_pass_share: f64,
    /// Cost per running request (default 0.0).
    pub active_request_weight: f64,
    /// Cost per request a worker runs beyond `excess_over_mean` times the workers' mean,
    /// in ms (default 20; 0 turns it off): it spreads a hot document's questions once its
    /// holder's pile is large, and moves nothing while load is even (the fleet
    /// benchmark's README has figures).
    pub excess_ms_per_request: f64,
    /// Multiple of the workers' mean of running requests past which
    /// `excess_ms_per_request` charges (default 3.0).
    pub excess_over_mean: f64,
    /// Running requests a worker must pass before `excess_ms_per_request` charges it,
    /// however low the mean (default 36).
    pub excess_requests_min: u32,
    /// Workers' mean of running requests past which `excess_requests_min` falls with the
    /// square of this over the mean (default 4.5; 0 keeps it fixed): a busier fleet
    /// spreads a hot document sooner.
    pub excess_floor_mean_requests: f64,
    /// Wait charged per KV block a worker would hold past 0.9 of its capacity, in ms
    /// (default 5.0): what turns work away from a worker whose memory is running out.
    pub memory_ms_per_block: f64,
    /// Sampling temperature of the kv cost; 0 picks the cheapest (default 0.0).
    pub temperature: f64,
    /// The engines' timing the kv cost predicts with: `gpu` (default; vLLM on a GPU, the
    /// mocker's fit) or `vllm-cpu` (vLLM's CPU build, one core a server).
    #[serde(deserialize_with = "from_str")]
    pub engine_timing: EngineTimingName,
    /// Extra wait charged a worker per second it has been idle, in ms, overriding the
    /// engine timing's (`gpu` 0, `vllm-cpu` 20): an idle CPU engine answers slower.
    pub cold_ms_per_idle_s: Option<f64>,
    /// Most that charge, in ms, overriding the engine timing's (`gpu` 0, `vllm-cpu` 250).
    pub cold_ms_max: Option<f64>,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        let ttft = router_core::TtftWeights::default();
        RoutingConfig {
            mode: RouterMode::Kv,
            block_size: BlockSize::DEFAULT.tokens(),
            approximate: true,
            queue_timeout_ms: 30_000,
            queued_max: 4096,
            queue_order: QueueOrderName(QueueOrder::Fcfs),
            classes: Vec::new(),
            sessions_max: 65_536,
            lease_ttl_ms: 300_000,
            affinity_mode: AffinityModeName(AffinityMode::Hard),
            requests_max: 65_536,
            prompt_ends_max: 16_384,
            request_age_max_ms: 900_000,
            prefill_tokens_max: 0,
            prefill_tokens_frac_of_batch: 4.0,
            decode_blocks_frac_of_kv: 0.95,
            overlap_credit: 1.0,
            prefill_load_scale: 1.0,
            overdue_pass_share: ttft.overdue_pass_share,
            active_request_weight: 0.0,
            excess_ms_per_request: ttft.excess_ms_per_request,
            excess_over_mean: ttft.excess_over_mean,
            excess_requests_min: ttft.excess_requests_min,
            excess_floor_mean_requests: ttft.excess_floor_mean_requests,
            memory_ms_per_block: ttft.memory_ms_per_block,
            temperature: 0.0,
            engine_timing: EngineTimingName::Gpu,
            cold_ms_per_idle_s: None,
            cold_ms_max: None,
        }
    }
}

/// `[replica]`: this proxy is one of several replicas fronting the same workers. Each
/// follows the workers' KV events itself; in-flight load and session bindings travel
/// over NATS. Losing NATS degrades to routing on local load, never to an outage.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    /// This replica's name, unique among the cluster's replicas (required).
    pub id: String,
    /// The NATS server (default `nats://127.0.0.1:4222`).
    #[serde(default = "nats_url")]
    pub nats_url: String,
    /// Replicas of one cluster share state; subjects are `kvroute.<cluster>.*`
    /// (default `default`; letters, digits, `-`, `_`).
    #[serde(default = "cluster")]
    pub cluster: String,
    /// A peer silent this long is presumed gone and its load dropped, in ms (default
    /// 5,000); keep it several heartbeats long.
    #[serde(default = "silence_ms")]
    pub replica_silence_max_ms: u64,
    /// Time between heartbeats, in ms (default 1,000).
    #[serde(default = "heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// Peers' in-flight requests remembered per model (default 65,536).
    #[serde(default = "remote_requests_max")]
    pub remote_requests_max: usize,
}

fn nats_url() -> String {
    "nats://127.0.0.1:4222".into()
}
fn cluster() -> String {
    "default".into()
}
fn silence_ms() -> u64 {
    5_000
}
fn heartbeat_ms() -> u64 {
    1_000
}
fn remote_requests_max() -> usize {
    65_536
}

impl ReplicaConfig {
    /// The replica adapter's options.
    pub fn options(&self) -> kvroute_replica::ReplicaOptions {
        kvroute_replica::ReplicaOptions {
            name: self.id.clone(),
            nats_url: self.nats_url.clone(),
            cluster: self.cluster.clone(),
            heartbeat_ms: self.heartbeat_ms,
            ..kvroute_replica::ReplicaOptions::default()
        }
    }
}

/// A request class (set by trusted clients with `kvroute.policy_class`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// The class name.
    pub name: String,
    /// Most requests of the class queued at once.
    pub queued_requests_max: Option<u32>,
    /// Most prompt tokens of the class queued at once.
    pub queued_prompt_tokens_max: Option<u64>,
}

/// One model: a pool of workers with its own router.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients send as `model`.
    pub name: String,
    /// Overrides `router.block_size` for this model.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Overrides `router.mode` for this model.
    #[serde(default, deserialize_with = "opt_from_str")]
    pub mode: Option<RouterMode>,
    /// LoRA adapters the pool's workers serve; a request naming one goes to this pool and
    /// hashes its prompt salted by the adapter's name.
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    /// Where the binary loads this model's tokenizer from: a local folder with
    /// `tokenizer.json` and `tokenizer_config.json` (nothing is downloaded). Without one,
    /// routing hashes the prompt's bytes, which a real engine's KV events never match, so
    /// the model's router predicts caches from its own decisions instead.
    #[serde(default)]
    pub tokenizer: Option<String>,
    /// The engine's `--model` (a path or a hub id), which vLLM hashes into the
    /// identifier of every image it is sent; default the `tokenizer` value. Only read
    /// for a model whose folder says it takes images (`config.json`'s `vision_config`).
    #[serde(default)]
    pub engine_model_id: Option<String>,
    /// Disaggregated serving: how a request is split between a prefill and a decode
    /// worker, `vllm-nixl` or `sglang-bootstrap` (default none: every request runs
    /// aggregated, and prefill workers are refused).
    #[serde(default, deserialize_with = "opt_from_str")]
    pub disagg_protocol: Option<DisaggProtocol>,
    /// With `disagg_protocol`: prompts whose uncached part is shorter than this many
    /// tokens run aggregated on a decode worker (default 2,048).
    #[serde(default)]
    pub disagg_isl_min_tokens: Option<u32>,
    /// With `disagg_protocol`: a topology label (e.g. `node` or `rack`) a decode worker
    /// must share with its request's prefill worker, so the KV moves over a short link
    /// (default none: any decode worker). A prefill worker without it constrains nothing.
    #[serde(default)]
    pub disagg_same_label: Option<String>,
    /// Sends a single-string `/v1/completions` prompt to the worker as the token ids
    /// kvroute already made of it, so the engine does not tokenize it again (default
    /// false). Set it only when `tokenizer` holds the engine's own tokenizer files: the
    /// ids become the model's input. Needs `tokenizer`; an adapter's requests, `echo`,
    /// and a body that sets `add_special_tokens` or `prompt_embeds` keep their text.
    #[serde(default)]
    pub forward_token_ids: bool,
    /// Most words the tokenizer's word memo keeps, for prompt text its prefix cache has
    /// not seen (default 131,072; 0 turns it off). Needs `tokenizer`.
    #[serde(default)]
    pub tokenizer_words_max: Option<usize>,
}

impl Default for ModelConfig {
    /// A model named `""` (give it a name) with every optional key unset.
    fn default() -> Self {
        ModelConfig {
            name: String::new(),
            block_size: None,
            mode: None,
            lora_adapters: Vec::new(),
            tokenizer: None,
            engine_model_id: None,
            disagg_protocol: None,
            disagg_isl_min_tokens: None,
            disagg_same_label: None,
            forward_token_ids: false,
            tokenizer_words_max: None,
        }
    }
}

/// The wire protocol that drives a model's prefill and decode workers. Exhaustive: a
/// new protocol comes with the proxy's code that speaks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DisaggProtocol {
    /// vLLM with the NIXL connector: prefill answers `kv_transfer_params`, which the
    /// decode request then carries.
    VllmNixl,
    /// SGLang: both workers get the request at once with `bootstrap_host`,
    /// `bootstrap_port` and `bootstrap_room`, and pair through the prefill worker's
    /// bootstrap server.
    SglangBootstrap,
}

impl DisaggProtocol {
    /// The name the configuration uses.
    pub const fn as_str(self) -> &'static str {
        match self {
            DisaggProtocol::VllmNixl => "vllm-nixl",
            DisaggProtocol::SglangBootstrap => "sglang-bootstrap",
        }
    }
}

impl FromStr for DisaggProtocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vllm-nixl" => Ok(DisaggProtocol::VllmNixl),
            "sglang-bootstrap" => Ok(DisaggProtocol::SglangBootstrap),
            _ => Err(format!("unknown disaggregation protocol {s:?}; expected vllm-nixl or sglang-bootstrap")),
        }
    }
}

impl fmt::Display for DisaggProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One worker: an OpenAI-compatible server of one model.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Unique id; also the value of the `x-kvroute-worker` response header.
    pub id: u64,
    /// Base URL, `http://host:port` or `https://host:port` with an optional path
    /// prefix; `https` workers are verified against `[upstream_tls]`.
    pub url: WorkerUrl,
    /// The model it serves (a `[[models]]` name).
    pub model: String,
    /// `aggregated` (default), `prefill` or `decode`.
    #[serde(default = "aggregated", deserialize_with = "from_str", serialize_with = "display")]
    pub role: WorkerRole,
    /// Data-parallel ranks (default 1).
    #[serde(default = "one")]
    pub dp_ranks: u32,
    /// Relative capacity (default 1).
    #[serde(default = "one")]
    pub weight: u32,
    /// Tokens per forward pass, per rank (default 8,192).
    #[serde(default = "batch")]
    pub max_batched_tokens: u32,
    /// KV-cache capacity in blocks, per rank (default 16,384).
    #[serde(default = "kv_blocks")]
    pub kv_blocks: u32,
    /// Topology labels, e.g. `{ node = "n7" }`.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Taints, e.g. `[{ key = "maintenance", effect = "NoSchedule" }]`.
    #[serde(default)]
    pub taints: Vec<TaintConfig>,
    /// The worker's KV-event ZeroMQ PUB endpoint, e.g. `tcp://10.0.0.5:5557`. Without
    /// one, the router predicts the worker's cache from its own decisions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// Its ROUTER replay endpoint, used to fill gaps in the event stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// The port of a prefill worker's bootstrap server (SGLang's
    /// `--disaggregation-bootstrap-port`), on the host of its `url`. Required for the
    /// prefill workers of a `sglang-bootstrap` model, refused on other workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

/// A taint on a worker.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TaintConfig {
    /// The key.
    pub key: String,
    /// The value (default empty).
    #[serde(default)]
    pub value: String,
    /// `NoSchedule` or `PreferNoSchedule`.
    #[serde(deserialize_with = "from_str", serialize_with = "display")]
    pub effect: TaintEffect,
}

fn aggregated() -> WorkerRole {
    WorkerRole::Aggregated
}
fn one() -> u32 {
    1
}
fn batch() -> u32 {
    8192
}
fn kv_blocks() -> u32 {
    16_384
}

impl WorkerConfig {
    /// The router's view of this worker.
    pub fn spec(&self) -> WorkerSpec {
        let mut s = WorkerSpec::new(WorkerId(self.id), self.role);
        s.dp_ranks = Some(self.dp_ranks);
        s.weight = self.weight;
        s.max_batched_tokens = self.max_batched_tokens;
        s.kv_blocks = self.kv_blocks;
        s.labels = self.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        s.taints = self.taints();
        s
    }

    /// Its taints in the router's type.
    pub fn taints(&self) -> Vec<Taint> {
        self.taints.iter().map(|t| Taint { key: t.key.clone(), value: t.value.clone(), effect: t.effect }).collect()
    }
}

/// A worker's base URL: `http` or `https`, an authority, and an optional path prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerUrl {
    https: bool,
    authority: String,
    prefix: String,
}

impl WorkerUrl {
    /// The URI of `path_and_query` on this worker.
    pub fn join(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        let uri = format!("{}://{}{}{}", self.scheme(), self.authority, self.prefix, path_and_query);
        Ok(http::Uri::try_from(uri)?)
    }

    /// `host:port`.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// Whether the worker is reached over TLS.
    pub fn is_https(&self) -> bool {
        self.https
    }

    fn scheme(&self) -> &'static str {
        if self.https {
            "https"
        } else {
            "http"
        }
    }
}

impl FromStr for WorkerUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let uri: http::Uri = s.parse().map_err(|e| format!("invalid worker URL {s:?}: {e}"))?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(format!("worker URL {s:?} must start with http:// or https://")),
        };
        let Some(authority) = uri.authority() else {
            return Err(format!("worker URL {s:?} has no host"));
        };
        if uri.query().is_some() {
            return Err(format!("worker URL {s:?} must not carry a query"));
        }
        let prefix = uri.path().trim_end_matches('/').to_string();
        Ok(WorkerUrl { https, authority: authority.to_string(), prefix })
    }
}

impl fmt::Display for WorkerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}{}", self.scheme(), self.authority, self.prefix)
    }
}

impl<'de> Deserialize<'de> for WorkerUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for WorkerUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// `fcfs` or `wspt`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueOrderName(pub QueueOrder);

impl FromStr for QueueOrderName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fcfs" => Ok(QueueOrderName(QueueOrder::Fcfs)),
            "wspt" => Ok(QueueOrderName(QueueOrder::Wspt)),
            _ => Err(format!("unknown queue order {s:?}; expected fcfs or wspt")),
        }
    }
}

/// `gpu` or `vllm-cpu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineTimingName {
    /// vLLM on a GPU (the core's default timing model).
    Gpu,
    /// vLLM's CPU build, one core a server.
    VllmCpu,
}

impl EngineTimingName {
    /// The core's timing model of these engines.
    pub fn model(self) -> router_core::TtftModel {
        match self {
            EngineTimingName::Gpu => router_core::TtftModel::default(),
            EngineTimingName::VllmCpu => router_core::TtftModel::vllm_cpu(),
        }
    }
}

impl FromStr for EngineTimingName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "gpu" => Ok(EngineTimingName::Gpu),
            "vllm-cpu" => Ok(EngineTimingName::VllmCpu),
            _ => Err(format!("unknown engine timing {s:?}; expected gpu or vllm-cpu")),
        }
    }
}

/// `hard` or `soft`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AffinityModeName(pub AffinityMode);

impl FromStr for AffinityModeName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "hard" => Ok(AffinityModeName(AffinityMode::Hard)),
            "soft" => Ok(AffinityModeName(AffinityMode::Soft)),
            "cost" => Ok(AffinityModeName(AffinityMode::Cost)),
            _ => Err(format!("unknown affinity mode {s:?}; expected hard, soft or cost")),
        }
    }
}

fn from_str<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: fmt::Display,
{
    let s = String::deserialize(d)?;
    s.parse().map_err(serde::de::Error::custom)
}

fn opt_from_str<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: fmt::Display,
{
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(s) => s.parse().map(Some).map_err(serde::de::Error::custom),
    }
}

fn display<S: Serializer, T: fmt::Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Why a configuration was refused.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    Read {
        /// The path.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The TOML is malformed, has an unknown key, or a value of the wrong type.
    Parse {
        /// 1-based line of the offending key or value, when known.
        line: Option<usize>,
        /// The text of that line.
        source_line: String,
        /// What is wrong.
        message: String,
    },
    /// A value is well-formed but not acceptable.
    Invalid {
        /// The key, e.g. `workers[2].model`.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A `[[tenants]]` entry or one of its keys is refused.
    Tenant(crate::tenants::TenantError),
    /// The key is set, but the server reading the file does not act on it.
    NotHonoured {
        /// The key, e.g. `retry` or `models[0].disagg_protocol`.
        key: String,
        /// Why the server does not act on it.
        reason: &'static str,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read { path, source } => write!(f, "cannot read {path}: {source}"),
            ConfigError::Parse { line: Some(l), source_line, message } => {
                write!(f, "line {l}: `{source_line}`: {message}")
            }
            ConfigError::Parse { line: None, message, .. } => write!(f, "{message}"),
            ConfigError::Invalid { key, message } => write!(f, "{key}: {message}"),
            ConfigError::Tenant(e) => write!(f, "{e}"),
            ConfigError::NotHonoured { key, reason } => write!(f, "{key}: not honoured here ({reason}); remove it"),
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Read { source, .. } => Some(source),
            ConfigError::Tenant(e) => Some(e),
            ConfigError::Parse { .. } | ConfigError::Invalid { .. } | ConfigError::NotHonoured { .. } => None,
        }
    }
}

mod discovery;
mod load;
mod otel;
mod refuse;
mod tls;
pub use discovery::{annotations, DiscoverySection, KubernetesDiscovery};
pub use load::router_config;
pub use otel::TracingConfig;
pub use refuse::RefusedKey;
pub use tls::{TlsConfig, UpstreamTlsConfig};
