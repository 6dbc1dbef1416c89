//! The worker's Prometheus metrics, named as vLLM names them where vLLM has one, so a
//! router that scrapes vLLM workers reads a simulated worker unchanged.
//!
//! The engine task sets the gauges after every pass boundary; handlers and the
//! publisher bump the counters, and each generation's response times its first and
//! last token into the latency histograms. Encoding is the OpenMetrics text format.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Every metric the worker exports; cheap to clone (each field is an `Arc`).
#[derive(Clone, Default)]
pub(crate) struct Metrics {
    pub(crate) running: Gauge,
    pub(crate) waiting: Gauge,
    pub(crate) kv_usage: Gauge<f64, AtomicU64>,
    pub(crate) active_blocks: Gauge,
    pub(crate) inactive_blocks: Gauge,
    pub(crate) total_blocks: Gauge,
    pub(crate) requests: Counter,
    pub(crate) finished: Counter,
    pub(crate) rejected: Counter,
    pub(crate) prefix_queries: Counter,
    pub(crate) prefix_hits: Counter,
    pub(crate) prompt_tokens: Counter,
    pub(crate) generation_tokens: Counter,
    pub(crate) event_batches: Counter,
    pub(crate) event_batches_dropped: Counter,
    pub(crate) events_missing_tokens: Counter,
    /// Wall seconds from a generation request's arrival to its first token.
    pub(crate) ttft: Latency,
    /// Wall seconds from a generation request's arrival to its last token.
    pub(crate) e2e: Latency,
}

/// A latency histogram in seconds, with vLLM's buckets for its request latencies, so
/// the same queries read a simulated worker and a real one.
#[derive(Clone)]
pub(crate) struct Latency(pub(crate) Histogram);

impl Default for Latency {
    fn default() -> Self {
        const BUCKETS_S: [f64; 19] = [
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0,
        ];
        Latency(Histogram::new(BUCKETS_S))
    }
}

impl Metrics {
    /// A registry exporting these metrics.
    pub(crate) fn registry(&self) -> Registry {
        let mut r = Registry::default();
        r.register("vllm:num_requests_running", "Requests in the running batch", self.running.clone());
        r.register("vllm:num_requests_waiting", "Requests waiting for admission", self.waiting.clone());
        r.register(
            "vllm:kv_cache_usage_perc",
            "Share of KV blocks held by running requests (0-1)",
            self.kv_usage.clone(),
        );
        r.register("kvroute_sim:kv_active_blocks", "KV blocks held by running requests", self.active_blocks.clone());
        r.register("kvroute_sim:kv_inactive_blocks", "Cached KV blocks no request holds", self.inactive_blocks.clone());
        r.register("kvroute_sim:kv_total_blocks", "KV capacity in blocks", self.total_blocks.clone());
        r.register("kvroute_sim:requests", "Generation requests received", self.requests.clone());
        r.register("vllm:request_success", "Requests finished", self.finished.clone());
        r.register(
            "kvroute_sim:requests_rejected",
            "Requests refused (bad input, too long, overloaded)",
            self.rejected.clone(),
        );
        r.register(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            self.prefix_queries.clone(),
        );
        r.register("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache", self.prefix_hits.clone());
        r.register("vllm:prompt_tokens", "Prompt tokens admitted", self.prompt_tokens.clone());
        r.register("vllm:generation_tokens", "Tokens generated", self.generation_tokens.clone());
        r.register("kvroute_sim:kv_event_batches", "KV event batches published", self.event_batches.clone());
        r.register(
            "kvroute_sim:kv_event_batches_dropped",
            "KV event batches dropped because the publisher queue was full",
            self.event_batches_dropped.clone(),
        );
        r.register(
            "kvroute_sim:kv_events_missing_tokens",
            "BlockStored events whose token ids were unknown (sent without those blocks)",
            self.events_missing_tokens.clone(),
        );
        r.register(
            "vllm:time_to_first_token_seconds",
            "Wall seconds from a request's arrival to its first token",
            self.ttft.0.clone(),
        );
        r.register(
            "vllm:e2e_request_latency_seconds",
            "Wall seconds from a request's arrival to its last token",
            self.e2e.0.clone(),
        );
        r
    }
}

/// Renders the registry as OpenMetrics text.
pub(crate) fn render(registry: &Registry) -> String {
    let mut s = String::with_capacity(4096);
    // Writing into a String cannot fail; an Err would only mean a metric's own encoder
    // refused, and then a partial page is still the most useful answer.
    if encode(&mut s, registry).is_err() {
        tracing::warn!("metrics encoding failed; serving a partial page");
    }
    s
}
