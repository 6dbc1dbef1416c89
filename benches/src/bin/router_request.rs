//! `router-request`: end-to-end latency of `Router::handle_request` (hash, match, filter,
//! select, book) for an 8k-token prompt, over 16 and 128 workers with 1M blocks indexed.
//!
//! `cargo run --release -p kvroute-benches --bin router-request [-- --iters N]`
//!
//! Prints one JSON line per fleet size. Each iteration hashes the prompt, routes it,
//! confirms the booking and finishes it, so the router stays in a steady state; only
//! hashing plus `handle_request` is timed. A baseline of hashing alone is timed in the
//! same process, so the routing share can be read as a difference on a noisy machine.

use std::time::Instant as Wall;

use kvroute_benches::{load_average_1m, nearest_rank};
use router_core::{
    hash_tokens, BlockHash, BlockSize, Decision, Draw, HashSeed, IndexEvent, Instant, LocalHash, Phase, Request,
    RequestId, Router, RouterConfig, SeqHash, Tier, WorkerId, WorkerKey, WorkerRole, WorkerSpec, WorkerUpdate,
};

const PROMPT_TOKENS: usize = 8192;
const INDEXED_BLOCKS: u64 = 1_000_000;

/// A fleet of `workers` with ~1M (worker, block) entries: random chains of 128 blocks,
/// a quarter of them sharing a prefix with the benchmark's prompts.
fn fleet(workers: u64, prompt: &[BlockHash], rng: &mut Draw) -> Router {
    let mut cfg = RouterConfig::default();
    cfg.index.blocks_max_per_worker = None;
    let mut r = Router::new(cfg);
    for w in 0..workers {
        let spec = WorkerSpec::new(WorkerId(w), WorkerRole::Aggregated);
        r.handle_worker_update(Instant::ZERO, WorkerUpdate::Upsert(spec)).expect("worker");
    }
    let per_chain = 128u64;
    let chains = INDEXED_BLOCKS / per_chain;
    let mut chain = Vec::with_capacity(per_chain as usize);
    for c in 0..chains {
        chain.clear();
        let shared = if c % 4 == 0 { (rng.next_u64() % per_chain) as usize } else { 0 };
        chain.extend_from_slice(&prompt[..shared]);
        while chain.len() < per_chain as usize {
            let h = rng.next_u64();
            chain.push(BlockHash { seq: SeqHash(h), local: LocalHash(h) });
        }
        let key = WorkerKey::new(c % workers, 0);
        let ev = IndexEvent::Stored { parent: None, blocks: &chain, tier: Tier::Device };
        let _ = r.handle_kv_event(Instant::ZERO, key, ev);
    }
    r
}

fn run(workers: u64, iters: usize) -> serde_json::Value {
    let mut rng = Draw(workers);
    let tokens: Vec<u32> = (0..PROMPT_TOKENS as u32).map(|i| i.wrapping_mul(2_654_435_761) >> 8).collect();
    let bs = BlockSize::DEFAULT;
    let mut prompt = Vec::new();
    hash_tokens(&tokens, bs, HashSeed::DEFAULT, &[], &mut prompt);
    let mut router = fleet(workers, &prompt, &mut rng);
    let entries = router.counts().index.entries;

    let mut hash_ns = Vec::with_capacity(iters);
    let mut route_ns = Vec::with_capacity(iters);
    let mut blocks = Vec::with_capacity(prompt.len());
    for i in 0..iters {
        let now = Instant::from_micros(i as u64 * 10);
        let t0 = Wall::now();
        blocks.clear();
        hash_tokens(&tokens, bs, HashSeed::DEFAULT, &[], &mut blocks);
        let t1 = Wall::now();
        let req = Request {
            id: RequestId(i as u64),
            blocks: blocks.iter().map(|b| b.seq).collect(),
            isl_tokens: PROMPT_TOKENS as u32,
            ..Request::default()
        };
        let d = router.handle_request(now, req, Draw(rng.next_u64()));
        let t2 = Wall::now();
        if let Ok(Decision::Routed(r)) = d {
            let _ = router.handle_dispatched(now, r.id, Phase::Aggregated);
            let _ = router.handle_finished(now, r.id, Phase::Aggregated);
        }
        hash_ns.push((t1 - t0).as_nanos() as u64);
        route_ns.push((t2 - t0).as_nanos() as u64);
    }
    hash_ns.sort_unstable();
    route_ns.sort_unstable();
    let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
    serde_json::json!({
        "bench": "handle_request",
        "workers": workers,
        "prompt_tokens": PROMPT_TOKENS,
        "index_entries": entries,
        "iters": iters,
        "end_to_end_p50_ns": nearest_rank(&route_ns, 50.0),
        "end_to_end_p99_ns": nearest_rank(&route_ns, 99.0),
        "end_to_end_mean_ns": mean(&route_ns),
        "hash_only_p50_ns": nearest_rank(&hash_ns, 50.0),
        "hash_only_p99_ns": nearest_rank(&hash_ns, 99.0),
        "load_average_1m": load_average_1m(),
    })
}

fn main() {
    let mut iters = 20_000usize;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--iters" => match it.next().and_then(|v| v.parse().ok()) {
                Some(n) if n > 0 => iters = n,
                _ => {
                    eprintln!("router-request: --iters needs a positive integer");
                    std::process::exit(2);
                }
            },
            "--help" | "-h" => {
                println!("usage: router-request [--iters N]   (default 20000)");
                return;
            }
            other => {
                eprintln!("router-request: unknown argument {other:?} (try --help)");
                std::process::exit(2);
            }
        }
    }
    for workers in [16, 128] {
        println!("{}", run(workers, iters));
    }
}
