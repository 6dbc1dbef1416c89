//! Pin resolution: turns a request's routing hints, its session's affinity binding and
//! any worker already planned for it into the set of workers the selector may consider.
//!
//! The result is a [`PinResolution`]: any worker, one worker (any of its ranks), or one
//! exact `(worker, rank)`. Resolution checks that a pin names a worker that exists,
//! serves the phase and has the named rank, and that the pins agree with each other. It
//! does not judge health, taints or load: [`crate::eligible`] does, and [`crate::eligible::check_pinned`]
//! turns an ineligible pinned worker into an error. Choosing among the candidates is
//! left to the selector.
//!
//! # Rules
//!
//! * **Which hint pins a phase** ([`explicit_pin`]): prefill uses `prefill_worker_id`,
//!   else `backend_instance_id`, with `prefill_dp_rank`, else `dp_rank`. Decode and
//!   aggregated use `decode_worker_id`, else `backend_instance_id`, with `dp_rank`. A
//!   rank without a worker pins nothing.
//! * **Ranks.** An explicit pin without a rank resolves to the worker's only rank; a
//!   worker with several ranks, or whose ranks are unknown, needs an explicit rank
//!   ([`PinError::RankRequired`]). Rank 0 is a real rank. A rank must be below the
//!   worker's rank count (or below `dp_ranks_max` when the count is unknown).
//! * **Explicit pin and affinity binding.** An explicit pin with a rank wins. An explicit
//!   pin without a rank takes the binding's rank when the binding names the same worker.
//!   With no explicit pin the binding is used; a binding without a rank narrows to its
//!   worker ([`PinResolution::Worker`]) and is never a rank error.
//! * **Planned worker.** A worker already previewed or planned for the request narrows the
//!   result to that exact key; if it disagrees with the pin, that is
//!   [`PinError::Conflict`], naming both.
//! * **Direct mode.** Every request must pin its phase explicitly, or
//!   [`PinError::DirectTargetRequired`].

use alloc::vec::Vec;
use core::fmt;

use crate::exclusion::ExclusionReason;
use crate::types::{DpRank, Phase, WorkerId, WorkerKey};
use crate::worker::{Toleration, WorkerTable};

/// The routing fields a request may carry. All are optional; `Default` is "no hints".
#[derive(Clone, PartialEq, Eq, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
pub struct RoutingHints {
    /// Pins every phase to this worker unless a phase-specific id is given.
    pub backend_instance_id: Option<WorkerId>,
    /// Pins the prefill phase.
    pub prefill_worker_id: Option<WorkerId>,
    /// Pins the decode and aggregated phases.
    pub decode_worker_id: Option<WorkerId>,
    /// The rank for the decode and aggregated phases, and for prefill when
    /// `prefill_dp_rank` is absent.
    pub dp_rank: Option<DpRank>,
    /// The rank for the prefill phase.
    pub prefill_dp_rank: Option<DpRank>,
    /// When present, only these workers may serve (an empty list allows none).
    pub allowed_worker_ids: Option<Vec<WorkerId>>,
    /// Taints this request tolerates.
    pub tolerations: Vec<Toleration>,
}

/// A worker (and maybe rank) a request names for one phase.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ExplicitPin {
    /// The worker named.
    pub worker: WorkerId,
    /// The rank named, if any.
    pub rank: Option<DpRank>,
}

/// A session's affinity binding for one phase.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct AffinityPin {
    /// The bound worker.
    pub worker: WorkerId,
    /// The bound rank; `None` narrows to the worker and lets the selector pick the rank.
    pub rank: Option<DpRank>,
}

/// Which candidates remain after pins.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PinResolution {
    /// No pin: every worker serving the phase.
    Any,
    /// Any rank of this worker.
    Worker(WorkerId),
    /// Exactly this key.
    Exact(WorkerKey),
}

impl PinResolution {
    /// Whether `key` is a candidate under this resolution.
    pub fn admits(self, key: WorkerKey) -> bool {
        match self {
            PinResolution::Any => true,
            PinResolution::Worker(w) => key.worker == w,
            PinResolution::Exact(k) => key == k,
        }
    }

    /// The pinned worker, if any.
    pub fn worker(self) -> Option<WorkerId> {
        match self {
            PinResolution::Any => None,
            PinResolution::Worker(w) => Some(w),
            PinResolution::Exact(k) => Some(k.worker),
        }
    }
}

impl fmt::Display for PinResolution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PinResolution::Any => f.write_str("any worker"),
            PinResolution::Worker(w) => write!(f, "worker {}", w.0),
            PinResolution::Exact(k) => write!(f, "worker {} rank {}", k.worker.0, k.rank.0),
        }
    }
}

/// Why a request's pins cannot be honoured.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum PinError {
    /// A pin or plan names a worker not in the table.
    UnknownWorker {
        /// The worker named.
        worker: WorkerId,
    },
    /// An explicit pin names no rank and the worker does not have exactly one.
    RankRequired {
        /// The worker named.
        worker: WorkerId,
        /// Its rank count, `None` when unknown.
        ranks: Option<u32>,
    },
    /// A pin or plan names a rank the worker does not have.
    RankOutOfRange {
        /// The worker named.
        worker: WorkerId,
        /// The rank named.
        rank: DpRank,
        /// Its rank count (or the table's `dp_ranks_max` when the count is unknown).
        ranks: u32,
    },
    /// The worker planned or previewed for the request is not the one it pins.
    Conflict {
        /// What the request's pins asked for.
        requested: PinResolution,
        /// What was planned.
        planned: WorkerKey,
    },
    /// Direct routing mode and the request names no worker for this phase.
    DirectTargetRequired {
        /// The phase being routed.
        phase: Phase,
    },
    /// The pinned worker's role does not serve this phase.
    WrongRole {
        /// The worker named.
        worker: WorkerId,
        /// The phase being routed.
        phase: Phase,
    },
    /// The pinned worker exists but eligibility excluded it.
    Ineligible {
        /// The pinned key (the lowest-ranked one, for a worker pin).
        worker: WorkerKey,
        /// Why it was excluded.
        reason: ExclusionReason,
    },
}

impl fmt::Display for PinError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PinError::UnknownWorker { worker } => {
                write!(f, "pinned worker {} is unknown", worker.0)
            }
            PinError::RankRequired { worker, ranks: Some(n) } => {
                write!(f, "worker {} has {n} dp ranks; the pin must name one", worker.0)
            }
            PinError::RankRequired { worker, ranks: None } => {
                write!(f, "worker {} has not reported its dp ranks; the pin must name one", worker.0)
            }
            PinError::RankOutOfRange { worker, rank, ranks } => {
                write!(f, "dp rank {} is out of range for worker {} ({ranks} ranks)", rank.0, worker.0)
            }
            PinError::Conflict { requested, planned } => write!(
                f,
                "request pins {requested} but worker {} rank {} was planned",
                planned.worker.0, planned.rank.0
            ),
            PinError::DirectTargetRequired { phase } => {
                write!(f, "worker ID required for {phase} request in Direct routing mode")
            }
            PinError::WrongRole { worker, phase } => {
                write!(f, "worker {} does not serve {phase} requests", worker.0)
            }
            PinError::Ineligible { worker, reason } => {
                write!(f, "pinned worker {} rank {} is not eligible: {reason}", worker.worker.0, worker.rank.0)
            }
        }
    }
}

impl core::error::Error for PinError {}

/// The worker and rank `hints` name for `phase`, if any (see the module rules).
pub fn explicit_pin(phase: Phase, hints: &RoutingHints) -> Option<ExplicitPin> {
    let (worker, rank) = match phase {
        Phase::Prefill => {
            (hints.prefill_worker_id.or(hints.backend_instance_id), hints.prefill_dp_rank.or(hints.dp_rank))
        }
        Phase::Decode | Phase::Aggregated => (hints.decode_worker_id.or(hints.backend_instance_id), hints.dp_rank),
    };
    worker.map(|worker| ExplicitPin { worker, rank })
}

/// Resolves the candidates for one phase of a request (see the module rules).
///
/// `affinity` is the session's binding for this phase, `planned` a key already previewed
/// or planned for it. Work: a few table look-ups.
pub(crate) fn resolve(
    phase: Phase,
    hints: &RoutingHints,
    affinity: Option<AffinityPin>,
    planned: Option<WorkerKey>,
    workers: &WorkerTable,
    direct_mode: bool,
) -> Result<PinResolution, PinError> {
    let explicit = explicit_pin(phase, hints);
    if direct_mode && explicit.is_none() {
        return Err(PinError::DirectTargetRequired { phase });
    }
    let requested = merge(explicit, affinity);
    if let Some(r) = requested {
        validate(r.worker, r.rank, phase, workers)?;
    }
    if let Some(p) = planned {
        validate(p.worker, Some(p.rank), phase, workers)?;
    }
    let Some(r) = requested else {
        return Ok(planned.map_or(PinResolution::Any, PinResolution::Exact));
    };
    if let Some(p) = planned {
        let requested = r.loose();
        if !requested.admits(p) {
            return Err(PinError::Conflict { requested, planned: p });
        }
        return Ok(PinResolution::Exact(p));
    }
    match (r.rank, r.explicit) {
        (Some(rank), _) => Ok(PinResolution::Exact(WorkerKey { worker: r.worker, rank })),
        (None, false) => Ok(PinResolution::Worker(r.worker)),
        (None, true) => only_rank(r.worker, workers).map(PinResolution::Exact),
    }
}

/// A pin after merging the explicit pin with the affinity binding.
#[derive(Clone, Copy)]
struct Requested {
    worker: WorkerId,
    rank: Option<DpRank>,
    /// Whether the worker came from the request itself (rank rules apply).
    explicit: bool,
}

impl Requested {
    fn loose(self) -> PinResolution {
        match self.rank {
            Some(rank) => PinResolution::Exact(WorkerKey { worker: self.worker, rank }),
            None => PinResolution::Worker(self.worker),
        }
    }
}

fn merge(explicit: Option<ExplicitPin>, affinity: Option<AffinityPin>) -> Option<Requested> {
    match (explicit, affinity) {
        (Some(e), Some(a)) if e.rank.is_none() && a.worker == e.worker => {
            Some(Requested { worker: e.worker, rank: a.rank, explicit: true })
        }
        (Some(e), _) => Some(Requested { worker: e.worker, rank: e.rank, explicit: true }),
        (None, Some(a)) => Some(Requested { worker: a.worker, rank: a.rank, explicit: false }),
        (None, None) => None,
    }
}

fn validate(worker: WorkerId, rank: Option<DpRank>, phase: Phase, workers: &WorkerTable) -> Result<(), PinError> {
    let spec = workers.get(worker).ok_or(PinError::UnknownWorker { worker })?;
    if !spec.role.serves(phase) {
        return Err(PinError::WrongRole { worker, phase });
    }
    if let Some(rank) = rank {
        let ranks = spec.dp_ranks.unwrap_or(workers.config().dp_ranks_max);
        if rank.0 >= ranks {
            return Err(PinError::RankOutOfRange { worker, rank, ranks });
        }
    }
    Ok(())
}

fn only_rank(worker: WorkerId, workers: &WorkerTable) -> Result<WorkerKey, PinError> {
    let ranks = workers.get(worker).and_then(|s| s.dp_ranks);
    match ranks {
        Some(1) => Ok(WorkerKey { worker, rank: DpRank(0) }),
        _ => Err(PinError::RankRequired { worker, ranks }),
    }
}

#[cfg(test)]
mod tests;
