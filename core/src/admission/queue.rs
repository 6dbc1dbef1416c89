//! [`AdmissionQueue`]: ordered entries per tenant, the share between tenants, their
//! deadlines, and class accounting.

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};

use super::classes::{Bucket, Classes};
use super::fair::Fair;
use super::order::Key;
#[cfg(test)]
use super::ClassUsage;
use super::{AdmissionError, LimitKind, QueueConfig, QueueEntry, QueueOrder, QueueRejection, TenantId};
use crate::time::Instant;
use crate::types::RequestId;

/// Requests waiting for admission, in priority order within each tenant and shared
/// between tenants by weight, with per-class limits.
///
/// Sans-IO. Inputs: [`push`](Self::push) (takes `now`: arrival time orders FCFS and
/// starts the timeout) and [`handle_timeout`](Self::handle_timeout). Mutators:
/// [`pop`](Self::pop), [`cancel`](Self::cancel). Getters: [`peek`](Self::peek),
/// [`contains`](Self::contains), [`len`](Self::len), [`class_usage`](Self::class_usage),
/// [`poll_timeout`](Self::poll_timeout). Output: [`poll_timed_out`](Self::poll_timed_out).
///
/// Calling order: sleep until `poll_timeout`, call `handle_timeout(now)`, then drain
/// `poll_timed_out` until `None` and answer those requests. A spurious `handle_timeout`
/// does nothing; time going backwards only means fewer requests are due.
///
/// Accounting: a request counts against its class from a successful `push` until it
/// leaves by `pop`, `cancel` or timeout; a refused push stores nothing. Usage returns to
/// exactly zero when the queue empties.
///
/// Work: `push`, `pop`, `cancel` and `contains` are O(log n) (n: queued requests, or
/// tenants with requests queued) plus a linear scan of the listed classes; one
/// `handle_timeout` call removes every due request, at most `queued_max`. The timed-out
/// buffer holds what callers have not drained.
#[derive(Debug)]
pub(crate) struct AdmissionQueue {
    order: QueueOrder,
    queued_max: usize,
    queue_timeout_ms: u64,
    classes: Classes,
    fair: Fair,
    /// Each tenant's requests in order; a tenant with none has no entry.
    queue: BTreeMap<TenantId, BTreeMap<Key, Stored>>,
    by_req: BTreeMap<RequestId, (TenantId, Key)>,
    len: usize,
    /// (deadline, push seq, request), soonest first.
    deadlines: BTreeSet<(Instant, u64, RequestId)>,
    timed_out: VecDeque<QueueEntry>,
    seq: u64,
}

#[derive(Debug)]
struct Stored {
    entry: QueueEntry,
    deadline: Instant,
    bucket: Bucket,
}

impl AdmissionQueue {
    /// An empty queue.
    pub(crate) fn new(cfg: QueueConfig) -> Self {
        AdmissionQueue {
            order: cfg.order,
            queued_max: cfg.queued_max,
            queue_timeout_ms: cfg.queue_timeout_ms,
            classes: Classes::new(&cfg),
            fair: Fair::new(&cfg),
            queue: BTreeMap::new(),
            by_req: BTreeMap::new(),
            len: 0,
            deadlines: BTreeSet::new(),
            timed_out: VecDeque::new(),
            seq: 0,
        }
    }

    /// Queues `entry`, arrived at `now`, or says why not. Checks, in order: duplicate id,
    /// `queued_max` (less the slots kept for other tenants), then the class's request,
    /// prompt-token and cached-token limits. A request that alone exceeds a token limit
    /// is always refused, so set token limits above the longest prompt a class may send.
    pub(crate) fn push(&mut self, now: Instant, entry: QueueEntry) -> Result<(), AdmissionError> {
        if self.by_req.contains_key(&entry.req) {
            return Err(AdmissionError::DuplicateRequest { req: entry.req });
        }
        let bucket = self.classes.bucket(entry.class.as_deref());
        let tenant = self.fair.tenant(entry.tenant);
        let taken = self.fair.taken(tenant, self.len);
        if taken >= self.queued_max as u64 {
            return Err(AdmissionError::Rejected(QueueRejection {
                class: self.classes.name(bucket, &entry).into(),
                limit_kind: LimitKind::QueueFull,
                current: taken,
                limit: self.queued_max as u64,
            }));
        }
        self.classes.check(bucket, &entry).map_err(AdmissionError::Rejected)?;
        self.seq += 1;
        let key = Key::new(self.order, now, self.seq, &entry);
        let deadline = now.add_ms(self.queue_timeout_ms);
        self.classes.add(bucket, &entry);
        self.fair.add(tenant);
        self.by_req.insert(entry.req, (tenant, key));
        self.deadlines.insert((deadline, key.seq, entry.req));
        self.queue.entry(tenant).or_default().insert(key, Stored { entry, deadline, bucket });
        self.len += 1;
        Ok(())
    }

    /// The request that would be popped next.
    pub(crate) fn peek(&self) -> Option<&QueueEntry> {
        let tenant = self.fair.next()?;
        self.queue.get(&tenant)?.first_key_value().map(|(_, s)| &s.entry)
    }

    /// Removes and returns the next request.
    pub(crate) fn pop(&mut self) -> Option<QueueEntry> {
        let tenant = self.fair.next()?;
        let key = *self.queue.get(&tenant)?.first_key_value()?.0;
        self.take(tenant, key, true)
    }

    /// Removes `req` (the client went away); `None` if it is not queued.
    pub(crate) fn cancel(&mut self, req: RequestId) -> Option<QueueEntry> {
        let (tenant, key) = *self.by_req.get(&req)?;
        self.take(tenant, key, false)
    }

    /// True while `req` is queued (not after it timed out).
    #[cfg(test)]
    pub(crate) fn contains(&self, req: RequestId) -> bool {
        self.by_req.contains_key(&req)
    }

    /// The soonest deadline of a queued request.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines.first().map(|&(deadline, _, _)| deadline)
    }

    /// Moves every request whose deadline is at or before `now` to the timed-out
    /// outputs, soonest deadline first.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        while let Some(&(deadline, _, req)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(entry) = self.cancel(req) {
                self.timed_out.push_back(entry);
            }
        }
    }

    /// The next request that timed out; answer it and drain until `None`.
    #[must_use]
    pub(crate) fn poll_timed_out(&mut self) -> Option<QueueEntry> {
        self.timed_out.pop_front()
    }

    /// Requests queued.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is queued.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What the class named `class` has queued. An unlisted name that was counted under
    /// the default class (too many unlisted names at once) reports zero.
    #[cfg(test)]
    pub(crate) fn class_usage(&self, class: &str) -> ClassUsage {
        self.classes.usage(class)
    }

    /// Removes one request; `served` when it leaves by `pop`, which charges its tenant.
    fn take(&mut self, tenant: TenantId, key: Key, served: bool) -> Option<QueueEntry> {
        let own = self.queue.get_mut(&tenant)?;
        let Stored { entry, deadline, bucket } = own.remove(&key)?;
        if own.is_empty() {
            self.queue.remove(&tenant);
        }
        self.len -= 1;
        self.fair.remove(tenant, served);
        self.by_req.remove(&entry.req);
        self.deadlines.remove(&(deadline, key.seq, entry.req));
        self.classes.sub(bucket, &entry);
        Some(entry)
    }
}
