//! Session-affinity table throughput at production size (65,536 sessions).
//!
//! Criterion groups:
//! * `affinity/bound_acquire_release`: a returning session's acquire (a lease on an
//!   idle binding) plus its release, on a full table.
//! * `affinity/new_session_evicting`: a new session on a full table: acquire (evicts the
//!   idle binding due soonest), commit, release.
//! * `affinity/insert_at_fill/<percent>`: acquire of a new session then abort, with the
//!   table at that fill level; flat across levels means insert cost does not grow.
//!
//! After criterion, `fill_curve` prints the mean cost of an insert (acquire + commit +
//! release) per slice while the table fills to `sessions_max` and then runs as far again
//! past it, where every insert evicts.

use std::hint::black_box;
use std::time::{Duration, Instant as WallClock};

use criterion::{BenchmarkId, Criterion};
use router_core::{internals::Acquire, internals::AffinityTable, AffinityConfig, Instant, Phase, WorkerId};

const SESSIONS_MAX: usize = 65_536;

/// A 24-byte session id, like an opaque client token.
fn sid(i: u64) -> [u8; 24] {
    let mut id = *b"sess-0000000000000000000";
    id[16..].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    id
}

fn table() -> AffinityTable {
    AffinityTable::new(AffinityConfig {
        sessions_max: SESSIONS_MAX,
        hash_seed: 0x5eed_1234,
        ..AffinityConfig::default()
    })
}

/// Binds and releases session `i` at `now`; on a full table this evicts one idle binding.
fn insert(t: &mut AffinityTable, now: Instant, i: u64) {
    match t.acquire(now, &sid(i), Phase::Aggregated) {
        Ok(Acquire::Initialize(tok)) => {
            let (_, lease) = t.commit(now, tok, WorkerId(i % 64), None).expect("commit");
            t.release(now, lease).expect("release");
        }
        other => panic!("session {i}: {other:?}"),
    }
    while t.poll_output().is_some() {}
}

/// A table holding `n` idle bindings, sessions `0..n`, released 1 µs apart.
fn filled(n: usize) -> AffinityTable {
    let mut t = table();
    for i in 0..n as u64 {
        insert(&mut t, Instant::from_micros(i), i);
    }
    t
}

fn bound_acquire_release(c: &mut Criterion) {
    let mut t = filled(SESSIONS_MAX);
    let mut i = 0u64;
    let mut now = SESSIONS_MAX as u64;
    c.bench_function("affinity/bound_acquire_release", |b| {
        b.iter(|| {
            i = (i + 7919) % SESSIONS_MAX as u64;
            now += 1;
            let now = Instant::from_micros(now);
            match t.acquire(now, black_box(&sid(i)), Phase::Aggregated) {
                Ok(Acquire::Bound { lease, .. }) => t.release(now, lease).expect("release"),
                other => panic!("{other:?}"),
            }
        })
    });
}

fn new_session_evicting(c: &mut Criterion) {
    let mut t = filled(SESSIONS_MAX);
    let mut next = SESSIONS_MAX as u64;
    c.bench_function("affinity/new_session_evicting", |b| {
        b.iter(|| {
            insert(&mut t, Instant::from_micros(next), next);
            next += 1;
        })
    });
    assert_eq!(t.len(), SESSIONS_MAX);
}

fn insert_at_fill(c: &mut Criterion) {
    let mut group = c.benchmark_group("affinity/insert_at_fill");
    for percent in [0usize, 25, 50, 75, 99] {
        let n = SESSIONS_MAX * percent / 100;
        let mut t = filled(n);
        let mut next = 1u64 << 40;
        group.bench_with_input(BenchmarkId::from_parameter(percent), &percent, |b, _| {
            b.iter(|| {
                next += 1;
                match t.acquire(Instant::from_micros(n as u64), black_box(&sid(next)), Phase::Aggregated) {
                    Ok(Acquire::Initialize(tok)) => t.abort(tok).expect("abort"),
                    other => panic!("{other:?}"),
                }
            })
        });
        assert_eq!(t.len(), n);
    }
    group.finish();
}

/// Mean ns per insert in eight slices from empty to `sessions_max`, then eight more
/// past it (every insert evicts). Best of three runs per slice, to shed scheduler noise.
fn fill_curve() {
    const SLICES: usize = 16;
    let slice = SESSIONS_MAX / 8;
    let mut best = [f64::MAX; SLICES];
    for _ in 0..3 {
        let mut t = table();
        for (s, best) in best.iter_mut().enumerate() {
            let start = WallClock::now();
            for k in 0..slice {
                let i = (s * slice + k) as u64;
                insert(&mut t, Instant::from_micros(i), i);
            }
            let ns = start.elapsed().as_nanos() as f64 / slice as f64;
            *best = best.min(ns);
        }
        assert_eq!(t.len(), SESSIONS_MAX);
        assert_eq!(t.stats().evictions, (SESSIONS_MAX) as u64);
    }
    println!("affinity fill curve: ns per insert (acquire + commit + release), sessions_max {SESSIONS_MAX}");
    for (s, ns) in best.iter().enumerate() {
        let (from, to) = (s * slice, (s + 1) * slice);
        let evicting = if from >= SESSIONS_MAX { "  (evicting)" } else { "" };
        println!("  inserts {from:>6}..{to:<6} {ns:>7.1} ns{evicting}");
    }
}

/// Best-of-five mean ns per operation over 2^18 operations each, for the two steady
/// states on a full table. Criterion's means swing with other load on the machine; the
/// best run is the figure to compare across commits.
fn steady_state() {
    const OPS: u64 = 1 << 18;
    let mut t = filled(SESSIONS_MAX);
    let mut now = SESSIONS_MAX as u64;
    let (mut bound, mut fresh) = (f64::MAX, f64::MAX);
    let mut next = SESSIONS_MAX as u64;
    for _ in 0..5 {
        let start = WallClock::now();
        for k in 0..OPS {
            let i = k.wrapping_mul(7919) % SESSIONS_MAX as u64;
            now += 1;
            let at = Instant::from_micros(now);
            match t.acquire(at, &sid(i), Phase::Aggregated) {
                Ok(Acquire::Bound { lease, .. }) => t.release(at, lease).expect("release"),
                other => panic!("{other:?}"),
            }
        }
        bound = bound.min(start.elapsed().as_nanos() as f64 / OPS as f64);
        // Every new session evicts one idle binding; the table stays full. It is refilled
        // afresh below so each round starts from the same state.
        let start = WallClock::now();
        for _ in 0..OPS {
            now += 1;
            insert(&mut t, Instant::from_micros(now), next);
            next += 1;
        }
        fresh = fresh.min(start.elapsed().as_nanos() as f64 / OPS as f64);
        t = filled(SESSIONS_MAX);
        now = SESSIONS_MAX as u64;
    }
    println!("affinity steady state at {SESSIONS_MAX} sessions, best of 5:");
    println!("  returning session: acquire + release                   {bound:>7.1} ns");
    println!("  new session: acquire (evicts one) + commit + release   {fresh:>7.1} ns");
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    bound_acquire_release(&mut c);
    new_session_evicting(&mut c);
    insert_at_fill(&mut c);
    c.final_summary();
    steady_state();
    fill_curve();
}
