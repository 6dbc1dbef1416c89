//! `kvroute-replica` lets several `kvroute serve` replicas front one fleet as if they
//! were one router: each publishes the in-flight load it books and the session bindings
//! it commits over NATS, and feeds its peers' into its own routers.
//!
//! Each replica still follows every worker's KV events itself, so prefix indexes are
//! never shared. What travels is what only the deciding replica knows: request added,
//! prefill done and finished (tagged with the replica's id), session bindings and their
//! invalidations, and heartbeats. The routers (`router-core`) keep peers' load apart from
//! their own, weigh both when they select, expire a silent peer's load after
//! `replica_silence_max_ms`, and settle concurrent bindings of one session by the lowest
//! (commit time, replica id).
//!
//! Updates are fire-and-forget. Routing never waits for NATS: a driver hands its
//! updates to a bounded channel that drops when full, and a replica that loses NATS
//! routes on its own load until the connection is back ([`ReplicaHandle::connected`]
//! says which). On a lost connection the replica forgets its peers' reports and starts
//! a new epoch, so its peers forget its own too: neither side keeps load whose end it
//! may have missed.
//!
//! Wire: msgpack envelopes on `kvroute.<cluster>.load`, `.affinity` and `.heartbeat`
//! (see [`wire`]); a message that does not decode is counted and dropped.
//!
//! What it leaves to others: configuration and wiring into the proxy
//! (`kvroute-proxy`), routing itself (`router-core`), and running the NATS server.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod options;
mod replica;
pub mod wire;

pub use options::{replica_id, ReplicaOptions, ReplicaStartError};
pub use replica::{start, PoolLink, ReplicaCounters, ReplicaHandle};
