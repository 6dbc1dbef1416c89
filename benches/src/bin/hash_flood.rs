//! `hash-flood`: can a client slow the router's hash tables down by choosing its keys?
//! Session ids key the affinity table and block hashes (which follow from the prompt's
//! tokens) key the prefix index, so both are attacker-chosen. Each table is filled
//! with random keys and with crafted ones, under two seeds:
//!
//! * `attacked`: the seed the attacker crafted against, here each table's default
//!   (`AffinityConfig::hash_seed` 0, `index::HASH_SEED_DEFAULT`), which is what a
//!   deployment that never sets `seed` would be running if the proxy did not draw one;
//! * `seeded`: a seed the attacker does not know, as the proxy draws at startup.
//!
//! Crafted keys: session ids whose seeded hash has the same low bits under the attacked
//! seed (so they share a home position in the table); block hashes whose seeded mix has
//! the same top bits under the attacked seed (the index's home bucket), block hashes
//! with identical low 32 bits, and consecutive block hashes. Crafting mirrors each
//! table's hashing (`affinity/table.rs`, `index/blocks.rs`); should that change, the
//! `attacked` ratios fall towards 1 and `attack_effective` says so.
//!
//! `cargo run --release -p kvroute-benches --bin hash-flood [-- --sessions N --blocks N]`
//!
//! Prints one JSON line per table: ns per operation (insert, then lookup) for each key
//! kind under each seed, and crafted/random ratios. The claim checked is
//! `seeded_max_ratio <= 2`; the process exits non-zero otherwise. Operations are timed
//! in chunks of 256 (the index: of 256 chains of 64 blocks); a figure is the median
//! chunk, best of three runs, so a busy machine's preemptions do not move it.

use std::io::Write;
use std::time::Instant as Wall;

use kvroute_benches::load_average_1m;
use router_core::{
    internals::Acquire, internals::AffinityTable, AffinityConfig, BlockHash, Draw, IndexConfig, IndexEvent, Instant,
    LocalHash, OverlapScores, Phase, PrefixIndex, SeqHash, Tier, WorkerId, WorkerKey, HASH_SEED_DEFAULT,
};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// `affinity/table.rs`'s salt for the aggregated phase, mixed into the table's seed.
const PHASE_SALT_AGGREGATED: u64 = 0x243F_6A88_85A3_08D3;
/// A seed the attacker does not know.
const SECRET_SEED: u64 = 0xD1B5_4A32_D192_ED03;
const RUNS: usize = 3;
const CHAIN: usize = 64;

/// Operations timed together; the median chunk stands for the pass, so a preempted
/// chunk on a busy machine does not move the figure.
const CHUNK: usize = 256;

/// Runs `op(i)` for `i` in `0..n` (in order), timed in chunks; the median chunk's ns
/// per operation.
fn timed(n: usize, mut op: impl FnMut(usize)) -> f64 {
    let mut per_op = Vec::with_capacity(n / CHUNK + 1);
    let mut i = 0;
    while i < n {
        let end = (i + CHUNK).min(n);
        let t0 = Wall::now();
        for k in i..end {
            op(k);
        }
        per_op.push(t0.elapsed().as_nanos() as f64 / (end - i) as f64);
        i = end;
    }
    per_op.sort_by(f64::total_cmp);
    per_op[per_op.len() / 2]
}

/// The best of [`RUNS`] runs of a pass, per figure.
fn best_of<F: FnMut() -> (f64, f64)>(mut f: F) -> (f64, f64) {
    (0..RUNS).map(|_| f()).fold((f64::INFINITY, f64::INFINITY), |(a, b), (x, y)| (a.min(x), b.min(y)))
}

fn ratio(a: f64, b: f64) -> f64 {
    (a / b.max(1e-9) * 100.0).round() / 100.0
}

/// Each key kind's figures under each seed, with the worst crafted/random ratio per seed.
struct Compared {
    by_seed: serde_json::Map<String, serde_json::Value>,
    attacked_max: f64,
    seeded_max: f64,
}

/// Times `pass` (insert, then lookup: ns per operation) over every kind of keys under
/// the attacked seed and under a secret one; `row` names one kind's figures and its
/// ratio to the first kind (random keys) in the JSON.
fn compare<K>(
    kinds: &[(&str, K)],
    attacked_seed: u64,
    pass: impl Fn(&K, u64) -> (f64, f64),
    row: impl Fn(f64, f64, f64) -> serde_json::Value,
) -> Compared {
    let mut out = Compared { by_seed: serde_json::Map::new(), attacked_max: 0.0, seeded_max: 0.0 };
    for (seed_name, seed) in [("attacked", attacked_seed), ("seeded", SECRET_SEED)] {
        let figures: Vec<(f64, f64)> = kinds.iter().map(|(_, keys)| best_of(|| pass(keys, seed))).collect();
        let (base_insert, base_lookup) = figures[0];
        let mut rows = serde_json::Map::new();
        for ((kind, _), &(insert, lookup)) in kinds.iter().zip(&figures) {
            let r = ratio(insert, base_insert).max(ratio(lookup, base_lookup));
            let max = if seed_name == "seeded" { &mut out.seeded_max } else { &mut out.attacked_max };
            *max = max.max(r);
            rows.insert(kind.to_string(), row(insert, lookup, r));
        }
        out.by_seed.insert(seed_name.to_string(), rows.into());
    }
    out
}

// ---- affinity table ----

/// Session ids whose hash under the attacked seed has `bits` equal low bits.
fn crafted_sessions(n: usize, bits: u32) -> Vec<Vec<u8>> {
    let mask = (1u64 << bits) - 1;
    let seed = AffinityConfig::default().hash_seed ^ PHASE_SALT_AGGREGATED;
    let mut out = Vec::with_capacity(n);
    let mut buf = Vec::with_capacity(32);
    let mut i = 0u64;
    while out.len() < n {
        buf.clear();
        let _ = write!(buf, "user-{i:019x}");
        i += 1;
        if xxh3_64_with_seed(&buf, seed) & mask == 0 {
            out.push(buf.clone());
        }
    }
    out
}

fn random_sessions(n: usize, rng: &mut Draw) -> Vec<Vec<u8>> {
    (0..n).map(|_| format!("user-{:019x}", rng.next_u64() >> 8).into_bytes()).collect()
}

/// Inserts every id (acquire, commit, release), then looks each up again; ns per
/// operation for each pass.
fn affinity_pass(ids: &[Vec<u8>], seed: u64) -> (f64, f64) {
    let cfg = AffinityConfig { sessions_max: ids.len(), hash_seed: seed, ..AffinityConfig::default() };
    let mut t = AffinityTable::new(cfg);
    let now = Instant::from_millis(1);
    let insert = timed(ids.len(), |i| {
        let Ok(Acquire::Initialize(token)) = t.acquire(now, &ids[i], Phase::Aggregated) else { panic!("new id") };
        let (_, lease) = t.commit(now, token, WorkerId(i as u64 % 16), None).expect("commit");
        t.release(now, lease).expect("release");
    });
    let lookup = timed(ids.len(), |i| {
        let Ok(Acquire::Bound { lease, .. }) = t.acquire(now, &ids[i], Phase::Aggregated) else { panic!("bound id") };
        t.release(now, lease).expect("release");
    });
    (insert, lookup)
}

fn affinity(n: usize, rng: &mut Draw) -> serde_json::Value {
    // The table reserves room for `sessions_max`: its positions take about log2(2n) bits.
    let bits = (2 * n).next_power_of_two().trailing_zeros();
    let kinds = [("random", random_sessions(n, rng)), ("crafted_low_bits", crafted_sessions(n, bits))];
    let c = compare(
        &kinds,
        AffinityConfig::default().hash_seed,
        |ids, seed| affinity_pass(ids, seed),
        |i, l, r| serde_json::json!({"insert_ns": i.round(), "lookup_ns": l.round(), "ratio_vs_random": r}),
    );
    serde_json::json!({
        "bench": "hash_flood", "table": "affinity", "keys": n, "crafted_equal_low_bits": bits,
        "by_seed": c.by_seed, "attacked_max_ratio": c.attacked_max, "attack_effective": c.attacked_max > 2.0,
        "seeded_max_ratio": c.seeded_max, "load_average_1m": load_average_1m(),
    })
}

// ---- prefix index ----

/// `index/sets.rs`'s `mix`: the index's seeded hash of a block.
fn mix(seed: u64, x: u64) -> u64 {
    let m = u128::from(x ^ seed) * u128::from(0x9E37_79B9_7F4A_7C15_u64);
    (m as u64) ^ ((m >> 64) as u64)
}

/// Block hashes whose index hash under the attacked seed has `bits` equal top bits,
/// the bits that pick the home bucket.
fn crafted_blocks(n: usize, bits: u32, rng: &mut Draw) -> Vec<u64> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let x = rng.next_u64();
        if mix(HASH_SEED_DEFAULT, x) >> (64 - bits) == 0 {
            out.push(x);
        }
    }
    out
}

/// Stores `hashes` as chains of [`CHAIN`] blocks for one worker, then queries each
/// chain; ns per block for each pass.
fn index_pass(hashes: &[u64], seed: u64) -> (f64, f64) {
    let mut index = PrefixIndex::new(IndexConfig { hash_seed: seed, ..IndexConfig::default() });
    let blocks: Vec<BlockHash> = hashes.iter().map(|&h| BlockHash { seq: SeqHash(h), local: LocalHash(h) }).collect();
    let key = WorkerKey::new(WorkerId(1).0, 0);
    let chains: Vec<&[BlockHash]> = blocks.chunks(CHAIN).collect();
    let insert = timed(chains.len(), |c| {
        let ev = IndexEvent::Stored { parent: None, blocks: chains[c], tier: Tier::Device };
        index.apply(key, ev).expect("stored");
    }) / CHAIN as f64;
    let seqs: Vec<SeqHash> = blocks.iter().map(|b| b.seq).collect();
    let queries: Vec<&[SeqHash]> = seqs.chunks(CHAIN).collect();
    let mut scores = OverlapScores::new();
    let query = timed(queries.len(), |c| {
        index.find_matches(queries[c], false, &mut scores);
        assert_eq!(scores.get(key).raw() as usize, queries[c].len());
    }) / CHAIN as f64;
    (insert, query)
}

fn index(n: usize, rng: &mut Draw) -> serde_json::Value {
    // The table has a bucket of eight per ~6 blocks: its home bucket takes about
    // log2(n / 4) bits; crafting a few more covers its growth.
    let bits = (n / 4).next_power_of_two().trailing_zeros() + 2;
    let kinds: [(&str, Vec<u64>); 4] = [
        ("random", (0..n).map(|_| rng.next_u64()).collect()),
        ("crafted_home_bucket", crafted_blocks(n, bits, rng)),
        ("equal_low_32_bits", (1..=n as u64).map(|i| i << 32 | 0xDEAD_BEEF).collect()),
        ("consecutive", (1..=n as u64).collect()),
    ];
    let c = compare(
        &kinds,
        HASH_SEED_DEFAULT,
        |hashes, seed| index_pass(hashes, seed),
        |i, q, r| {
            serde_json::json!({
                "insert_ns_per_block": i.round(), "query_ns_per_block": (q * 10.0).round() / 10.0, "ratio_vs_random": r,
            })
        },
    );
    serde_json::json!({
        "bench": "hash_flood", "table": "prefix_index", "keys": n, "crafted_equal_top_bits": bits,
        "by_seed": c.by_seed, "attacked_max_ratio": c.attacked_max, "attack_effective": c.attacked_max > 2.0,
        "seeded_max_ratio": c.seeded_max, "load_average_1m": load_average_1m(),
    })
}

fn main() {
    let (mut sessions, mut blocks) = (8_192usize, 16_384usize);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = |name: &str| -> usize {
            match it.next().and_then(|v| v.parse().ok()) {
                Some(n) if n >= 64 => n,
                _ => {
                    eprintln!("hash-flood: {name} needs an integer of at least 64");
                    std::process::exit(2);
                }
            }
        };
        match a.as_str() {
            "--sessions" => sessions = num("--sessions"),
            "--blocks" => blocks = num("--blocks"),
            "--help" | "-h" => {
                println!("usage: hash-flood [--sessions N (8192)] [--blocks N (16384)]");
                return;
            }
            other => {
                eprintln!("hash-flood: unknown argument {other:?} (try --help)");
                std::process::exit(2);
            }
        }
    }
    let mut rng = Draw(0x6861_7368);
    let mut worst: f64 = 0.0;
    for v in [affinity(sessions, &mut rng), index(blocks, &mut rng)] {
        worst = worst.max(v["seeded_max_ratio"].as_f64().unwrap_or(f64::INFINITY));
        println!("{v}");
    }
    if worst > 2.0 {
        eprintln!("hash-flood: crafted keys cost {worst}x random ones against a seeded table (limit 2x)");
        std::process::exit(1);
    }
}
