//! `router-core` decides where an LLM inference request should go, and nothing else.
//!
//! It is a set of deterministic state machines: block hashing, the prefix index, the
//! load tracker, pin resolution, eligibility, session-affinity leases, admission and
//! worker selection, behind one sans-IO [`router::Router`] façade. It does no
//! networking, reads no clock, draws no random numbers, spawns nothing, logs nothing
//! and takes no locks: time arrives as an [`time::Instant`] argument and randomness as
//! a [`types::Draw`]. Every table has a bound named in its config.
//!
//! What it leaves to others: sockets, HTTP, tokenization, KV-event decoding, metrics
//! export and timers live in the adapter crates, which call `handle_*`, drain
//! `poll_*`, and sleep until `poll_timeout`.
#![no_std]
#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), allow(clippy::todo))]

extern crate alloc;
#[cfg(any(feature = "std", test))]
extern crate std;

pub mod admission;
pub mod affinity;
pub mod eligible;
pub mod hash;
pub mod index;
pub mod learn;
pub mod load;
pub mod mathf;
pub mod pin;
pub mod router;
pub mod select;
pub mod time;
pub mod types;
pub mod worker;

pub use learn::{CostLearner, EngineLoad, LearnConfig, LearnError, Observation};
pub use time::Instant;
pub use types::{DpRank, Draw, Overlap, Phase, RequestId, Tier, WorkerId, WorkerKey, WorkerLoad};
