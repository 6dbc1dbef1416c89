//! Weighted fair sharing of the queue between tenants: start-time fair queuing (SFQ)
//! over request counts, in exact integers.
//!
//! Every tenant with queued requests carries a virtual start tag; the tenant with the
//! smallest tag (then the smallest id) goes next. Serving a request of tenant `i` sets
//! the virtual clock to its tag and advances the tag by `1 / weight_i`. A tenant that
//! starts queueing takes `max(its last tag, the virtual clock)`, so idling neither
//! banks credit nor loses it. For two tenants queued throughout any run of pops, the
//! counts served satisfy `|n_i·w_j − n_j·w_i| ≤ w_i + w_j` (SFQ's fairness bound).
//!
//! Tags are rationals `k / weight` kept with the tenant's own weight as denominator and
//! compared by cross-multiplication, so no float and no rounding enters the order. The
//! one rounding, up to the next `1 / weight_i` when a tenant starts queueing, delays it
//! by less than one of its own requests' worth of virtual time.
//!
//! Space: besides the sharing, each tenant listed in `tenant_weights` keeps a guaranteed
//! slice of `queued_max`, `queued_max · w_i / Σ w` requests; a push that would eat into
//! another tenant's unused slice is refused as if the queue were full. A flood fills
//! the rest of the queue, never another tenant's slice.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;
use core::cmp::Ordering;

use super::{QueueConfig, TenantId, TENANT_WEIGHT_MAX};

/// A virtual time `k / w`, `w >= 1`.
#[derive(Clone, Copy, Debug)]
struct Tag {
    k: u128,
    w: u32,
}

impl Tag {
    const ZERO: Tag = Tag { k: 0, w: 1 };

    /// The smallest multiple of `1 / w` at or after `self`.
    fn ceil_to(self, w: u32) -> Tag {
        let num = self.k.saturating_mul(u128::from(w));
        let den = u128::from(self.w.max(1));
        Tag { k: num.div_ceil(den), w }
    }
}

impl Ord for Tag {
    fn cmp(&self, other: &Self) -> Ordering {
        // k <= 2^64 · 2^16 (pops since the queue was last empty, times a weight) and
        // w <= 2^16, so the products stay far below 2^128.
        let mine = self.k.saturating_mul(u128::from(other.w));
        let theirs = other.k.saturating_mul(u128::from(self.w));
        mine.cmp(&theirs)
    }
}

impl PartialOrd for Tag {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Tag {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Tag {}

#[derive(Clone, Copy, Debug)]
struct Tenant {
    /// The start tag of its next request (while queued), or after its last (while idle).
    tag: Tag,
    queued: u32,
}

/// The sharing state: at most `tenants_max` tenants, reset whenever the queue empties.
#[derive(Debug)]
pub(super) struct Fair {
    /// Clamped weights of the listed tenants, by id.
    weights: Vec<u32>,
    /// Guaranteed queue slots of the listed tenants, by id.
    slots: Vec<u64>,
    tenants_max: u16,
    /// Tenants with queued requests, the next to serve first.
    ready: BTreeSet<(Tag, TenantId)>,
    tenants: BTreeMap<TenantId, Tenant>,
    /// The virtual clock: the tag of the last request served.
    clock: Tag,
    /// Guaranteed slots not in use, summed over listed tenants.
    reserved: u64,
}

impl Fair {
    pub(super) fn new(cfg: &QueueConfig) -> Self {
        let tenants_max = cfg.tenants_max.max(1);
        let listed = cfg.tenant_weights.len().min(usize::from(tenants_max));
        let weights: Vec<u32> = cfg.tenant_weights[..listed].iter().map(|&w| w.clamp(1, TENANT_WEIGHT_MAX)).collect();
        let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
        let queued_max = cfg.queued_max as u64;
        let slots: Vec<u64> = weights
            .iter()
            .map(|&w| u64::try_from(u128::from(queued_max) * u128::from(w) / u128::from(total.max(1))).unwrap_or(0))
            .collect();
        let reserved = slots.iter().sum();
        Fair {
            weights,
            slots,
            tenants_max,
            ready: BTreeSet::new(),
            tenants: BTreeMap::new(),
            clock: Tag::ZERO,
            reserved,
        }
    }

    /// The tenant a request naming `t` is served as: ids at or past `tenants_max` share
    /// tenant 0.
    pub(super) fn tenant(&self, t: TenantId) -> TenantId {
        if t.0 < self.tenants_max {
            t
        } else {
            TenantId(0)
        }
    }

    /// The tenant whose request goes next.
    pub(super) fn next(&self) -> Option<TenantId> {
        self.ready.first().map(|&(_, t)| t)
    }

    /// Queue slots in use or held for other tenants' guarantees, with `len` queued, once
    /// `t` queues one more: that push fits while this is below `queued_max`. A listed
    /// tenant under its guarantee always fits.
    pub(super) fn taken(&self, t: TenantId, len: usize) -> u64 {
        let q = self.queued(t);
        let own = self.unused_slots(t, q) - self.unused_slots(t, q.saturating_add(1));
        (len as u64).saturating_add(self.reserved.saturating_sub(own))
    }

    /// Counts a request of `t` in.
    pub(super) fn add(&mut self, t: TenantId) {
        let queued = self.queued(t);
        let used = self.unused_slots(t, queued) - self.unused_slots(t, queued.saturating_add(1));
        self.reserved = self.reserved.saturating_sub(used);
        let w = self.weight(t);
        let clock = self.clock;
        let e = self.tenants.entry(t).or_insert(Tenant { tag: clock.ceil_to(w), queued: 0 });
        if e.queued == 0 {
            e.tag = e.tag.max(clock.ceil_to(w));
            self.ready.insert((e.tag, t));
        }
        e.queued += 1;
    }

    /// Counts a request of `t` out; `served` when it was popped (it must be `next`'s).
    pub(super) fn remove(&mut self, t: TenantId, served: bool) {
        let Some(e) = self.tenants.get_mut(&t) else { return };
        let queued = e.queued;
        self.ready.remove(&(e.tag, t));
        if served {
            self.clock = e.tag;
            e.tag.k = e.tag.k.saturating_add(1);
        }
        e.queued = queued.saturating_sub(1);
        if e.queued > 0 {
            self.ready.insert((e.tag, t));
        }
        let freed = self.unused_slots(t, queued.saturating_sub(1)) - self.unused_slots(t, queued);
        self.reserved = self.reserved.saturating_add(freed);
        if self.ready.is_empty() {
            // Nobody waits: no tag can matter any more, and starting over keeps them small.
            self.tenants.clear();
            self.clock = Tag::ZERO;
        }
    }

    fn queued(&self, t: TenantId) -> u32 {
        self.tenants.get(&t).map_or(0, |e| e.queued)
    }

    fn weight(&self, t: TenantId) -> u32 {
        self.weights.get(usize::from(t.0)).copied().unwrap_or(1)
    }

    fn unused_slots(&self, t: TenantId, queued: u32) -> u64 {
        self.slots.get(usize::from(t.0)).map_or(0, |&s| s.saturating_sub(u64::from(queued)))
    }
}
