//! The headers the router owns. A client may send the steering ones (honoured only when
//! trusted); none of them ever reaches a worker, and only the router names workers in
//! answers.

use http::HeaderName;

/// Headers that steer the router itself; they never reach a worker.
pub const PIN_HEADERS: [&str; 5] =
    ["x-worker-id", "x-dp-rank", "x-prefill-worker-id", "x-prefill-dp-rank", "x-decode-worker-id"];

/// The preview flag header.
pub const PREVIEW_HEADER: &str = "x-kvroute-preview";

/// The response header naming the worker that served a request.
#[allow(clippy::declare_interior_mutable_const)] // a static name: nothing in it changes
pub const WORKER_HEADER: HeaderName = HeaderName::from_static("x-kvroute-worker");
