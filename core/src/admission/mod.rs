//! Admission: the bounded queue requests wait in until a worker can take them.
//!
//! An [`AdmissionQueue`] holds requests in priority order ([`QueueOrder`]), refuses a
//! request that would push its class over a limit ([`ClassLimits`]) or the queue over
//! `queued_max`, and times requests out after `queue_timeout_ms`. Every refusal names the
//! class, the limit and the current usage, so the proxy can answer 429 with a useful
//! `Retry-After`.
//!
//! Requests of several tenants ([`TenantId`]) share the queue by weight: the tenant
//! that has been served least for its weight goes next, and the order above applies
//! within each tenant (see `fair`). With one tenant the queue is exactly the order
//! above.
//!
//! What it leaves to others: deciding *when* to pop (the façade pops when a worker has
//! room), classifying requests (the adapter sets `QueueEntry::class`), answering the
//! client, and sleeping until [`AdmissionQueue::poll_timeout`].

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use crate::types::RequestId;

mod classes;
mod fair;
mod order;
mod queue;

pub(crate) use queue::AdmissionQueue;

/// Which waiting request goes first, after `strict_priority`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum QueueOrder {
    /// First come, first served, with `priority_jump_ms` moving a request ahead as if it
    /// had arrived that much earlier: highest `priority_jump_s − arrival_s` first.
    #[default]
    Fcfs,
    /// Weighted shortest processing time: highest `(1 + priority_jump_s) / max(1, isl −
    /// cached_tokens)` first, so short uncached prompts overtake long ones.
    Wspt,
}

/// The tenant a request is queued for: a small id the adapter assigns from its own
/// tenant list (0, the default, for requests of no tenant). Its weight comes from
/// [`QueueConfig::tenant_weights`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct TenantId(pub u16);

/// The largest tenant weight; larger weights count as this.
pub const TENANT_WEIGHT_MAX: u32 = 1 << 16;

/// Queue limits of one request class. `None` means unlimited.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ClassLimits {
    /// The class name requests carry in `QueueEntry::class`.
    pub name: String,
    /// Most requests of the class queued at once.
    pub queued_requests_max: Option<u32>,
    /// Most prompt tokens (sum of `isl_tokens`) of the class queued at once.
    pub queued_prompt_tokens_max: Option<u64>,
    /// Most cached tokens (sum of `cached_tokens`) of the class queued at once.
    pub queued_cached_tokens_max: Option<u64>,
}

impl ClassLimits {
    /// A class with no limits.
    pub fn unlimited(name: &str) -> Self {
        ClassLimits {
            name: name.into(),
            queued_requests_max: None,
            queued_prompt_tokens_max: None,
            queued_cached_tokens_max: None,
        }
    }
}

impl Default for ClassLimits {
    /// The default class: named `"default"`, no limits.
    fn default() -> Self {
        ClassLimits::unlimited("default")
    }
}

/// Limits and ordering of the admission queue.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct QueueConfig {
    /// Ordering after strict priority. Default [`QueueOrder::Fcfs`].
    pub order: QueueOrder,
    /// Most requests queued at once, all classes together. Default 4,096.
    pub queued_max: usize,
    /// How long a request may wait before it times out, in milliseconds. Default 30,000.
    pub queue_timeout_ms: u64,
    /// Named classes with their own limits. Looked up by name, linearly; the first of
    /// two equal names wins. Default none.
    pub classes: Vec<ClassLimits>,
    /// Limits of requests with no class, and of classes not listed in `classes`.
    /// Default: named `"default"`, no limits.
    pub default_class: ClassLimits,
    /// Most unlisted class names whose usage is tracked apart at once. Past it, requests
    /// of a new unlisted name are counted under `default_class`. Default 64.
    pub extra_classes_max: usize,
    /// Weight of tenant `i` at index `i`, its share of the queue's pops while it and
    /// others wait. A tenant listed here also keeps `queued_max · weight / Σ weights`
    /// queue slots that no other tenant may fill. Unlisted tenants weigh 1 and keep no
    /// slots; weights are clamped to `1..=TENANT_WEIGHT_MAX`. Default none.
    pub tenant_weights: Vec<u32>,
    /// Tenant ids told apart (at least 1); a request naming a higher id is queued as
    /// tenant 0, and listed weights past it are ignored. Default 256.
    pub tenants_max: u16,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            order: QueueOrder::Fcfs,
            queued_max: 4096,
            queue_timeout_ms: 30_000,
            classes: Vec::new(),
            default_class: ClassLimits::default(),
            extra_classes_max: 64,
            tenant_weights: Vec::new(),
            tenants_max: 256,
        }
    }
}

/// A request waiting for admission.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct QueueEntry {
    /// The request; unique among queued requests.
    pub req: RequestId,
    /// Higher goes first, before any other ordering.
    pub strict_priority: i32,
    /// Moves the request ahead (or, negative, behind) in the order, in milliseconds.
    pub priority_jump_ms: i64,
    /// Prompt length, in tokens.
    pub isl_tokens: u32,
    /// Prompt tokens expected to hit a worker's cache.
    pub cached_tokens: u32,
    /// The request's class; `None` is the default class.
    pub class: Option<String>,
    /// The tenant whose share the request is served from.
    pub tenant: TenantId,
}

/// What one class has queued.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct ClassUsage {
    /// Requests queued.
    pub requests: u32,
    /// Sum of their `isl_tokens`.
    pub prompt_tokens: u64,
    /// Sum of their `cached_tokens`.
    pub cached_tokens: u64,
}

/// Which limit refused a request.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LimitKind {
    /// The class's `queued_requests_max`.
    QueuedRequests,
    /// The class's `queued_prompt_tokens_max`.
    QueuedPromptTokens,
    /// The class's `queued_cached_tokens_max`.
    QueuedCachedTokens,
    /// The queue's `queued_max`, all classes together, less the slots kept for other
    /// tenants (see [`QueueConfig::tenant_weights`]).
    QueueFull,
}

impl LimitKind {
    /// The snake-case name used in metrics and error bodies.
    pub const fn as_str(self) -> &'static str {
        match self {
            LimitKind::QueuedRequests => "queued_requests",
            LimitKind::QueuedPromptTokens => "queued_prompt_tokens",
            LimitKind::QueuedCachedTokens => "queued_cached_tokens",
            LimitKind::QueueFull => "queue_full",
        }
    }
}

/// A request refused because a limit would be exceeded. Nothing was stored.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct QueueRejection {
    /// The class the request was counted under.
    pub class: String,
    /// The limit that refused it.
    pub limit_kind: LimitKind,
    /// Usage of that limit before the request: requests or tokens (for `QueueFull`,
    /// queued requests plus the slots kept for other tenants).
    pub current: u64,
    /// The limit.
    pub limit: u64,
}

impl fmt::Display for QueueRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "class {:?} is at {} {} of {}", self.class, self.current, self.limit_kind.as_str(), self.limit)
    }
}

/// Why [`AdmissionQueue::push`] refused a request. Nothing was stored.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub(crate) enum AdmissionError {
    /// A class limit or the queue bound would be exceeded.
    Rejected(QueueRejection),
    /// A request with this id is already queued.
    DuplicateRequest {
        /// The id.
        req: RequestId,
    },
}

impl fmt::Display for AdmissionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdmissionError::Rejected(r) => write!(f, "request refused: {r}"),
            AdmissionError::DuplicateRequest { req } => {
                write!(f, "request {} is already queued", req.0)
            }
        }
    }
}

impl core::error::Error for AdmissionError {}

#[cfg(test)]
mod tests;
