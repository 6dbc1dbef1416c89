//! Distributed tracing with OpenTelemetry, switched on by `[tracing]`
//! ([`crate::config::TracingConfig`]).
//!
//! [`Tracing::start`] builds a tracer provider of its own (never a process-global one, so
//! two servers in one process trace apart) behind a parent-based ratio sampler, with a
//! batch processor exporting over OTLP/HTTP (protobuf). The exporter posts through a
//! hyper client whose requests run on the tokio runtime that started it, so the batch
//! processor's own thread never needs a reactor. [`Tracing::shutdown`] flushes what is
//! left.
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
use opentelemetry::trace::{SpanBuilder, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::Context;
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

pub use opentelemetry::trace::{SpanKind, Status};
pub use opentelemetry::KeyValue;

use crate::config::TracingConfig;

/// The W3C trace-context headers, which the proxy owns when tracing is on.
pub const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// A running tracer: its provider (with the exporter), and whether requests without a
/// trace start one.
pub struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    start_traces: bool,
}

impl Tracing {
    /// Builds the exporter and the provider from `cfg` (already checked). Must run inside
    /// a tokio runtime: exports are sent on it.
    pub fn start(cfg: &TracingConfig) -> Result<Tracing, TracingError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| TracingError::NoRuntime)?;
        let timeout = Duration::from_millis(cfg.export_timeout_ms);
        let client = ExportClient { client: export_client(), runtime, timeout };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(cfg.traces_url())
            .with_timeout(timeout)
            .build()
            .map_err(|e| TracingError::Exporter(e.to_string()))?;
        let batch = BatchConfigBuilder::default()
            .with_scheduled_delay(Duration::from_millis(cfg.export_interval_ms))
            .with_max_queue_size(cfg.spans_queued_max)
            .with_max_export_batch_size(cfg.spans_queued_max.min(512))
            .build();
        let processor = BatchSpanProcessor::builder(exporter).with_batch_config(batch).build();
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sampling_ratio))))
            .with_resource(Resource::builder_empty().with_service_name(cfg.service_name.clone()).build())
            .with_span_processor(processor)
            .build();
        let tracer = provider.tracer("kvroute");
        Ok(Tracing { provider, tracer, start_traces: cfg.start_traces })
    }

    /// The request span, opened at `arrived`: under the client's trace when `headers`
    /// carry a valid `traceparent`, else a new trace when `start_traces` is on, else
    /// `None` (nothing traced, nothing injected).
    pub fn request(&self, headers: &HeaderMap, arrived: SystemTime) -> Option<RequestTrace> {
        let parent = TraceContextPropagator::new().extract_with_context(&Context::new(), &HeaderExtractor(headers));
        if !parent.span().span_context().is_valid() && !self.start_traces {
            return None;
        }
        let span = self
            .tracer
            .span_builder("kvroute.request")
            .with_kind(SpanKind::Server)
            .with_start_time(arrived)
            .start_with_context(&self.tracer, &parent);
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
    for h in TRACE_HEADERS {
        headers.remove(h);
    }
    TraceContextPropagator::new().inject_context(cx, &mut HeaderInjector(headers));
    if headers.get("tracestate").is_some_and(|v| v.is_empty()) {
        headers.remove("tracestate");
    }
}

/// `at` (a monotonic instant) on the wall clock, as spans carry it.
pub fn wall(at: tokio::time::Instant) -> SystemTime {
    let now = SystemTime::now();
    now.checked_sub(at.elapsed()).unwrap_or(now)
}

fn export_client() -> Client<HttpConnector, Full<Bytes>> {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(conn)
}

/// The exporter's HTTP client: each export runs as a task on the runtime that started
/// tracing, awaited from the batch processor's thread.
struct ExportClient {
    client: Client<HttpConnector, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl fmt::Debug for ExportClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportClient").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (client, timeout) = (self.client.clone(), self.timeout);
        let task = self.runtime.spawn(async move {
            let exchange = async {
                let resp = client.request(request.map(Full::new)).await?;
                let (parts, body) = resp.into_parts();
                let body = body.collect().await?.to_bytes();
                Ok::<_, HttpError>(Response::from_parts(parts, body))
            };
            match tokio::time::timeout(timeout, exchange).await {
                Ok(r) => r,
                Err(_) => Err(HttpError::from(format!("no answer within {timeout:?}"))),
            }
        });
        task.await?
    }
}

/// Why tracing could not start.
#[derive(Debug)]
#[non_exhaustive]
pub enum TracingError {
    /// [`Tracing::start`] ran outside a tokio runtime.
    NoRuntime,
    /// The OTLP exporter refused its settings.
    Exporter(String),
}

impl fmt::Display for TracingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TracingError::NoRuntime => write!(f, "tracing must start inside a tokio runtime"),
            TracingError::Exporter(e) => write!(f, "OTLP exporter: {e}"),
        }
    }
}

impl std::error::Error for TracingError {}
