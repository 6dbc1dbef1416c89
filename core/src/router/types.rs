//! The façade's inputs and outputs: requests, decisions, outputs and errors.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use crate::admission::{QueueRejection, TenantId};
use crate::affinity::AffinityError;
use crate::eligible::{EligibilityError, ExclusionReason};
use crate::hash::SeqHash;
use crate::index::IndexError;
use crate::pin::{PinError, RoutingHints};
use crate::select::{CandidateScore, KvCostOverrides, SelectError};
use crate::worker::WorkerError;
use crate::{Overlap, Phase, RequestId, WorkerKey};

/// Queue placement fields of a request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Priority {
    /// Higher strict priorities always leave the queue first.
    pub strict: i32,
    /// Moves the request ahead in the queue by this many milliseconds of arrival time.
    pub jump_ms: i64,
    /// The admission class the request's queue limits come from.
    pub class: Option<String>,
}

/// One routing question: where should this phase of this request go?
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    /// The adapter's id; with `phase` it must be unique among tracked requests.
    pub id: RequestId,
    /// Which step of serving this decision is for.
    pub phase: PhaseField,
    /// Sequence hashes of the prompt's full blocks.
    pub blocks: Vec<SeqHash>,
    /// Prompt length in tokens (including a trailing partial block).
    pub isl_tokens: u32,
    /// Session-affinity id, if the request belongs to a session.
    pub session: Option<Vec<u8>>,
    /// Pins, allow-lists and tolerations.
    pub hints: RoutingHints,
    /// Queue placement.
    pub priority: Priority,
    /// The tenant whose weighted share of the admission queue the request waits in
    /// (default 0); priorities order requests within a tenant only.
    pub tenant: TenantId,
    /// Predicted output length, if the client supplied one.
    pub expected_output_tokens: Option<u32>,
    /// Per-request overrides of the kv cost knobs.
    pub cost: KvCostOverrides,
    /// A worker already chosen for this phase (for example by a preview); a conflicting
    /// pin is an error.
    pub planned: Option<WorkerKey>,
    /// Restrict candidates to workers whose topology label `key` has value `value`.
    pub same_label_as: Option<(String, String)>,
    /// Query-only: compute the decision but change no state at all.
    pub preview: bool,
    /// Workers that already failed this request (a retry or migration): excluded unless
    /// an explicit pin names them.
    pub failed_workers: Vec<crate::WorkerId>,
}

/// `Phase` with a default, so `Request` can derive `Default`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhaseField(pub Phase);

impl Default for PhaseField {
    fn default() -> Self {
        PhaseField(Phase::Aggregated)
    }
}

/// One row of a decision's explanation.
#[derive(Clone, Debug, PartialEq)]
pub struct ExplainRow {
    /// The candidate.
    pub key: WorkerKey,
    /// Its prefix match, raw per tier.
    pub overlap: Overlap,
    /// Its score, if it was eligible.
    pub score: Option<CandidateScore>,
    /// Why it was left out, if it was.
    pub excluded: Option<ExclusionReason>,
}

/// A routed decision: a booking the adapter must confirm or roll back.
#[derive(Clone, Debug, PartialEq)]
pub struct Routed {
    /// The request.
    pub id: RequestId,
    /// Its phase.
    pub phase: Phase,
    /// Where it goes.
    pub target: WorkerKey,
    /// The chosen worker's prefix match.
    pub overlap: Overlap,
    /// The best raw overlap any worker had, to spot decisions that traded cache for load.
    pub max_overlap_blocks: u32,
    /// The request's prompt blocks (for metrics: overlap ratio).
    pub request_blocks: u32,
    /// Per-candidate explanation, in worker order.
    pub explanation: Vec<ExplainRow>,
    /// True for a preview: nothing was booked.
    pub preview: bool,
}

/// What `handle_request` decided.
#[derive(Clone, Debug, PartialEq)]
#[must_use]
#[non_exhaustive]
pub enum Decision {
    /// Routed now (booked unless a preview). Confirm with `handle_dispatched` or roll back
    /// with `handle_dispatch_failed`.
    Routed(Routed),
    /// Every eligible worker is busy: the request waits in the admission queue and later
    /// comes out of `poll_output` as routed or timed out.
    Queued,
    /// Another request is initializing this session's binding; this one comes out of
    /// `poll_output` once that commits or aborts.
    Waiting,
    /// The admission queue refused it (a 429 with `Retry-After`).
    Rejected(QueueRejection),
}

/// Why a dispatch failed, which decides whether the session binding survives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DispatchFailure {
    /// The client went away: the binding stays.
    Cancelled,
    /// The worker failed (connect error, reset, prepare step): the binding is dropped.
    Worker,
    /// The worker is up but could not serve this request (a 429, a 5xx, no first byte in
    /// time): the binding stays, in both affinity modes, because the worker still holds
    /// the session's cache. The request's retry lists the worker in
    /// [`Request::failed_workers`] and goes elsewhere once, without moving the binding.
    Refused,
}

/// Something the router decided on its own, drained from `poll_output`.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Output {
    /// A queued or waiting request is now routed (booked; confirm or roll back).
    Routed(Routed),
    /// A queued or waiting request failed.
    Failed {
        /// The request.
        id: RequestId,
        /// Its phase.
        phase: Phase,
        /// Why.
        error: RouteError,
    },
    /// A request that waited for a session's first binding was then refused by the
    /// admission queue (a 429 with `Retry-After`).
    Rejected {
        /// The request.
        id: RequestId,
        /// Its phase.
        phase: Phase,
        /// The limit it hit.
        rejection: QueueRejection,
    },
    /// A queued request waited longer than `queue_timeout_ms`.
    TimedOut {
        /// The request.
        id: RequestId,
        /// Its phase.
        phase: Phase,
    },
    /// An idle session binding expired.
    LeaseExpired {
        /// The worker it pointed to.
        worker: crate::WorkerId,
        /// Its phase.
        phase: Phase,
    },
    /// A booking outlived `request_age_max_ms` without `handle_finished` and was dropped.
    BookingExpired {
        /// The request.
        id: RequestId,
        /// Its phase.
        phase: Phase,
    },
}

/// Why a request could not be routed.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum RouteError {
    /// The session id is empty, too long, or the affinity table is full of live sessions.
    Affinity(AffinityError),
    /// The pins cannot be satisfied.
    Pin(PinError),
    /// No worker can take the request.
    Eligibility(EligibilityError),
    /// Selection failed (for example direct mode without a target).
    Select(SelectError),
    /// The request id and phase are already tracked.
    DuplicateRequest {
        /// The request.
        id: RequestId,
        /// Its phase.
        phase: Phase,
    },
    /// `requests_max` requests are already in flight, queued or waiting.
    TooManyRequests {
        /// The limit.
        requests_max: usize,
    },
    /// The bound or pinned worker was removed while the request waited.
    WorkerGone,
}

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouteError::Affinity(e) => write!(f, "session affinity: {e}"),
            RouteError::Pin(e) => write!(f, "{e}"),
            RouteError::Eligibility(e) => write!(f, "{e}"),
            RouteError::Select(e) => write!(f, "{e}"),
            RouteError::DuplicateRequest { id, phase } => {
                write!(f, "request {} ({phase}) is already being routed", id.0)
            }
            RouteError::TooManyRequests { requests_max } => {
                write!(f, "router is tracking its limit of {requests_max} requests")
            }
            RouteError::WorkerGone => f.write_str("the worker this request was bound to was removed"),
        }
    }
}

/// The wrapped error of a variant that wraps one is its source.
impl core::error::Error for RouteError {
    fn source(&self) -> Option<&(dyn core::error::Error + 'static)> {
        match self {
            RouteError::Affinity(e) => Some(e),
            RouteError::Pin(e) => Some(e),
            RouteError::Eligibility(e) => Some(e),
            RouteError::Select(e) => Some(e),
            _ => None,
        }
    }
}

/// Errors from the router's event and lifecycle inputs.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum InputError {
    /// A KV event the index refused.
    Index(IndexError),
    /// A worker update the worker table refused.
    Worker(WorkerError),
    /// No tracked request has this id and phase (counted, otherwise a no-op).
    UnknownRequest {
        /// The request.
        id: RequestId,
        /// Its phase.
        phase: Phase,
    },
    /// The request exists but is not in a state that accepts this input.
    WrongState {
        /// The request.
        id: RequestId,
        /// Its phase.
        phase: Phase,
    },
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InputError::Index(e) => write!(f, "kv event: {e}"),
            InputError::Worker(e) => write!(f, "worker update: {e}"),
            InputError::UnknownRequest { id, phase } => write!(f, "unknown request {} ({phase})", id.0),
            InputError::WrongState { id, phase } => {
                write!(f, "request {} ({phase}) is not in a state that accepts this input", id.0)
            }
        }
    }
}

/// The wrapped error of a variant that wraps one is its source.
impl core::error::Error for InputError {
    fn source(&self) -> Option<&(dyn core::error::Error + 'static)> {
        match self {
            InputError::Index(e) => Some(e),
            InputError::Worker(e) => Some(e),
            _ => None,
        }
    }
}

/// Why the router's invariants do not hold; only ever produced by a bug.
#[derive(Clone, Debug, PartialEq)]
pub struct InvariantViolation(pub String);

impl fmt::Display for InvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "router invariant violated: {}", self.0)
    }
}

impl core::error::Error for InvariantViolation {}

/// Where a pool's request blocks get their token ids, which decides whether the
/// workers' KV events can match them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestTokens {
    /// The engines' own token ids (the model's tokenizer): KV events match requests, so
    /// the first event from a worker makes its overlap exact and drops its predictions.
    #[default]
    Engine,
    /// An estimate (the caller has no tokenizer for the model): KV events match only
    /// workers that tokenize the same way, such as simulated ones. The cache of every
    /// worker that publishes events is then also predicted from the router's own
    /// decisions, even with `approximate` off (in approximate mode every worker's is),
    /// and a worker's overlap is the larger of its exact and predicted ones, so a
    /// matching worker still counts exactly and a mismatched one on its predictions.
    Estimated,
}
