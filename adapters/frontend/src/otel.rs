//! Distributed tracing with OpenTelemetry, switched on by `[tracing]`
//! ([`crate::config::TracingConfig`]).
//!
//! [`Tracing::start`] builds a tracer provider of its own (never a process-global one, so
//! two servers in one process trace apart) behind a parent-based ratio sampler, with a
//! batch processor exporting over OTLP/HTTP (protobuf, encoded by [`crate::otlp`]). The
//! exporter posts through a hyper client whose requests run on the tokio runtime that
//! started it, so the batch processor's own thread never needs a reactor.
//! [`Tracing::shutdown`] flushes what is left.
//!
//! Per request, [`Tracing::request`] reads the client's W3C `traceparent` and
//! `tracestate` and opens the request span under them, or a new trace when none arrives
//! and `start_traces` is on. Children ([`RequestTrace::child`], [`RequestTrace::stage`])
//! are made only for sampled requests; an unsampled one costs its ids and its headers.
//! [`RequestTrace::inject`] writes the trace context the worker gets: the sampled flag is
//! kept as it is, so a worker of an unsampled request sees flag `00` and the same trace id.

use std::fmt;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::HeaderMap;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    SamplingDecision, SpanBuilder, SpanContext, TraceContextExt, TraceFlags, Tracer as _, TracerProvider as _,
};
use opentelemetry::Context;
use opentelemetry_http::HeaderExtractor;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, IdGenerator, RandomIdGenerator, Sampler, SdkTracer, SdkTracerProvider,
    ShouldSample, SpanData, SpanExporter,
};
use opentelemetry_sdk::Resource;

pub use opentelemetry::trace::{SpanKind, Status};
pub use opentelemetry::KeyValue;

use crate::config::TracingConfig;
use crate::span_drops::{Counted, Pending, SpanDrops};
use crate::tls::{HttpsConnector, TlsError};

/// The W3C trace-context headers, which the proxy owns when tracing is on. Names as
/// constants: a `&str` name is parsed on every lookup.
const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");
const TRACESTATE: http::HeaderName = http::HeaderName::from_static("tracestate");
/// The request span's name.
const REQUEST_SPAN: &str = "kvroute.request";

/// A running tracer: its provider (with the exporter), and whether requests without a
/// trace start one.
pub struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    start_traces: bool,
    /// The provider's sampler for traces kvroute starts, consulted before any span
    /// exists, so an unsampled request never builds one.
    ratio: Sampler,
    drops: SpanDrops,
}

impl Tracing {
    /// Builds the exporter and the provider from `cfg` (already checked), verifying an
    /// `https` collector against the system's roots. Must run inside a tokio runtime:
    /// exports are sent on it.
    pub fn start(cfg: &TracingConfig) -> Result<Tracing, TracingError> {
        let tls = crate::tls::client_config(None).map_err(TracingError::Tls)?;
        Self::start_with_tls(cfg, &tls)
    }

    /// As [`Tracing::start`], verifying an `https` collector with `tls`.
    pub fn start_with_tls(cfg: &TracingConfig, tls: &rustls::ClientConfig) -> Result<Tracing, TracingError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| TracingError::NoRuntime)?;
        let ratio = Sampler::TraceIdRatioBased(cfg.sampling_ratio);
        let timeout = Duration::from_millis(cfg.export_timeout_ms);
        let url = cfg.traces_url().parse().map_err(TracingError::Endpoint)?;
        let (pending, drops) = (Pending::default(), SpanDrops::default());
        let exporter = Exporter {
            client: export_client(tls),
            runtime,
            timeout,
            url,
            resource: Vec::new(),
            pending: pending.clone(),
            drops: drops.clone(),
        };
        let batch = BatchConfigBuilder::default()
            .with_scheduled_delay(Duration::from_millis(cfg.export_interval_ms))
            .with_max_queue_size(cfg.spans_queued_max)
            .with_max_export_batch_size(cfg.spans_queued_max.min(512))
            .build();
        let inner = BatchSpanProcessor::builder(exporter).with_batch_config(batch).build();
        let processor = Counted { inner, pending, queued_max: cfg.spans_queued_max, drops: drops.clone() };
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::ParentBased(Box::new(ratio.clone())))
            .with_resource(Resource::builder_empty().with_service_name(cfg.service_name.clone()).build())
            .with_span_processor(processor)
            .build();
        let tracer = provider.tracer("kvroute");
        Ok(Tracing { provider, tracer, start_traces: cfg.start_traces, ratio, drops })
    }

    /// The counts of spans that never reached the collector, for `/metrics`.
    pub fn drops(&self) -> SpanDrops {
        self.drops.clone()
    }

    /// The request span, opened at `arrived`: under the client's trace when `headers`
    /// carry a valid `traceparent`, else a new trace when `start_traces` is on, else
    /// `None` (nothing traced, nothing injected).
    pub fn request(&self, headers: &HeaderMap, arrived: SystemTime) -> Option<RequestTrace> {
        // Most requests carry no trace: skip the propagator's parsing for them.
        let parent = if headers.contains_key(&TRACEPARENT) {
            TraceContextPropagator::new().extract_with_context(&Context::new(), &HeaderExtractor(headers))
        } else {
            Context::new()
        };
        let mut trace_id = None;
        if !parent.span().span_context().is_valid() {
            if !self.start_traces {
                return None;
            }
            // A new trace the sampler drops gets its ids and nothing else: the SDK would
            // build (and drop) a span for it on every request.
            let ids = RandomIdGenerator::default();
            let id = ids.new_trace_id();
            let decision = self.ratio.should_sample(None, id, REQUEST_SPAN, &SpanKind::Server, &[], &[]).decision;
            if decision != SamplingDecision::RecordAndSample {
                let sc = SpanContext::new(id, ids.new_span_id(), TraceFlags::default(), false, Default::default());
                return Some(RequestTrace {
                    cx: Context::new().with_remote_span_context(sc),
                    tracer: self.tracer.clone(),
                });
            }
            // The provider's sampler decides again on the same id, and agrees.
            trace_id = Some(id);
        }
        let mut builder = self.tracer.span_builder(REQUEST_SPAN).with_kind(SpanKind::Server).with_start_time(arrived);
        builder.trace_id = trace_id;
        let span = builder.start_with_context(&self.tracer, &parent);
        Some(RequestTrace { cx: parent.with_span(span), tracer: self.tracer.clone() })
    }

    /// Ends the provider: exports the spans still queued (within the export time-out)
    /// and stops the batch processor. Spans opened after it are not recorded.
    pub async fn shutdown(&self) {
        let provider = self.provider.clone();
        // Blocking (it joins the processor's thread), and the export it waits for runs
        // on this runtime: off the runtime's threads.
        let done = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(e)) = done {
            tracing::warn!(error = %e, "tracing: the last spans were not exported");
        }
    }
}

impl Drop for Tracing {
    /// A tracer dropped without [`Tracing::shutdown`] still flushes, from a thread of
    /// its own: the flush waits on an export that runs on the runtime, which may be the
    /// very thread dropping it.
    fn drop(&mut self) {
        let provider = self.provider.clone();
        let _ = std::thread::Builder::new().name("kvroute-otel-flush".into()).spawn(move || provider.shutdown());
    }
}

impl fmt::Debug for Tracing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracing").field("start_traces", &self.start_traces).finish_non_exhaustive()
    }
}

/// One request's trace: the context holding its span. Clones share the span, which ends
/// at [`RequestTrace::end`] or when the last clone is dropped.
#[derive(Clone)]
pub struct RequestTrace {
    cx: Context,
    tracer: SdkTracer,
}

impl RequestTrace {
    /// Whether the request is recorded (its children are then made too).
    pub fn sampled(&self) -> bool {
        self.cx.span().span_context().is_sampled()
    }

    /// A child span opened at `start`, `None` when the request is not sampled.
    pub fn child(&self, name: &'static str, kind: SpanKind, start: SystemTime) -> Option<ChildSpan> {
        if !self.sampled() {
            return None;
        }
        let b = SpanBuilder::from_name(name).with_kind(kind).with_start_time(start);
        let span = self.tracer.build_with_context(b, &self.cx);
        Some(ChildSpan { cx: self.cx.with_span(span) })
    }

    /// A finished child span from `start` to `end` with `attributes`, if sampled.
    pub fn stage(&self, name: &'static str, start: SystemTime, end: SystemTime, attributes: Vec<KeyValue>) {
        if let Some(c) = self.child(name, SpanKind::Internal, start) {
            c.cx.span().set_attributes(attributes);
            c.cx.span().end_with_timestamp(end);
        }
    }

    /// Sets an attribute of the request span.
    pub fn set(&self, kv: KeyValue) {
        if self.sampled() {
            self.cx.span().set_attribute(kv);
        }
    }

    /// Writes this request's trace context into `headers`, replacing the client's.
    pub fn inject(&self, headers: &mut HeaderMap) {
        inject(&self.cx, headers);
    }

    /// Ends the request span with the answer's status; an error status marks it failed.
    pub fn end(&self, status: u16) {
        let span = self.cx.span();
        if self.sampled() {
            span.set_attribute(KeyValue::new("http.response.status_code", i64::from(status)));
            if status >= 500 {
                span.set_status(Status::error(format!("status {status}")));
            }
        }
        span.end();
    }
}

/// A child span of a sampled request; it ends at [`ChildSpan::end`] or when dropped.
pub struct ChildSpan {
    cx: Context,
}

impl ChildSpan {
    /// Sets an attribute.
    pub fn set(&self, kv: KeyValue) {
        self.cx.span().set_attribute(kv);
    }

    /// Records an event now, e.g. the first byte of an answer.
    pub fn event(&self, name: &'static str, attributes: Vec<KeyValue>) {
        self.cx.span().add_event(name, attributes);
    }

    /// Marks the span failed.
    pub fn fail(&self, message: String) {
        self.cx.span().set_status(Status::error(message));
    }

    /// Writes this span's trace context into `headers` (the callee's parent is this span).
    pub fn inject(&self, headers: &mut HeaderMap) {
        inject(&self.cx, headers);
    }

    /// Ends the span now.
    pub fn end(&self) {
        self.cx.span().end();
    }
}

/// `traceparent` (and a non-empty `tracestate`) of `cx`'s span into `headers`, after
/// removing whatever trace context they carried.
fn inject(cx: &Context, headers: &mut HeaderMap) {
    headers.remove(&TRACEPARENT);
    headers.remove(&TRACESTATE);
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return;
    }
    if let Some(v) = traceparent(sc.trace_id().to_bytes(), sc.span_id().to_bytes(), sc.trace_flags()) {
        headers.insert(TRACEPARENT, v);
    }
    let state = sc.trace_state().header();
    if !state.is_empty() {
        if let Ok(v) = http::HeaderValue::from_str(&state) {
            headers.insert(TRACESTATE, v);
        }
    }
}

/// `00-{trace id}-{span id}-{flags}` in lower-case hex, as W3C trace context writes it;
/// on every traced request, so without the formatter's allocations.
fn traceparent(trace_id: [u8; 16], span_id: [u8; 8], flags: TraceFlags) -> Option<http::HeaderValue> {
    let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
    hex_into(&mut out[3..35], &trace_id);
    hex_into(&mut out[36..52], &span_id);
    hex_into(&mut out[53..55], &[flags.to_u8()]);
    http::HeaderValue::from_bytes(&out).ok()
}

fn hex_into(out: &mut [u8], bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = HEX[usize::from(b >> 4)];
        pair[1] = HEX[usize::from(b & 15)];
    }
}

/// `at` (a monotonic instant) on the wall clock, as spans carry it.
pub fn wall(at: tokio::time::Instant) -> SystemTime {
    let now = SystemTime::now();
    now.checked_sub(at.elapsed()).unwrap_or(now)
}

fn export_client(tls: &rustls::ClientConfig) -> Client<HttpsConnector, Full<Bytes>> {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let conn = crate::tls::https_connector(conn, tls);
    Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(conn)
}

/// The OTLP/HTTP exporter: each batch is encoded by [`crate::otlp`] and posted as a task
/// on the runtime that started tracing, awaited from the batch processor's thread.
struct Exporter {
    client: Client<HttpsConnector, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
    url: http::Uri,
    resource: Vec<KeyValue>,
    pending: Pending,
    drops: SpanDrops,
}

impl fmt::Debug for Exporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exporter").field("url", &self.url).field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

impl SpanExporter for Exporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let sent = self.post(crate::otlp::encode_request(&self.resource, &batch)).await;
        self.pending.exported(n);
        if sent.is_err() {
            self.drops.export_failed(n);
        }
        sent
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.resource = resource.iter().map(|(k, v)| KeyValue::new(k.clone(), v.clone())).collect();
    }
}

impl Exporter {
    async fn post(&self, body: Vec<u8>) -> OTelSdkResult {
        let req = http::Request::post(self.url.clone())
            .header(http::header::CONTENT_TYPE, "application/x-protobuf")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| OTelSdkError::InternalFailure(e.to_string()))?;
        let (client, timeout) = (self.client.clone(), self.timeout);
        let task = self.runtime.spawn(async move {
            let exchange = async {
                let resp = client.request(req).await.map_err(|e| e.to_string())?;
                let status = resp.status();
                // Read whole, so the connection goes back to the pool.
                let _ = resp.into_body().collect().await;
                Ok::<_, String>(status)
            };
            match tokio::time::timeout(timeout, exchange).await {
                Ok(Ok(s)) if s.is_success() => Ok(()),
                Ok(Ok(s)) => Err(format!("the collector answered {s}")),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(format!("no answer within {timeout:?}")),
            }
        });
        match task.await {
            Ok(r) => r.map_err(OTelSdkError::InternalFailure),
            Err(e) => Err(OTelSdkError::InternalFailure(e.to_string())),
        }
    }
}

/// Why tracing could not start.
#[derive(Debug)]
#[non_exhaustive]
pub enum TracingError {
    /// [`Tracing::start`] ran outside a tokio runtime.
    NoRuntime,
    /// The collector's endpoint is not a URI.
    Endpoint(http::uri::InvalidUri),
    /// The TLS client for an `https` collector could not be built.
    Tls(TlsError),
}

impl fmt::Display for TracingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TracingError::NoRuntime => write!(f, "tracing must start inside a tokio runtime"),
            TracingError::Endpoint(e) => write!(f, "OTLP exporter: endpoint: {e}"),
            TracingError::Tls(e) => write!(f, "OTLP exporter: {e}"),
        }
    }
}

impl std::error::Error for TracingError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TracingError::NoRuntime => None,
            TracingError::Endpoint(e) => Some(e),
            TracingError::Tls(e) => Some(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceId, TraceState};

    /// `inject` writes what the SDK's propagator writes for the same span context.
    fn check(trace_id: u128, span_id: u64, sampled: bool, state: &[(&str, &str)]) {
        let flags = if sampled { TraceFlags::SAMPLED } else { TraceFlags::default() };
        let state = TraceState::from_key_value(state.iter().copied()).expect("a valid trace state");
        let sc = SpanContext::new(TraceId::from(trace_id), SpanId::from(span_id), flags, true, state);
        let cx = Context::new().with_remote_span_context(sc);
        let mut ours = HeaderMap::new();
        ours.insert("tracestate", http::HeaderValue::from_static("stale=1"));
        inject(&cx, &mut ours);
        let mut sdk = HeaderMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut opentelemetry_http::HeaderInjector(&mut sdk));
        if sdk.get("tracestate").is_some_and(|v| v.is_empty()) {
            sdk.remove("tracestate");
        }
        assert_eq!(ours, sdk, "trace {trace_id:x} span {span_id:x}");
    }

    #[test]
    fn inject_writes_what_the_propagator_writes() {
        check(1, 1, true, &[]);
        check(u128::MAX, u64::MAX, false, &[]);
        check(0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, true, &[("vendor", "v1"), ("other", "x")]);
        check(0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331, false, &[("k", "v")]);
    }

    #[test]
    fn an_invalid_context_injects_nothing() {
        let mut h = HeaderMap::new();
        h.insert("traceparent", http::HeaderValue::from_static("00-stale"));
        inject(&Context::new(), &mut h);
        assert!(h.is_empty(), "{h:?}");
    }
}
