//! Counting the spans that never reach the collector. The SDK's batch processor drops a
//! span silently when its queue is full; [`Counted`] wraps it and keeps its own count of
//! spans waiting or in an export, so it drops (and counts) exactly where the queue would
//! overflow. The exporter counts the spans of batches the collector did not take.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{BatchSpanProcessor, Span, SpanData, SpanProcessor};
use opentelemetry_sdk::Resource;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// Spans lost on the way to the collector, by reason (`queue_full`: ended while
/// `spans_queued_max` spans were already waiting or being exported; `export_failed`: in
/// a batch the collector refused or did not answer in time). Clones share the counts.
#[derive(Clone, Debug, Default)]
pub struct SpanDrops(pub(crate) Family<ReasonLabels, Counter>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabels {
    reason: &'static str,
}

impl SpanDrops {
    fn add(&self, reason: &'static str, n: u64) {
        self.0.get_or_create(&ReasonLabels { reason }).inc_by(n);
    }

    /// The spans of a batch the collector did not take.
    pub(crate) fn export_failed(&self, n: usize) {
        self.add("export_failed", n as u64);
    }

    /// How many spans were dropped for `reason` so far.
    pub fn count(&self, reason: &'static str) -> u64 {
        self.0.get(&ReasonLabels { reason }).map_or(0, |c| c.get())
    }
}

/// Spans ended but not yet through an export, shared by [`Counted`] and the exporter.
#[derive(Clone, Debug, Default)]
pub(crate) struct Pending(Arc<AtomicUsize>);

impl Pending {
    /// An export of `n` spans finished, taken or not.
    pub(crate) fn exported(&self, n: usize) {
        // Saturating: a span the processor never counted (there is none) must not wrap.
        let _ = self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| Some(p.saturating_sub(n)));
    }
}

/// The batch processor, with drops counted instead of silent.
#[derive(Debug)]
pub(crate) struct Counted {
    pub(crate) inner: BatchSpanProcessor,
    pub(crate) pending: Pending,
    pub(crate) queued_max: usize,
    pub(crate) drops: SpanDrops,
}

impl SpanProcessor for Counted {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.pending.0.fetch_add(1, Ordering::Relaxed) >= self.queued_max {
            self.pending.0.fetch_sub(1, Ordering::Relaxed);
            self.drops.add("queue_full", 1);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}
