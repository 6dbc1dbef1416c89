//! The remote table against a plain model: a `BTreeMap` of entries and one of replica
//! deadlines, every sum recomputed from scratch. Small id ranges make duplicates,
//! unknown entries, a full table, too many replicas, silence and age expiry common.

use super::*;
use crate::load::tests::keys::{any_key, universe};
use alloc::vec::Vec;
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

const SILENCE_MS: u64 = 1000;
const AGE_MS: u64 = 2500;
const ENTRIES_MAX: usize = 5;
const REPLICAS_MAX: usize = 2;
const REPLICAS: u64 = 3;
const REQS: u64 = 4;
const WORKERS: u64 = 3;
const BLOCKS_PER_REQUEST: usize = 3;
const BLOCKS_MAX: usize = 8;

/// A local tracker with no bookings: the remote table on its own.
fn none() -> LoadTracker {
    LoadTracker::new(crate::load::LoadConfig::default())
}

fn cfg() -> RemoteLoadConfig {
    RemoteLoadConfig {
        replica_silence_max_ms: SILENCE_MS,
        request_age_max_ms: AGE_MS,
        remote_requests_max: ENTRIES_MAX,
        replicas_max: REPLICAS_MAX,
        blocks_max_per_request: BLOCKS_PER_REQUEST,
        blocks_max: BLOCKS_MAX,
        hash_seed: 9,
    }
}

#[derive(Clone, Debug)]
struct MEntry {
    key: WorkerKey,
    prefill: u32,
    blocks: Vec<u64>,
    output: u32,
    age: Instant,
    prefilling: bool,
}

#[derive(Clone, Debug, Default)]
struct Model {
    now: Instant,
    entries: BTreeMap<EntryKey, MEntry>,
    replicas: BTreeMap<ReplicaId, Instant>,
    stats: RemoteLoadStats,
    last: Option<Result<(), RemoteLoadError>>,
    removed: usize,
    /// Per key with an entry prefilling: when that stretch began, tokens done in it.
    stretch: BTreeMap<WorkerKey, (Instant, u64)>,
}

impl Model {
    fn held(&self, key: WorkerKey) -> alloc::collections::BTreeSet<u64> {
        self.entries.values().filter(|e| e.key == key).flat_map(|e| e.blocks.iter().copied()).collect()
    }

    fn load(&self, key: WorkerKey) -> WorkerLoad {
        let mut l = WorkerLoad { active_decode_blocks: self.held(key).len() as u64, ..WorkerLoad::default() };
        for e in self.entries.values().filter(|e| e.key == key) {
            l.active_requests += 1;
            l.active_prefill_tokens += u64::from(e.prefill);
            l.active_decode_blocks += u64::from(e.output);
        }
        l
    }

    fn touch(&mut self, r: ReplicaId) -> Result<(), RemoteLoadError> {
        let deadline = self.now.add_ms(SILENCE_MS);
        let full = self.replicas.len() >= REPLICAS_MAX;
        match self.replicas.get_mut(&r) {
            Some(d) => *d = (*d).max(deadline),
            None if full => {
                self.stats.replicas_refused += 1;
                return Err(RemoteLoadError::TooManyReplicas { replicas_max: REPLICAS_MAX });
            }
            None => {
                self.replicas.insert(r, deadline);
            }
        }
        Ok(())
    }

    fn unknown(&mut self, ek: EntryKey) -> Result<(), RemoteLoadError> {
        self.stats.unknown_request += 1;
        Err(RemoteLoadError::UnknownRequest { replica: ek.0, req: ek.1, phase: ek.2 })
    }

    fn progress(&self, key: WorkerKey) -> PrefillProgress {
        let requests = self.entries.values().filter(|e| e.key == key && e.prefilling).count();
        let stretch = self.stretch.get(&key).copied();
        PrefillProgress {
            requests: requests as u32,
            busy_since: stretch.map(|s| s.0),
            done_tokens: stretch.map_or(0, |s| s.1),
        }
    }

    /// Ends stretches with no entry prefilling any more.
    fn close_stretches(&mut self) {
        let entries = &self.entries;
        self.stretch.retain(|k, _| entries.values().any(|e| e.key == *k && e.prefilling));
    }

    fn drop_where(&mut self, f: impl Fn(&EntryKey, &MEntry) -> bool) -> usize {
        let before = self.entries.len();
        self.entries.retain(|ek, e| !f(ek, e));
        self.close_stretches();
        before - self.entries.len()
    }
}

#[derive(Clone, Debug)]
enum Step {
    Heartbeat(ReplicaId),
    Add {
        ek: EntryKey,
        key: WorkerKey,
        prefill: u32,
        blocks: Vec<u64>,
        output: u32,
    },
    PrefillDone(EntryKey),
    Finish(EntryKey),
    RemoveReplica(ReplicaId),
    RemoveWorker(WorkerId),
    /// Moves the clock by this many ms (negative: backwards) and expires what is due.
    Advance(i64),
}

fn replica() -> impl Strategy<Value = ReplicaId> {
    (0..REPLICAS).prop_map(ReplicaId)
}

fn entry_key() -> impl Strategy<Value = EntryKey> {
    (replica(), 0..REQS, prop::sample::select(Phase::ALL.to_vec())).prop_map(|(r, q, p)| (r, RequestId(q), p))
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Step> {
        let key = any_key(WORKERS, 2);
        let blocks = prop::collection::vec(0u64..6, 0..5);
        let add = (entry_key(), key, 0u32..100, blocks, 0u32..10)
            .prop_map(|(ek, key, prefill, blocks, output)| Step::Add { ek, key, prefill, blocks, output });
        prop_oneof![
            2 => replica().prop_map(Step::Heartbeat),
            5 => add,
            2 => entry_key().prop_map(Step::PrefillDone),
            3 => entry_key().prop_map(Step::Finish),
            1 => replica().prop_map(Step::RemoveReplica),
            1 => (0..WORKERS + 1).prop_map(|w| Step::RemoveWorker(WorkerId(w))),
            // Quarter-second steps so the clock often lands exactly on a deadline.
            3 => (-2i64..6).prop_map(|q| Step::Advance(q * 250)),
        ]
        .boxed()
    }

    fn apply(mut m: Model, step: &Step) -> Model {
        m.last = None;
        match step.clone() {
            Step::Heartbeat(r) => m.last = Some(m.touch(r)),
            Step::Add { ek, key, prefill, blocks, output } => {
                let out = m.touch(ek.0).and_then(|()| {
                    if m.entries.contains_key(&ek) {
                        m.stats.duplicate_request += 1;
                        return Err(RemoteLoadError::DuplicateRequest { replica: ek.0, req: ek.1, phase: ek.2 });
                    }
                    if m.entries.len() >= ENTRIES_MAX {
                        m.stats.table_full += 1;
                        return Err(RemoteLoadError::TableFull { remote_requests_max: ENTRIES_MAX });
                    }
                    let prefilling = ek.2 != Phase::Decode;
                    let prefill = if prefilling { prefill } else { 0 };
                    let decodes = ek.2 != Phase::Prefill;
                    let output = if decodes { output } else { 0 };
                    let offered = if decodes { blocks.len() } else { 0 };
                    let held: usize = m.entries.values().map(|e| e.blocks.len()).sum();
                    let keep = offered.min(BLOCKS_PER_REQUEST);
                    let keep = if held + keep > BLOCKS_MAX { 0 } else { keep };
                    m.stats.blocks_truncated += (offered - keep) as u64;
                    let blocks = blocks[..keep].to_vec();
                    if prefilling && !m.stretch.contains_key(&key) {
                        m.stretch.insert(key, (m.now, 0));
                    }
                    let age = m.now.add_ms(AGE_MS);
                    m.entries.insert(ek, MEntry { key, prefill, blocks, output, age, prefilling });
                    m.stats.added += 1;
                    Ok(())
                });
                m.last = Some(out);
            }
            Step::PrefillDone(ek) => {
                let out = m.touch(ek.0).and_then(|()| match m.entries.get_mut(&ek) {
                    Some(e) => {
                        if e.prefilling {
                            if let Some(s) = m.stretch.get_mut(&e.key) {
                                s.1 += u64::from(e.prefill);
                            }
                        }
                        (e.prefill, e.prefilling) = (0, false);
                        Ok(())
                    }
                    None => m.unknown(ek),
                });
                m.close_stretches();
                m.last = Some(out);
            }
            Step::Finish(ek) => {
                let out = m.touch(ek.0).and_then(|()| match m.entries.remove(&ek) {
                    Some(_) => Ok(()),
                    None => m.unknown(ek),
                });
                m.close_stretches();
                m.last = Some(out);
            }
            Step::RemoveReplica(r) => {
                m.replicas.remove(&r);
                m.removed = m.drop_where(|ek, _| ek.0 == r);
                m.stats.dropped_requests += m.removed as u64;
            }
            Step::RemoveWorker(w) => {
                m.removed = m.drop_where(|_, e| e.key.worker == w);
                m.stats.dropped_requests += m.removed as u64;
            }
            Step::Advance(ms) => {
                let us = ms.unsigned_abs() * 1000;
                m.now =
                    if ms >= 0 { m.now.add_us(us) } else { Instant::from_micros(m.now.as_micros().saturating_sub(us)) };
                let now = m.now;
                let silent: Vec<ReplicaId> = m.replicas.iter().filter(|(_, &d)| d <= now).map(|(&r, _)| r).collect();
                for r in silent {
                    m.replicas.remove(&r);
                    m.stats.silent_replicas += 1;
                    m.stats.dropped_requests += m.drop_where(|ek, _| ek.0 == r) as u64;
                }
                m.stats.expired_requests += m.drop_where(|_, e| e.age <= now) as u64;
            }
        }
        m
    }
}

struct Real;

impl StateMachineTest for Real {
    type SystemUnderTest = RemoteLoad;
    type Reference = Reference;

    fn init_test(_: &Model) -> RemoteLoad {
        RemoteLoad::new(cfg())
    }

    fn apply(mut t: RemoteLoad, m: &Model, step: Step) -> RemoteLoad {
        let got = match step {
            Step::Heartbeat(r) => Some(t.heartbeat(m.now, r)),
            Step::Add { ek, key, prefill, blocks, output } => {
                let blocks: Vec<SeqHash> = blocks.into_iter().map(SeqHash).collect();
                Some(t.add(m.now, ek.0, ek.1, ek.2, key, prefill, &blocks, output, &none()))
            }
            Step::PrefillDone(ek) => Some(t.prefill_done(m.now, ek.0, ek.1, ek.2)),
            Step::Finish(ek) => Some(t.finish(m.now, ek.0, ek.1, ek.2)),
            Step::RemoveReplica(r) => {
                assert_eq!(t.remove_replica(r), m.removed);
                None
            }
            Step::RemoveWorker(w) => {
                assert_eq!(t.remove_worker(w), m.removed);
                None
            }
            Step::Advance(_) => {
                // One call suffices at this size; the extras are spurious and harmless.
                t.handle_timeout(m.now);
                t.handle_timeout(m.now);
                None
            }
        };
        assert_eq!(got, m.last);
        t
    }

    fn check_invariants(t: &RemoteLoad, m: &Model) {
        t.check().expect("internal sums");
        for key in universe(WORKERS, 2) {
            assert_eq!(t.load(key), m.load(key), "remote load of {key}");
            let local = WorkerLoad { active_prefill_tokens: 1, active_decode_blocks: 2, active_requests: 3 };
            let want = m.load(key);
            let both = WorkerLoad {
                active_prefill_tokens: 1 + want.active_prefill_tokens,
                active_decode_blocks: 2 + want.active_decode_blocks,
                active_requests: 3 + want.active_requests,
            };
            assert_eq!(t.combined(key, local), both);
            assert_eq!(t.combined_progress(key, PrefillProgress::default()), m.progress(key), "progress of {key}");
            let held = m.held(key);
            for query in [&[0u64, 1, 2, 3][..], &[2, 5], &[4]] {
                let want = query.iter().take(BLOCKS_PER_REQUEST).take_while(|b| held.contains(b)).count() as u32;
                let q: Vec<SeqHash> = query.iter().copied().map(SeqHash).collect();
                assert_eq!(t.held_prefix(key, &q), want, "held prefix of {query:?} on {key}");
            }
            // A local backlog that began at 250 ms merges with the remote one.
            let mine = PrefillProgress { requests: 1, busy_since: Some(Instant::from_millis(250)), done_tokens: 7 };
            let r = m.progress(key);
            let want = PrefillProgress {
                requests: 1 + r.requests,
                busy_since: r.busy_since.map_or(mine.busy_since, |t| Some(t.min(Instant::from_millis(250)))),
                done_tokens: 7 + r.done_tokens,
            };
            assert_eq!(t.combined_progress(key, mine), want, "merged progress of {key}");
        }
        assert_eq!(t.len(), m.entries.len());
        assert_eq!(t.replicas().collect::<Vec<_>>(), m.replicas.keys().copied().collect::<Vec<_>>());
        for (ek, e) in &m.entries {
            assert_eq!(t.entry(ek.0, ek.1, ek.2), Some(e.key));
        }
        let due = m.replicas.values().copied().chain(m.entries.values().map(|e| e.age)).min();
        assert_eq!(t.poll_timeout(), due);
        assert_eq!(t.stats(), m.stats);
    }
}

prop_state_machine! {
    #[test]
    fn remote_table_matches_model(sequential 1..60 => Real);
}

#[track_caller]
fn check(steps: &[(&str, u64)], want_requests_on_w0: u32) {
    // Each step: an action and the ms at which it happens, from replica 1 on worker 0.
    let mut t = RemoteLoad::new(RemoteLoadConfig { replica_silence_max_ms: 100, ..RemoteLoadConfig::default() });
    let r = ReplicaId(1);
    for (i, &(action, ms)) in steps.iter().enumerate() {
        let now = Instant::from_millis(ms);
        let q = RequestId(i as u64 % 2);
        let _ = match action {
            "add" => t.add(now, r, q, Phase::Aggregated, WorkerKey::new(0, 0), 10, &[], 1, &none()),
            "beat" => t.heartbeat(now, r),
            "tick" => {
                t.handle_timeout(now);
                Ok(())
            }
            _ => unreachable!("unknown action {action}"),
        };
    }
    assert_eq!(t.load(WorkerKey::new(0, 0)).active_requests, want_requests_on_w0, "{steps:?}");
}

#[test]
fn silence_expires_a_replica_and_any_update_is_activity() {
    check(&[("add", 0), ("tick", 99)], 1);
    check(&[("add", 0), ("tick", 100)], 0);
    check(&[("add", 0), ("beat", 50), ("tick", 100)], 1);
    check(&[("add", 0), ("add", 60), ("tick", 150)], 2);
    check(&[("add", 0), ("beat", 50), ("tick", 150)], 0);
    // Time going backwards does not pull the deadline in.
    check(&[("add", 50), ("beat", 0), ("tick", 120)], 1);
}

#[test]
fn a_time_jump_expires_in_bounded_steps() {
    let mut t = RemoteLoad::new(RemoteLoadConfig { remote_requests_max: 10_000, ..RemoteLoadConfig::default() });
    for q in 0..(REMOTE_EXPIRE_PER_CALL_MAX as u64 + 10) {
        t.add(Instant::ZERO, ReplicaId(7), RequestId(q), Phase::Aggregated, WorkerKey::new(0, 0), 1, &[], 1, &none())
            .unwrap();
    }
    let late = Instant::from_millis(3_600_000);
    t.handle_timeout(late);
    assert_eq!(t.len(), 10, "one call drops at most the cap");
    assert!(t.poll_timeout().is_some_and(|d| d <= late), "and stays due");
    t.handle_timeout(late);
    assert!(t.is_empty() && t.replicas().next().is_none() && t.poll_timeout().is_none());
    t.check().unwrap();
}
