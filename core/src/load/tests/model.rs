//! Model-based test: the tracker against a plain `BTreeMap` of bookings that recomputes
//! every load from scratch. Ids, keys and blocks come from small ranges so duplicates,
//! unknown ids, shared blocks, a full table and expiry all happen often.

use super::super::*;
use super::keys::{any_key, universe};
use alloc::vec;
use alloc::vec::Vec;
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

const AGE_MS: u64 = 1000;
const REQUESTS_MAX: usize = 5;
const REQS: u64 = 7;
const WORKERS: u64 = 3;
const RANKS: u32 = 2;

#[derive(Clone, Debug)]
struct MBooking {
    key: WorkerKey,
    blocks: Vec<u64>,
    prefill: u32,
    expected: u32,
    output: u32,
    deadline: Instant,
    seq: u64,
    /// Its prefill has not finished (never for decode bookings).
    prefilling: bool,
}

/// What the last transition returned, for the real tracker to match.
#[derive(Clone, Debug, PartialEq, Default)]
enum Outcome {
    #[default]
    Nothing,
    Result(Result<(), LoadError>),
    Removed(usize),
    Expired(Vec<(RequestId, Phase)>),
}

#[derive(Clone, Debug, Default)]
struct Model {
    now: Instant,
    bookings: BTreeMap<(RequestId, Phase), MBooking>,
    next_seq: u64,
    stats: LoadStats,
    last: Outcome,
    /// Per key with a booking prefilling: when that stretch began, tokens done in it.
    stretch: BTreeMap<WorkerKey, (Instant, u64)>,
}

impl Model {
    fn load(&self, key: WorkerKey) -> WorkerLoad {
        let mut blocks = alloc::collections::BTreeSet::new();
        let mut l = WorkerLoad::default();
        for (&(_, phase), b) in self.bookings.iter().filter(|(_, b)| b.key == key) {
            l.active_requests += 1;
            l.active_prefill_tokens += u64::from(b.prefill);
            if phase != Phase::Prefill {
                blocks.extend(b.blocks.iter().copied());
                l.active_decode_blocks += u64::from(b.expected.max(b.output));
            }
        }
        l.active_decode_blocks += blocks.len() as u64;
        l
    }

    fn progress(&self, key: WorkerKey) -> PrefillProgress {
        let requests = self.bookings.values().filter(|b| b.key == key && b.prefilling).count();
        let stretch = self.stretch.get(&key).copied();
        PrefillProgress {
            requests: requests as u32,
            busy_since: stretch.map(|s| s.0),
            done_tokens: stretch.map_or(0, |s| s.1),
        }
    }

    /// The booking's prefill finished (`done`) or it left; the stretch ends with the last.
    fn end_prefill(&mut self, id: (RequestId, Phase), done: bool) {
        let Some(b) = self.bookings.get_mut(&id) else { return };
        let (key, tokens, was) = (b.key, b.prefill, b.prefilling);
        b.prefilling = false;
        b.prefill = 0;
        if was && done {
            if let Some(s) = self.stretch.get_mut(&key) {
                s.1 += u64::from(tokens);
            }
        }
        if !self.bookings.values().any(|b| b.key == key && b.prefilling) {
            self.stretch.remove(&key);
        }
    }

    /// Removes a booking as free, expiry or worker removal do.
    fn drop_booking(&mut self, id: (RequestId, Phase)) {
        self.end_prefill(id, false);
        self.bookings.remove(&id);
    }

    fn unknown(&mut self, req: RequestId, phase: Phase) -> Result<(), LoadError> {
        self.stats.unknown_request += 1;
        Err(LoadError::UnknownRequest { req, phase })
    }
}

#[derive(Clone, Debug)]
enum Step {
    Add {
        req: RequestId,
        phase: Phase,
        key: WorkerKey,
        blocks: Vec<u64>,
        prefill: u32,
        expected: u32,
    },
    PrefillDone {
        req: RequestId,
        phase: Phase,
    },
    Progress {
        req: RequestId,
        phase: Phase,
        output_tokens: u32,
        block_size: u32,
    },
    Free {
        req: RequestId,
        phase: Phase,
    },
    RemoveWorker(WorkerId),
    /// Moves the clock by this many ms (negative: backwards) and expires what is due.
    Advance(i64),
}

fn ids() -> impl Strategy<Value = (RequestId, Phase)> {
    (0..REQS, prop::sample::select(Phase::ALL.to_vec())).prop_map(|(r, p)| (RequestId(r), p))
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Step> {
        let key = any_key(WORKERS, RANKS);
        let add = (ids(), key, prop::collection::vec(0u64..6, 0..4), 0u32..100, 0u32..4).prop_map(
            |((req, phase), key, blocks, prefill, expected)| Step::Add { req, phase, key, blocks, prefill, expected },
        );
        prop_oneof![
            4 => add,
            1 => ids().prop_map(|(req, phase)| Step::PrefillDone { req, phase }),
            2 => (ids(), 0u32..20, prop::sample::select(vec![1u32, 2, 4])).prop_map(
                |((req, phase), output_tokens, block_size)| Step::Progress { req, phase, output_tokens, block_size }
            ),
            2 => ids().prop_map(|(req, phase)| Step::Free { req, phase }),
            1 => (0..WORKERS + 1).prop_map(|w| Step::RemoveWorker(WorkerId(w))),
            // Quarter-second steps so the clock often lands exactly on a deadline.
            2 => (-2i64..7).prop_map(|q| Step::Advance(q * 250)),
        ]
        .boxed()
    }

    fn apply(mut m: Model, step: &Step) -> Model {
        m.last = match step.clone() {
            Step::Add { req, phase, key, blocks, prefill, expected } => {
                Outcome::Result(if m.bookings.contains_key(&(req, phase)) {
                    m.stats.duplicate_request += 1;
                    Err(LoadError::DuplicateRequest { req, phase })
                } else if m.bookings.len() >= REQUESTS_MAX {
                    m.stats.table_full += 1;
                    Err(LoadError::TableFull { requests_max: REQUESTS_MAX })
                } else {
                    let (deadline, seq) = (m.now.add_ms(AGE_MS), m.next_seq);
                    m.next_seq += 1;
                    let prefilling = phase != Phase::Decode;
                    if prefilling && !m.stretch.contains_key(&key) {
                        m.stretch.insert(key, (m.now, 0));
                    }
                    let b = MBooking { key, blocks, prefill, expected, output: 0, deadline, seq, prefilling };
                    m.bookings.insert((req, phase), b);
                    Ok(())
                })
            }
            Step::PrefillDone { req, phase } => Outcome::Result(if m.bookings.contains_key(&(req, phase)) {
                m.end_prefill((req, phase), true);
                Ok(())
            } else {
                m.unknown(req, phase)
            }),
            Step::Progress { req, phase, output_tokens, block_size } => {
                Outcome::Result(if m.bookings.contains_key(&(req, phase)) {
                    if output_tokens > 0 {
                        m.end_prefill((req, phase), true);
                    }
                    if let Some(b) = m.bookings.get_mut(&(req, phase)) {
                        b.output = b.output.max(output_tokens.div_ceil(block_size));
                    }
                    Ok(())
                } else {
                    m.unknown(req, phase)
                })
            }
            Step::Free { req, phase } => Outcome::Result(if m.bookings.contains_key(&(req, phase)) {
                m.drop_booking((req, phase));
                Ok(())
            } else {
                m.unknown(req, phase)
            }),
            Step::RemoveWorker(w) => {
                let gone: Vec<_> = m.bookings.iter().filter(|(_, b)| b.key.worker == w).map(|(&id, _)| id).collect();
                for &id in &gone {
                    m.drop_booking(id);
                }
                Outcome::Removed(gone.len())
            }
            Step::Advance(ms) => {
                let us = ms.unsigned_abs() * 1000;
                m.now =
                    if ms >= 0 { m.now.add_us(us) } else { Instant::from_micros(m.now.as_micros().saturating_sub(us)) };
                let mut due: Vec<_> = m
                    .bookings
                    .iter()
                    .filter(|(_, b)| b.deadline <= m.now)
                    .map(|(&id, b)| (b.deadline, b.seq, id))
                    .collect();
                due.sort();
                for &(_, _, id) in &due {
                    m.drop_booking(id);
                }
                m.stats.expired += due.len() as u64;
                Outcome::Expired(due.into_iter().map(|(_, _, id)| id).collect())
            }
        };
        m
    }
}

struct RealTracker;

impl StateMachineTest for RealTracker {
    type SystemUnderTest = LoadTracker;
    type Reference = Reference;

    fn init_test(_: &Model) -> LoadTracker {
        LoadTracker::new(LoadConfig { request_age_max_ms: AGE_MS, requests_max: REQUESTS_MAX, hash_seed: 5 })
    }

    fn apply(mut t: LoadTracker, m: &Model, step: Step) -> LoadTracker {
        let got = match step {
            Step::Add { req, phase, key, blocks, prefill, expected } => {
                let blocks: Vec<SeqHash> = blocks.into_iter().map(SeqHash).collect();
                Outcome::Result(t.add(m.now, req, phase, key, &blocks, prefill, expected))
            }
            Step::PrefillDone { req, phase } => Outcome::Result(t.prefill_done(req, phase)),
            Step::Progress { req, phase, output_tokens, block_size } => {
                let bs = BlockSize::new(block_size).unwrap();
                Outcome::Result(t.decode_progress(req, phase, output_tokens, bs))
            }
            Step::Free { req, phase } => Outcome::Result(t.free(req, phase)),
            Step::RemoveWorker(w) => Outcome::Removed(t.remove_worker(w)),
            Step::Advance(_) => {
                for _ in 0..3 {
                    t.handle_timeout(m.now); // One call suffices at this size; extras are spurious.
                }
                let mut expired = Vec::new();
                while let Some(id) = t.poll_expired() {
                    expired.push(id);
                }
                Outcome::Expired(expired)
            }
        };
        assert_eq!(got, m.last);
        t
    }

    fn check_invariants(t: &LoadTracker, m: &Model) {
        let mut requests = 0;
        for key in universe(WORKERS, RANKS) {
            assert_eq!(t.load(key), m.load(key), "load of {key}");
            assert_eq!(t.prefill_progress(key), m.progress(key), "prefill progress of {key}");
            requests += t.load(key).active_requests as usize;
        }
        assert_eq!(requests, t.len(), "per-key requests vs live bookings");
        assert_eq!(t.len(), m.bookings.len());
        let total = universe(WORKERS, RANKS).map(|k| m.load(k)).fold(WorkerLoad::default(), |a, l| WorkerLoad {
            active_prefill_tokens: a.active_prefill_tokens + l.active_prefill_tokens,
            active_decode_blocks: a.active_decode_blocks + l.active_decode_blocks,
            active_requests: a.active_requests + l.active_requests,
        });
        assert_eq!(t.total(), total);
        for r in 0..REQS {
            for phase in Phase::ALL {
                let want = m.bookings.get(&(RequestId(r), phase)).map(|b| b.key);
                assert_eq!(t.booking(RequestId(r), phase), want);
            }
        }
        assert_eq!(t.poll_timeout(), m.bookings.values().map(|b| b.deadline).min());
        assert_eq!(t.stats(), m.stats);
    }
}

prop_state_machine! {
    #[test]
    fn tracker_matches_model(sequential 1..60 => RealTracker);
}
