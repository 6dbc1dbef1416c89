//! Scripted scenarios: each test is a list of steps with the answer each must give.
//! Tokens, leases and bindings are named in the script when they are first handed out.

mod model;

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use super::table::EXPIRE_PER_CALL_MAX;
use super::*;
use crate::time::Instant;

const A: Phase = Phase::Aggregated;
const D: Phase = Phase::Decode;
const TTL_MS: u64 = 1000;
const YEAR_MS: u64 = 365 * 24 * 3600 * 1000;

/// What an acquire must return.
#[derive(Clone, Copy, Debug)]
enum Want<'a> {
    /// `Initialize`, naming the token.
    Init(&'a str),
    /// `Wait`, naming the token.
    Wait(&'a str),
    /// `Bound` to the worker, naming the lease.
    Bound(&'a str, u64),
    Err(AffinityError),
}

/// One output `poll_output` must return.
#[derive(Clone, Copy, Debug)]
enum Output<'a> {
    Woken(&'a str),
    Expired(u64, Phase),
    Evicted(Phase),
}

#[derive(Clone, Copy, Debug)]
enum Step<'a> {
    /// Sets the clock, in milliseconds.
    At(u64),
    Acq(&'a str, Phase, Want<'a>),
    /// Commits the named init token to a worker and names the first lease; the binding
    /// takes the token's name.
    Commit(&'a str, u64, &'a str),
    CommitErr(&'a str, AffinityError),
    Abort(&'a str, Option<AffinityError>),
    Cancel(&'a str, Option<AffinityError>),
    Release(&'a str, Option<AffinityError>),
    /// Invalidates with the revision of the binding named by its init token.
    Invalidate(&'a str, Phase, &'a str, bool),
    InvalidateWorker(u64, usize),
    /// `peek` must return a binding to this worker (or none) and change nothing.
    Peek(&'a str, Phase, Option<u64>),
    /// `handle_timeout` at the current clock.
    Timeout,
    /// `poll_timeout` must be this many milliseconds.
    Next(Option<u64>),
    /// `poll_output` must return exactly these, then `None`.
    Out(&'a [Output<'a>]),
    /// `returning(now, phase, window_ms)` must count these (worker, sessions), by worker.
    Returning(Phase, u64, &'a [(u64, u32)]),
    /// `len()` and `live_leases()`.
    Len(usize, usize),
    /// evictions, expirations, refusals.
    Stats(u64, u64, u64),
}

fn cfg(sessions_max: usize) -> AffinityConfig {
    AffinityConfig { sessions_max, lease_ttl_ms: TTL_MS, hash_seed: 0x5eed, ..AffinityConfig::default() }
}

#[derive(Default)]
struct Names<'a> {
    inits: BTreeMap<&'a str, InitToken>,
    waits: BTreeMap<&'a str, WaitToken>,
    leases: BTreeMap<&'a str, LeaseId>,
    bindings: BTreeMap<&'a str, Binding>,
}

/// Runs `steps` on a fresh table; every output must be claimed by an `Out` step.
#[track_caller]
fn check<'a>(cfg: AffinityConfig, steps: &[Step<'a>]) {
    let sessions_max = cfg.sessions_max;
    let mut t = AffinityTable::new(cfg);
    let mut now = Instant::ZERO;
    let mut n: Names<'a> = Names::default();
    for (i, &step) in steps.iter().enumerate() {
        let at = || alloc::format!("step {i}: {step:?}");
        match step {
            Step::At(ms) => now = Instant::from_millis(ms),
            Step::Acq(s, phase, want) => acquire(&mut t, &mut n, now, s, phase, want, &at()),
            Step::Commit(init, worker, lease) => {
                let (b, l) =
                    t.commit(now, n.inits[init], WorkerId(worker), None).unwrap_or_else(|e| panic!("{}: {e}", at()));
                assert_eq!(b.worker, WorkerId(worker), "{}", at());
                n.bindings.insert(init, b);
                n.leases.insert(lease, l);
            }
            Step::CommitErr(init, e) => {
                assert_eq!(t.commit(now, n.inits[init], WorkerId(0), None), Err(e), "{}", at())
            }
            Step::Abort(init, e) => {
                assert_eq!(t.abort(n.inits[init]), e.map_or(Ok(()), Err), "{}", at())
            }
            Step::Cancel(w, e) => {
                assert_eq!(t.cancel_wait(n.waits[w]), e.map_or(Ok(()), Err), "{}", at())
            }
            Step::Release(l, e) => assert_eq!(t.release(now, n.leases[l]), e.map_or(Ok(()), Err), "{}", at()),
            Step::Invalidate(s, phase, b, want) => {
                assert_eq!(t.invalidate(s.as_bytes(), phase, n.bindings[b].revision), want, "{}", at())
            }
            Step::InvalidateWorker(w, want) => {
                assert_eq!(t.invalidate_worker(WorkerId(w)), want, "{}", at())
            }
            Step::Peek(s, phase, want) => {
                let before = t.fingerprint();
                assert_eq!(t.peek(s.as_bytes(), phase).map(|b| b.worker.0), want, "{}", at());
                assert_eq!(t.fingerprint(), before, "{}: peek changed the table", at());
            }
            Step::Timeout => t.handle_timeout(now),
            Step::Next(ms) => {
                assert_eq!(t.poll_timeout(), ms.map(Instant::from_millis), "{}", at())
            }
            Step::Out(want) => drain(&mut t, &n, want, &at()),
            Step::Returning(phase, window_ms, want) => {
                let mut got = Vec::new();
                t.returning(now, phase, window_ms, &mut got);
                let mut got: Vec<(u64, u32)> = got.into_iter().map(|(w, k)| (w.0, k)).collect();
                got.sort_unstable();
                assert_eq!(got, want, "{}", at())
            }
            Step::Len(len, leases) => {
                assert_eq!((t.len(), t.live_leases()), (len, leases), "{}", at());
                assert_eq!(t.is_empty(), len == 0, "{}", at());
            }
            Step::Stats(ev, exp, refused) => {
                let s = t.stats();
                assert_eq!((s.evictions, s.expirations, s.refusals), (ev, exp, refused), "{}", at())
            }
        }
        assert!(t.len() <= sessions_max, "{}: len {} over sessions_max", at(), t.len());
    }
    let left: Vec<AffinityOutput> = core::iter::from_fn(|| t.poll_output()).collect();
    assert!(left.is_empty(), "outputs nobody checked: {left:?}");
}

#[track_caller]
fn acquire<'a>(
    t: &mut AffinityTable,
    n: &mut Names<'a>,
    now: Instant,
    s: &str,
    phase: Phase,
    want: Want<'a>,
    at: &str,
) {
    let got = t.acquire(now, s.as_bytes(), phase);
    match (want, got) {
        (Want::Init(name), Ok(Acquire::Initialize(tok))) => {
            n.inits.insert(name, tok);
        }
        (Want::Wait(name), Ok(Acquire::Wait(tok))) => {
            n.waits.insert(name, tok);
        }
        (Want::Bound(name, worker), Ok(Acquire::Bound { binding, lease })) => {
            assert_eq!(binding.worker, WorkerId(worker), "{at}");
            n.leases.insert(name, lease);
        }
        (Want::Err(e), Err(got)) => assert_eq!(got, e, "{at}"),
        (want, got) => panic!("{at}: want {want:?}, got {got:?}"),
    }
}

#[track_caller]
fn drain(t: &mut AffinityTable, n: &Names<'_>, want: &[Output<'_>], at: &str) {
    let got: Vec<AffinityOutput> = core::iter::from_fn(|| t.poll_output()).collect();
    let want: Vec<AffinityOutput> = want
        .iter()
        .map(|o| match *o {
            Output::Woken(w) => AffinityOutput::Woken(n.waits[w]),
            Output::Expired(worker, phase) => AffinityOutput::Expired { worker: WorkerId(worker), phase },
            Output::Evicted(phase) => AffinityOutput::Evicted { phase },
        })
        .collect();
    assert_eq!(got, want, "{at}");
}

use Output::{Evicted, Expired, Woken};
use Step::*;
use Want::{Bound, Init, Wait};

#[test]
fn session_id_limits() {
    let max = "s".repeat(256);
    let over = "s".repeat(257);
    check(
        cfg(8),
        &[
            Acq("", A, Want::Err(AffinityError::SessionIdEmpty)),
            Acq(&max, A, Init("max")),
            Acq(&over, A, Want::Err(AffinityError::SessionIdTooLong { bytes: 257, max: 256 })),
            Peek(&over, A, None),
            Peek("", A, None),
            Len(1, 0),
            Stats(0, 0, 0),
        ],
    );
    let tight = AffinityConfig { session_id_bytes_max: 1, ..cfg(8) };
    check(
        tight,
        &[Acq("a", A, Init("a")), Acq("ab", A, Want::Err(AffinityError::SessionIdTooLong { bytes: 2, max: 1 }))],
    );
}

#[test]
fn wait_then_commit_wakes_and_binds() {
    check(
        cfg(8),
        &[
            Acq("s", A, Init("t")),
            Acq("s", A, Wait("w1")),
            Acq("s", A, Wait("w2")),
            Peek("s", A, None),
            Out(&[]),
            Commit("t", 7, "l0"),
            Out(&[Woken("w1"), Woken("w2")]),
            Acq("s", A, Bound("l1", 7)),
            Acq("s", A, Bound("l2", 7)),
            Peek("s", A, Some(7)),
            Len(1, 3),
            CommitErr("t", AffinityError::UnknownToken),
            Abort("t", Some(AffinityError::UnknownToken)),
            Cancel("w1", Some(AffinityError::UnknownToken)),
        ],
    );
}

#[test]
fn abort_leaves_no_entry_and_wakes() {
    check(
        cfg(8),
        &[
            Acq("s", A, Init("t")),
            Acq("s", A, Wait("w")),
            Abort("t", None),
            Out(&[Woken("w")]),
            Len(0, 0),
            Peek("s", A, None),
            Next(None),
            Abort("t", Some(AffinityError::UnknownToken)),
            CommitErr("t", AffinityError::UnknownToken),
            Acq("s", A, Init("t2")),
            Acq("s", A, Wait("w2")),
            Len(1, 0),
        ],
    );
}

#[test]
fn cancelled_waiter_is_not_woken() {
    check(
        cfg(8),
        &[
            Acq("s", A, Init("t")),
            Acq("s", A, Wait("w1")),
            Acq("s", A, Wait("w2")),
            Acq("s", A, Wait("w3")),
            Cancel("w1", None),
            Cancel("w1", Some(AffinityError::UnknownToken)),
            Commit("t", 1, "l"),
            // The rest wake in arrival order.
            Out(&[Woken("w2"), Woken("w3")]),
            Cancel("w2", Some(AffinityError::UnknownToken)),
        ],
    );
}

#[test]
fn waiters_and_leases_are_bounded() {
    let c = AffinityConfig { waiters_max_per_session: 1, leases_max: 2, ..cfg(8) };
    check(
        c,
        &[
            Acq("s", A, Init("t")),
            Acq("s", A, Wait("w")),
            Acq("s", A, Want::Err(AffinityError::TooManyWaiters { waiters_max_per_session: 1 })),
            Acq("u", A, Init("u")),
            Commit("t", 1, "l1"),
            Out(&[Woken("w")]),
            Acq("s", A, Bound("l2", 1)),
            Acq("s", A, Want::Err(AffinityError::TooManyLeases { leases_max: 2 })),
            CommitErr("u", AffinityError::TooManyLeases { leases_max: 2 }),
            Release("l2", None),
            // The refused commit left its token usable.
            Commit("u", 2, "l3"),
            Len(2, 2),
        ],
    );
}

#[test]
fn last_release_starts_the_idle_clock() {
    check(
        cfg(8),
        &[
            Acq("s", A, Init("t")),
            Commit("t", 3, "l1"),
            Acq("s", A, Bound("l2", 3)),
            At(100),
            Release("l1", None),
            Next(None),
            Release("l1", Some(AffinityError::UnknownLease)),
            At(200),
            Release("l2", None),
            Next(Some(200 + TTL_MS)),
            At(200 + TTL_MS - 1),
            Timeout,
            Peek("s", A, Some(3)),
            At(200 + TTL_MS),
            Timeout,
            Out(&[Expired(3, A)]),
            Len(0, 0),
            Next(None),
            Stats(0, 1, 0),
        ],
    );
}

#[test]
fn acquire_renews_an_idle_binding() {
    check(
        cfg(8),
        &[
            Acq("s", A, Init("t")),
            Commit("t", 3, "l1"),
            Release("l1", None),
            Next(Some(TTL_MS)),
            At(TTL_MS - 1),
            Acq("s", A, Bound("l2", 3)),
            Next(None),
            At(10 * TTL_MS),
            Timeout,
            Peek("s", A, Some(3)),
            Release("l2", None),
            Next(Some(11 * TTL_MS)),
        ],
    );
}

#[test]
fn acquire_past_the_deadline_starts_over() {
    check(
        cfg(8),
        &[
            Acq("s", A, Init("t")),
            Commit("t", 3, "l1"),
            Release("l1", None),
            At(TTL_MS),
            // handle_timeout has not run yet; the binding is already dead.
            Acq("s", A, Init("t2")),
            Out(&[Expired(3, A)]),
            Len(1, 0),
            Next(None),
            Stats(0, 1, 0),
        ],
    );
}

#[test]
fn live_leases_never_expire() {
    check(
        cfg(8),
        &[
            Acq("s", A, Init("t")),
            Commit("t", 3, "l1"),
            Acq("i", A, Init("i")),
            // Decades later, still leased.
            At(YEAR_MS * 30),
            Timeout,
            Peek("s", A, Some(3)),
            Len(2, 1),
            Next(None),
            Release("l1", None),
            Next(Some(YEAR_MS * 30 + TTL_MS)),
            At(YEAR_MS * 30 + TTL_MS),
            Timeout,
            Out(&[Expired(3, A)]),
            Len(1, 0),
        ],
    );
}

#[test]
fn full_table_evicts_the_soonest_idle() {
    check(
        cfg(3),
        &[
            Acq("a", A, Init("a")),
            Commit("a", 1, "la"),
            Acq("b", A, Init("b")),
            Commit("b", 2, "lb"),
            Acq("c", A, Init("c")),
            Commit("c", 3, "lc"),
            At(30),
            Release("lb", None),
            At(10),
            Release("lc", None),
            At(20),
            Release("la", None),
            // Deadlines: c at 10+ttl, a at 20+ttl, b at 30+ttl.
            Acq("d", A, Init("d")),
            Out(&[Evicted(A)]),
            Peek("c", A, None),
            Acq("e", A, Init("e")),
            Out(&[Evicted(A)]),
            Peek("a", A, None),
            Peek("b", A, Some(2)),
            Len(3, 0),
            Stats(2, 0, 0),
        ],
    );
}

#[test]
fn full_table_never_evicts_leased_or_initializing() {
    check(
        cfg(3),
        &[
            Acq("a", A, Init("a")),
            Commit("a", 1, "la"),
            Acq("b", A, Init("b")),
            Acq("c", A, Init("c")),
            Commit("c", 3, "lc"),
            Release("lc", None),
            Acq("d", A, Init("d")),
            Out(&[Evicted(A)]),
            Acq("e", A, Want::Err(AffinityError::TableFull { sessions_max: 3 })),
            Acq("e", D, Want::Err(AffinityError::TableFull { sessions_max: 3 })),
            Peek("a", A, Some(1)),
            Acq("b", A, Wait("wb")),
            Acq("a", A, Bound("la2", 1)),
            Len(3, 2),
            Stats(1, 0, 2),
            // Freeing one slot lets the refused session in.
            Abort("d", None),
            Acq("e", A, Init("e")),
            Abort("b", None),
            Out(&[Woken("wb")]),
        ],
    );
}

#[test]
fn a_due_binding_is_expired_not_evicted() {
    check(
        cfg(1),
        &[
            Acq("a", A, Init("a")),
            Commit("a", 1, "la"),
            Release("la", None),
            At(TTL_MS),
            Acq("b", A, Init("b")),
            Out(&[Expired(1, A)]),
            Stats(0, 1, 0),
        ],
    );
}

#[test]
fn zero_sessions_max_refuses_everything() {
    check(cfg(0), &[Acq("a", A, Want::Err(AffinityError::TableFull { sessions_max: 0 })), Len(0, 0), Stats(0, 0, 1)]);
}

#[test]
fn time_going_backwards() {
    check(
        cfg(8),
        &[
            At(5000),
            Acq("s", A, Init("t")),
            Commit("t", 1, "l1"),
            Release("l1", None),
            Next(Some(5000 + TTL_MS)),
            At(0),
            Timeout,
            Acq("s", A, Bound("l2", 1)),
            Release("l2", None),
            // Released "earlier" than before: the deadline moves back with the clock.
            Next(Some(TTL_MS)),
            At(TTL_MS - 1),
            Timeout,
            Peek("s", A, Some(1)),
            At(TTL_MS),
            Timeout,
            Out(&[Expired(1, A)]),
        ],
    );
}

#[test]
fn invalidate_needs_the_current_revision() {
    check(
        cfg(8),
        &[
            Acq("s", A, Init("old")),
            Commit("old", 1, "l1"),
            Invalidate("s", A, "old", true),
            Invalidate("s", A, "old", false),
            Peek("s", A, None),
            // The orphaned lease is still counted and still releasable.
            Len(0, 1),
            Acq("s", A, Init("new")),
            Commit("new", 2, "l2"),
            Invalidate("s", A, "old", false),
            Invalidate("s", D, "new", false),
            Invalidate("", A, "new", false),
            Release("l1", None),
            // Releasing the orphan did not idle the new binding.
            Next(None),
            Peek("s", A, Some(2)),
            Len(1, 1),
            Release("l2", None),
            Next(Some(TTL_MS)),
            Invalidate("s", A, "new", true),
            Next(None),
            Len(0, 0),
        ],
    );
}

#[test]
fn invalidate_worker_drops_its_bindings() {
    check(
        cfg(8),
        &[
            Acq("a", A, Init("a")),
            Commit("a", 1, "la"),
            Acq("b", D, Init("b")),
            Commit("b", 1, "lb"),
            Release("lb", None),
            Acq("c", A, Init("c")),
            Commit("c", 2, "lc"),
            Acq("i", A, Init("i")),
            InvalidateWorker(1, 2),
            InvalidateWorker(1, 0),
            Peek("a", A, None),
            Peek("c", A, Some(2)),
            Next(None),
            Len(2, 2),
            Release("la", None),
            Len(2, 1),
        ],
    );
}

#[test]
fn phases_are_separate_entries() {
    check(
        cfg(8),
        &[
            Acq("s", Phase::Prefill, Init("p")),
            Acq("s", D, Init("d")),
            Commit("p", 1, "lp"),
            Commit("d", 2, "ld"),
            Peek("s", Phase::Prefill, Some(1)),
            Peek("s", D, Some(2)),
            Peek("s", A, None),
            Release("ld", None),
            At(TTL_MS),
            Timeout,
            Out(&[Expired(2, D)]),
            Peek("s", Phase::Prefill, Some(1)),
        ],
    );
}

#[test]
fn handle_timeout_work_is_bounded() {
    let n = EXPIRE_PER_CALL_MAX + 10;
    let mut t = AffinityTable::new(cfg(n));
    for i in 0..n {
        let s = alloc::format!("s{i}");
        let Ok(Acquire::Initialize(tok)) = t.acquire(Instant::ZERO, s.as_bytes(), A) else { panic!("init {i}") };
        let (_, lease) = t.commit(Instant::ZERO, tok, WorkerId(1), None).unwrap();
        t.release(Instant::ZERO, lease).unwrap();
    }
    let late = Instant::from_millis(10 * TTL_MS);
    t.handle_timeout(late);
    assert_eq!(t.len(), 10);
    assert!(t.poll_timeout().is_some_and(|d| d <= late), "more is due: call again");
    t.handle_timeout(late);
    assert_eq!((t.len(), t.poll_timeout(), t.stats().expirations), (0, None, n as u64));
    assert_eq!(core::iter::from_fn(|| t.poll_output()).count(), n);
}

#[test]
fn tokens_from_another_table_are_unknown() {
    let mut big = AffinityTable::new(cfg(8));
    let mut small = AffinityTable::new(cfg(8));
    for i in 0..4u8 {
        let _ = big.acquire(Instant::ZERO, &[b'a' + i], A);
    }
    let Ok(Acquire::Initialize(tok)) = big.acquire(Instant::ZERO, b"z", A) else { panic!() };
    let Ok(Acquire::Wait(w)) = big.acquire(Instant::ZERO, b"z", A) else { panic!() };
    let (_, lease) = big.commit(Instant::ZERO, tok, WorkerId(1), None).unwrap();
    assert_eq!(small.abort(tok), Err(AffinityError::UnknownToken));
    assert_eq!(small.cancel_wait(w), Err(AffinityError::UnknownToken));
    assert_eq!(small.release(Instant::ZERO, lease), Err(AffinityError::UnknownLease));
}

#[test]
fn errors_display() {
    let cases: [(AffinityError, &str); 3] = [
        (
            AffinityError::SessionIdTooLong { bytes: 300, max: 256 },
            "session id is 300 bytes, more than the 256 allowed",
        ),
        (AffinityError::TableFull { sessions_max: 4 }, "all 4 session slots are in use"),
        (AffinityError::UnknownLease, "unknown or already released session lease"),
    ];
    for (e, want) in cases {
        assert_eq!(alloc::format!("{e}"), want);
    }
}

#[test]
fn returning_counts_recent_idle_bindings_by_worker_and_phase() {
    check(
        cfg(8),
        &[
            Acq("a", A, Init("a")),
            Commit("a", 1, "la"),
            Acq("b", A, Init("b")),
            Commit("b", 1, "lb"),
            Acq("c", A, Init("c")),
            Commit("c", 2, "lc"),
            Acq("d", D, Init("d")),
            Commit("d", 1, "ld"),
            // Sessions with a request in flight are not between requests.
            Returning(A, 500, &[]),
            At(100),
            Release("la", None),
            Release("ld", None),
            At(300),
            Release("lb", None),
            Release("lc", None),
            Returning(A, 500, &[(1, 2), (2, 1)]),
            Returning(D, 500, &[(1, 1)]),
            // 450 ms on, "a" ended 350 ms ago and the others 150 ms ago.
            At(450),
            Returning(A, 300, &[(1, 1), (2, 1)]),
            Returning(A, 0, &[]),
            // A window past the TTL counts every idle binding.
            Returning(A, 5 * TTL_MS, &[(1, 2), (2, 1)]),
            // A session back in flight leaves the count.
            Acq("b", A, Bound("lb2", 1)),
            Returning(A, 500, &[(1, 1), (2, 1)]),
            Release("lb2", None),
        ],
    );
}
