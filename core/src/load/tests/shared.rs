//! A prompt block held on a worker key both by local bookings and by other replicas'
//! entries counts once in [`RemoteLoad::combined`]: table cases first, then the two
//! tables driven together against a model that recomputes `|local ∪ remote|` per key.

use super::super::*;
use super::keys::{any_key, universe};
use crate::load::{RemoteLoad, RemoteLoadConfig, ReplicaId};
use alloc::collections::BTreeSet;
use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

const LOCAL_AGE_MS: u64 = 1000;
const SILENCE_MS: u64 = 2000;
const REMOTE_AGE_MS: u64 = 5000;

fn local_cfg() -> LoadConfig {
    LoadConfig { request_age_max_ms: LOCAL_AGE_MS, requests_max: 64, hash_seed: 3 }
}

fn remote_cfg() -> RemoteLoadConfig {
    RemoteLoadConfig {
        replica_silence_max_ms: SILENCE_MS,
        request_age_max_ms: REMOTE_AGE_MS,
        hash_seed: 4,
        ..RemoteLoadConfig::default()
    }
}

const K: WorkerKey = WorkerKey::new(0, 0);
/// Another rank of the same worker: blocks there are not blocks on `K`.
const K2: WorkerKey = WorkerKey::new(0, 1);

/// One input to the pair of tables, as a router would feed it.
#[derive(Clone, Debug)]
enum Op {
    /// A local aggregated booking of request `.0` on `.1` with prompt blocks `.2`.
    Local(u64, WorkerKey, Range<u64>),
    /// The local request finished.
    Free(u64),
    /// Replica `.0` booked its request `.1` on `K` with prompt blocks `.2`.
    Remote(u64, u64, Range<u64>),
    /// Replica `.0`'s request `.1` finished.
    Finish(u64, u64),
    /// Replica `.0` restarted or left.
    Forget(u64),
    /// Worker 0 left: the local tracker hears first.
    LocalRemoveWorker,
    /// Worker 0 left: the remote table hears.
    RemoteRemoveWorker,
    /// The clock reads this many ms; both tables expire what is due.
    At(u64),
}

/// Runs `steps`; after each, `K` must have `shared` blocks held on both sides and
/// `decode` decode blocks combined.
#[track_caller]
fn check(steps: &[(Op, u64, u64)]) {
    let mut local = LoadTracker::new(local_cfg());
    let mut remote = RemoteLoad::new(remote_cfg());
    let mut now = Instant::ZERO;
    for (i, (op, shared, decode)) in steps.iter().enumerate() {
        let blocks = |r: &Range<u64>| r.clone().map(SeqHash).collect::<Vec<_>>();
        match op {
            Op::Local(q, key, r) => local
                .add_with_remote(now, RequestId(*q), Phase::Aggregated, *key, &blocks(r), 0, 0, &mut remote)
                .unwrap(),
            Op::Free(q) => local.free_with_remote(RequestId(*q), Phase::Aggregated, &mut remote).unwrap(),
            Op::Remote(p, q, r) => {
                let (p, q) = (ReplicaId(*p), RequestId(*q));
                remote.add(now, p, q, Phase::Aggregated, K, 0, &blocks(r), 0, &local).unwrap()
            }
            Op::Finish(p, q) => remote.finish(now, ReplicaId(*p), RequestId(*q), Phase::Aggregated).unwrap(),
            Op::Forget(p) => {
                remote.remove_replica(ReplicaId(*p));
            }
            Op::LocalRemoveWorker => {
                local.remove_worker_with_remote(WorkerId(0), &mut remote);
            }
            Op::RemoteRemoveWorker => {
                remote.remove_worker(WorkerId(0));
            }
            Op::At(ms) => {
                now = Instant::from_millis(*ms);
                local.handle_timeout_with_remote(now, &mut remote);
                while local.poll_expired().is_some() {}
                remote.handle_timeout(now);
            }
        }
        let got = (remote.shared_blocks(K), remote.combined(K, local.load(K)).active_decode_blocks);
        assert_eq!(got, (*shared, *decode), "(shared, decode blocks) after step {i}: {op:?}");
        remote.check().unwrap();
        remote.check_shared(&local).unwrap();
    }
}

#[test]
fn local_then_remote_then_each_side_goes() {
    check(&[
        (Op::Local(1, K, 1..5), 0, 4),
        (Op::Remote(7, 1, 1..7), 4, 6),
        (Op::Free(1), 0, 6),
        (Op::Finish(7, 1), 0, 0),
    ]);
    check(&[
        (Op::Local(1, K, 1..5), 0, 4),
        (Op::Remote(7, 1, 1..7), 4, 6),
        (Op::Finish(7, 1), 0, 4),
        (Op::Free(1), 0, 0),
    ]);
}

#[test]
fn remote_then_local_overlapping_in_the_middle() {
    check(&[
        (Op::Remote(7, 1, 1..5), 0, 4),
        (Op::Local(1, K, 3..9), 2, 8),
        (Op::Finish(7, 1), 0, 6),
        (Op::Free(1), 0, 0),
    ]);
}

#[test]
fn a_block_stays_shared_while_any_holder_on_either_side_stays() {
    check(&[
        (Op::Remote(7, 1, 1..5), 0, 4),
        (Op::Remote(8, 1, 1..5), 0, 4),
        (Op::Local(1, K, 1..3), 2, 4),
        (Op::Local(2, K, 2..4), 3, 4),
        (Op::Finish(7, 1), 3, 4),
        (Op::Free(1), 2, 4),
        (Op::Forget(8), 0, 2),
        (Op::Free(2), 0, 0),
    ]);
}

#[test]
fn expiry_on_either_side_unshares() {
    check(&[
        (Op::Local(1, K, 1..5), 0, 4),
        (Op::At(500), 0, 4),
        (Op::Local(2, K, 3..7), 0, 6),
        (Op::Remote(7, 1, 1..5), 4, 6),
        // Local request 1 is due at 1000: blocks 1 and 2 are now the peer's alone.
        (Op::At(1000), 2, 6),
        // Local request 2 is due at 1500.
        (Op::At(1500), 0, 4),
        // The peer has been silent since 500.
        (Op::At(2500), 0, 0),
        (Op::Local(3, K, 1..3), 0, 2),
    ]);
}

#[test]
fn a_removed_worker_unshares_in_either_order() {
    let setup = [(Op::Local(1, K, 1..4), 0, 3), (Op::Remote(7, 1, 1..4), 3, 3)];
    let local_first = [(Op::LocalRemoveWorker, 0, 3), (Op::RemoteRemoveWorker, 0, 0)];
    let remote_first = [(Op::RemoteRemoveWorker, 0, 3), (Op::LocalRemoveWorker, 0, 0)];
    check(&[&setup[..], &local_first[..]].concat());
    check(&[&setup[..], &remote_first[..]].concat());
}

#[test]
fn blocks_on_another_key_are_not_shared() {
    check(&[(Op::Local(1, K2, 1..4), 0, 0), (Op::Remote(7, 1, 1..4), 0, 3), (Op::Local(2, K, 2..3), 1, 3)]);
}

#[test]
fn shared_blocks_return_after_a_local_rebooking() {
    check(&[
        (Op::Local(1, K, 1..3), 0, 2),
        (Op::Remote(7, 1, 1..4), 2, 3),
        (Op::Free(1), 0, 3),
        (Op::Local(2, K, 2..6), 2, 5),
        (Op::Forget(7), 0, 4),
        (Op::Remote(7, 2, 5..6), 1, 4),
    ]);
}

// --- Model-based: both tables together against `|local ∪ remote|` per key. ---

const REQS: u64 = 4;
const REPLICAS: u64 = 2;
const WORKERS: u64 = 2;
const RANKS: u32 = 2;
const BLOCKS: u64 = 5;

#[derive(Clone, Debug)]
struct MBooking {
    key: WorkerKey,
    /// Empty for prefill bookings, which hold no decode blocks.
    blocks: Vec<u64>,
    output: u32,
    deadline: Instant,
}

#[derive(Clone, Debug, Default)]
struct Model {
    now: Instant,
    local: BTreeMap<(RequestId, Phase), MBooking>,
    remote: BTreeMap<(ReplicaId, RequestId, Phase), MBooking>,
    /// Replica → its silence deadline.
    replicas: BTreeMap<ReplicaId, Instant>,
}

impl Model {
    fn held<'a>(m: impl Iterator<Item = &'a MBooking>, key: WorkerKey) -> BTreeSet<u64> {
        m.filter(|b| b.key == key).flat_map(|b| b.blocks.iter().copied()).collect()
    }

    fn outputs<'a>(m: impl Iterator<Item = &'a MBooking>, key: WorkerKey) -> u64 {
        m.filter(|b| b.key == key).map(|b| u64::from(b.output)).sum()
    }

    /// Decode blocks on `key`: every prompt block held on either side once, plus outputs.
    fn decode_blocks(&self, key: WorkerKey) -> u64 {
        let mut all = Self::held(self.local.values(), key);
        all.extend(Self::held(self.remote.values(), key));
        all.len() as u64 + Self::outputs(self.local.values(), key) + Self::outputs(self.remote.values(), key)
    }

    fn shared(&self, key: WorkerKey) -> u64 {
        Self::held(self.local.values(), key).intersection(&Self::held(self.remote.values(), key)).count() as u64
    }

    fn touch(&mut self, r: ReplicaId) {
        self.replicas.insert(r, self.now.add_ms(SILENCE_MS));
    }
}

#[derive(Clone, Debug)]
enum Step {
    LocalAdd {
        req: RequestId,
        phase: Phase,
        key: WorkerKey,
        blocks: Vec<u64>,
        output: u32,
    },
    LocalFree {
        req: RequestId,
        phase: Phase,
    },
    LocalRemoveWorker(WorkerId),
    RemoteAdd {
        replica: ReplicaId,
        req: RequestId,
        phase: Phase,
        key: WorkerKey,
        blocks: Vec<u64>,
        output: u32,
    },
    RemoteFinish {
        replica: ReplicaId,
        req: RequestId,
        phase: Phase,
    },
    RemoteForget(ReplicaId),
    RemoteRemoveWorker(WorkerId),
    /// The clock moves forward this many ms; both tables expire what is due.
    Advance(u64),
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Step> {
        let req = (0..REQS).prop_map(RequestId);
        let phase = prop::sample::select(Phase::ALL.to_vec());
        let replica = (0..REPLICAS).prop_map(ReplicaId);
        let key = any_key(WORKERS, RANKS);
        let blocks = prop::collection::vec(0..BLOCKS, 0..4);
        let worker = (0..WORKERS).prop_map(WorkerId);
        let local_add = (req.clone(), phase.clone(), key.clone(), blocks.clone(), 0u32..3)
            .prop_map(|(req, phase, key, blocks, output)| Step::LocalAdd { req, phase, key, blocks, output });
        let remote_add = (replica.clone(), req.clone(), phase.clone(), key, blocks, 0u32..3).prop_map(
            |(replica, req, phase, key, blocks, output)| Step::RemoteAdd { replica, req, phase, key, blocks, output },
        );
        prop_oneof![
            4 => local_add,
            4 => remote_add,
            2 => (req.clone(), phase.clone()).prop_map(|(req, phase)| Step::LocalFree { req, phase }),
            2 => (replica.clone(), req, phase)
                .prop_map(|(replica, req, phase)| Step::RemoteFinish { replica, req, phase }),
            1 => replica.prop_map(Step::RemoteForget),
            1 => worker.clone().prop_map(Step::LocalRemoveWorker),
            1 => worker.prop_map(Step::RemoteRemoveWorker),
            // Quarter-second steps so the clock often lands exactly on a deadline.
            2 => (0u64..5).prop_map(|q| Step::Advance(q * 250)),
        ]
        .boxed()
    }

    fn apply(mut m: Model, step: &Step) -> Model {
        let decode = |phase: Phase, blocks: &[u64], output: u32| {
            if phase == Phase::Prefill {
                (Vec::new(), 0)
            } else {
                (blocks.to_vec(), output)
            }
        };
        match step.clone() {
            Step::LocalAdd { req, phase, key, blocks, output } => {
                let (blocks, output) = decode(phase, &blocks, output);
                let deadline = m.now.add_ms(LOCAL_AGE_MS);
                m.local.entry((req, phase)).or_insert(MBooking { key, blocks, output, deadline });
            }
            Step::LocalFree { req, phase } => {
                m.local.remove(&(req, phase));
            }
            Step::LocalRemoveWorker(w) => m.local.retain(|_, b| b.key.worker != w),
            Step::RemoteAdd { replica, req, phase, key, blocks, output } => {
                m.touch(replica);
                let (blocks, output) = decode(phase, &blocks, output);
                let deadline = m.now.add_ms(REMOTE_AGE_MS);
                m.remote.entry((replica, req, phase)).or_insert(MBooking { key, blocks, output, deadline });
            }
            Step::RemoteFinish { replica, req, phase } => {
                m.touch(replica);
                m.remote.remove(&(replica, req, phase));
            }
            Step::RemoteForget(r) => {
                m.replicas.remove(&r);
                m.remote.retain(|ek, _| ek.0 != r);
            }
            Step::RemoteRemoveWorker(w) => m.remote.retain(|_, b| b.key.worker != w),
            Step::Advance(ms) => {
                let now = m.now.add_ms(ms);
                m.now = now;
                m.local.retain(|_, b| b.deadline > now);
                let silent: Vec<ReplicaId> = m.replicas.iter().filter(|&(_, &d)| d <= now).map(|(&r, _)| r).collect();
                for r in silent {
                    m.replicas.remove(&r);
                    m.remote.retain(|ek, _| ek.0 != r);
                }
                m.remote.retain(|_, b| b.deadline > now);
            }
        }
        m
    }
}

struct Pair {
    local: LoadTracker,
    remote: RemoteLoad,
}

struct Real;

impl StateMachineTest for Real {
    type SystemUnderTest = Pair;
    type Reference = Reference;

    fn init_test(_: &Model) -> Pair {
        Pair { local: LoadTracker::new(local_cfg()), remote: RemoteLoad::new(remote_cfg()) }
    }

    fn apply(mut t: Pair, m: &Model, step: Step) -> Pair {
        let hashes = |b: &[u64]| b.iter().copied().map(SeqHash).collect::<Vec<_>>();
        let now = m.now;
        // Refusals (duplicates, unknown ids) are the single tables' concern, tested there.
        match step {
            Step::LocalAdd { req, phase, key, blocks, output } => {
                let _ = t.local.add_with_remote(now, req, phase, key, &hashes(&blocks), 0, output, &mut t.remote);
            }
            Step::LocalFree { req, phase } => {
                let _ = t.local.free_with_remote(req, phase, &mut t.remote);
            }
            Step::LocalRemoveWorker(w) => {
                t.local.remove_worker_with_remote(w, &mut t.remote);
            }
            Step::RemoteAdd { replica, req, phase, key, blocks, output } => {
                let _ = t.remote.add(now, replica, req, phase, key, 0, &hashes(&blocks), output, &t.local);
            }
            Step::RemoteFinish { replica, req, phase } => {
                let _ = t.remote.finish(now, replica, req, phase);
            }
            Step::RemoteForget(r) => {
                t.remote.remove_replica(r);
            }
            Step::RemoteRemoveWorker(w) => {
                t.remote.remove_worker(w);
            }
            Step::Advance(_) => {
                t.local.handle_timeout_with_remote(now, &mut t.remote);
                while t.local.poll_expired().is_some() {}
                t.remote.handle_timeout(now);
            }
        }
        t
    }

    fn check_invariants(t: &Pair, m: &Model) {
        for key in universe(WORKERS, RANKS) {
            let combined = t.remote.combined(key, t.local.load(key));
            assert_eq!(combined.active_decode_blocks, m.decode_blocks(key), "decode blocks of {key}");
            assert_eq!(t.remote.shared_blocks(key), m.shared(key), "shared blocks of {key}");
        }
        assert_eq!((t.local.len(), t.remote.len()), (m.local.len(), m.remote.len()));
        t.remote.check().unwrap();
        t.remote.check_shared(&t.local).unwrap();
    }
}

prop_state_machine! {
    #[test]
    fn local_and_remote_count_a_block_once(sequential 1..60 => Real);
}

#[test]
fn the_model_counts_a_block_on_both_sides_once() {
    // The model itself, on the case the feature is about.
    let b = |key, blocks: &[u64]| MBooking { key, blocks: blocks.to_vec(), output: 0, deadline: Instant::MAX };
    let mut m = Model::default();
    m.local.insert((RequestId(1), Phase::Aggregated), b(K, &[1, 2, 3]));
    m.remote.insert((ReplicaId(7), RequestId(1), Phase::Aggregated), b(K, &[2, 3, 4]));
    assert_eq!((m.shared(K), m.decode_blocks(K)), (2, 4));
    assert_eq!(vec![m.shared(K2), m.decode_blocks(K2)], vec![0, 0]);
}
