//! Prefix-index micro-benches on a synthetic, deterministic fleet: conversations that
//! extend their own earlier turns below one shared system prompt, spread round-robin
//! over the workers.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use router_core::{
    internals::ApproxIndex, ApproxConfig, BlockHash, IndexConfig, IndexEvent, Instant, LocalHash, OverlapScores,
    PrefixIndex, SeqHash, Tier, WorkerKey,
};
use std::hint::black_box;

/// SplitMix64, so the fleet is the same on every run.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `convs` conversations of `turns` turns; turn t re-states the conversation so far and
/// adds 20 to 120 blocks. Returns every request's chain, in arrival order.
fn fleet(convs: u64, turns: u64) -> Vec<Vec<BlockHash>> {
    let root: Vec<u64> = (0..8).map(mix).collect();
    let mut reqs = Vec::new();
    let mut convs_so_far: Vec<Vec<u64>> = (0..convs).map(|_| root.clone()).collect();
    for t in 0..turns {
        for (c, chain) in convs_so_far.iter_mut().enumerate() {
            let add = 20 + mix(c as u64 * 1000 + t) % 100;
            for _ in 0..add {
                let next = mix(*chain.last().unwrap_or(&0) ^ 0x5555);
                chain.push(next);
            }
            reqs.push(chain.iter().map(|&h| BlockHash { seq: SeqHash(h), local: LocalHash(h) }).collect());
        }
    }
    reqs
}

fn key(i: usize, workers: usize) -> WorkerKey {
    WorkerKey::new((i % workers) as u64, 0)
}

fn build(reqs: &[Vec<BlockHash>], workers: usize) -> PrefixIndex {
    let mut index = PrefixIndex::new(IndexConfig::default());
    for (i, r) in reqs.iter().enumerate() {
        let _ = index.apply(key(i, workers), IndexEvent::Stored { parent: None, blocks: r, tier: Tier::Device });
    }
    index
}

fn seqs(r: &[BlockHash]) -> Vec<SeqHash> {
    r.iter().map(|b| b.seq).collect()
}

fn query(c: &mut Criterion) {
    let reqs = fleet(400, 5);
    let mut g = c.benchmark_group("index_query");
    for workers in [16usize, 128] {
        let index = build(&reqs, workers);
        let mut out = OverlapScores::new();
        // The latest turns: long queries that match their own worker fully.
        let long: Vec<Vec<SeqHash>> = reqs[reqs.len() - 64..].iter().map(|r| seqs(r)).collect();
        g.throughput(Throughput::Elements(long.len() as u64));
        g.bench_function(BenchmarkId::new("last_turns", workers), |b| {
            b.iter(|| {
                for q in &long {
                    index.find_matches(black_box(q), false, &mut out);
                }
                out.max_raw()
            })
        });
        // A request no one has seen past the shared prefix.
        let mut fresh = long[0][..8].to_vec();
        fresh.extend((0..256u64).map(|i| SeqHash(mix(i ^ 0xdead))));
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("shared_prefix_only", workers), |b| {
            b.iter(|| {
                index.find_matches(black_box(&fresh), false, &mut out);
                out.max_raw()
            })
        });
    }
    g.finish();
}

fn ingest(c: &mut Criterion) {
    let reqs = fleet(400, 5);
    let mut g = c.benchmark_group("index_ingest");
    g.sample_size(10);
    let blocks: usize = reqs.iter().map(Vec::len).sum();
    g.throughput(Throughput::Elements(blocks as u64));
    g.bench_function("build_16_workers", |b| b.iter(|| build(black_box(&reqs), 16).stats().entries));
    g.finish();

    // Steady state: store 128 new blocks after a known prefix, then remove them.
    let mut index = build(&reqs, 16);
    let base = &reqs[reqs.len() - 1];
    let tail: Vec<BlockHash> =
        (0..128u64).map(|i| BlockHash { seq: SeqHash(mix(i ^ 0xbeef)), local: LocalHash(i) }).collect();
    let tail_seqs: Vec<SeqHash> = tail.iter().rev().map(|b| b.seq).collect();
    let k = key(reqs.len() - 1, 16);
    let mut g = c.benchmark_group("index_events");
    g.throughput(Throughput::Elements(256));
    g.bench_function("store_then_remove_128", |b| {
        b.iter(|| {
            let parent = base.last().map(|b| b.seq);
            let _ = index.apply(k, IndexEvent::Stored { parent, blocks: &tail, tier: Tier::Device });
            index.apply(k, IndexEvent::Removed { blocks: &tail_seqs, tier: Tier::Device })
        })
    });
    g.throughput(Throughput::Elements(base.len() as u64));
    g.bench_function("restate_held_chain", |b| {
        b.iter(|| index.apply(k, IndexEvent::Stored { parent: None, blocks: black_box(base), tier: Tier::Device }))
    });
    g.finish();
}

fn approx(c: &mut Criterion) {
    let reqs = fleet(100, 3);
    let mut index = ApproxIndex::new(ApproxConfig::default());
    let mut now = Instant::ZERO;
    for (i, r) in reqs.iter().enumerate() {
        index.record(now, key(i, 16), &seqs(r));
        now = now.add_ms(10);
    }
    let q = seqs(&reqs[reqs.len() - 1]);
    let mut out = OverlapScores::new();
    let mut g = c.benchmark_group("approx");
    g.bench_function("find_matches_last_turn", |b| {
        b.iter(|| {
            index.find_matches(now, black_box(&q), &mut out);
            out.max_raw()
        })
    });
    g.bench_function("record_last_turn", |b| {
        b.iter(|| {
            now = now.add_us(1);
            index.record(now, key(0, 16), black_box(&q));
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = query, ingest, approx
}
criterion_main!(benches);
