//! `router-core` decides where an LLM inference request should go, and nothing else.
//!
//! It is a set of deterministic state machines: block hashing, the prefix index, the
//! load tracker, pin resolution, eligibility, session-affinity leases, admission and
//! worker selection, behind one sans-IO [`Router`] façade. It does no
//! networking, reads no clock, draws no random numbers, spawns nothing, logs nothing
//! and takes no locks: time arrives as an [`Instant`] argument and randomness as
//! a [`Draw`]. Every table has a bound named in its config.
//!
//! What it leaves to others: sockets, HTTP, tokenization, KV-event decoding, metrics
//! export and timers live in the adapter crates, which call `handle_*`, drain
//! `poll_*`, and sleep until `poll_timeout`. [`Router`]'s documentation states that
//! calling contract in full; `examples/event_loop.rs` drives a router through it.
//!
//! # The API
//!
//! Everything is at the crate root:
//!
//! * the façade: [`Router`], its [`RouterConfig`], and plain-data views of it
//!   ([`RouterSnapshot`], [`RouterCounts`], [`RouterStats`]);
//! * requests and what becomes of them: [`Request`], [`Decision`], [`Routed`],
//!   [`Output`], [`DispatchFailure`];
//! * the fleet: [`WorkerSpec`], [`WorkerUpdate`], [`Health`], [`Taint`];
//! * KV events: [`IndexEvent`], block hashing ([`hash_tokens`], [`SeqHash`]) and the
//!   exact [`PrefixIndex`], which also stands alone;
//! * replicas: [`ReplicaUpdate`], [`ReplicaId`];
//! * the cost learner: its inputs ([`Observation`], [`EngineLoad`]) and what it knows
//!   of a worker key ([`Learned`], from [`Router::learned`]);
//! * the configuration of each sub-machine ([`IndexConfig`], [`LoadConfig`],
//!   [`AffinityConfig`], [`QueueConfig`], [`LearnConfig`], the cost model's
//!   [`KvCostConfig`] with its engine timing [`TtftModel`], ...), and [`limits`] on the
//!   work per call;
//! * errors, one small enum per operation ([`RouteError`], [`InputError`],
//!   [`ReplicaError`], ...), each implementing [`core::error::Error`] with its cause as
//!   `source()`.
#![no_std]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, unnameable_types)]
#![cfg_attr(not(test), allow(clippy::todo))]

extern crate alloc;
#[cfg(test)]
extern crate std;

// The modules are private: the items below are the whole API, grouped by what an
// embedder does with them.
mod admission;
mod affinity;
mod eligible;
mod exclusion;
mod hash;
mod index;
mod learn;
mod load;
mod mathf;
mod pin;
mod router;
mod select;
mod time;
mod types;
mod worker;

// ---- the façade ----
pub use router::{KeySnapshot, Router, RouterCounts, RouterSnapshot, RouterStats, WorkerSnapshot};

// ---- requests, decisions and outputs ----
pub use pin::{explicit_pin, ExplicitPin, RoutingHints};
pub use router::{Decision, DispatchFailure, ExplainRow, Output, PhaseField, Priority, Request, Routed};
pub use select::{CandidateScore, KvCostOverrides};

// ---- the cost learner's inputs and view ----
pub use learn::{EngineLoad, LearnConfig, LearnError, LearnStats, Learned, Observation};

// ---- ids and plain values ----
pub use admission::TenantId;
pub use time::Instant;
pub use types::{DpRank, Draw, Overlap, Phase, RequestId, Tier, WorkerId, WorkerKey, WorkerLoad};

// ---- workers ----
pub use router::WorkerUpdate;
pub use worker::{Health, Taint, TaintEffect, Toleration, WorkerRole, WorkerSpec};

// ---- KV events, block hashes and the prefix index ----
pub use hash::{
    chain, chain_all, hash_tokens, local_hash, seq_hashes, BlockHash, BlockSize, HashSeed, LocalHash, SeqHash,
    BLOCK_SIZE_MAX_TOKENS,
};
pub use hash::{hash_tokens_with_media, MediaError, MediaItem, MediaItems, MediaKey, MEDIA_ITEMS_MAX};
pub use index::{
    ApplySummary, IndexEvent, IndexStats, OverlapScores, PrefixIndex, UnknownParentPolicy, HASH_SEED_DEFAULT,
};

// ---- configuration ----
pub use admission::{ClassLimits, QueueConfig, QueueOrder, TENANT_WEIGHT_MAX};
pub use affinity::{AffinityConfig, AffinityMode};
pub use eligible::EligibilityConfig;
pub use index::{ApproxConfig, IndexConfig};
pub use load::{LoadConfig, RemoteLoadConfig};
pub use router::{DisaggConfig, ReplicaConfig, RequestTokens, RouterConfig};
pub use select::{KvCostConfig, KvCostModel, RouterMode, TtftModel, TtftWeights};
pub use worker::WorkerTableConfig;

// ---- disaggregation and replicas ----
pub use affinity::{BindStamp, Binding};
pub use load::ReplicaId;
pub use router::{BypassReason, DisaggPlan, DisaggStats, ReplicaStats, ReplicaUpdate};

// ---- counters and refusals reported as data ----
pub use admission::{LimitKind, QueueRejection};
pub use affinity::AffinityStats;
pub use eligible::ExclusionReason;
pub use load::RemoteLoadStats;

// ---- errors ----
pub use affinity::AffinityError;
pub use eligible::EligibilityError;
pub use hash::BlockSizeError;
pub use index::IndexError;
pub use load::RemoteLoadError;
pub use pin::PinError;
pub use router::{InputError, InvariantViolation, ReplicaError, RouteError};
pub use select::{RouterModeParseError, SelectError};
pub use worker::{ParseError, WorkerError};

/// Bounds on the work one [`Router::handle_timeout`] call does, so that a clock jump of
/// hours cannot stall the caller. While more is due, [`Router::poll_timeout`] stays at or
/// before `now`.
pub mod limits {
    pub use crate::affinity::EXPIRE_PER_CALL_MAX as SESSIONS_EXPIRE_PER_CALL_MAX;
    pub use crate::index::EXPIRE_PER_CALL_MAX as PREDICTIONS_EXPIRE_PER_CALL_MAX;
    pub use crate::load::EXPIRE_PER_CALL_MAX as BOOKINGS_EXPIRE_PER_CALL_MAX;
    pub use crate::load::REMOTE_EXPIRE_PER_CALL_MAX;
    pub use crate::router::ORPHANS_PER_CALL_MAX;
}

/// The sub-machines behind [`Router`], for this workspace's benches and model tests.
///
/// Not part of the API: nothing here is covered by semver, and it may change or vanish
/// in any release. Embedders drive a [`Router`].
#[doc(hidden)]
pub mod internals {
    pub use crate::affinity::{
        Acquire, AffinityOutput, AffinityTable, InitToken, LeaseId, RemoteApplied, RemoteBinding, WaitToken,
    };
    pub use crate::index::ApproxIndex;
    pub use crate::load::{LoadError, LoadStats, LoadTracker, PrefillProgress};
    pub use crate::pin::PinResolution;
    pub use crate::select::{kv_cost, Candidate, SelectRequest, Selection, Selector};
}
