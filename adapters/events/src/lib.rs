//! `kvroute-events` turns the KV-cache events that vLLM and SGLang publish over
//! ZeroMQ into prefix-index updates keyed by the router's own block hashes.
//!
//! Layers, from pure to I/O:
//! * [`msgpack`]: a bounded, zero-copy MessagePack reader ([`encode`] writes, for fakes).
//! * [`decode`]: one payload into typed events, both wire encodings, strict limits.
//! * [`translate`]: engine hashes into router hashes per (worker, rank), and the
//!   [`EventSink`] the results go to.
//! * [`sequence`]: the per-publisher ordering state machine (duplicates, gaps and
//!   replay, restarts).
//! * [`ingest`]: all streams together, sans-IO: frames in, sink calls and replay
//!   commands out.
//! * [`transport`] and [`runner`]: the tokio tasks and the `zeromq` sockets.
//!
//! What it leaves to others: the index itself (behind [`EventSink`]), worker
//! discovery (the caller adds and removes endpoints), and logging (problems are
//! counted in [`ingest::StreamStatus`] and surfaced as [`ingest::Notice`]s).
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod decode;
pub mod encode;
pub mod frame;
pub mod ingest;
pub mod msgpack;
pub mod runner;
pub mod sequence;
pub mod translate;
pub mod transport;

pub use ingest::{IngestConfig, IngestCore, StreamConfig};
pub use runner::{spawn, EndpointConfig, IngestHandle, RunnerConfig};
pub use translate::{EventSink, RouterEvent};
pub use transport::ZmqConnector;
