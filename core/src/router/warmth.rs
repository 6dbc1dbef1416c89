//! How cold each worker is: the wait an engine's first pass after a pause adds (the
//! timing model's cold term, see [`TtftModel::cold_ms`]).
//!
//! A worker running none of the router's requests is as cold as its idle time says.
//! Once a request goes to it, that request's first pass pays the cold wait, and every
//! request sent there before the pass ends waits it out too: the timing model's credit
//! for a backlog's progress assumes the worker was computing all along. So the wait is
//! remembered until the worker's first prefill finishes (or any of its requests ends).
//! The pipeline waives it for the holders of a request's longest prefix: the charge
//! moves requests between workers that would compute the same, never off a cache.

use crate::select::TtftModel;
use crate::time::Instant;
use crate::types::{WorkerId, WorkerKey};
use alloc::collections::BTreeMap;

#[derive(Clone, Copy, Debug, Default)]
struct KeyWarmth {
    /// When a request on it last ended; `None` if none has.
    last_end: Option<Instant>,
    /// The cold wait of its current backlog's first pass, while that pass runs.
    ahead_ms: f64,
}

/// Per worker key; bounded by the fleet (a removed worker's keys go with it). Tracks
/// nothing while the timing model has no cold term.
#[derive(Debug, Default)]
pub(super) struct Warmth {
    keys: BTreeMap<WorkerKey, KeyWarmth>,
}

impl Warmth {
    /// The cold wait ahead of a request sent to `key` now, ms, `running` being the
    /// requests it runs (every replica's).
    pub(super) fn cold_ms(&self, timing: &TtftModel, now: Instant, key: WorkerKey, running: u32) -> f64 {
        let k = self.keys.get(&key).copied().unwrap_or_default();
        if running > 0 {
            return k.ahead_ms;
        }
        let idle_ms = k.last_end.map_or(u64::MAX, |t| now.micros_since(t) / 1000);
        timing.cold_ms(idle_ms)
    }

    /// Whether `timing` has a cold term, without which nothing is tracked.
    pub(super) fn tracks(&self, timing: &TtftModel) -> bool {
        on(timing)
    }

    /// A request was booked on `key`, which ran none before it: a new backlog, whose
    /// first pass pays the cold wait.
    pub(super) fn began_idle(&mut self, timing: &TtftModel, now: Instant, key: WorkerKey) {
        let ahead_ms = self.cold_ms(timing, now, key, 0);
        self.keys.entry(key).or_default().ahead_ms = ahead_ms;
    }

    /// A prefill on `key` finished: its first pass is over.
    pub(super) fn prefill_done(&mut self, key: WorkerKey) {
        if let Some(k) = self.keys.get_mut(&key) {
            k.ahead_ms = 0.0;
        }
    }

    /// A request on `key` ended (finished, failed or cancelled).
    pub(super) fn ended(&mut self, timing: &TtftModel, now: Instant, key: WorkerKey) {
        if on(timing) {
            *self.keys.entry(key).or_default() = KeyWarmth { last_end: Some(now), ahead_ms: 0.0 };
        }
    }

    pub(super) fn remove_worker(&mut self, id: WorkerId) {
        self.keys.retain(|k, _| k.worker != id);
    }

    /// A key whose worker `registered` does not know, if any.
    pub(super) fn stray(&self, registered: impl Fn(WorkerId) -> bool) -> Option<WorkerKey> {
        self.keys.keys().copied().find(|k| !registered(k.worker))
    }
}

fn on(timing: &TtftModel) -> bool {
    timing.cold_ms(u64::MAX) > 0.0
}
