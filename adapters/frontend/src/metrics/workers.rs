//! A worker's series leave with the worker.
//!
//! Every label set naming a worker is recorded here when it is created. At each scrape,
//! the series of workers the fleet no longer holds (or holds under another model) are
//! removed from their families, so `/metrics` stays bounded however many workers come
//! and go. A request that ends on a worker after its removal re-creates a series; the
//! next scrape removes it again.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::encoding::EncodeLabelSet;

use crate::fleet::Fleet;

/// One series of a worker, by the family it lives in.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub(super) enum Series {
    /// `kvroute_requests`.
    Request(super::RequestLabels),
    /// `kvroute_upstream_failures`.
    Failure(super::FailureLabels),
    /// `kvroute_worker_ejections`.
    Ejection(super::FailureLabels),
    /// `kvroute_kv_event_streams_silent`.
    Silent(WorkerLabels),
    /// The per-worker request histograms (end-to-end, prompt and cached tokens).
    Histograms(WorkerLabels),
}

impl Series {
    fn model(&self) -> &str {
        match self {
            Series::Request(l) => &l.model,
            Series::Failure(l) | Series::Ejection(l) => &l.model,
            Series::Silent(l) | Series::Histograms(l) => &l.model,
        }
    }
}

/// A model and a worker.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct WorkerLabels {
    pub(super) model: String,
    pub(super) worker: String,
}

/// The series created for each worker id.
#[derive(Default)]
pub(super) struct WorkerSeries {
    by_worker: Mutex<BTreeMap<u64, HashSet<Series>>>,
}

impl WorkerSeries {
    /// Notes that `series` exists for `worker`.
    pub(super) fn record(&self, worker: u64, series: Series) {
        self.lock().entry(worker).or_default().insert(series);
    }

    /// Takes out the series of workers `fleet` no longer holds under their model, as
    /// (worker, series) pairs. Linear in the workers with series.
    pub(super) fn take_stale(&self, fleet: &Fleet) -> Vec<(u64, Series)> {
        let mut held = self.lock();
        let mut stale = Vec::new();
        held.retain(|&id, series| {
            let model = fleet.worker(id).map(|w| w.model.clone());
            series.retain(|s| {
                let keep = model.as_deref() == Some(s.model());
                if !keep {
                    stale.push((id, s.clone()));
                }
                keep
            });
            !series.is_empty()
        });
        stale
    }

    /// Workers that have series now.
    #[cfg(test)]
    pub(super) fn workers(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, HashSet<Series>>> {
        self.by_worker.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl super::Metrics {
    /// A request of `prompt_tokens` was routed to `worker`, where the router expected
    /// `overlap_blocks` blocks of `block_tokens` cached: the cached tokens are those
    /// blocks' tokens, at most the prompt's.
    pub fn routed(&self, model: &str, worker: u64, prompt_tokens: u32, overlap_blocks: u32, block_tokens: u32) {
        let Some(h) = self.worker_handles(model, worker) else { return };
        let cached_tokens = overlap_blocks.saturating_mul(block_tokens).min(prompt_tokens);
        h.prompt_tokens.observe(f64::from(prompt_tokens));
        h.cached_tokens.observe(f64::from(cached_tokens));
    }

    /// A request that reached `worker` ended, `d` after it arrived (whatever the outcome).
    pub fn request_duration(&self, model: &str, worker: u64, d: std::time::Duration) {
        if let Some(h) = self.worker_handles(model, worker) {
            h.e2e.observe(d.as_secs_f64());
        }
    }

    /// The KV-event streams' counters as the events runner reports them now (see
    /// [`crate::events::Subscriptions::ingest_rows`]); replaces the last snapshot.
    pub fn set_ingest(&self, rows: Vec<super::IngestRow>) {
        *self.ingest.lock().unwrap_or_else(PoisonError::into_inner) = rows;
    }

    /// `worker`'s histograms within `model`, created on first use; `None` past the
    /// resolved models' limit (the sample is dropped rather than grow the families).
    fn worker_handles(&self, model: &str, worker: u64) -> Option<Arc<super::WorkerHandles>> {
        let m = self.model(model)?;
        if let Some(h) = m.workers.read().unwrap_or_else(PoisonError::into_inner).get(&worker) {
            return Some(h.clone());
        }
        let labels = WorkerLabels { model: model.into(), worker: worker.to_string() };
        let h = Arc::new(super::WorkerHandles {
            e2e: self.e2e.get_or_create(&labels).clone(),
            prompt_tokens: self.prompt_tokens.get_or_create(&labels).clone(),
            cached_tokens: self.cached_tokens.get_or_create(&labels).clone(),
        });
        m.workers.write().unwrap_or_else(PoisonError::into_inner).insert(worker, h.clone());
        self.worker_series.record(worker, Series::Histograms(labels));
        Some(h)
    }

    /// Removes every series of workers the fleet no longer holds under that model, and
    /// the handles that point at them.
    pub(super) fn forget_departed(&self) {
        let stale = self.worker_series.take_stale(&self.fleet);
        for (id, series) in stale {
            if let Some(m) = self.model(series.model()) {
                m.workers.write().unwrap_or_else(PoisonError::into_inner).remove(&id);
                m.ok.write().unwrap_or_else(PoisonError::into_inner).retain(|&(w, _), _| w != id);
            }
            match &series {
                Series::Request(l) => self.requests.remove(l),
                Series::Failure(l) => self.failures.remove(l),
                Series::Ejection(l) => self.ejections.remove(l),
                Series::Silent(l) => self.silent_streams.remove(l),
                Series::Histograms(l) => {
                    self.prompt_tokens.remove(l);
                    self.cached_tokens.remove(l);
                    self.e2e.remove(l)
                }
            };
        }
        let mut served = self.served.lock().unwrap_or_else(PoisonError::into_inner);
        served.retain(|&id, _| self.fleet.worker(id).is_some());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::config::{ModelConfig, ProxyConfig, WorkerConfig};
    use crate::fleet::Fleet;
    use crate::metrics::Metrics;

    fn worker(id: u64, model: &str) -> WorkerConfig {
        let w = serde_json::json!({"id": id, "url": "http://127.0.0.1:9", "model": model});
        serde_json::from_value(w).expect("a worker")
    }

    /// Each worker in `ids` is added to `m`, serves one request of every kind of series,
    /// and leaves; `/metrics` ends as it began, with nothing of theirs held.
    #[track_caller]
    fn check(fleet: &Fleet, metrics: &Metrics, ids: std::ops::Range<u64>) {
        let before = metrics.encode();
        for id in ids.clone() {
            assert!(fleet.add_worker(worker(id, "m")).expect("added"));
            metrics.routed("m", id, 100, 3, 16);
            metrics.request_duration("m", id, Duration::from_millis(5));
            metrics.request("m", Some(id), "ok", 200);
            metrics.request("m", Some(id), "stream_broken", 200);
            metrics.failure("m", id, "connect");
            metrics.ejected("m", id);
            metrics.silent_stream("m", id);
            fleet.verdicts().record(id, crate::agree::Verdict::Agrees, std::time::Instant::now());
        }
        let during = metrics.encode();
        check_dashboard_names(&during);
        let last = format!("worker=\"{}\"", ids.end - 1);
        for family in [
            "kvroute_requests_total",
            "kvroute_upstream_failures_total",
            "kvroute_worker_ejections_total",
            "kvroute_kv_event_streams_silent_total",
            "kvroute_request_duration_seconds_count",
            "kvroute_prompt_tokens_sum",
            "kvroute_cached_tokens_sum",
            "kvroute_worker_index_entries",
            "kvroute_worker_tokenizer_agrees",
        ] {
            let held = during.lines().any(|l| l.starts_with(family) && l.contains(&last));
            assert!(held, "{family} has no series of the last worker");
        }
        let cached = format!("kvroute_cached_tokens_sum{{model=\"m\",{last}}} 48");
        assert!(during.contains(&cached), "3 blocks of 16 expected cached");
        for id in ids {
            assert!(fleet.remove_worker(id));
        }
        let after = metrics.encode();
        assert_eq!(after.lines().count(), before.lines().count(), "before:\n{before}\nafter:\n{after}");
        let left: Vec<&str> = after.lines().filter(|l| !l.starts_with('#') && l.contains("worker=")).collect();
        assert!(left.is_empty(), "series of removed workers: {left:#?}");
        assert_eq!(metrics.worker_series.workers(), 0);
        assert!(metrics.served_totals().is_empty());
    }

    #[tokio::test]
    async fn a_workers_series_leave_with_it() {
        let cfg = ProxyConfig {
            models: vec![ModelConfig { name: "m".into(), ..ModelConfig::default() }],
            ..Default::default()
        };
        let fleet = Arc::new(Fleet::new(&cfg, 1));
        let metrics = Metrics::new(fleet.clone());
        // The model's own series exist from its first request on.
        metrics.ttft("m", Duration::from_millis(1));
        // The tokenizer check's families exist from the first check on.
        fleet.verdicts().count(crate::agree::Verdict::Agrees);
        check(&fleet, &metrics, 0..1_000);
        // Ids come back: their series are created afresh and leave again.
        check(&fleet, &metrics, 500..600);
    }

    /// Every metric the dashboard in the docs queries is a family `/metrics` declares.
    #[track_caller]
    fn check_dashboard_names(exposition: &str) {
        let dashboard = include_str!("../../../../docs/dashboard.json");
        let typed: std::collections::BTreeSet<&str> =
            exposition.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next()).collect();
        let mut queried = 0;
        for (i, _) in dashboard.match_indices("kvroute_") {
            let name: String = dashboard[i..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            // Counters are typed with their `_total`, histograms without their sample suffixes.
            let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(&name);
            if name != "kvroute_" {
                assert!(typed.contains(family), "the dashboard queries {name}, which /metrics does not declare");
                queried += 1;
            }
        }
        assert!(queried >= 20, "the dashboard queries {queried} metrics");
    }
}
