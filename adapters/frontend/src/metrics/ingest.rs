//! KV-event ingestion in Prometheus: each subscribed stream's counters, as the events
//! runner last reported them (see [`crate::events::Subscriptions::ingest_rows`]).
//!
//! The runner answers asynchronously and a scrape encodes synchronously, so the rows are
//! a snapshot that the server refreshes before it encodes (and the silence watch every
//! few seconds). Rows of workers the fleet no longer holds are never encoded.

use std::sync::{Arc, Mutex, PoisonError};

use kvroute_events::ingest::StreamStatus;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::fleet::Fleet;

/// One rank's KV-event stream at one instant.
#[derive(Clone, Debug)]
pub struct IngestRow {
    /// The worker's model.
    pub model: String,
    /// The worker id.
    pub worker: u64,
    /// The data-parallel rank.
    pub rank: u32,
    /// The ingestion's counters.
    pub status: StreamStatus,
    /// Seconds since the stream's last message of any kind; `None` before the first.
    pub last_message_age_s: Option<f64>,
}

/// The last snapshot of every stream; shared by the metrics and their collector.
pub(super) type IngestRows = Arc<Mutex<Vec<IngestRow>>>;

/// Encodes the rows of [`IngestRows`] whose worker is still in the fleet.
#[derive(Debug)]
pub(super) struct IngestCollector {
    pub(super) rows: IngestRows,
    pub(super) fleet: Arc<Fleet>,
}

type Counted = fn(&StreamStatus) -> u64;
type Flag = fn(&StreamStatus) -> bool;
/// A counter family with a `result` label: name, help, and (result, value) readers.
type ResultFamily = (&'static str, &'static str, &'static [(&'static str, Counted)]);

/// Counter families with a `result` label.
const RESULTS: [ResultFamily; 3] = [
    (
        "kvroute_kv_event_batches",
        "KV-event batches by result: applied, malformed (frame or payload), duplicate",
        &[
            ("applied", |s| s.batches_applied),
            ("malformed", |s| s.batches_malformed),
            ("duplicate", |s| s.seq.duplicates),
        ],
    ),
    (
        "kvroute_kv_events",
        "Engine KV events by result: applied, dropped (untranslatable or malformed), unknown (type skipped)",
        &[("applied", |s| s.events_applied), ("dropped", |s| s.events_dropped), ("unknown", |s| s.events_unknown)],
    ),
    (
        "kvroute_kv_event_replays",
        "Replays by result: requested (connect replays included), completed, failed (ended early, skipped, timed out)",
        &[
            ("requested", |s| s.seq.replays_requested),
            ("completed", |s| s.seq.replays_completed),
            ("failed", |s| s.seq.replays_failed),
        ],
    ),
];

/// Counter families without a `result` label.
const COUNTERS: [(&str, &str, Counted); 3] = [
    ("kvroute_kv_event_gaps", "Sequence gaps seen in a worker's live KV-event stream", |s| s.seq.gaps),
    (
        "kvroute_kv_event_stream_resets",
        "Times a worker's index entries were cleared because its history could not be recovered",
        |s| s.seq.resets,
    ),
    ("kvroute_kv_event_publisher_restarts", "Publisher restarts detected on a KV-event stream", |s| s.seq.restarts),
];

impl Collector for IngestCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let rows: Vec<IngestRow> = {
            let rows = self.rows.lock().unwrap_or_else(PoisonError::into_inner);
            rows.iter().filter(|r| self.fleet.worker(r.worker).is_some_and(|w| w.model == r.model)).cloned().collect()
        };
        let labels = |r: &IngestRow| {
            [("model", r.model.clone()), ("worker", r.worker.to_string()), ("rank", r.rank.to_string())]
        };
        for (name, help, results) in RESULTS {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for r in &rows {
                for (result, f) in results {
                    let [a, b, c] = labels(r);
                    let l = [a, b, c, ("result", (*result).to_string())];
                    ConstCounter::new(f(&r.status)).encode(m.encode_family(&l)?)?;
                }
            }
        }
        for (name, help, f) in COUNTERS {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for r in &rows {
                ConstCounter::new(f(&r.status)).encode(m.encode_family(&labels(r))?)?;
            }
        }
        let flags: [(&str, &str, Flag); 2] = [
            ("kvroute_kv_event_stream_connected", "1 while the transport reports a live KV-event connection", |s| {
                s.connected
            }),
            ("kvroute_kv_event_stream_trusted", "1 while a worker's index entries are trusted (no gap open)", |s| {
                s.trusted
            }),
        ];
        for (name, help, f) in flags {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for r in &rows {
                ConstGauge::new(i64::from(f(&r.status))).encode(m.encode_family(&labels(r))?)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "kvroute_kv_event_last_message_age_seconds",
            "Seconds since a KV-event stream's last message of any kind (absent before the first)",
            None,
            MetricType::Gauge,
        )?;
        for r in &rows {
            if let Some(age) = r.last_message_age_s {
                ConstGauge::new(age).encode(m.encode_family(&labels(r))?)?;
            }
        }
        Ok(())
    }
}
