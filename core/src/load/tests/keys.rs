//! Worker keys for the load model tests: `workers` × `ranks` of them.

use crate::types::WorkerKey;
use proptest::prelude::*;

/// Every key, worker by worker.
pub(in crate::load) fn universe(workers: u64, ranks: u32) -> impl Iterator<Item = WorkerKey> {
    (0..workers).flat_map(move |w| (0..ranks).map(move |r| WorkerKey::new(w, r)))
}

/// Any one key.
pub(in crate::load) fn any_key(workers: u64, ranks: u32) -> impl Strategy<Value = WorkerKey> + Clone {
    (0..workers, 0..ranks).prop_map(|(w, r)| WorkerKey::new(w, r))
}
