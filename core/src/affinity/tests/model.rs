//! Model-based test: random operations on a small session universe, run against a plain
//! `BTreeMap` model and the real table, compared after every step.
//!
//! The model resolves each generated transition into an [`Op`] carrying its expected
//! answer in model ids; the test side maps those ids to the real tokens it was handed.

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

use super::super::*;
use crate::time::Instant;

/// Keys `0..KEYS`: session `k / 2`, phase by `k % 2`.
const KEYS: u8 = 8;
const TTL_MS: u64 = 100;
const WAITERS_MAX: usize = 3;
const LEASES_MAX: usize = 6;

fn session(key: u8) -> [u8; 2] {
    [b's', b'0' + key / 2]
}

fn phase(key: u8) -> Phase {
    if key & 1 == 0 {
        Phase::Aggregated
    } else {
        Phase::Decode
    }
}

#[derive(Clone, Debug)]
enum Transition {
    Acquire(u8),
    /// `fresh` picks among live tokens, otherwise among every token ever issued.
    Commit {
        pick: Index,
        fresh: bool,
        worker: u8,
        rank: Option<u8>,
    },
    Abort {
        pick: Index,
        fresh: bool,
    },
    CancelWait {
        pick: Index,
        fresh: bool,
    },
    Release {
        pick: Index,
        fresh: bool,
    },
    Invalidate {
        key: u8,
        current: bool,
    },
    InvalidateWorker(u8),
    Peek(u8),
    Advance(i16),
    Timeout,
}

/// A binding as the model names it: worker, rank, revision id.
type MBinding = (u8, Option<u8>, u64);

#[derive(Clone, Debug, PartialEq)]
enum MAcquire {
    Init(u64),
    Wait(u64),
    Bound { binding: MBinding, lease: u64 },
}

/// A transition resolved against the model, with the answer the table must give.
#[derive(Clone, Debug)]
enum Op {
    Nothing,
    Acquire {
        key: u8,
        want: Result<MAcquire, AffinityError>,
    },
    Commit {
        init: u64,
        worker: u8,
        rank: Option<u8>,
        want: Result<(u64, u64), AffinityError>,
    },
    Abort {
        init: u64,
        want: Result<(), AffinityError>,
    },
    CancelWait {
        wait: u64,
        want: Result<(), AffinityError>,
    },
    Release {
        lease: u64,
        want: Result<(), AffinityError>,
    },
    /// `rev: None` (nothing bound) passes revision 0; `stale` passes a wrong revision.
    Invalidate {
        key: u8,
        rev: Option<u64>,
        stale: bool,
        want: bool,
    },
    InvalidateWorker {
        worker: u8,
        want: usize,
    },
    Peek {
        key: u8,
        want: Option<MBinding>,
    },
    Timeout,
}

#[derive(Clone, Debug, PartialEq)]
enum MOut {
    Woken(u64),
    Expired(u8, Phase),
    Evicted(Phase),
}

#[derive(Clone, Debug)]
enum MState {
    /// The entry's `created` id is its init token.
    Init {
        waiters: Vec<u64>,
    },
    Bound {
        binding: MBinding,
        leases: u32,
        deadline_ms: Option<u64>,
    },
}

#[derive(Clone, Debug)]
struct MEntry {
    created: u64,
    state: MState,
}

#[derive(Clone, Debug)]
struct Model {
    sessions_max: usize,
    now_ms: u64,
    entries: BTreeMap<u8, MEntry>,
    /// Live leases (orphans included) and the entry they were taken on.
    leases: BTreeMap<u64, (u8, u64)>,
    next_id: u64,
    inits_ever: Vec<u64>,
    waits_ever: Vec<u64>,
    leases_ever: Vec<u64>,
    stats: AffinityStats,
    op: Op,
    outputs: Vec<MOut>,
}

impl Model {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn lease_room(&self) -> Result<(), AffinityError> {
        match self.leases.len() >= LEASES_MAX {
            true => Err(AffinityError::TooManyLeases { leases_max: LEASES_MAX }),
            false => Ok(()),
        }
    }

    fn take_lease(&mut self, key: u8, created: u64) -> u64 {
        let lease = self.id();
        self.leases.insert(lease, (key, created));
        self.leases_ever.push(lease);
        lease
    }

    /// Idle entries as (deadline, created, key), soonest first.
    fn idle(&self) -> Vec<(u64, u64, u8)> {
        let mut idle: Vec<_> = self
            .entries
            .iter()
            .filter_map(|(&k, e)| match e.state {
                MState::Bound { deadline_ms: Some(d), .. } => Some((d, e.created, k)),
                _ => None,
            })
            .collect();
        idle.sort();
        idle
    }

    fn expire(&mut self, key: u8) {
        if let Some(MEntry { state: MState::Bound { binding, .. }, .. }) = self.entries.remove(&key) {
            self.stats.expirations += 1;
            self.outputs.push(MOut::Expired(binding.0, phase(key)));
        }
    }

    fn wake(&mut self, waiters: Vec<u64>) {
        self.outputs.extend(waiters.into_iter().map(MOut::Woken));
    }

    fn acquire(&mut self, key: u8) -> Result<MAcquire, AffinityError> {
        let now = self.now_ms;
        if let Some(e) = self.entries.get(&key) {
            let created = e.created;
            match e.state.clone() {
                MState::Init { waiters } if waiters.len() >= WAITERS_MAX => {
                    return Err(AffinityError::TooManyWaiters { waiters_max_per_session: WAITERS_MAX })
                }
                MState::Init { .. } => {
                    let wait = self.id();
                    self.waits_ever.push(wait);
                    if let Some(MEntry { state: MState::Init { waiters }, .. }) = self.entries.get_mut(&key) {
                        waiters.push(wait);
                    }
                    return Ok(MAcquire::Wait(wait));
                }
                MState::Bound { deadline_ms: Some(d), .. } if d <= now => self.expire(key),
                MState::Bound { binding, leases, .. } => {
                    self.lease_room()?;
                    let lease = self.take_lease(key, created);
                    let state = MState::Bound { binding, leases: leases + 1, deadline_ms: None };
                    self.entries.insert(key, MEntry { created, state });
                    return Ok(MAcquire::Bound { binding, lease });
                }
            }
        }
        if self.entries.len() >= self.sessions_max {
            let Some(&(deadline, _, victim)) = self.idle().first() else {
                self.stats.refusals += 1;
                return Err(AffinityError::TableFull { sessions_max: self.sessions_max });
            };
            if deadline <= now {
                self.expire(victim);
            } else {
                self.entries.remove(&victim);
                self.stats.evictions += 1;
                self.outputs.push(MOut::Evicted(phase(victim)));
            }
        }
        let created = self.id();
        self.inits_ever.push(created);
        self.entries.insert(key, MEntry { created, state: MState::Init { waiters: Vec::new() } });
        Ok(MAcquire::Init(created))
    }

    fn init_key(&self, init: u64) -> Option<u8> {
        self.entries.iter().find(|(_, e)| e.created == init && matches!(e.state, MState::Init { .. })).map(|(&k, _)| k)
    }

    fn commit(&mut self, init: u64, worker: u8, rank: Option<u8>) -> Result<(u64, u64), AffinityError> {
        let key = self.init_key(init).ok_or(AffinityError::UnknownToken)?;
        self.lease_room()?;
        let rev = self.id();
        let lease = self.take_lease(key, init);
        let state = MState::Bound { binding: (worker, rank, rev), leases: 1, deadline_ms: None };
        if let Some(MEntry { state: MState::Init { waiters }, .. }) =
            self.entries.insert(key, MEntry { created: init, state })
        {
            self.wake(waiters);
        }
        Ok((rev, lease))
    }

    fn abort(&mut self, init: u64) -> Result<(), AffinityError> {
        let key = self.init_key(init).ok_or(AffinityError::UnknownToken)?;
        if let Some(MEntry { state: MState::Init { waiters }, .. }) = self.entries.remove(&key) {
            self.wake(waiters);
        }
        Ok(())
    }

    fn cancel_wait(&mut self, wait: u64) -> Result<(), AffinityError> {
        for e in self.entries.values_mut() {
            if let MState::Init { waiters } = &mut e.state {
                if let Some(pos) = waiters.iter().position(|&w| w == wait) {
                    waiters.remove(pos);
                    return Ok(());
                }
            }
        }
        Err(AffinityError::UnknownToken)
    }

    fn release(&mut self, lease: u64) -> Result<(), AffinityError> {
        let (key, created) = self.leases.remove(&lease).ok_or(AffinityError::UnknownLease)?;
        let now = self.now_ms;
        if let Some(MEntry { created: c, state: MState::Bound { leases, deadline_ms, .. } }) =
            self.entries.get_mut(&key)
        {
            if *c == created {
                *leases -= 1;
                if *leases == 0 {
                    *deadline_ms = Some(now + TTL_MS);
                }
            }
        }
        Ok(())
    }

    fn bound(&self, key: u8) -> Option<MBinding> {
        match self.entries.get(&key)?.state {
            MState::Bound { binding, .. } => Some(binding),
            MState::Init { .. } => None,
        }
    }

    fn resolve(&mut self, t: &Transition) -> Op {
        match *t {
            Transition::Acquire(key) => Op::Acquire { key, want: self.acquire(key) },
            Transition::Commit { pick, fresh, worker, rank } => match self.pick_init(pick, fresh) {
                Some(init) => Op::Commit { init, worker, rank, want: self.commit(init, worker, rank) },
                None => Op::Nothing,
            },
            Transition::Abort { pick, fresh } => match self.pick_init(pick, fresh) {
                Some(init) => Op::Abort { init, want: self.abort(init) },
                None => Op::Nothing,
            },
            Transition::CancelWait { pick, fresh } => {
                let live: Vec<u64> = self
                    .entries
                    .values()
                    .flat_map(|e| match &e.state {
                        MState::Init { waiters } => waiters.clone(),
                        MState::Bound { .. } => Vec::new(),
                    })
                    .collect();
                match pick_from(&live, &self.waits_ever, pick, fresh) {
                    Some(wait) => Op::CancelWait { wait, want: self.cancel_wait(wait) },
                    None => Op::Nothing,
                }
            }
            Transition::Release { pick, fresh } => {
                let live: Vec<u64> = self.leases.keys().copied().collect();
                match pick_from(&live, &self.leases_ever, pick, fresh) {
                    Some(lease) => Op::Release { lease, want: self.release(lease) },
                    None => Op::Nothing,
                }
            }
            Transition::Invalidate { key, current } => {
                let rev = self.bound(key).map(|b| b.2);
                let want = rev.is_some() && current;
                if want {
                    self.entries.remove(&key);
                    self.stats.invalidations += 1;
                }
                Op::Invalidate { key, rev, stale: !current, want }
            }
            Transition::InvalidateWorker(worker) => {
                let gone: Vec<u8> =
                    self.entries.keys().copied().filter(|&k| self.bound(k).is_some_and(|b| b.0 == worker)).collect();
                for k in &gone {
                    self.entries.remove(k);
                }
                self.stats.invalidations += gone.len() as u64;
                Op::InvalidateWorker { worker, want: gone.len() }
            }
            Transition::Peek(key) => Op::Peek { key, want: self.bound(key) },
            Transition::Advance(ms) => {
                self.now_ms = self.now_ms.saturating_add_signed(i64::from(ms));
                Op::Nothing
            }
            Transition::Timeout => {
                for (d, _, key) in self.idle() {
                    if d <= self.now_ms {
                        self.expire(key);
                    }
                }
                Op::Timeout
            }
        }
    }

    fn pick_init(&self, pick: Index, fresh: bool) -> Option<u64> {
        let live: Vec<u64> =
            self.entries.values().filter(|e| matches!(e.state, MState::Init { .. })).map(|e| e.created).collect();
        pick_from(&live, &self.inits_ever, pick, fresh)
    }
}

fn pick_from(live: &[u64], ever: &[u64], pick: Index, fresh: bool) -> Option<u64> {
    let from = if fresh && !live.is_empty() { live } else { ever };
    (!from.is_empty()).then(|| *pick.get(from))
}

struct TableModel;

impl ReferenceStateMachine for TableModel {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        (1usize..=5)
            .prop_map(|sessions_max| Model {
                sessions_max,
                now_ms: 0,
                entries: BTreeMap::new(),
                leases: BTreeMap::new(),
                next_id: 0,
                inits_ever: Vec::new(),
                waits_ever: Vec::new(),
                leases_ever: Vec::new(),
                stats: AffinityStats::default(),
                op: Op::Nothing,
                outputs: Vec::new(),
            })
            .boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Transition> {
        let fresh = || proptest::bool::weighted(0.8);
        prop_oneof![
            5 => (0..KEYS).prop_map(Transition::Acquire),
            3 => (any::<Index>(), fresh(), 0..3u8, proptest::option::of(0..2u8))
                .prop_map(|(pick, fresh, worker, rank)| Transition::Commit { pick, fresh, worker, rank }),
            1 => (any::<Index>(), fresh()).prop_map(|(pick, fresh)| Transition::Abort { pick, fresh }),
            1 => (any::<Index>(), fresh()).prop_map(|(pick, fresh)| Transition::CancelWait { pick, fresh }),
            4 => (any::<Index>(), fresh()).prop_map(|(pick, fresh)| Transition::Release { pick, fresh }),
            1 => (0..KEYS, any::<bool>()).prop_map(|(key, current)| Transition::Invalidate { key, current }),
            1 => (0..3u8).prop_map(Transition::InvalidateWorker),
            1 => (0..KEYS).prop_map(Transition::Peek),
            2 => (-3i16..15).prop_map(|tens| Transition::Advance(tens * 10)),
            1 => Just(Transition::Timeout),
        ]
        .boxed()
    }

    fn apply(mut state: Model, t: &Transition) -> Model {
        state.outputs.clear();
        state.op = state.resolve(t);
        state
    }
}

/// The real table plus the real tokens behind each model id.
struct Sut {
    t: AffinityTable,
    inits: BTreeMap<u64, InitToken>,
    waits: BTreeMap<u64, WaitToken>,
    leases: BTreeMap<u64, LeaseId>,
    revs: BTreeMap<u64, u64>,
    /// Keys with an initialization in flight, as the table's own answers say.
    initializing: BTreeMap<u8, u64>,
}

impl Sut {
    fn binding(&self, b: MBinding) -> Binding {
        Binding { worker: WorkerId(b.0.into()), rank: b.1.map(|r| DpRank(r.into())), revision: self.revs[&b.2] }
    }

    fn run(&mut self, m: &Model) {
        let now = Instant::from_millis(m.now_ms);
        match m.op.clone() {
            Op::Nothing => {}
            Op::Acquire { key, want } => {
                let got = self.t.acquire(now, &session(key), phase(key));
                match (want, got) {
                    (Ok(MAcquire::Init(id)), Ok(Acquire::Initialize(tok))) => {
                        assert!(self.initializing.insert(key, id).is_none(), "second initializer for key {key}");
                        self.inits.insert(id, tok);
                    }
                    (Ok(MAcquire::Wait(id)), Ok(Acquire::Wait(tok))) => {
                        self.waits.insert(id, tok);
                    }
                    (Ok(MAcquire::Bound { binding, lease: id }), Ok(Acquire::Bound { binding: got, lease })) => {
                        assert_eq!(got, self.binding(binding));
                        self.leases.insert(id, lease);
                    }
                    (Err(want), Err(got)) => assert_eq!(got, want),
                    (want, got) => panic!("acquire key {key}: model {want:?}, table {got:?}"),
                }
            }
            Op::Commit { init, worker, rank, want } => {
                let (w, r) = (WorkerId(worker.into()), rank.map(|r| DpRank(r.into())));
                match (want, self.t.commit(now, self.inits[&init], w, r)) {
                    (Ok((rev, id)), Ok((binding, lease))) => {
                        self.revs.insert(rev, binding.revision);
                        assert_eq!(binding, self.binding((worker, rank, rev)));
                        self.leases.insert(id, lease);
                        self.initializing.retain(|_, &mut i| i != init);
                    }
                    (Err(want), Err(got)) => assert_eq!(got, want),
                    (want, got) => panic!("commit: model {want:?}, table {got:?}"),
                }
            }
            Op::Abort { init, want } => {
                assert_eq!(self.t.abort(self.inits[&init]), want);
                self.initializing.retain(|_, &mut i| i != init);
            }
            Op::CancelWait { wait, want } => {
                assert_eq!(self.t.cancel_wait(self.waits[&wait]), want)
            }
            Op::Release { lease, want } => {
                assert_eq!(self.t.release(now, self.leases[&lease]), want)
            }
            Op::Invalidate { key, rev, stale, want } => {
                let real = rev.map_or(0, |r| self.revs[&r]);
                let revision = if stale { real.wrapping_add(1) } else { real };
                assert_eq!(self.t.invalidate(&session(key), phase(key), revision), want);
            }
            Op::InvalidateWorker { worker, want } => {
                assert_eq!(self.t.invalidate_worker(WorkerId(worker.into())), want)
            }
            Op::Peek { key, want } => {
                assert_eq!(self.t.peek(&session(key), phase(key)), want.map(|b| self.binding(b)));
            }
            Op::Timeout => self.t.handle_timeout(now),
        }
        self.check_outputs(m);
    }

    fn check_outputs(&mut self, m: &Model) {
        let got: Vec<MOut> = core::iter::from_fn(|| self.t.poll_output())
            .map(|o| match o {
                AffinityOutput::Woken(tok) => {
                    let id = self.waits.iter().find(|(_, &t)| t == tok).map(|(&id, _)| id);
                    MOut::Woken(id.expect("woke a token never handed out"))
                }
                AffinityOutput::Expired { worker, phase } => MOut::Expired(worker.0 as u8, phase),
                AffinityOutput::Evicted { phase } => MOut::Evicted(phase),
            })
            .collect();
        assert_eq!(got, m.outputs, "outputs after {:?}", m.op);
    }
}

impl StateMachineTest for Sut {
    type SystemUnderTest = Sut;
    type Reference = TableModel;

    fn init_test(m: &Model) -> Sut {
        let cfg = AffinityConfig {
            sessions_max: m.sessions_max,
            lease_ttl_ms: TTL_MS,
            waiters_max_per_session: WAITERS_MAX,
            leases_max: LEASES_MAX,
            hash_seed: 7,
            ..AffinityConfig::default()
        };
        Sut {
            t: AffinityTable::new(cfg),
            inits: BTreeMap::new(),
            waits: BTreeMap::new(),
            leases: BTreeMap::new(),
            revs: BTreeMap::new(),
            initializing: BTreeMap::new(),
        }
    }

    fn apply(mut sut: Sut, m: &Model, _: Transition) -> Sut {
        sut.run(m);
        sut
    }

    fn check_invariants(sut: &Sut, m: &Model) {
        let t = &sut.t;
        let before = t.fingerprint();
        assert!(t.len() <= m.sessions_max, "len {} over sessions_max", t.len());
        assert_eq!((t.len(), t.live_leases(), t.stats()), (m.entries.len(), m.leases.len(), m.stats));
        let next = m.idle().first().map(|&(d, _, _)| Instant::from_millis(d));
        assert_eq!(t.poll_timeout(), next);
        for key in 0..KEYS {
            assert_eq!(t.peek(&session(key), phase(key)), m.bound(key).map(|b| sut.binding(b)), "peek key {key}");
        }
        // Every lease not orphaned keeps its binding alive.
        for &(key, created) in m.leases.values() {
            if m.entries.get(&key).is_some_and(|e| e.created == created) {
                assert!(t.peek(&session(key), phase(key)).is_some(), "leased key {key} lost its binding");
            }
        }
        let inits = m.entries.iter().filter(|(_, e)| matches!(e.state, MState::Init { .. })).count();
        assert_eq!(sut.initializing.len(), inits, "initializers the table handed out");
        assert_eq!(t.fingerprint(), before, "a query changed the table");
    }
}

prop_state_machine! {
    #[test]
    fn affinity_table_matches_model(sequential 1..80 => Sut);
}
