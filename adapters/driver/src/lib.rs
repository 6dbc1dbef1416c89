//! `kvroute-driver` runs one `router-core` [`Router`] on tokio: it feeds it a monotonic
//! clock, sleeps until its deadlines, drains its outputs after every input and hands
//! each output to whoever awaits it.
//!
//! The router lives behind one `std::sync::Mutex`. Every critical section is a single
//! synchronous `handle_*` call plus the drain of `poll_output`; nothing awaits while the
//! lock is held. One timer task sleeps until [`Router::poll_timeout`] and is woken early
//! only when an input moves that deadline forward.
//!
//! The proxy's view is [`Driver::route`]: it returns a [`Booking`] once the request has a
//! worker, transparently awaiting the admission queue or another request's session
//! initialization. A `Booking` is a guard: confirm it with [`Booking::dispatched`], end
//! it with [`Booking::finish`] or [`Booking::fail`], or drop it to release its load,
//! lease and queue slot. Dropping the `route` future while it waits releases the queue
//! slot or the session wait in the same way, so a client that goes away never leaves
//! anything behind.
//!
//! Replicas: a router with a [`ReplicaConfig::id`] queues updates for other replicas;
//! the driver drains them after every call, with the outputs, into the sink set by
//! [`Driver::set_replica_sink`] (a bounded channel, never awaited: a full one drops and
//! counts). Other replicas' updates come in through [`Driver::apply_replica_update`],
//! [`Driver::replica_heartbeat`] and [`Driver::replica_gone`]. Stamps travel as wall
//! time: see [`Driver::unix_us`] and [`Driver::instant_at_unix_us`].
//!
//! Time: the core's [`Instant`] is microseconds since the driver was created, read from
//! `tokio::time::Instant`, so tests on paused tokio time drive the router's timers
//! without sleeping.
//!
//! What it leaves to others: HTTP, tokenization, upstream I/O, health checks and KV-event
//! decoding live in the proxy and events adapters, which call this crate.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod booking;
mod driver;
mod error;
mod replica;
mod shared;
mod snapshot;

pub use booking::Booking;
pub use driver::{Driver, DriverConfig};
pub use error::DriveError;
pub use snapshot::{DriverStats, KeySnapshot, Snapshot, WorkerSnapshot};

pub use router_core::Instant;
pub use router_core::{
    DispatchFailure, ReplicaConfig, ReplicaError, ReplicaId, ReplicaUpdate, Request, Routed, Router, RouterConfig,
    WorkerUpdate,
};
