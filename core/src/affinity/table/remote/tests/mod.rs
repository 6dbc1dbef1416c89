//! The conflict rule as data: what one replica (id 5) ends up bound to after its own
//! steps and other replicas' announcements, in the order given.

use alloc::vec::Vec;

use crate::affinity::*;
use crate::time::Instant;

const ME: u64 = 5;
const TTL_MS: u64 = 1000;
const S: &[u8] = b"session";
const A: Phase = Phase::Aggregated;

/// One step on replica `ME`, at a time in ms.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// A request here starts the session's first binding.
    Init(u64),
    /// It commits to this worker.
    Commit(u64, u64),
    /// It gives up.
    Abort,
    /// Another replica announces (worker, committed at ms, replica).
    Remote(u64, u64, u64),
    /// That replica invalidated its binding stamped (ms, replica).
    Unbind(u64, u64),
}

/// A binding as (worker, committed at ms, replica).
type Bound = Option<(u64, u64, u64)>;

/// `want` is the binding left, or none.
#[track_caller]
fn check(steps: &[Step], want: Bound) {
    let mut t = AffinityTable::new(AffinityConfig {
        lease_ttl_ms: TTL_MS,
        replica: ReplicaId(ME),
        ..AffinityConfig::default()
    });
    let mut token = None;
    let mut now = Instant::ZERO;
    for &step in steps {
        match step {
            Step::Init(ms) => {
                now = Instant::from_millis(ms);
                let Ok(Acquire::Initialize(tok)) = t.acquire(now, S, A) else { panic!("{steps:?}: no init") };
                token = Some(tok);
            }
            Step::Commit(worker, ms) => {
                now = Instant::from_millis(ms);
                let tok = token.take().expect("an init first");
                let (b, lease) = t.commit(now, tok, WorkerId(worker), None).expect("commit");
                assert_eq!(t.peek(S, A), Some(b), "commit returns the binding kept");
                t.release(now, lease).expect("release");
            }
            Step::Abort => t.abort(token.take().expect("an init first")).expect("abort"),
            Step::Remote(worker, ms, replica) => {
                now = now.max(Instant::from_millis(ms));
                let stamp = BindStamp { committed_at: Instant::from_millis(ms), replica: ReplicaId(replica) };
                let r = RemoteBinding { worker: WorkerId(worker), rank: None, stamp };
                t.apply_remote(now, S, A, r).expect("apply");
            }
            Step::Unbind(ms, replica) => {
                let stamp = BindStamp { committed_at: Instant::from_millis(ms), replica: ReplicaId(replica) };
                let _ = t.unbind_remote(S, A, stamp);
            }
        }
    }
    let got = t.peek(S, A).zip(t.stamp(S, A)).map(|(b, s)| (b.worker.0, s.committed_at.as_millis(), s.replica.0));
    assert_eq!(got, want, "{steps:?}");
}

use Step::*;

#[test]
fn the_lowest_commit_time_then_replica_id_wins_in_any_order() {
    let cases: &[(&[Step], Bound)] = &[
        // Unknown here: stored as announced.
        (&[Remote(2, 10, 7)], Some((2, 10, 7))),
        // Bound here first, announced later: the earlier commit stays.
        (&[Init(10), Commit(1, 10), Remote(2, 20, 7)], Some((1, 10, ME))),
        // Announced commit was earlier: it replaces the one here.
        (&[Init(20), Commit(1, 20), Remote(2, 10, 7)], Some((2, 10, 7))),
        // Same time: the lower replica id wins, both ways round.
        (&[Init(10), Commit(1, 10), Remote(2, 10, 7)], Some((1, 10, ME))),
        (&[Init(10), Commit(1, 10), Remote(2, 10, 3)], Some((2, 10, 3))),
        // Same worker: one binding, with the lower stamp.
        (&[Init(20), Commit(1, 20), Remote(1, 10, 7)], Some((1, 10, 7))),
        (&[Init(10), Commit(1, 10), Remote(1, 20, 7)], Some((1, 10, ME))),
        // Announced while initializing here: settled at the commit.
        (&[Init(5), Remote(2, 10, 7), Commit(1, 20)], Some((2, 10, 7))),
        (&[Init(5), Remote(2, 30, 7), Commit(1, 20)], Some((1, 20, ME))),
        (&[Init(5), Remote(2, 30, 7), Remote(3, 8, 9), Commit(1, 20)], Some((3, 8, 9))),
        // An abort adopts what was announced meanwhile, or leaves nothing.
        (&[Init(5), Remote(2, 10, 7), Abort], Some((2, 10, 7))),
        (&[Init(5), Abort], None),
        // Three replicas' announcements in every order converge on the lowest.
        (&[Remote(2, 10, 7), Remote(3, 5, 8), Remote(4, 5, 9)], Some((3, 5, 8))),
        (&[Remote(4, 5, 9), Remote(3, 5, 8), Remote(2, 10, 7)], Some((3, 5, 8))),
        (&[Remote(3, 5, 8), Remote(2, 10, 7), Remote(4, 5, 9)], Some((3, 5, 8))),
        // An invalidation drops only the binding it names.
        (&[Remote(2, 10, 7), Unbind(10, 7)], None),
        (&[Remote(2, 10, 7), Unbind(11, 7)], Some((2, 10, 7))),
        (&[Remote(2, 10, 7), Unbind(10, 8)], Some((2, 10, 7))),
        (&[Init(5), Remote(2, 10, 7), Unbind(10, 7), Commit(1, 20)], Some((1, 20, ME))),
    ];
    for (steps, want) in cases {
        check(steps, *want);
    }
}

#[test]
fn a_losing_announcement_is_answered_with_the_winner() {
    let mut t = AffinityTable::new(AffinityConfig { replica: ReplicaId(ME), ..AffinityConfig::default() });
    let at = |ms| Instant::from_millis(ms);
    let Ok(Acquire::Initialize(tok)) = t.acquire(at(10), S, A) else { panic!() };
    let (b, lease) = t.commit(at(10), tok, WorkerId(1), None).unwrap();
    let mine = RemoteBinding {
        worker: WorkerId(1),
        rank: None,
        stamp: BindStamp { committed_at: at(10), replica: ReplicaId(ME) },
    };
    let late = RemoteBinding {
        worker: WorkerId(2),
        rank: None,
        stamp: BindStamp { committed_at: at(20), replica: ReplicaId(7) },
    };
    assert_eq!(t.apply_remote(at(30), S, A, late), Ok(RemoteApplied::Kept(mine)));
    // An earlier announcement replaces it; the lease taken before stays valid and a late
    // failure report of the old binding cannot break the new one.
    let early = RemoteBinding { stamp: BindStamp { committed_at: at(5), replica: ReplicaId(7) }, ..late };
    assert_eq!(t.apply_remote(at(30), S, A, early), Ok(RemoteApplied::Replaced));
    assert!(!t.invalidate(S, A, b.revision), "the old revision no longer names the binding");
    assert_eq!(t.release(at(40), lease), Ok(()));
    assert_eq!((t.live_leases(), t.peek(S, A).map(|b| b.worker)), (0, Some(WorkerId(2))));
    let s = t.stats();
    assert_eq!((s.remote_lost, s.remote_won, s.remote_inserted), (1, 1, 0));
}

#[test]
fn waiters_behind_an_aborted_init_find_the_announced_binding() {
    let mut t = AffinityTable::new(AffinityConfig { replica: ReplicaId(ME), ..AffinityConfig::default() });
    let now = Instant::from_millis(1);
    let Ok(Acquire::Initialize(tok)) = t.acquire(now, S, A) else { panic!() };
    let Ok(Acquire::Wait(w)) = t.acquire(now, S, A) else { panic!() };
    let stamp = BindStamp { committed_at: now, replica: ReplicaId(7) };
    let r = RemoteBinding { worker: WorkerId(3), rank: None, stamp };
    assert_eq!(t.apply_remote(now, S, A, r), Ok(RemoteApplied::Pending));
    t.abort(tok).unwrap();
    assert_eq!(t.poll_output(), Some(AffinityOutput::Woken(w)));
    assert!(matches!(t.acquire(now, S, A), Ok(Acquire::Bound { binding, .. }) if binding.worker == WorkerId(3)));
}

#[test]
fn remote_bindings_respect_sessions_max() {
    let mut t = AffinityTable::new(AffinityConfig { sessions_max: 2, ..AffinityConfig::default() });
    let now = Instant::from_millis(1);
    let remote = |w| RemoteBinding { worker: WorkerId(w), rank: None, stamp: BindStamp::default() };
    // Two idle remote bindings fill the table; a third evicts the one due soonest.
    for (i, s) in [b"a", b"b", b"c"].iter().enumerate() {
        let now = now.add_ms(i as u64);
        assert_eq!(t.apply_remote(now, *s, A, remote(i as u64)), Ok(RemoteApplied::Inserted));
    }
    assert_eq!((t.len(), t.peek(b"a", A), t.stats().evictions), (2, None, 1));
    // With every entry leased or initializing, a remote binding is refused and counted.
    let mut held = Vec::new();
    for s in [b"b", b"c"] {
        let Ok(Acquire::Bound { lease, .. }) = t.acquire(now, s, A) else { panic!() };
        held.push(lease);
    }
    assert_eq!(t.apply_remote(now, b"d", A, remote(9)), Err(AffinityError::TableFull { sessions_max: 2 }));
    assert_eq!((t.len(), t.stats().remote_refused), (2, 1));
}
