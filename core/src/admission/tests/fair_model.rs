//! Model-based test of the sharing between tenants: random pushes, pops, cancels and
//! time-outs of several weighted tenants against a plain model that rescans every
//! tenant's tag and recounts every kept slot at each step; and the fairness bounds as
//! properties of random runs.

use alloc::collections::BTreeMap;
use alloc::vec::Vec;
use core::cmp::Ordering;

use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

use super::super::*;
use crate::time::Instant;

const REQS: u64 = 16;
const TIMEOUT_MS: u64 = 400;
const QUEUED_MAX: usize = 10;
/// Tenants 0..3 are listed; 3 is unlisted (weight 1, no slots); 4 and up share 0's.
const WEIGHTS: [u32; 3] = [3, 1, 2];
const TENANTS_MAX: u16 = 4;
const TENANT_IDS: u16 = 6;

fn config(order: QueueOrder) -> QueueConfig {
    QueueConfig {
        order,
        queued_max: QUEUED_MAX,
        queue_timeout_ms: TIMEOUT_MS,
        tenant_weights: WEIGHTS.to_vec(),
        tenants_max: TENANTS_MAX,
        ..QueueConfig::default()
    }
}

/// `num / den` in lowest terms is not needed: compared by cross-multiplication.
#[derive(Clone, Copy, Debug)]
struct Frac {
    num: u128,
    den: u128,
}

impl Frac {
    fn cmp(self, o: Frac) -> Ordering {
        (self.num * o.den).cmp(&(o.num * self.den))
    }
}

#[derive(Clone, Debug)]
struct Queued {
    entry: QueueEntry,
    tenant: u16,
    seq: u64,
    arrival_ms: u64,
}

#[derive(Clone, Debug)]
enum Transition {
    Push(QueueEntry),
    Pop,
    Cancel(u64),
    Advance(u64),
    Timeout,
}

#[derive(Clone, Debug)]
enum Op {
    Nothing,
    Push(QueueEntry, Result<(), AdmissionError>),
    Pop(Option<QueueEntry>),
    Cancel(u64, Option<QueueEntry>),
    Timeout(Vec<QueueEntry>),
}

#[derive(Clone, Debug)]
struct Model {
    order: QueueOrder,
    now_ms: u64,
    queued: BTreeMap<u64, Queued>,
    /// Every tenant's start tag, kept while anything is queued.
    tags: BTreeMap<u16, Frac>,
    clock: Frac,
    seq: u64,
    op: Op,
}

fn weight(t: u16) -> u128 {
    WEIGHTS.get(usize::from(t)).map_or(1, |&w| u128::from(w))
}

fn slots(t: u16) -> u64 {
    let total: u64 = WEIGHTS.iter().map(|&w| u64::from(w)).sum();
    WEIGHTS.get(usize::from(t)).map_or(0, |&w| QUEUED_MAX as u64 * u64::from(w) / total)
}

impl Model {
    fn count(&self, t: u16) -> u64 {
        self.queued.values().filter(|q| q.tenant == t).count() as u64
    }

    /// `Less` when `a` leaves before `b`, within one tenant.
    fn before(&self, a: &Queued, b: &Queued) -> Ordering {
        let (ea, eb) = (&a.entry, &b.entry);
        let score = match self.order {
            QueueOrder::Fcfs => {
                let sa = ea.priority_jump_ms - a.arrival_ms as i64;
                let sb = eb.priority_jump_ms - b.arrival_ms as i64;
                sb.cmp(&sa)
            }
            QueueOrder::Wspt => {
                let w = |e: &QueueEntry| i64::from(e.isl_tokens.saturating_sub(e.cached_tokens).max(1));
                ((1000 + eb.priority_jump_ms) * w(ea)).cmp(&((1000 + ea.priority_jump_ms) * w(eb)))
            }
        };
        eb.strict_priority.cmp(&ea.strict_priority).then(score).then(a.seq.cmp(&b.seq))
    }

    /// The next request: the waiting tenant with the least tag (then id), its first.
    fn next(&self) -> Option<u64> {
        let mut waiting: Vec<u16> = self.queued.values().map(|q| q.tenant).collect();
        waiting.sort_unstable();
        waiting.dedup();
        let tenant = waiting.into_iter().min_by(|a, b| self.tags[a].cmp(self.tags[b]).then(a.cmp(b)))?;
        let own = self.queued.values().filter(|q| q.tenant == tenant);
        own.min_by(|a, b| self.before(a, b)).map(|q| q.entry.req.0)
    }

    fn push(&mut self, entry: QueueEntry) -> Result<(), AdmissionError> {
        if self.queued.contains_key(&entry.req.0) {
            return Err(AdmissionError::DuplicateRequest { req: entry.req });
        }
        let tenant = if entry.tenant.0 < TENANTS_MAX { entry.tenant.0 } else { 0 };
        let kept_for_others: u64 =
            (0..TENANTS_MAX).filter(|&o| o != tenant).map(|o| slots(o).saturating_sub(self.count(o))).sum();
        let own_free = u64::from(self.count(tenant) < slots(tenant));
        let taken =
            self.queued.len() as u64 + kept_for_others + slots(tenant).saturating_sub(self.count(tenant)) - own_free;
        if taken >= QUEUED_MAX as u64 {
            return Err(AdmissionError::Rejected(QueueRejection {
                class: "default".into(),
                limit_kind: LimitKind::QueueFull,
                current: taken,
                limit: QUEUED_MAX as u64,
            }));
        }
        if self.count(tenant) == 0 {
            let w = weight(tenant);
            let clock_up = Frac { num: (self.clock.num * w).div_ceil(self.clock.den), den: w };
            let tag = match self.tags.get(&tenant) {
                Some(&old) if old.cmp(clock_up) == Ordering::Greater => old,
                _ => clock_up,
            };
            self.tags.insert(tenant, tag);
        }
        self.seq += 1;
        let q = Queued { entry: entry.clone(), tenant, seq: self.seq, arrival_ms: self.now_ms };
        self.queued.insert(entry.req.0, q);
        Ok(())
    }

    fn remove(&mut self, req: u64, served: bool) -> Option<QueueEntry> {
        let q = self.queued.remove(&req)?;
        if served {
            let tag = self.tags[&q.tenant];
            self.clock = tag;
            self.tags.insert(q.tenant, Frac { num: tag.num + 1, den: tag.den });
        }
        if self.queued.is_empty() {
            self.tags.clear();
            self.clock = Frac { num: 0, den: 1 };
        }
        Some(q.entry)
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

fn entry(req: u64, tenant: u16, strict_priority: i32, jump: i64, isl: u32) -> QueueEntry {
    QueueEntry {
        req: RequestId(req),
        strict_priority,
        priority_jump_ms: jump,
        isl_tokens: isl,
        cached_tokens: 0,
        class: None,
        tenant: TenantId(tenant),
    }
}

struct FairModel;

impl ReferenceStateMachine for FairModel {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        prop_oneof![Just(QueueOrder::Fcfs), Just(QueueOrder::Wspt)]
            .prop_map(|order| Model {
                order,
                now_ms: 0,
                queued: BTreeMap::new(),
                tags: BTreeMap::new(),
                clock: Frac { num: 0, den: 1 },
                seq: 0,
                op: Op::Nothing,
            })
            .boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Transition> {
        let push = (0..REQS, 0..TENANT_IDS, -1..=1i32, -3..3i64, 1..5u32)
            .prop_map(|(req, t, prio, jump, isl)| Transition::Push(entry(req, t, prio, jump * 100, isl * 100)));
        prop_oneof![
            6 => push,
            4 => Just(Transition::Pop),
            1 => (0..REQS).prop_map(Transition::Cancel),
            2 => (0..30u64).prop_map(|tens| Transition::Advance(tens * 10)),
            1 => Just(Transition::Timeout),
        ]
        .boxed()
    }

    fn apply(mut m: Model, t: &Transition) -> Model {
        m.op = match t.clone() {
            Transition::Push(e) => Op::Push(e.clone(), m.push(e)),
            Transition::Pop => Op::Pop(m.next().and_then(|req| m.remove(req, true))),
            Transition::Cancel(req) => Op::Cancel(req, m.remove(req, false)),
            Transition::Advance(ms) => {
                m.now_ms += ms;
                Op::Nothing
            }
            Transition::Timeout => {
                let due = m.due();
                Op::Timeout(due.into_iter().filter_map(|req| m.remove(req, false)).collect())
            }
        };
        m
    }
}

struct Sut;

impl StateMachineTest for Sut {
    type SystemUnderTest = AdmissionQueue;
    type Reference = FairModel;

    fn init_test(m: &Model) -> AdmissionQueue {
        AdmissionQueue::new(config(m.order))
    }

    fn apply(mut q: AdmissionQueue, m: &Model, _: Transition) -> AdmissionQueue {
        let now = Instant::from_millis(m.now_ms);
        match m.op.clone() {
            Op::Nothing => {}
            Op::Push(e, want) => assert_eq!(q.push(now, e), want),
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
        assert_eq!(q.len(), m.queued.len());
        assert_eq!(q.peek().map(|e| e.req.0), m.next(), "next in order");
        for req in 0..REQS {
            assert_eq!(q.contains(RequestId(req)), m.queued.contains_key(&req), "contains {req}");
        }
    }
}

prop_state_machine! {
    #[test]
    fn tenants_share_the_queue_as_the_model_does(sequential 1..80 => Sut);
}

/// A run of two weighted tenants: pushes of either (`true`: tenant 1) and pops.
#[derive(Clone, Debug)]
enum Act {
    Push(bool),
    Pop,
}

/// Runs `acts` on tenants 1 and 2, returning the tenant of every pop with whether both
/// tenants were waiting just before it, and the tenant each pop found newly waiting.
fn run(w1: u32, w2: u32, acts: &[Act]) -> Vec<(u16, bool)> {
    let c = QueueConfig { tenant_weights: alloc::vec![1, w1, w2], queued_max: 1 << 16, ..QueueConfig::default() };
    let mut q = AdmissionQueue::new(c);
    let mut waiting = [0u32; 3];
    let mut pops = Vec::new();
    for (i, act) in acts.iter().enumerate() {
        match act {
            Act::Push(first) => {
                let t = if *first { 1 } else { 2 };
                let e = entry(i as u64, t, 0, 0, 100);
                assert_eq!(q.push(Instant::from_millis(i as u64), e), Ok(()));
                waiting[usize::from(t)] += 1;
            }
            Act::Pop => {
                let both = waiting[1] > 0 && waiting[2] > 0;
                if let Some(e) = q.pop() {
                    waiting[usize::from(e.tenant.0)] -= 1;
                    pops.push((e.tenant.0, both));
                }
            }
        }
    }
    pops
}

fn acts() -> impl Strategy<Value = Vec<Act>> {
    // Floods by one tenant, trickles by the other, and pops in between.
    let act = prop_oneof![3 => any::<bool>().prop_map(Act::Push), 2 => Just(Act::Pop)];
    proptest::collection::vec(act, 0..300)
}

proptest! {
    /// Over every run of pops during which both tenants wait, the counts served keep
    /// within SFQ's bound of the weights: |n1·w2 − n2·w1| ≤ w1 + w2.
    #[test]
    fn served_counts_keep_a_bounded_lag_of_the_weights(w1 in 1..=8u32, w2 in 1..=8u32, acts in acts()) {
        let pops = run(w1, w2, &acts);
        let (w1, w2) = (i64::from(w1), i64::from(w2));
        // Each maximal stretch of pops made while both waited, and every window in it.
        for stretch in pops.split(|&(_, both)| !both) {
            for start in 0..stretch.len() {
                let (mut n1, mut n2) = (0i64, 0i64);
                for &(t, _) in &stretch[start..] {
                    if t == 1 { n1 += 1 } else { n2 += 1 }
                    let lag = (n1 * w2 - n2 * w1).abs();
                    prop_assert!(lag <= w1 + w2, "window from pop {start}: {n1} and {n2} served, weights {w1}:{w2}");
                }
            }
        }
    }

    /// A tenant that starts waiting while the other floods is served after at most
    /// `floor(w_other / w_own) + 1` of the other's requests.
    #[test]
    fn a_newly_waiting_tenant_waits_at_most_its_share(w1 in 1..=8u32, w2 in 1..=8u32, flood in 1..60usize, late in 0..60usize) {
        let mut acts: Vec<Act> = (0..flood).map(|_| Act::Push(true)).collect();
        acts.extend((0..late.min(flood)).map(|_| Act::Pop));
        acts.push(Act::Push(false));
        acts.extend((0..flood + 1).map(|_| Act::Pop));
        let pops = run(w1, w2, &acts);
        let before_it = pops[late.min(flood)..].iter().take_while(|&&(t, _)| t == 1).count();
        let bound = (w1 / w2) as usize + 1;
        prop_assert!(before_it <= bound, "{before_it} pops of tenant 1 first, weights {w1}:{w2}");
    }
}
