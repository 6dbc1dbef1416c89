//! Session flood: a million distinct session ids (a tenth in debug builds) against a
//! table of `sessions_max` bindings, with a few hot sessions touched regularly
//! throughout. The table never holds more than `sessions_max`, every new id evicts the
//! idle binding due soonest (a cold one), and the hot sessions keep their binding to
//! the end. The same flood, shorter, runs through the `Router` façade. Insert cost
//! staying flat is measured by the `session_flood` bench
//! (`benches/src/bin/session_flood.rs`), not asserted here.

use router_core::SeqHash;
use router_core::{internals::Acquire, internals::AffinityOutput, internals::AffinityTable, AffinityConfig, Binding};
use router_core::{Decision, Request, Router, RouterConfig, WorkerUpdate};
use router_core::{Draw, Instant, Phase, RequestId, WorkerId};
use router_core::{WorkerRole, WorkerSpec};

const AGG: Phase = Phase::Aggregated;
const HOT: u64 = 64;

/// Session id `i`: eight bytes plus a tag, so hot and cold ids never collide.
fn sid(tag: u8, i: u64) -> [u8; 9] {
    let mut id = [tag; 9];
    id[1..].copy_from_slice(&i.to_le_bytes());
    id
}

/// Binds `session` to `worker` and releases its lease at once (an idle binding).
#[track_caller]
fn bind(t: &mut AffinityTable, now: Instant, session: &[u8], worker: u64) -> Binding {
    let Ok(Acquire::Initialize(token)) = t.acquire(now, session, AGG) else {
        panic!("{session:?} should be new");
    };
    let (binding, lease) = t.commit(now, token, WorkerId(worker), None).expect("commit");
    t.release(now, lease).expect("release");
    binding
}

/// Acquires and releases `session`, which must still be bound as `want`.
#[track_caller]
fn touch(t: &mut AffinityTable, now: Instant, session: &[u8], want: Binding, i: u64) {
    match t.acquire(now, session, AGG) {
        Ok(Acquire::Bound { binding, lease }) => {
            assert_eq!(binding, want, "hot session {session:?} moved after {i} inserts");
            t.release(now, lease).expect("release");
        }
        other => panic!("hot session {session:?} lost its binding after {i} inserts: {other:?}"),
    }
}

#[track_caller]
fn check(flood: u64, sessions_max: usize, touch_every: u64) {
    let cfg = AffinityConfig { sessions_max, lease_ttl_ms: 3_600_000, hash_seed: 0x5eed, ..AffinityConfig::default() };
    let mut t = AffinityTable::new(cfg);
    let hot: Vec<Binding> = (0..HOT).map(|h| bind(&mut t, Instant::ZERO, &sid(b'h', h), h % 8)).collect();
    let mut evicted = 0u64;
    for i in 0..flood {
        let now = Instant::from_micros(10 * (i + 1));
        bind(&mut t, now, &sid(b'c', i), i % 16);
        assert!(t.len() <= sessions_max, "{} entries after {i} inserts", t.len());
        while let Some(out) = t.poll_output() {
            assert!(matches!(out, AffinityOutput::Evicted { .. }), "{out:?}");
            evicted += 1;
        }
        if i % touch_every == 0 {
            for (h, &want) in hot.iter().enumerate() {
                touch(&mut t, now, &sid(b'h', h as u64), want, i);
            }
            // Nothing is due yet: a timer call is harmless.
            t.handle_timeout(now);
            assert!(t.poll_output().is_none());
        }
    }
    assert_eq!(t.len(), sessions_max);
    assert_eq!(evicted, flood + HOT - sessions_max as u64, "each insert past the limit evicts one");
    assert_eq!(t.stats().evictions, evicted);
    for (h, &want) in hot.iter().enumerate() {
        touch(&mut t, Instant::from_micros(10 * (flood + 1)), &sid(b'h', h as u64), want, flood);
    }
}

/// A million ids in an optimized build; a tenth of that in a debug one, where the
/// million takes too long for CI (the `session_flood` bench floods a million too).
const FLOOD: u64 = if cfg!(debug_assertions) { 100_000 } else { 1_000_000 };

#[test]
fn a_million_sessions_stay_within_sessions_max_and_hot_ones_keep_their_binding() {
    // A cold entry is evicted `sessions_max - HOT` inserts after it arrived, so hot
    // sessions touched more often than that always have the later deadline.
    check(FLOOD, 4096, 1024);
}

#[test]
fn small_tables_keep_hot_sessions_too() {
    check(20_000, 128, 32);
    check(20_000, 256, 100);
}

/// The same flood through the façade: sessions of one request each, dispatched and
/// finished, with hot sessions routed regularly; the affinity table stays bounded and
/// every hot request lands on its session's worker.
#[test]
fn the_router_keeps_hot_sessions_under_a_flood() {
    let sessions_max = 256;
    let mut cfg = RouterConfig::default();
    cfg.affinity.sessions_max = sessions_max;
    let mut r = Router::new(cfg);
    for w in 0..8 {
        r.handle_worker_update(
            Instant::ZERO,
            WorkerUpdate::Upsert(WorkerSpec::new(WorkerId(w), WorkerRole::Aggregated)),
        )
        .expect("fits");
    }
    let mut next_id = 0u64;
    let mut route = |r: &mut Router, now: Instant, session: &[u8]| -> WorkerId {
        next_id += 1;
        let req = Request {
            id: RequestId(next_id),
            blocks: vec![SeqHash(next_id)],
            isl_tokens: 64,
            session: Some(session.to_vec()),
            ..Request::default()
        };
        let Ok(Decision::Routed(routed)) = r.handle_request(now, req, Draw(next_id)) else {
            panic!("session {session:?} not routed");
        };
        r.handle_dispatched(now, RequestId(next_id), AGG).expect("booked");
        r.handle_finished(now, RequestId(next_id), AGG).expect("dispatched");
        while r.poll_output().is_some() {}
        routed.target.worker
    };
    let hot: Vec<WorkerId> = (0..HOT).map(|h| route(&mut r, Instant::ZERO, &sid(b'h', h))).collect();
    for i in 0..5_000u64 {
        let now = Instant::from_micros(10 * (i + 1));
        route(&mut r, now, &sid(b'c', i));
        assert!(r.counts().affinity_sessions <= sessions_max);
        if i % 64 == 0 {
            for (h, &want) in hot.iter().enumerate() {
                assert_eq!(route(&mut r, now, &sid(b'h', h as u64)), want, "hot session {h} after {i}");
            }
        }
    }
    assert_eq!(r.counts().affinity_sessions, sessions_max);
    assert_eq!(r.counts().affinity_live_leases, 0);
}
