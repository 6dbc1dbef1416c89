//! Model-based test: random pushes, pops, cancels and clock moves against a plain
//! `BTreeMap` model that recomputes order, limits and usage from scratch every time.

use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::cmp::Ordering;

use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

use super::super::*;
use crate::time::Instant;

const REQS: u64 = 12;
const TIMEOUT_MS: u64 = 500;
const QUEUED_MAX: usize = 8;
const EXTRA_MAX: usize = 2;
/// Class names requests carry; `""` stands for no class.
const NAMES: [&str; 7] = ["", "gold", "silver", "default", "x", "y", "z"];

fn config(order: QueueOrder) -> QueueConfig {
    let gold = ClassLimits {
        queued_requests_max: Some(3),
        queued_prompt_tokens_max: Some(3000),
        ..ClassLimits::unlimited("gold")
    };
    let silver = ClassLimits { queued_cached_tokens_max: Some(1500), ..ClassLimits::unlimited("silver") };
    let default_class = ClassLimits { queued_requests_max: Some(2), ..ClassLimits::default() };
    QueueConfig {
        order,
        queued_max: QUEUED_MAX,
        queue_timeout_ms: TIMEOUT_MS,
        classes: alloc::vec![gold, silver],
        default_class,
        extra_classes_max: EXTRA_MAX,
        ..QueueConfig::default()
    }
}

#[derive(Clone, Debug)]
enum Transition {
    Push(QueueEntry),
    Pop,
    Cancel(u64),
    Advance(i64),
    Timeout,
}

/// A transition with the answer the queue must give.
#[derive(Clone, Debug)]
enum Op {
    Nothing,
    Push(QueueEntry, Result<(), AdmissionError>),
    Pop(Option<QueueEntry>),
    Cancel(u64, Option<QueueEntry>),
    Timeout(Vec<QueueEntry>),
}

#[derive(Clone, Debug)]
struct Queued {
    entry: QueueEntry,
    seq: u64,
    arrival_ms: u64,
    /// The class the request is counted under.
    bucket: String,
}

#[derive(Clone, Debug)]
struct Model {
    order: QueueOrder,
    now_ms: u64,
    queued: BTreeMap<u64, Queued>,
    seq: u64,
    op: Op,
}

impl Model {
    /// `Less` when `a` leaves before `b`.
    fn before(&self, a: &Queued, b: &Queued) -> Ordering {
        let (ea, eb) = (&a.entry, &b.entry);
        let score = match self.order {
            // jump − arrival, both in ms: exact.
            QueueOrder::Fcfs => {
                let sa = ea.priority_jump_ms - a.arrival_ms as i64;
                let sb = eb.priority_jump_ms - b.arrival_ms as i64;
                sb.cmp(&sa)
            }
            // (1000 + jump_a) / w_a against (1000 + jump_b) / w_b, cross-multiplied.
            QueueOrder::Wspt => {
                let w = |e: &QueueEntry| i64::from(e.isl_tokens.saturating_sub(e.cached_tokens).max(1));
                let sa = (1000 + ea.priority_jump_ms) * w(eb);
                let sb = (1000 + eb.priority_jump_ms) * w(ea);
                sb.cmp(&sa)
            }
        };
        eb.strict_priority.cmp(&ea.strict_priority).then(score).then(a.seq.cmp(&b.seq))
    }

    fn next(&self) -> Option<u64> {
        self.queued.values().min_by(|a, b| self.before(a, b)).map(|q| q.entry.req.0)
    }

    fn usage(&self, bucket: &str) -> ClassUsage {
        let mut u = ClassUsage::default();
        for q in self.queued.values().filter(|q| q.bucket == bucket) {
            u.requests += 1;
            u.prompt_tokens += u64::from(q.entry.isl_tokens);
            u.cached_tokens += u64::from(q.entry.cached_tokens);
        }
        u
    }

    fn bucket(&self, class: Option<&str>) -> String {
        let name = class.unwrap_or("default");
        let listed = ["gold", "silver", "default"].contains(&name);
        let tracked: Vec<&str> = self
            .queued
            .values()
            .map(|q| q.bucket.as_str())
            .filter(|b| !["gold", "silver", "default"].contains(b))
            .collect();
        let own = listed || tracked.contains(&name) || {
            let mut distinct = tracked.clone();
            distinct.sort_unstable();
            distinct.dedup();
            distinct.len() < EXTRA_MAX
        };
        String::from(if own { name } else { "default" })
    }

    fn push(&mut self, entry: QueueEntry) -> Result<(), AdmissionError> {
        if self.queued.contains_key(&entry.req.0) {
            return Err(AdmissionError::DuplicateRequest { req: entry.req });
        }
        let bucket = self.bucket(entry.class.as_deref());
        let u = self.usage(&bucket);
        let (reqs_max, prompt_max, cached_max) = match bucket.as_str() {
            "gold" => (Some(3), Some(3000), None),
            "silver" => (None, None, Some(1500)),
            _ => (Some(2), None, None),
        };
        let refuse = |limit_kind, current, limit| {
            Err(AdmissionError::Rejected(QueueRejection { class: bucket.clone(), limit_kind, current, limit }))
        };
        if self.queued.len() >= QUEUED_MAX {
            return refuse(LimitKind::QueueFull, self.queued.len() as u64, QUEUED_MAX as u64);
        }
        if let Some(max) = reqs_max.filter(|&m| u.requests >= m) {
            return refuse(LimitKind::QueuedRequests, u.requests.into(), max.into());
        }
        if let Some(max) = prompt_max.filter(|&m| u.prompt_tokens + u64::from(entry.isl_tokens) > m) {
            return refuse(LimitKind::QueuedPromptTokens, u.prompt_tokens, max);
        }
        if let Some(max) = cached_max.filter(|&m| u.cached_tokens + u64::from(entry.cached_tokens) > m) {
            return refuse(LimitKind::QueuedCachedTokens, u.cached_tokens, max);
        }
        self.seq += 1;
        let queued = Queued { entry: entry.clone(), seq: self.seq, arrival_ms: self.now_ms, bucket };
        self.queued.insert(entry.req.0, queued);
        Ok(())
    }

    fn due(&self) -> Vec<u64> {
        let mut due: Vec<(u64, u64, u64)> = self
            .queued
            .values()
            .map(|q| (q.arrival_ms + TIMEOUT_MS, q.seq, q.entry.req.0))
            .filter(|&(deadline, _, _)| deadline <= self.now_ms)
            .collect();
        due.sort_unstable();
        due.into_iter().map(|(_, _, req)| req).collect()
    }
}

struct QueueModel;

impl ReferenceStateMachine for QueueModel {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        prop_oneof![Just(QueueOrder::Fcfs), Just(QueueOrder::Wspt)]
            .prop_map(|order| Model { order, now_ms: 0, queued: BTreeMap::new(), seq: 0, op: Op::Nothing })
            .boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Transition> {
        // Coarse steps make equal scores and exactly-full limits common.
        let entry = (0..REQS, -1..=1i32, -30..30i64, 0..16u32, 0..11u32, 0..NAMES.len()).prop_map(
            |(req, strict_priority, jump, isl, cached, name)| QueueEntry {
                req: RequestId(req),
                strict_priority,
                priority_jump_ms: jump * 100,
                isl_tokens: isl * 100,
                cached_tokens: cached * 100,
                class: Some(NAMES[name]).filter(|n| !n.is_empty()).map(String::from),
                tenant: TenantId(0),
            },
        );
        prop_oneof![
            6 => entry.prop_map(Transition::Push),
            3 => Just(Transition::Pop),
            2 => (0..REQS).prop_map(Transition::Cancel),
            2 => (-5..40i64).prop_map(|tens| Transition::Advance(tens * 10)),
            1 => Just(Transition::Timeout),
        ]
        .boxed()
    }

    fn apply(mut m: Model, t: &Transition) -> Model {
        m.op = match t.clone() {
            Transition::Push(entry) => Op::Push(entry.clone(), m.push(entry)),
            Transition::Pop => {
                let next = m.next();
                Op::Pop(next.and_then(|req| m.queued.remove(&req)).map(|q| q.entry))
            }
            Transition::Cancel(req) => Op::Cancel(req, m.queued.remove(&req).map(|q| q.entry)),
            Transition::Advance(ms) => {
                m.now_ms = m.now_ms.saturating_add_signed(ms);
                Op::Nothing
            }
            Transition::Timeout => {
                let due = m.due();
                Op::Timeout(due.iter().filter_map(|req| m.queued.remove(req)).map(|q| q.entry).collect())
            }
        };
        m
    }
}

struct Sut;

impl StateMachineTest for Sut {
    type SystemUnderTest = AdmissionQueue;
    type Reference = QueueModel;

    fn init_test(m: &Model) -> AdmissionQueue {
        AdmissionQueue::new(config(m.order))
    }

    fn apply(mut q: AdmissionQueue, m: &Model, _: Transition) -> AdmissionQueue {
        let now = Instant::from_millis(m.now_ms);
        match m.op.clone() {
            Op::Nothing => {}
            Op::Push(entry, want) => assert_eq!(q.push(now, entry), want),
            Op::Pop(want) => assert_eq!(q.pop(), want),
            Op::Cancel(req, want) => assert_eq!(q.cancel(RequestId(req)), want),
            Op::Timeout(want) => {
                q.handle_timeout(now);
                let got: Vec<QueueEntry> = core::iter::from_fn(|| q.poll_timed_out()).collect();
                assert_eq!(got, want);
            }
        }
        q
    }

    fn check_invariants(q: &AdmissionQueue, m: &Model) {
        assert_eq!((q.len(), q.is_empty()), (m.queued.len(), m.queued.is_empty()));
        assert_eq!(q.peek().map(|e| e.req.0), m.next(), "next in order");
        let deadline = m.queued.values().map(|q| q.arrival_ms + TIMEOUT_MS).min();
        assert_eq!(q.poll_timeout(), deadline.map(Instant::from_millis));
        for req in 0..REQS {
            assert_eq!(q.contains(RequestId(req)), m.queued.contains_key(&req), "contains {req}");
        }
        // Usage is recomputed from the queued requests: a leak shows up as a difference,
        // and an empty queue must report zero everywhere.
        for name in NAMES.iter().map(|n| if n.is_empty() { "default" } else { n }) {
            assert_eq!(q.class_usage(name), m.usage(name), "usage of {name:?}");
        }
    }
}

prop_state_machine! {
    #[test]
    fn admission_queue_matches_model(sequential 1..60 => Sut);
}
