//! Why a worker key cannot take a request: the one vocabulary shared by pin resolution
//! (which reports it in [`crate::pin::PinError::Ineligible`]) and eligibility (which
//! decides it). It lives apart from both so that pin resolution never imports
//! eligibility: the one import between them runs from `eligible` to `pin`.

use alloc::string::String;
use core::fmt;

/// Why a key cannot take the request.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum ExclusionReason {
    /// The request's allow-list does not name the worker.
    NotAllowed,
    /// The worker carries a `NoSchedule` taint the request does not tolerate.
    Tainted {
        /// The first such taint's key.
        key: String,
    },
    /// The key's load is above a threshold.
    Overloaded {
        /// Its active prefill tokens.
        prefill_tokens: u64,
        /// Its active decode blocks.
        decode_blocks: u64,
    },
    /// The worker already failed this request (migration).
    FailedBefore,
    /// The worker is ejected.
    Ejected,
    /// The worker is draining.
    Draining,
    /// The worker's role does not serve the phase.
    WrongRole,
    /// The request is pinned elsewhere.
    NotPinned,
    /// The worker's topology label differs from the one required.
    TopologyMismatch {
        /// The label key compared.
        label: String,
    },
}

impl ExclusionReason {
    /// A short stable code, for metrics labels.
    pub const fn as_str(&self) -> &'static str {
        match self {
            ExclusionReason::NotAllowed => "not_allowed",
            ExclusionReason::Tainted { .. } => "tainted",
            ExclusionReason::Overloaded { .. } => "overloaded",
            ExclusionReason::FailedBefore => "failed_before",
            ExclusionReason::Ejected => "ejected",
            ExclusionReason::Draining => "draining",
            ExclusionReason::WrongRole => "wrong_role",
            ExclusionReason::NotPinned => "not_pinned",
            ExclusionReason::TopologyMismatch { .. } => "topology_mismatch",
        }
    }
}

impl fmt::Display for ExclusionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExclusionReason::NotAllowed => f.write_str("not in the request's allowed workers"),
            ExclusionReason::Tainted { key } => write!(f, "has untolerated NoSchedule taint {key}"),
            ExclusionReason::Overloaded { prefill_tokens, decode_blocks } => {
                write!(f, "overloaded ({prefill_tokens} active prefill tokens, {decode_blocks} active decode blocks)")
            }
            ExclusionReason::FailedBefore => f.write_str("already failed this request"),
            ExclusionReason::Ejected => f.write_str("ejected"),
            ExclusionReason::Draining => f.write_str("draining"),
            ExclusionReason::WrongRole => f.write_str("role does not serve this phase"),
            ExclusionReason::NotPinned => f.write_str("request is pinned elsewhere"),
            ExclusionReason::TopologyMismatch { label } => write!(f, "label {label} does not match"),
        }
    }
}
