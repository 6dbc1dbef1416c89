//! The worker table: which workers exist, what role each plays, how many data-parallel
//! ranks it has, its taints, topology labels, capacity figures and health.
//!
//! The table only records facts and enforces its bounds. It decides nothing about a
//! request: [`crate::pin`] resolves pins against it and [`crate::eligible`] turns its
//! facts into per-request verdicts. Iteration is in [`WorkerId`] order (a `BTreeMap`), so
//! anything built by walking the table is deterministic.

use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;
use core::str::FromStr;

use crate::types::{DpRank, Phase, WorkerId, WorkerKey};

/// What a worker is deployed to do.
///
/// Which request phases a role serves ([`WorkerRole::serves`]):
///
/// | role \ phase | Aggregated | Prefill | Decode |
/// |---|---|---|---|
/// | `Aggregated` | yes | no | no |
/// | `Prefill` | no | yes | no |
/// | `Decode` | yes (disagg bypass) | no | yes |
///
/// A decode worker also serves the aggregated phase because the disaggregated bypass
/// (prefill skipped, say for a short prompt) runs the whole request on a decode worker.
/// An aggregated worker serves only the aggregated phase: it is not part of a
/// disaggregated pipeline, so it never takes half of one.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum WorkerRole {
    /// Does prefill and decode for each request.
    Aggregated,
    /// Does only the prefill step of disaggregated serving.
    Prefill,
    /// Does the decode step of disaggregated serving (and bypassed aggregated requests).
    Decode,
}

impl WorkerRole {
    /// The lower-case name used in configuration, errors and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Aggregated => "aggregated",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }

    /// Whether a worker of this role may serve `phase` (see the table on the type).
    pub const fn serves(self, phase: Phase) -> bool {
        matches!(
            (self, phase),
            (WorkerRole::Aggregated, Phase::Aggregated)
                | (WorkerRole::Prefill, Phase::Prefill)
                | (WorkerRole::Decode, Phase::Decode)
                | (WorkerRole::Decode, Phase::Aggregated)
        )
    }
}

impl fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that matches no variant of the enum being parsed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ParseError {
    /// The accepted names, for the message.
    pub expected: &'static str,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "expected one of: {}", self.expected)
    }
}

impl core::error::Error for ParseError {}

impl FromStr for WorkerRole {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "aggregated" => Ok(WorkerRole::Aggregated),
            "prefill" => Ok(WorkerRole::Prefill),
            "decode" => Ok(WorkerRole::Decode),
            _ => Err(ParseError { expected: "aggregated, prefill, decode" }),
        }
    }
}

/// What a taint does to requests that do not tolerate it (Kubernetes semantics).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum TaintEffect {
    /// The worker is excluded.
    NoSchedule,
    /// The worker stays eligible but costs more, so it is picked only when better ones are not.
    PreferNoSchedule,
}

impl TaintEffect {
    /// The Kubernetes spelling, `NoSchedule` or `PreferNoSchedule`.
    pub const fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::PreferNoSchedule => "PreferNoSchedule",
        }
    }
}

impl fmt::Display for TaintEffect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TaintEffect {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "NoSchedule" => Ok(TaintEffect::NoSchedule),
            "PreferNoSchedule" => Ok(TaintEffect::PreferNoSchedule),
            _ => Err(ParseError { expected: "NoSchedule, PreferNoSchedule" }),
        }
    }
}

/// A mark on a worker that repels requests which do not tolerate it.
#[derive(Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Taint {
    /// The taint's key, e.g. `gpu-maintenance`.
    pub key: String,
    /// The taint's value; may be empty.
    pub value: String,
    /// What the taint does to requests that do not tolerate it.
    pub effect: TaintEffect,
}

/// A request's permission to land on workers carrying a matching taint.
#[derive(Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Toleration {
    /// The taint key tolerated. An empty key with `value: None` tolerates every key
    /// (Kubernetes' "empty key, operator Exists").
    pub key: String,
    /// `Some(v)` tolerates only the value `v` (operator Equal); `None` tolerates any
    /// value (operator Exists).
    pub value: Option<String>,
    /// `Some(e)` tolerates only effect `e`; `None` tolerates every effect.
    pub effect: Option<TaintEffect>,
}

impl Toleration {
    /// Whether this toleration matches `taint`, with Kubernetes' matching rules.
    pub fn tolerates(&self, taint: &Taint) -> bool {
        if self.effect.is_some_and(|e| e != taint.effect) {
            return false;
        }
        match &self.value {
            None => self.key.is_empty() || self.key == taint.key,
            Some(v) => self.key == taint.key && *v == taint.value,
        }
    }
}

/// Whether a worker may take new requests.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Health {
    /// Takes new requests.
    #[default]
    Healthy,
    /// Removed from rotation by a failure detector; takes nothing new.
    Ejected,
    /// Finishing its in-flight requests before leaving; takes nothing new.
    Draining,
}

impl Health {
    /// The lower-case name used in metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "healthy",
            Health::Ejected => "ejected",
            Health::Draining => "draining",
        }
    }
}

/// Everything the router is told about one worker.
#[derive(Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WorkerSpec {
    /// The worker.
    pub id: WorkerId,
    /// Which phases it serves.
    pub role: WorkerRole,
    /// How many data-parallel ranks it has; `None` when the worker has not said. A worker
    /// with unknown ranks is routed as rank 0 unless a request names another rank.
    pub dp_ranks: Option<u32>,
    /// Its taints, at most [`WorkerTableConfig::taints_max`].
    pub taints: Vec<Taint>,
    /// Relative capacity for the selector; at least 1 (default 1).
    pub weight: u32,
    /// Tokens one forward pass batches, per rank (default 8192); scales the prefill
    /// overload threshold.
    pub max_batched_tokens: u32,
    /// KV-cache capacity in blocks, per rank (default 16384); scales the decode overload
    /// threshold.
    pub kv_blocks: u32,
    /// Topology labels such as `("node", "n7")` or `("rack", "r2")`, at most
    /// [`WorkerTableConfig::labels_max`]. The first pair with a key wins.
    pub labels: Vec<(String, String)>,
}

impl WorkerSpec {
    /// A worker with the default capacity figures, one known rank, no taints, no labels.
    pub fn new(id: WorkerId, role: WorkerRole) -> Self {
        WorkerSpec {
            id,
            role,
            dp_ranks: Some(1),
            taints: Vec::new(),
            weight: 1,
            max_batched_tokens: 8192,
            kv_blocks: 16384,
            labels: Vec::new(),
        }
    }

    /// The value of label `key`, if the worker carries it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// How many ranks routing enumerates: the known count, or 1 (rank 0) when unknown.
    pub fn routable_ranks(&self) -> u32 {
        self.dp_ranks.unwrap_or(1)
    }
}

/// Bounds of the worker table.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct WorkerTableConfig {
    /// Most workers held (default 4096).
    pub workers_max: usize,
    /// Most dp ranks one worker may declare (default 1024).
    pub dp_ranks_max: u32,
    /// Most taints on one worker (default 32).
    pub taints_max: usize,
    /// Most topology labels on one worker (default 32).
    pub labels_max: usize,
}

impl Default for WorkerTableConfig {
    fn default() -> Self {
        WorkerTableConfig { workers_max: 4096, dp_ranks_max: 1024, taints_max: 32, labels_max: 32 }
    }
}

/// Why the table refused a change. A refused change leaves the table as it was.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum WorkerError {
    /// Adding the worker would exceed `workers_max`.
    TableFull {
        /// The bound.
        workers_max: usize,
    },
    /// The worker declares more dp ranks than `dp_ranks_max`.
    TooManyRanks {
        /// The worker.
        worker: WorkerId,
        /// Ranks it declared.
        ranks: u32,
        /// The bound.
        dp_ranks_max: u32,
    },
    /// The worker declares zero dp ranks; a worker that exists has at least one.
    ZeroRanks {
        /// The worker.
        worker: WorkerId,
    },
    /// The worker's weight is zero; remove or drain a worker instead.
    ZeroWeight {
        /// The worker.
        worker: WorkerId,
    },
    /// The worker carries more taints than `taints_max`.
    TooManyTaints {
        /// The worker.
        worker: WorkerId,
        /// Taints given.
        taints: usize,
        /// The bound.
        taints_max: usize,
    },
    /// The worker carries more labels than `labels_max`.
    TooManyLabels {
        /// The worker.
        worker: WorkerId,
        /// Labels given.
        labels: usize,
        /// The bound.
        labels_max: usize,
    },
    /// No worker with this id is in the table.
    UnknownWorker {
        /// The worker asked for.
        worker: WorkerId,
    },
}

impl fmt::Display for WorkerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            WorkerError::TableFull { workers_max } => {
                write!(f, "worker table full ({workers_max} workers)")
            }
            WorkerError::TooManyRanks { worker, ranks, dp_ranks_max } => {
                write!(f, "worker {} declares {ranks} dp ranks, above the limit {dp_ranks_max}", worker.0)
            }
            WorkerError::ZeroRanks { worker } => {
                write!(f, "worker {} declares zero dp ranks", worker.0)
            }
            WorkerError::ZeroWeight { worker } => write!(f, "worker {} has weight zero", worker.0),
            WorkerError::TooManyTaints { worker, taints, taints_max } => {
                write!(f, "worker {} has {taints} taints, above the limit {taints_max}", worker.0)
            }
            WorkerError::TooManyLabels { worker, labels, labels_max } => {
                write!(f, "worker {} has {labels} labels, above the limit {labels_max}", worker.0)
            }
            WorkerError::UnknownWorker { worker } => write!(f, "unknown worker {}", worker.0),
        }
    }
}

impl core::error::Error for WorkerError {}

#[derive(Clone, Debug)]
struct Entry {
    spec: WorkerSpec,
    health: Health,
}

/// The set of known workers, bounded by [`WorkerTableConfig`], iterated in id order.
#[derive(Clone, Debug)]
pub(crate) struct WorkerTable {
    cfg: WorkerTableConfig,
    workers: BTreeMap<WorkerId, Entry>,
}

impl WorkerTable {
    /// An empty table.
    pub(crate) fn new(cfg: WorkerTableConfig) -> Self {
        WorkerTable { cfg, workers: BTreeMap::new() }
    }

    /// Adds `spec`, or replaces the spec of a worker already present (keeping its health).
    /// Returns whether the worker is new.
    pub(crate) fn upsert(&mut self, spec: WorkerSpec) -> Result<bool, WorkerError> {
        self.validate(&spec)?;
        if let Some(entry) = self.workers.get_mut(&spec.id) {
            entry.spec = spec;
            return Ok(false);
        }
        if self.workers.len() >= self.cfg.workers_max {
            return Err(WorkerError::TableFull { workers_max: self.cfg.workers_max });
        }
        self.workers.insert(spec.id, Entry { spec, health: Health::Healthy });
        Ok(true)
    }

    /// Removes a worker, returning its spec if it was present.
    pub(crate) fn remove(&mut self, id: WorkerId) -> Option<WorkerSpec> {
        self.workers.remove(&id).map(|e| e.spec)
    }

    /// Sets a worker's health.
    pub(crate) fn set_health(&mut self, id: WorkerId, health: Health) -> Result<(), WorkerError> {
        self.entry_mut(id)?.health = health;
        Ok(())
    }

    /// Replaces a worker's taints.
    pub(crate) fn set_taints(&mut self, id: WorkerId, taints: Vec<Taint>) -> Result<(), WorkerError> {
        let taints_max = self.cfg.taints_max;
        let entry = self.entry_mut(id)?;
        if taints.len() > taints_max {
            return Err(WorkerError::TooManyTaints { worker: id, taints: taints.len(), taints_max });
        }
        entry.spec.taints = taints;
        Ok(())
    }

    /// A worker's spec.
    pub(crate) fn get(&self, id: WorkerId) -> Option<&WorkerSpec> {
        self.workers.get(&id).map(|e| &e.spec)
    }

    /// A worker's health.
    pub(crate) fn health(&self, id: WorkerId) -> Option<Health> {
        self.workers.get(&id).map(|e| e.health)
    }

    /// Every worker with its health, in id order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&WorkerSpec, Health)> + '_ {
        self.workers.values().map(|e| (&e.spec, e.health))
    }

    /// Every routable `(worker, rank)` in key order. A worker with unknown ranks
    /// contributes rank 0 only. Work: one step per key.
    pub(crate) fn keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.workers.values().flat_map(|e| spec_keys(&e.spec))
    }

    /// The keys of workers whose role serves `phase`, in key order, whatever their health.
    #[cfg(test)]
    pub(crate) fn keys_for_phase(&self, phase: Phase) -> impl Iterator<Item = WorkerKey> + '_ {
        self.workers.values().filter(move |e| e.spec.role.serves(phase)).flat_map(|e| spec_keys(&e.spec))
    }

    /// How many workers the table holds.
    pub(crate) fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether the table holds no worker.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The table's bounds.
    pub(crate) fn config(&self) -> &WorkerTableConfig {
        &self.cfg
    }

    fn entry_mut(&mut self, id: WorkerId) -> Result<&mut Entry, WorkerError> {
        self.workers.get_mut(&id).ok_or(WorkerError::UnknownWorker { worker: id })
    }

    fn validate(&self, spec: &WorkerSpec) -> Result<(), WorkerError> {
        let worker = spec.id;
        let cfg = &self.cfg;
        match spec.dp_ranks {
            Some(0) => return Err(WorkerError::ZeroRanks { worker }),
            Some(ranks) if ranks > cfg.dp_ranks_max => {
                return Err(WorkerError::TooManyRanks { worker, ranks, dp_ranks_max: cfg.dp_ranks_max })
            }
            _ => {}
        }
        if spec.weight == 0 {
            return Err(WorkerError::ZeroWeight { worker });
        }
        if spec.taints.len() > cfg.taints_max {
            return Err(WorkerError::TooManyTaints { worker, taints: spec.taints.len(), taints_max: cfg.taints_max });
        }
        if spec.labels.len() > cfg.labels_max {
            return Err(WorkerError::TooManyLabels { worker, labels: spec.labels.len(), labels_max: cfg.labels_max });
        }
        Ok(())
    }
}

fn spec_keys(spec: &WorkerSpec) -> impl Iterator<Item = WorkerKey> {
    let worker = spec.id;
    (0..spec.routable_ranks()).map(move |r| WorkerKey { worker, rank: DpRank(r) })
}

#[cfg(test)]
mod tests;
