//! The driver's error type.

use std::fmt;

use router_core::{InputError, QueueRejection, ReplicaError, RouteError};

/// Why a driver call did not succeed.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum DriveError {
    /// The router could not route the request (pins, eligibility, sessions, limits).
    Route(RouteError),
    /// The admission queue refused the request; answer 429 with `Retry-After`.
    Rejected(QueueRejection),
    /// The request waited in the admission queue longer than `queue_timeout_ms`.
    QueueTimeout,
    /// The router refused a lifecycle, worker or KV-event input.
    Input(InputError),
    /// The driver went away while the request waited.
    Closed,
    /// The router refused another replica's update.
    Replica(ReplicaError),
}

impl fmt::Display for DriveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DriveError::Route(e) => write!(f, "cannot route: {e}"),
            DriveError::Rejected(r) => write!(f, "admission queue full: {r}"),
            DriveError::QueueTimeout => f.write_str("timed out in the admission queue"),
            DriveError::Input(e) => write!(f, "{e}"),
            DriveError::Closed => f.write_str("the router driver shut down"),
            DriveError::Replica(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for DriveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DriveError::Route(e) => Some(e),
            DriveError::Input(e) => Some(e),
            DriveError::Replica(e) => Some(e),
            DriveError::Rejected(_) | DriveError::QueueTimeout | DriveError::Closed => None,
        }
    }
}

impl From<InputError> for DriveError {
    fn from(e: InputError) -> Self {
        DriveError::Input(e)
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use router_core::{InputError, Phase, RequestId};

    use super::DriveError;

    #[test]
    fn wrapped_core_errors_are_the_source_and_plain_ones_have_none() {
        let inner = InputError::UnknownRequest { id: RequestId(7), phase: Phase::Aggregated };
        let e = DriveError::Input(inner.clone());
        let source = e.source().expect("the core error is the source");
        assert_eq!(source.to_string(), inner.to_string());
        assert!(DriveError::QueueTimeout.source().is_none());
        assert!(DriveError::Closed.source().is_none());
    }
}
