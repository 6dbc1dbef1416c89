//! `session-flood`: does inserting a session cost the same after a million inserts as
//! after the first hundred thousand? A full affinity table (`sessions_max` idle
//! bindings) takes a flood of distinct session ids, each evicting the idle binding due
//! soonest, while 64 hot sessions are touched after every 1,000 inserts.
//!
//! `cargo run --release -p kvroute-benches --bin session-flood [-- --flood N --sessions-max N]`
//!
//! Prints one JSON line: the median ns per insert (acquire, commit, release) of each
//! 100k-insert block of the flood, the first and last block's medians and their ratio
//! (flat is about 1.0). Inserts are timed 1,000 at a time, so the clock's own cost is
//! spread thin; the hot-session touches are not timed. It also checks what the core
//! test checks, at full size: the table never exceeds `sessions_max`, and every hot
//! session keeps its binding (the process exits non-zero otherwise).

use std::io::Write;
use std::time::Instant as Wall;

use kvroute_benches::{load_average_1m, nearest_rank};
use router_core::{internals::Acquire, internals::AffinityTable, AffinityConfig, Binding, Instant, Phase, WorkerId};

const BLOCK: u64 = 100_000;
const CHUNK: u64 = 1_000;
const HOT: u64 = 64;

/// A 24-byte session id, as clients send them (`user-` and 19 hex digits).
fn sid(out: &mut Vec<u8>, tag: &str, i: u64) {
    out.clear();
    let _ = write!(out, "{tag}-{:019x}", i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
}

fn insert(t: &mut AffinityTable, now: Instant, id: &[u8], worker: u64) -> Binding {
    let Ok(Acquire::Initialize(token)) = t.acquire(now, id, Phase::Aggregated) else {
        fail(&format!("session {:?} was not new", String::from_utf8_lossy(id)));
    };
    let Ok((binding, lease)) = t.commit(now, token, WorkerId(worker), None) else { fail("commit refused") };
    if t.release(now, lease).is_err() {
        fail("release refused");
    }
    while t.poll_output().is_some() {}
    binding
}

fn fail(msg: &str) -> ! {
    eprintln!("session-flood: {msg}");
    std::process::exit(1);
}

fn run(flood: u64, sessions_max: usize) -> serde_json::Value {
    let cfg = AffinityConfig {
        sessions_max,
        lease_ttl_ms: 24 * 3_600_000,
        hash_seed: 0x243F_6A88_85A3_08D3,
        ..AffinityConfig::default()
    };
    let mut t = AffinityTable::new(cfg);
    let mut id = Vec::with_capacity(32);
    let mut clock = 0u64;
    let mut tick = || {
        clock += 1;
        Instant::from_micros(clock)
    };
    // Warm-up, untimed: fill the table so every timed insert evicts.
    for i in 0..sessions_max as u64 - HOT {
        sid(&mut id, "fill", i);
        insert(&mut t, tick(), &id, i % 16);
    }
    let hot: Vec<Binding> = (0..HOT)
        .map(|h| {
            sid(&mut id, "hot", h);
            insert(&mut t, tick(), &id, h % 8)
        })
        .collect();
    let mut per_block: Vec<u64> = Vec::new();
    let mut chunks: Vec<u64> = Vec::new();
    let mut i = 0u64;
    let mut held_max = t.len();
    while i < flood {
        let t0 = Wall::now();
        for _ in 0..CHUNK {
            sid(&mut id, "user", i);
            insert(&mut t, tick(), &id, i % 16);
            i += 1;
        }
        chunks.push(t0.elapsed().as_nanos() as u64 / CHUNK);
        held_max = held_max.max(t.len());
        if t.len() > sessions_max {
            fail(&format!("{} sessions held, sessions_max {sessions_max}", t.len()));
        }
        touch_hot(&mut t, tick(), &hot, &mut id, i);
        if i.is_multiple_of(BLOCK) || i >= flood {
            chunks.sort_unstable();
            per_block.push(nearest_rank(&chunks, 50.0));
            chunks.clear();
        }
    }
    touch_hot(&mut t, tick(), &hot, &mut id, i);
    let first = per_block.first().copied().unwrap_or(0);
    let last = per_block.last().copied().unwrap_or(0);
    serde_json::json!({
        "bench": "session_flood",
        "flood_inserts": flood,
        "sessions_max": sessions_max,
        "hot_sessions": HOT,
        "hot_bindings_kept": true,
        "sessions_held_max": held_max,
        "evictions": t.stats().evictions,
        "block_inserts": BLOCK,
        "median_ns_per_insert_by_block": per_block,
        "first_block_median_ns": first,
        "last_block_median_ns": last,
        "last_over_first": last as f64 / first.max(1) as f64,
        "load_average_1m": load_average_1m(),
    })
}

/// Every hot session is still bound where it was; each touch refreshes its deadline.
fn touch_hot(t: &mut AffinityTable, now: Instant, hot: &[Binding], id: &mut Vec<u8>, after: u64) {
    for (h, want) in hot.iter().enumerate() {
        sid(id, "hot", h as u64);
        match t.acquire(now, id, Phase::Aggregated) {
            Ok(Acquire::Bound { binding, lease }) if binding == *want => {
                let _ = t.release(now, lease);
            }
            other => fail(&format!("hot session {h} lost its binding after {after} inserts: {other:?}")),
        }
    }
}

fn main() {
    let (mut flood, mut sessions_max) = (1_000_000u64, AffinityConfig::default().sessions_max);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = |name: &str| -> u64 {
            match it.next().and_then(|v| v.parse().ok()) {
                Some(n) if n > 0 => n,
                _ => fail(&format!("{name} needs a positive integer")),
            }
        };
        match a.as_str() {
            "--flood" => flood = num("--flood"),
            "--sessions-max" => sessions_max = num("--sessions-max") as usize,
            "--help" | "-h" => {
                println!("usage: session-flood [--flood N (1000000)] [--sessions-max N (65536)]");
                return;
            }
            other => fail(&format!("unknown argument {other:?} (try --help)")),
        }
    }
    // Hot sessions outlive a chunk of cold inserts only if the table holds more.
    if sessions_max as u64 <= CHUNK + HOT {
        fail(&format!("--sessions-max must be above {}", CHUNK + HOT));
    }
    println!("{}", run(flood, sessions_max));
}
