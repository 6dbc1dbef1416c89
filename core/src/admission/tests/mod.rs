//! Scripted scenarios: each test is a list of steps with the answer each must give.

mod fair;
mod fair_model;
mod model;

use alloc::string::String;
use alloc::vec::Vec;

use super::*;
use crate::time::Instant;

const TIMEOUT_MS: u64 = 1000;

/// A request `req` with no priority, 100 prompt tokens, nothing cached, no class.
fn e(req: u64) -> QueueEntry {
    QueueEntry {
        req: RequestId(req),
        strict_priority: 0,
        priority_jump_ms: 0,
        isl_tokens: 100,
        cached_tokens: 0,
        class: None,
        tenant: TenantId(0),
    }
}

impl QueueEntry {
    fn prio(mut self, p: i32) -> Self {
        self.strict_priority = p;
        self
    }
    fn jump(mut self, ms: i64) -> Self {
        self.priority_jump_ms = ms;
        self
    }
    fn isl(mut self, isl: u32, cached: u32) -> Self {
        (self.isl_tokens, self.cached_tokens) = (isl, cached);
        self
    }
    fn class(mut self, c: &str) -> Self {
        self.class = Some(c.into());
        self
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// Sets the clock, in milliseconds.
    At(u64),
    Push(QueueEntry),
    /// A push refused with (class, limit, current, limit value).
    Refused(QueueEntry, &'static str, LimitKind, u64, u64),
    Duplicate(QueueEntry),
    /// `pop` must return this request.
    Pop(Option<u64>),
    /// Pops everything; must come out in this order.
    Drain(&'static [u64]),
    Peek(Option<u64>),
    /// `cancel` must find (or not find) the request.
    Cancel(u64, bool),
    /// `handle_timeout` now; these must time out, in this order.
    Timeout(&'static [u64]),
    /// `poll_timeout` in milliseconds.
    Next(Option<u64>),
    /// `class_usage(class)`: requests, prompt tokens, cached tokens.
    Usage(&'static str, u32, u64, u64),
    Len(usize),
}

fn cfg(order: QueueOrder) -> QueueConfig {
    QueueConfig { order, queue_timeout_ms: TIMEOUT_MS, ..QueueConfig::default() }
}

fn limited() -> QueueConfig {
    let gold = ClassLimits {
        queued_requests_max: Some(2),
        queued_prompt_tokens_max: Some(1000),
        ..ClassLimits::unlimited("gold")
    };
    let cache = ClassLimits { queued_cached_tokens_max: Some(500), ..ClassLimits::unlimited("cache") };
    let default_class = ClassLimits { queued_requests_max: Some(2), ..ClassLimits::default() };
    QueueConfig {
        queued_max: 6,
        classes: alloc::vec![gold, cache],
        default_class,
        extra_classes_max: 2,
        ..cfg(QueueOrder::Fcfs)
    }
}

#[track_caller]
fn check(cfg: QueueConfig, steps: &[Step]) {
    let mut q = AdmissionQueue::new(cfg);
    let mut now = Instant::ZERO;
    for (i, step) in steps.iter().enumerate() {
        let at = alloc::format!("step {i}: {step:?}");
        let len = q.len();
        match step.clone() {
            Step::At(ms) => now = Instant::from_millis(ms),
            Step::Push(entry) => assert_eq!(q.push(now, entry), Ok(()), "{at}"),
            Step::Refused(entry, class, limit_kind, current, limit) => {
                let want = QueueRejection { class: class.into(), limit_kind, current, limit };
                assert_eq!(q.push(now, entry), Err(AdmissionError::Rejected(want)), "{at}");
                assert_eq!(q.len(), len, "{at}: a refused request was stored");
            }
            Step::Duplicate(entry) => {
                let req = entry.req;
                assert_eq!(q.push(now, entry), Err(AdmissionError::DuplicateRequest { req }), "{at}");
                assert_eq!(q.len(), len, "{at}");
            }
            Step::Pop(want) => assert_eq!(q.pop().map(|e| e.req.0), want, "{at}"),
            Step::Drain(want) => {
                let got: Vec<u64> = core::iter::from_fn(|| q.pop()).map(|e| e.req.0).collect();
                assert_eq!(got, want, "{at}");
            }
            Step::Peek(want) => assert_eq!(q.peek().map(|e| e.req.0), want, "{at}"),
            Step::Cancel(req, found) => {
                assert_eq!(q.cancel(RequestId(req)).map(|e| e.req.0), found.then_some(req), "{at}");
                assert!(!q.contains(RequestId(req)), "{at}");
            }
            Step::Timeout(want) => {
                q.handle_timeout(now);
                let got: Vec<u64> = core::iter::from_fn(|| q.poll_timed_out()).map(|e| e.req.0).collect();
                assert_eq!(got, want, "{at}");
            }
            Step::Next(ms) => assert_eq!(q.poll_timeout(), ms.map(Instant::from_millis), "{at}"),
            Step::Usage(class, requests, prompt_tokens, cached_tokens) => {
                let want = ClassUsage { requests, prompt_tokens, cached_tokens };
                assert_eq!(q.class_usage(class), want, "{at}");
            }
            Step::Len(n) => assert_eq!((q.len(), q.is_empty()), (n, n == 0), "{at}"),
        }
    }
}

use Step::*;

#[test]
fn fcfs_is_arrival_order() {
    check(
        cfg(QueueOrder::Fcfs),
        &[
            At(0),
            Push(e(1)),
            At(10),
            Push(e(2)),
            // The clock went back: arrival is what the caller says.
            At(5),
            Push(e(3)),
            At(10),
            Push(e(4)),
            Peek(Some(1)),
            Drain(&[1, 3, 2, 4]),
            Pop(None),
            Peek(None),
        ],
    );
}

#[test]
fn fcfs_priority_jump_counts_as_earlier_arrival() {
    check(
        cfg(QueueOrder::Fcfs),
        &[
            At(1000),
            Push(e(1)),
            At(1100),
            // Arrived 100 ms later but jumps 200 ms: ahead of 1.
            Push(e(2).jump(200)),
            // Jumps exactly its lateness: ties with 1, and 1 was pushed first.
            Push(e(3).jump(100)),
            Push(e(4).jump(-1000)),
            At(0),
            Push(e(5).jump(-1001)),
            Drain(&[2, 1, 3, 5, 4]),
        ],
    );
}

#[test]
fn strict_priority_comes_first() {
    for order in [QueueOrder::Fcfs, QueueOrder::Wspt] {
        check(
            cfg(order),
            &[
                Push(e(1).jump(i64::MAX).isl(1, 0)),
                Push(e(2).prio(1).isl(100_000, 0)),
                Push(e(3).prio(-1).jump(i64::MAX)),
                Push(e(4).prio(i32::MAX)),
                Push(e(5).prio(i32::MIN)),
                Drain(&[4, 2, 1, 3, 5]),
            ],
        );
    }
}

#[test]
fn wspt_prefers_short_uncached_work() {
    check(
        cfg(QueueOrder::Wspt),
        &[
            Push(e(1).isl(1000, 0)),
            Push(e(2).isl(1000, 900)),
            Push(e(3).isl(200, 0)),
            // More cached than prompt: one token of work, the least possible.
            Push(e(4).isl(10, 50)),
            // (1 + 1 s) / 2000 == 1 / 1000: ties with 1, pushed later.
            Push(e(5).isl(2000, 0).jump(1000)),
            // (1 − 2 s) / 1: negative, last.
            Push(e(6).isl(1, 0).jump(-2000)),
            At(1_000_000),
            // Arrival does not matter to WSPT.
            Push(e(7).isl(100, 0)),
            Drain(&[4, 2, 7, 3, 1, 5, 6]),
        ],
    );
}

#[test]
fn class_limits_refuse_and_store_nothing() {
    check(
        limited(),
        &[
            Push(e(1).class("gold").isl(600, 0)),
            Refused(e(2).class("gold").isl(401, 0), "gold", LimitKind::QueuedPromptTokens, 600, 1000),
            Push(e(2).class("gold").isl(400, 0)),
            Refused(e(3).class("gold").isl(0, 0), "gold", LimitKind::QueuedRequests, 2, 2),
            Usage("gold", 2, 1000, 0),
            Push(e(4).class("cache").isl(900, 500)),
            Refused(e(5).class("cache").isl(900, 1), "cache", LimitKind::QueuedCachedTokens, 500, 500),
            Push(e(5).class("cache").isl(900, 0)),
            Usage("cache", 2, 1800, 500),
            Len(4),
            // Leaving frees the slot.
            Cancel(1, true),
            Cancel(1, false),
            Usage("gold", 1, 400, 0),
            Push(e(3).class("gold").isl(600, 0)),
            Drain(&[2, 4, 5, 3]),
            Usage("gold", 0, 0, 0),
            Usage("cache", 0, 0, 0),
        ],
    );
}

#[test]
fn a_request_alone_over_a_token_limit_is_refused() {
    check(
        limited(),
        &[
            Refused(e(1).class("gold").isl(1001, 0), "gold", LimitKind::QueuedPromptTokens, 0, 1000),
            Len(0),
            Usage("gold", 0, 0, 0),
        ],
    );
}

#[test]
fn queue_full_counts_every_class() {
    let c = QueueConfig { queued_max: 3, ..cfg(QueueOrder::Fcfs) };
    check(
        c,
        &[
            Push(e(1)),
            Push(e(2).class("a")),
            Push(e(3).class("b")),
            Refused(e(4).class("a"), "a", LimitKind::QueueFull, 3, 3),
            Refused(e(4), "default", LimitKind::QueueFull, 3, 3),
            Pop(Some(1)),
            Push(e(4)),
            Len(3),
        ],
    );
    let none = QueueConfig { queued_max: 0, ..cfg(QueueOrder::Fcfs) };
    check(none, &[Refused(e(1), "default", LimitKind::QueueFull, 0, 0), Len(0)]);
}

#[test]
fn duplicate_ids_are_refused_until_the_request_leaves() {
    check(
        cfg(QueueOrder::Fcfs),
        &[
            Push(e(1).isl(10, 0)),
            Duplicate(e(1).isl(99, 0)),
            Usage("default", 1, 10, 0),
            Pop(Some(1)),
            Push(e(1)),
            Cancel(1, true),
            Push(e(1)),
            Len(1),
        ],
    );
}

#[test]
fn unlisted_classes_get_default_limits_and_own_usage() {
    check(
        limited(),
        &[
            Push(e(1).class("x")),
            Push(e(2).class("x")),
            Refused(e(3).class("x"), "x", LimitKind::QueuedRequests, 2, 2),
            // "y" has its own usage, under the same limits.
            Push(e(3).class("y")),
            Usage("x", 2, 200, 0),
            Usage("y", 1, 100, 0),
            Usage("default", 0, 0, 0),
            // Two unlisted names are tracked at most: "z" counts as default.
            Push(e(4).class("z")),
            Usage("z", 0, 0, 0),
            Usage("default", 1, 100, 0),
            Push(e(5).class("w")),
            Refused(e(6).class("v"), "default", LimitKind::QueuedRequests, 2, 2),
            Usage("default", 2, 200, 0),
            Len(5),
        ],
    );
}

#[test]
fn unlisted_class_slots_are_reused_once_empty() {
    check(
        limited(),
        &[
            Push(e(1).class("x")),
            Push(e(2).class("y")),
            Push(e(3).class("z")),
            Usage("z", 0, 0, 0),
            Cancel(1, true),
            Usage("x", 0, 0, 0),
            Push(e(4).class("w")),
            Usage("w", 1, 100, 0),
            // "z" stays in the bucket it was pushed under.
            Cancel(3, true),
            Usage("default", 0, 0, 0),
            Usage("w", 1, 100, 0),
        ],
    );
}

#[test]
fn default_class_name_is_the_default_bucket() {
    check(
        limited(),
        &[
            Push(e(1).class("default")),
            Push(e(2)),
            Refused(e(3).class("default"), "default", LimitKind::QueuedRequests, 2, 2),
            Usage("default", 2, 200, 0),
        ],
    );
}

#[test]
fn requests_time_out_in_deadline_order() {
    check(
        cfg(QueueOrder::Fcfs),
        &[
            At(100),
            Push(e(1)),
            At(50),
            Push(e(2)),
            At(100),
            Push(e(3)),
            Next(Some(50 + TIMEOUT_MS)),
            At(50 + TIMEOUT_MS - 1),
            Timeout(&[]),
            At(100 + TIMEOUT_MS),
            Timeout(&[2, 1, 3]),
            Timeout(&[]),
            Next(None),
            Len(0),
            Usage("default", 0, 0, 0),
            Cancel(1, false),
            Push(e(1)),
        ],
    );
}

#[test]
fn a_huge_time_jump_times_everything_out() {
    check(
        limited(),
        &[
            Push(e(1).class("gold")),
            Push(e(2).class("x")),
            Push(e(3)),
            Cancel(3, true),
            At(u64::MAX / 1000),
            Timeout(&[1, 2]),
            Usage("gold", 0, 0, 0),
            Usage("x", 0, 0, 0),
            Len(0),
        ],
    );
}

#[test]
fn extreme_inputs_do_not_panic() {
    for order in [QueueOrder::Fcfs, QueueOrder::Wspt] {
        let mut q = AdmissionQueue::new(cfg(order));
        let far = Instant::MAX;
        for (i, jump) in [i64::MIN, -1, 0, 1, i64::MAX].into_iter().enumerate() {
            let entry = e(i as u64).jump(jump).isl(u32::MAX, 0).prio(i32::MIN);
            assert_eq!(q.push(far, entry), Ok(()));
        }
        let got: Vec<i64> = core::iter::from_fn(|| q.pop()).map(|e| e.priority_jump_ms).collect();
        assert_eq!(got, [i64::MAX, 1, 0, -1, i64::MIN], "{order:?}");
    }
}

#[test]
fn errors_display() {
    let r = QueueRejection {
        class: String::from("gold"),
        limit_kind: LimitKind::QueuedPromptTokens,
        current: 900,
        limit: 1000,
    };
    assert_eq!(alloc::format!("{r}"), "class \"gold\" is at 900 queued_prompt_tokens of 1000");
    let d = AdmissionError::DuplicateRequest { req: RequestId(7) };
    assert_eq!(alloc::format!("{d}"), "request 7 is already queued");
    let kinds =
        [LimitKind::QueuedRequests, LimitKind::QueuedPromptTokens, LimitKind::QueuedCachedTokens, LimitKind::QueueFull];
    let names: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
    assert_eq!(names, ["queued_requests", "queued_prompt_tokens", "queued_cached_tokens", "queue_full"]);
}
