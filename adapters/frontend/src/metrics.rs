//! Prometheus metrics. Counters and histograms are updated on the request path; gauges
//! of the fleet (queue depth, per-worker load, affinity table) are read from the
//! routers' snapshots at scrape time.
//!
//! Labels are bounded sets only: model names from the config, worker ids, outcomes,
//! status codes, stages, queue classes the router bounds. Never a session id, a prompt
//! or a client-chosen model name.
//!
//! The per-request series (a model's latency histograms, a worker's `ok` counter) are
//! looked up once and kept as handles, so the request path builds no label strings.
//!
//! Worker ids come and go (epp files every pod as a new worker), so a worker's series
//! are removed at the first scrape after it leaves the fleet ([`workers`]).

mod ingest;
mod tokenizer_cache;
mod tokenizer_check;
mod workers;

pub use ingest::IngestRow;
use workers::{Series, WorkerLabels, WorkerSeries};

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, linear_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use router_core::Health;

use crate::fleet::Fleet;

/// A request's end: model, worker (`none` if it reached none), outcome and status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The pool, or `unknown`.
    pub model: String,
    /// The worker id, or `none`.
    pub worker: String,
    /// `ok`, `upstream_error`, `stream_broken`, `cancelled`, `timeout` or an error code.
    pub outcome: String,
    /// The HTTP status sent to the client.
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabels {
    stage: &'static str,
}

/// A tenant's name (bounded by `[[tenants]]`) and what happened to its request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabels {
    tenant: String,
    outcome: &'static str,
}

/// A tenant's name and why its request was refused.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantRejectLabels {
    tenant: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectLabels {
    model: String,
    class: String,
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FieldLabels {
    field: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    model: String,
    worker: String,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FallbackLabels {
    model: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MigrationLabels {
    model: String,
    reason: &'static str,
    outcome: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// One tenant's series that every request of it counts into (see
/// [`Metrics::tenant_series`]); clones share the series.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TenantSeries {
    /// `kvroute_tenant_requests_total{outcome="ok"}`.
    pub ok: Counter,
    /// `kvroute_tenant_prompt_tokens_total`.
    pub prompt_tokens: Counter,
    /// `kvroute_tenant_charged_tokens_total`.
    pub charged_tokens: Counter,
    /// `kvroute_tenant_queue_wait_seconds`.
    pub queue_wait: Histogram,
}

/// Every metric the proxy exports.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    ttft: HistogramFamily<ModelLabels>,
    itl: HistogramFamily<ModelLabels>,
    overhead: HistogramFamily<StageLabels>,
    overlap_ratio: HistogramFamily<ModelLabels>,
    not_max_overlap: Family<ModelLabels, Counter>,
    rejections: Family<RejectLabels, Counter>,
    tenant_requests: Family<TenantLabels, Counter>,
    tenant_rejections: Family<TenantRejectLabels, Counter>,
    tenant_prompt_tokens: Family<TenantLabels, Counter>,
    tenant_charged_tokens: Family<TenantLabels, Counter>,
    tenant_queue_wait: HistogramFamily<TenantLabels>,
    untrusted: Family<FieldLabels, Counter>,
    retries: Family<FallbackLabels, Counter>,
    first_byte_waits_extended: Family<ModelLabels, Counter>,
    migrations: Family<MigrationLabels, Counter>,
    failures: Family<FailureLabels, Counter>,
    ejections: Family<FailureLabels, Counter>,
    fallbacks: Family<FallbackLabels, Counter>,
    sent_as_ids: Family<ModelLabels, Counter>,
    silent_streams: Family<WorkerLabels, Counter>,
    e2e: HistogramFamily<WorkerLabels>,
    prompt_tokens: HistogramFamily<WorkerLabels>,
    cached_tokens: HistogramFamily<WorkerLabels>,
    /// Every series naming a worker, so they leave with it.
    worker_series: WorkerSeries,
    /// The fleet, to tell which workers left.
    fleet: Arc<Fleet>,
    /// The KV-event streams' last reported counters.
    ingest: ingest::IngestRows,
    disagg_plans: Family<PlanLabels, Counter>,
    disagg_aborts: Family<AbortLabels, Counter>,
    /// Connections refused at `limits.connections_max`.
    connections_refused: Counter,
    /// Discovery steps that failed, by kind.
    discovery_troubles: Family<KindLabels, Counter>,
    /// Requests served per worker id, cumulative.
    served: std::sync::Mutex<BTreeMap<u64, u64>>,
    /// Resolved per-model series, at most [`MODEL_HANDLES_MAX`].
    handles: RwLock<Vec<(String, Arc<ModelHandles>)>>,
    /// The request path's stages, resolved at start.
    stages: Vec<(&'static str, Histogram)>,
}

/// Stages every request passes through; others are looked up by name.
const STAGES: [&str; 4] = ["parse", "tokenize", "route", "queue_wait"];

/// Models whose series are kept resolved; past this, lookups go through the families.
const MODEL_HANDLES_MAX: usize = 256;

/// One model's per-request series.
struct ModelHandles {
    ttft: Histogram,
    itl: Histogram,
    overlap_ratio: Histogram,
    not_max_overlap: Counter,
    /// `kvroute_requests{outcome="ok"}` by worker and status.
    ok: RwLock<BTreeMap<(u64, u16), Counter>>,
    /// The per-worker request histograms.
    workers: RwLock<BTreeMap<u64, Arc<WorkerHandles>>>,
}

/// One worker's request histograms within a model.
struct WorkerHandles {
    e2e: Histogram,
    prompt_tokens: Histogram,
    cached_tokens: Histogram,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PlanLabels {
    model: String,
    plan: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AbortLabels {
    model: String,
    aborted: &'static str,
    cause: &'static str,
}

fn ttft_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 14))
}
fn itl_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 14))
}
fn overhead_buckets() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 24))
}
fn ratio_buckets() -> Histogram {
    Histogram::new(linear_buckets(0.1, 0.1, 10))
}
/// 10 ms to about 5.5 minutes.
fn e2e_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.0, 16))
}
/// 16 to 131,072 tokens.
fn token_buckets() -> Histogram {
    Histogram::new(exponential_buckets(16.0, 2.0, 14))
}

impl Metrics {
    /// Registers every metric, with a collector reading `fleet` at scrape time.
    pub fn new(fleet: Arc<Fleet>) -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            requests: Family::default(),
            ttft: Family::new_with_constructor(ttft_buckets),
            itl: Family::new_with_constructor(itl_buckets),
            overhead: Family::new_with_constructor(overhead_buckets),
            overlap_ratio: Family::new_with_constructor(ratio_buckets),
            not_max_overlap: Family::default(),
            rejections: Family::default(),
            tenant_requests: Family::default(),
            tenant_rejections: Family::default(),
            tenant_prompt_tokens: Family::default(),
            tenant_charged_tokens: Family::default(),
            tenant_queue_wait: Family::new_with_constructor(overhead_buckets),
            untrusted: Family::default(),
            retries: Family::default(),
            first_byte_waits_extended: Family::default(),
            migrations: Family::default(),
            failures: Family::default(),
            ejections: Family::default(),
            fallbacks: Family::default(),
            sent_as_ids: Family::default(),
            silent_streams: Family::default(),
            e2e: Family::new_with_constructor(e2e_buckets),
            prompt_tokens: Family::new_with_constructor(token_buckets),
            cached_tokens: Family::new_with_constructor(token_buckets),
            worker_series: WorkerSeries::default(),
            fleet: fleet.clone(),
            ingest: Default::default(),
            disagg_plans: Family::default(),
            disagg_aborts: Family::default(),
            connections_refused: Counter::default(),
            discovery_troubles: Family::default(),
            served: std::sync::Mutex::new(BTreeMap::new()),
            handles: RwLock::new(Vec::new()),
            stages: Vec::new(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register("kvroute_requests", "Proxied requests by model, worker, outcome and status", m.requests.clone());
        r.register("kvroute_ttft_seconds", "Time to first response byte, seen at the proxy", m.ttft.clone());
        r.register("kvroute_itl_seconds", "Time between streamed chunks, seen at the proxy", m.itl.clone());
        r.register(
            "kvroute_routing_overhead_microseconds",
            "Time the proxy spends per stage before forwarding",
            m.overhead.clone(),
        );
        r.register(
            "kvroute_overlap_ratio",
            "Share of the prompt's blocks cached on the chosen worker",
            m.overlap_ratio.clone(),
        );
        r.register(
            "kvroute_chosen_not_max_overlap",
            "Decisions that chose a worker with less than the best cache overlap",
            m.not_max_overlap.clone(),
        );
        r.register("kvroute_queue_rejections", "Requests the admission queue refused", m.rejections.clone());
        r.register("kvroute_tenant_requests", "Requests answered per tenant, by outcome", m.tenant_requests.clone());
        r.register(
            "kvroute_tenant_rejections",
            "Requests of a tenant refused, by reason (the limit, or forbidden)",
            m.tenant_rejections.clone(),
        );
        r.register("kvroute_tenant_prompt_tokens", "Prompt tokens admitted per tenant", m.tenant_prompt_tokens.clone());
        r.register(
            "kvroute_tenant_charged_tokens",
            "Tokens charged to a tenant's tokens_per_minute, trued up to the usage at each request's end",
            m.tenant_charged_tokens.clone(),
        );
        r.register(
            "kvroute_tenant_queue_wait_seconds",
            "Time a tenant's requests waited in the admission queue",
            m.tenant_queue_wait.clone(),
        );
        r.register(
            "kvroute_untrusted_fields_stripped",
            "Routing fields removed from untrusted requests",
            m.untrusted.clone(),
        );
        r.register(
            "kvroute_retries",
            "Tries re-sent to another worker before the first byte, by reason",
            m.retries.clone(),
        );
        r.register(
            "kvroute_first_byte_waits_extended",
            "First-byte timeouts on a worker that served others meanwhile (busy, not wedged): the try waited on instead of being retried",
            m.first_byte_waits_extended.clone(),
        );
        r.register(
            "kvroute_migrations",
            "Streams continued on another worker, by reason and outcome",
            m.migrations.clone(),
        );
        r.register("kvroute_upstream_failures", "Failures counted against workers", m.failures.clone());
        r.register("kvroute_worker_ejections", "Times a worker was ejected", m.ejections.clone());
        r.register(
            "kvroute_tokenizer_fallbacks",
            "Requests routed on hashed bytes instead of token ids",
            m.fallbacks.clone(),
        );
        r.register(
            "kvroute_prompts_sent_as_token_ids",
            "Completion prompts forwarded as kvroute's token ids in place of their text",
            m.sent_as_ids.clone(),
        );
        r.register(
            "kvroute_kv_event_streams_silent",
            "Times a worker's KV-event stream was found silent while it served requests",
            m.silent_streams.clone(),
        );
        r.register(
            "kvroute_disagg_plans",
            "Requests of disaggregated models by plan: split, or the reason they ran aggregated",
            m.disagg_plans.clone(),
        );
        r.register(
            "kvroute_disagg_aborts",
            "Paired phases cut short because the other phase failed",
            m.disagg_aborts.clone(),
        );
        r.register(
            "kvroute_connections_refused",
            "Connections refused because limits.connections_max connections were already open",
            m.connections_refused.clone(),
        );
        r.register(
            "kvroute_discovery_troubles",
            "Discovery steps that failed, by kind: pod_not_a_worker (bad annotation, no port or model), \
             pod_cannot_add, watch (retried with back-off)",
            m.discovery_troubles.clone(),
        );
        r.register(
            "kvroute_request_duration_seconds",
            "Time from a request's arrival to its stream's end, by model and worker, seen at the proxy",
            m.e2e.clone(),
        );
        r.register(
            "kvroute_prompt_tokens",
            "Prompt tokens of routed requests, by model and chosen worker",
            m.prompt_tokens.clone(),
        );
        r.register(
            "kvroute_cached_tokens",
            "Prompt tokens the router expected cached on the chosen worker (overlap blocks times block size)",
            m.cached_tokens.clone(),
        );
        r.register_collector(Box::new(ingest::IngestCollector { rows: m.ingest.clone(), fleet: fleet.clone() }));
        r.register_collector(Box::new(tokenizer_check::TokenizerCheckCollector(fleet.clone())));
        r.register_collector(Box::new(FleetCollector { fleet }));
        let stages =
            STAGES.iter().map(|&stage| (stage, m.overhead.get_or_create(&StageLabels { stage }).clone())).collect();
        Metrics { registry, stages, ..m }
    }

    /// Adds the replica link's metrics: `kvroute_replica_nats_connected` (0 or 1), peers,
    /// update counters, and peers' in-flight requests per worker.
    pub fn register_replica(&mut self, replica: Arc<kvroute_replica::ReplicaHandle>, fleet: Arc<Fleet>) {
        self.registry.register_collector(Box::new(ReplicaCollector { replica, fleet }));
    }

    /// Adds `kvroute_trace_spans_dropped_total{reason}`: spans that never reached the
    /// OTLP collector (`queue_full` or `export_failed`).
    pub fn register_span_drops(&mut self, drops: crate::span_drops::SpanDrops) {
        self.registry.register(
            "kvroute_trace_spans_dropped",
            "Spans that never reached the OTLP collector, by reason: queue_full (tracing.spans_queued_max \
             spans already waiting or exporting), export_failed (refused or no answer in time)",
            drops.0,
        );
    }

    /// Adds the prefix-cache counters of every tokenizer in `tokenizers` that keeps one
    /// (`kvroute_tokenizer_cache_*`, by model), read at each scrape.
    pub fn register_tokenizers(&mut self, tokenizers: crate::tokenize::Tokenizers) {
        self.registry.register_collector(Box::new(tokenizer_cache::TokenizerCacheCollector(tokenizers)));
    }

    /// Adds `kvroute_tls_reloads_total{result}`: certificate reloads of `[tls]` that
    /// `loaded` or ended in an `error` (the previous certificate still serves).
    pub fn register_tls_reloads(&mut self, reloads: crate::tls::TlsReloads) {
        self.registry.register(
            "kvroute_tls_reloads",
            "Reloads of the [tls] certificate after its files changed, by result: loaded, or error (the \
             previous certificate still serves)",
            reloads.0,
        );
    }

    /// The Prometheus text exposition. First removes the series of workers that left.
    pub fn encode(&self) -> String {
        self.forget_departed();
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }

    /// `model`'s resolved series (`None` once [`MODEL_HANDLES_MAX`] models are held).
    fn model(&self, model: &str) -> Option<Arc<ModelHandles>> {
        {
            let held = self.handles.read().unwrap_or_else(PoisonError::into_inner);
            if let Some((_, h)) = held.iter().find(|(m, _)| m == model) {
                return Some(h.clone());
            }
        }
        let mut held = self.handles.write().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, h)) = held.iter().find(|(m, _)| m == model) {
            return Some(h.clone());
        }
        if held.len() >= MODEL_HANDLES_MAX {
            return None;
        }
        let labels = ModelLabels { model: model.into() };
        let h = Arc::new(ModelHandles {
            ttft: self.ttft.get_or_create(&labels).clone(),
            itl: self.itl.get_or_create(&labels).clone(),
            overlap_ratio: self.overlap_ratio.get_or_create(&labels).clone(),
            not_max_overlap: self.not_max_overlap.get_or_create(&labels).clone(),
            ok: RwLock::new(BTreeMap::new()),
            workers: RwLock::new(BTreeMap::new()),
        });
        held.push((model.to_string(), h.clone()));
        Some(h)
    }

    /// A request ended.
    pub fn request(&self, model: &str, worker: Option<u64>, outcome: &str, status: u16) {
        if let Some(w) = worker {
            *self.served.lock().unwrap_or_else(PoisonError::into_inner).entry(w).or_default() += 1;
            if outcome == "ok" {
                if let Some(h) = self.model(model) {
                    self.count_ok(&h, model, w, status);
                    return;
                }
            }
        }
        self.request_slow(model, worker, outcome, status);
    }

    /// Counts an `ok` request of `model` on `worker` with `status`.
    fn count_ok(&self, h: &ModelHandles, model: &str, worker: u64, status: u16) {
        if let Some(c) = h.ok.read().unwrap_or_else(PoisonError::into_inner).get(&(worker, status)) {
            c.inc();
            return;
        }
        let labels = RequestLabels { model: model.into(), worker: worker.to_string(), outcome: "ok".into(), status };
        let c = self.requests.get_or_create(&labels).clone();
        c.inc();
        self.worker_series.record(worker, Series::Request(labels));
        h.ok.write().unwrap_or_else(PoisonError::into_inner).insert((worker, status), c);
    }

    fn request_slow(&self, model: &str, worker: Option<u64>, outcome: &str, status: u16) {
        let id = worker;
        let worker = worker.map_or_else(|| "none".to_string(), |w| w.to_string());
        let labels = RequestLabels { model: model.into(), worker, outcome: outcome.into(), status };
        self.requests.get_or_create(&labels).inc();
        if let Some(id) = id {
            self.worker_series.record(id, Series::Request(labels));
        }
    }

    /// Requests each worker has served so far (for silent-stream detection).
    pub fn served_totals(&self) -> BTreeMap<u64, u64> {
        self.served.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// A worker's KV-event stream was silent while it served traffic.
    pub fn silent_stream(&self, model: &str, worker: u64) {
        let labels = WorkerLabels { model: model.into(), worker: worker.to_string() };
        self.silent_streams.get_or_create(&labels).inc();
        self.worker_series.record(worker, Series::Silent(labels));
    }

    /// Time to first byte.
    pub fn ttft(&self, model: &str, d: Duration) {
        match self.model(model) {
            Some(h) => h.ttft.observe(d.as_secs_f64()),
            None => self.ttft.get_or_create(&ModelLabels { model: model.into() }).observe(d.as_secs_f64()),
        }
    }

    /// Time between two chunks.
    pub fn itl(&self, model: &str, d: Duration) {
        match self.model(model) {
            Some(h) => h.itl.observe(d.as_secs_f64()),
            None => self.itl.get_or_create(&ModelLabels { model: model.into() }).observe(d.as_secs_f64()),
        }
    }

    /// Time spent in a routing stage.
    pub fn stage(&self, stage: &'static str, d: Duration) {
        let us = d.as_secs_f64() * 1e6;
        match self.stages.iter().find(|(s, _)| *s == stage) {
            Some((_, h)) => h.observe(us),
            None => self.overhead.get_or_create(&StageLabels { stage }).observe(us),
        }
    }

    /// A routing decision's cache overlap.
    pub fn decision(&self, model: &str, overlap_blocks: u32, max_overlap_blocks: u32, request_blocks: u32) {
        let ratio = (request_blocks > 0).then(|| f64::from(overlap_blocks) / f64::from(request_blocks));
        let not_max = overlap_blocks < max_overlap_blocks;
        if let Some(h) = self.model(model) {
            if let Some(r) = ratio {
                h.overlap_ratio.observe(r);
            }
            if not_max {
                h.not_max_overlap.inc();
            }
            return;
        }
        let labels = ModelLabels { model: model.into() };
        if let Some(r) = ratio {
            self.overlap_ratio.get_or_create(&labels).observe(r);
        }
        if not_max {
            self.not_max_overlap.get_or_create(&labels).inc();
        }
    }

    /// Tenant `tenant`'s per-request series, to be made once (at start) and kept: a
    /// request then counts into them without building labels.
    pub fn tenant_series(&self, tenant: &str) -> TenantSeries {
        let labels = |outcome| TenantLabels { tenant: tenant.into(), outcome };
        TenantSeries {
            ok: self.tenant_requests.get_or_create(&labels("ok")).clone(),
            prompt_tokens: self.tenant_prompt_tokens.get_or_create(&labels("admitted")).clone(),
            charged_tokens: self.tenant_charged_tokens.get_or_create(&labels("trued_up")).clone(),
            queue_wait: self.tenant_queue_wait.get_or_create(&labels("routed")).clone(),
        }
    }

    /// A request of tenant `tenant` (a configured name) answered with `outcome`.
    pub fn tenant_request(&self, tenant: &str, outcome: &'static str) {
        self.tenant_requests.get_or_create(&TenantLabels { tenant: tenant.into(), outcome }).inc();
    }

    /// A request of tenant `tenant` refused for `reason`.
    pub fn tenant_rejected(&self, tenant: &str, reason: &'static str) {
        self.tenant_rejections.get_or_create(&TenantRejectLabels { tenant: tenant.into(), reason }).inc();
    }

    /// A queue rejection.
    pub fn rejected(&self, model: &str, class: &str, limit: &'static str) {
        self.rejections.get_or_create(&RejectLabels { model: model.into(), class: class.into(), limit }).inc();
    }

    /// A routing field removed from an untrusted request.
    pub fn untrusted(&self, field: &'static str) {
        self.untrusted.get_or_create(&FieldLabels { field }).inc();
    }

    /// A retry: `connect`, `reset`, `status_5xx`, `status_429`, `first_byte_timeout`, `ejected`.
    pub fn retry(&self, model: &str, reason: &'static str) {
        self.retries.get_or_create(&FallbackLabels { model: model.into(), reason }).inc();
    }

    /// A try outlived its first-byte timeout on a worker that was serving others, and
    /// waits another period there.
    pub fn first_byte_wait_extended(&self, model: &str) {
        self.first_byte_waits_extended.get_or_create(&ModelLabels { model: model.into() }).inc();
    }

    /// A migration attempt (`reason`: `stream_broken`, `idle_timeout`) and its `outcome`
    /// (`resumed`, `refused_structured`, `refused_fidelity`, `attempts_exhausted`, `deadline`, `no_worker`,
    /// `unsupported`).
    pub fn migration(&self, model: &str, reason: &'static str, outcome: &'static str) {
        self.migrations.get_or_create(&MigrationLabels { model: model.into(), reason, outcome }).inc();
    }

    /// A failure counted against a worker: `connect`, `status_5xx`, `stream_broken`, `probe`.
    pub fn failure(&self, model: &str, worker: u64, kind: &'static str) {
        let labels = FailureLabels { model: model.into(), worker: worker.to_string(), kind };
        self.failures.get_or_create(&labels).inc();
        self.worker_series.record(worker, Series::Failure(labels));
    }

    /// A worker was ejected.
    pub fn ejected(&self, model: &str, worker: u64) {
        let labels = FailureLabels { model: model.into(), worker: worker.to_string(), kind: "consecutive_failures" };
        self.ejections.get_or_create(&labels).inc();
        self.worker_series.record(worker, Series::Ejection(labels));
    }

    /// A disaggregated model's plan for a request: `split`, or a bypass reason
    /// (`short_prompt`, `prefill_busy`, `no_prefill_workers`).
    pub fn disagg_plan(&self, model: &str, plan: &'static str) {
        self.disagg_plans.get_or_create(&PlanLabels { model: model.into(), plan }).inc();
    }

    /// One phase (`prefill` or `decode`) of a pair was aborted because the other failed.
    /// `cause` is the other phase's failure: `connect`, `request`, `status_5xx`,
    /// `stream_broken` or `refused` (a 4xx) for a prefill; `connect`, `request` or
    /// `status` for a decode.
    pub fn disagg_abort(&self, model: &str, aborted: &'static str, cause: &'static str) {
        self.disagg_aborts.get_or_create(&AbortLabels { model: model.into(), aborted, cause }).inc();
    }

    /// A connection was refused at `limits.connections_max`.
    pub fn connection_refused(&self) {
        self.connections_refused.inc();
    }

    /// A discovery step failed: `kind` is `kvroute_k8s::Trouble::as_str`.
    pub fn discovery_trouble(&self, kind: &'static str) {
        self.discovery_troubles.get_or_create(&KindLabels { kind }).inc();
    }

    /// A request routed on hashed bytes: `no_tokenizer` or `tokenizer_error`.
    pub fn fallback(&self, model: &str, reason: &'static str) {
        self.fallbacks.get_or_create(&FallbackLabels { model: model.into(), reason }).inc();
    }

    /// A completion whose text prompt was forwarded as its token ids.
    pub fn sent_as_ids(&self, model: &str) {
        self.sent_as_ids.get_or_create(&ModelLabels { model: model.into() }).inc();
    }
}

/// Reads every pool's snapshot once per scrape.
#[derive(Debug)]
struct FleetCollector {
    fleet: Arc<Fleet>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.pools().map(|p| &p.name)).finish()
    }
}

impl Collector for FleetCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snaps: Vec<_> = self.fleet.pools().map(|p| (p.name.clone(), p.driver.snapshot())).collect();
        let mut gauge = |name: &str, help: &str, rows: &mut dyn Iterator<Item = (Vec<(&str, String)>, i64)>| {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (labels, v) in rows {
                ConstGauge::new(v).encode(m.encode_family(&labels)?)?;
            }
            Ok::<(), std::fmt::Error>(())
        };
        let per_model = |f: fn(&kvroute_driver::Snapshot) -> i64| {
            snaps.iter().map(move |(model, s)| (vec![("model", model.clone())], f(s)))
        };
        let missing = self
            .fleet
            .pools()
            .map(|p| (vec![("model", p.name.clone())], i64::from(self.fleet.tokenizer_missing(&p.name))));
        gauge(
            "kvroute_tokenizer_missing",
            "1 if the model has no tokenizer while its workers publish KV events, so it routes on predictions",
            &mut missing.collect::<Vec<_>>().into_iter(),
        )?;
        gauge(
            "kvroute_queue_depth",
            "Requests waiting in the admission queue",
            &mut per_model(|s| s.queue_depth as i64),
        )?;
        gauge(
            "kvroute_requests_in_flight",
            "Requests the router tracks: booked, streaming, queued or waiting",
            &mut per_model(|s| s.requests_in_flight as i64),
        )?;
        gauge(
            "kvroute_affinity_sessions",
            "Sessions in the affinity table",
            &mut per_model(|s| s.affinity_sessions as i64),
        )?;
        gauge(
            "kvroute_affinity_live_leases",
            "Session leases held by running requests",
            &mut per_model(|s| s.affinity_live_leases as i64),
        )?;
        let per_key = |f: fn(&router_core::WorkerLoad) -> i64| {
            snaps.iter().flat_map(move |(model, s)| {
                s.workers.iter().flat_map(move |w| {
                    w.keys.iter().map(move |k| {
                        let labels = vec![
                            ("model", model.clone()),
                            ("worker", k.key.worker.0.to_string()),
                            ("rank", k.key.rank.0.to_string()),
                        ];
                        (labels, f(&k.load))
                    })
                })
            })
        };
        gauge(
            "kvroute_worker_active_prefill_tokens",
            "Prompt tokens routed to a worker and not yet prefilled",
            &mut per_key(|l| l.active_prefill_tokens as i64),
        )?;
        gauge(
            "kvroute_worker_active_decode_blocks",
            "KV blocks held by a worker's running requests",
            &mut per_key(|l| l.active_decode_blocks as i64),
        )?;
        gauge(
            "kvroute_worker_active_requests",
            "Requests routed to a worker and not finished",
            &mut per_key(|l| i64::from(l.active_requests)),
        )?;
        gauge(
            "kvroute_worker_index_entries",
            "Blocks the exact prefix index holds for a worker's rank",
            &mut per_key_entries(&snaps),
        )?;
        let mut healthy = snaps.iter().flat_map(|(model, s)| {
            s.workers.iter().map(move |w| {
                let labels = vec![("model", model.clone()), ("worker", w.spec.id.0.to_string())];
                (labels, i64::from(w.health == Health::Healthy))
            })
        });
        gauge("kvroute_worker_healthy", "1 while a worker takes new requests", &mut healthy)?;
        for (name, help, f) in [
            (
                "kvroute_affinity_evictions",
                "Idle sessions evicted to make room",
                (|s| s.affinity.evictions) as fn(&kvroute_driver::Snapshot) -> u64,
            ),
            ("kvroute_affinity_expirations", "Idle sessions expired", |s| s.affinity.expirations),
            ("kvroute_queue_timeouts", "Requests that timed out in the admission queue", |s| s.router.timed_out),
        ] {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (model, s) in &snaps {
                let labels = [("model", model.as_str())];
                ConstCounter::new(f(s)).encode(m.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// Reads the replica link and the routers' remote load once per scrape.
struct ReplicaCollector {
    replica: Arc<kvroute_replica::ReplicaHandle>,
    fleet: Arc<Fleet>,
}

impl std::fmt::Debug for ReplicaCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaCollector").field("id", &self.replica.id()).finish()
    }
}

impl Collector for ReplicaCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let r = &self.replica;
        let no_labels: [(&str, &str); 0] = [];
        for (name, help, v) in [
            (
                "kvroute_replica_nats_connected",
                "1 while the NATS link to peer replicas is up",
                i64::from(r.connected()),
            ),
            ("kvroute_replica_peers", "Peer replicas heard from since the link came up", r.peers() as i64),
        ] {
            ConstGauge::new(v)
                .encode(enc.encode_descriptor(name, help, None, MetricType::Gauge)?.encode_family(&no_labels)?)?;
        }
        let c = r.counters();
        for (name, help, v) in [
            ("kvroute_replica_published_updates", "Updates published to peer replicas", c.published_updates),
            (
                "kvroute_replica_dropped_updates",
                "Updates not published (NATS down or publish failed)",
                c.dropped_updates,
            ),
            ("kvroute_replica_received_updates", "Peer updates applied", c.received_updates),
            ("kvroute_replica_refused_updates", "Peer updates the router refused", c.refused_updates),
            ("kvroute_replica_decode_errors", "Peer messages that did not decode (dropped)", c.decode_errors),
            ("kvroute_replica_peer_resets", "Times a peer's earlier reports were dropped", c.peer_resets),
            ("kvroute_replica_nats_disconnects", "Times the NATS link was lost", c.disconnects),
        ] {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(v).encode(m.encode_family(&no_labels)?)?;
        }
        let mut m = enc.encode_descriptor(
            "kvroute_worker_remote_active_requests",
            "Requests peer replicas routed to a worker and not finished",
            None,
            MetricType::Gauge,
        )?;
        for p in self.fleet.pools() {
            let rows: Vec<_> = p.driver.with_router(|router| {
                let workers = router.snapshot().workers;
                workers.iter().flat_map(|w| &w.keys).map(|k| (k.key, k.remote_load.active_requests)).collect()
            });
            for (k, n) in rows {
                let labels =
                    [("model", p.name.clone()), ("worker", k.worker.0.to_string()), ("rank", k.rank.0.to_string())];
                ConstGauge::new(i64::from(n)).encode(m.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// `kvroute_worker_index_entries` rows: (model, worker, rank) and the entries.
fn per_key_entries(
    snaps: &[(String, kvroute_driver::Snapshot)],
) -> impl Iterator<Item = (Vec<(&'static str, String)>, i64)> + '_ {
    snaps.iter().flat_map(|(model, s)| {
        s.workers.iter().flat_map(move |w| {
            w.keys.iter().map(move |k| {
                let labels = vec![
                    ("model", model.clone()),
                    ("worker", k.key.worker.0.to_string()),
                    ("rank", k.key.rank.0.to_string()),
                ];
                (labels, i64::from(k.index_entries))
            })
        })
    })
}
