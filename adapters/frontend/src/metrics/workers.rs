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
