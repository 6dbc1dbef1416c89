//! The queue's sort key: strict priority, then the FCFS or WSPT score, then push order.
//!
//! Scores are exact rationals compared by cross-multiplication in `i128`, so the order
//! never depends on float rounding.

use core::cmp::Ordering;

use super::{QueueEntry, QueueOrder};
use crate::time::Instant;

/// Sorts ascending in the order requests leave the queue.
#[derive(Clone, Copy, Debug)]
pub(super) struct Key {
    strict: i32,
    /// The score is `num / den`, `den >= 1`; higher leaves first.
    num: i128,
    den: u64,
    /// Push order, unique: the last tie-break, and the key's identity.
    pub(super) seq: u64,
}

impl Key {
    /// The key of `entry` pushed at `now` as the `seq`th request.
    pub(super) fn new(order: QueueOrder, now: Instant, seq: u64, entry: &QueueEntry) -> Key {
        let jump_ms = i128::from(entry.priority_jump_ms);
        let (num, den) = match order {
            // priority_jump_s − arrival_s, in microseconds; the epoch is Instant::ZERO,
            // and any fixed epoch gives the same order.
            QueueOrder::Fcfs => (jump_ms * 1000 - i128::from(now.as_micros()), 1),
            // (1 + jump_ms / 1000) / w == (1000 + jump_ms) / (1000 w); the common 1000
            // does not change the order.
            QueueOrder::Wspt => {
                let work = entry.isl_tokens.saturating_sub(entry.cached_tokens).max(1);
                (1000 + jump_ms, u64::from(work))
            }
        };
        Key { strict: entry.strict_priority, num, den, seq }
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        // |num| < 2^75 and den < 2^33, so the products fit in i128.
        let mine = self.num * i128::from(other.den);
        let theirs = other.num * i128::from(self.den);
        other.strict.cmp(&self.strict).then(theirs.cmp(&mine)).then(self.seq.cmp(&other.seq))
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Key {}
