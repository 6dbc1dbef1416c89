//! `kvroute-sim` simulates a fleet of LLM inference workers so routing policies can be
//! compared offline, deterministically, and fast.
//!
//! It models each worker the way NVIDIA Dynamo's mocker does (vLLM v1 style: paged KV
//! blocks with prefix caching and LRU eviction, chunked prefill, LIFO preemption, a
//! polynomial timing model), reads Mooncake-format traces or generates synthetic ones,
//! replays them through any [`replay::Dispatcher`] on virtual time, and reports TTFT,
//! ITL, throughput and prefix reuse. It does no I/O of its own and reads no clock; the
//! same inputs give byte-identical reports.
//!
//! What it leaves to others: the routing policy, which stays in router-core ([`router`]
//! only adapts router-core's façade to the [`replay::Dispatcher`] calls), file handling,
//! and plotting.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod bound;
pub mod ceiling;
pub mod engine;
pub mod lookahead;
pub mod peer;
pub mod prompt;
pub mod replay;
pub mod rng;
pub mod router;
pub mod search;
pub mod stats;
pub mod synth;
#[cfg(test)]
mod test_requests;
pub mod trace;

pub use engine::{Engine, EngineConfig, EngineOutput, EngineRequest, EngineRole, KvEvent};
pub use prompt::Prompt;
pub use replay::{replay, Dispatch, Dispatcher, ReplayConfig, ReplayReport, SimRequest, WorkerLoadSample};
pub use stats::{RequestRecord, Summary};
