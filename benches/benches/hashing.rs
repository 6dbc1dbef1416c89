//! Block hashing throughput, in tokens per second.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use router_core::{chain_all, hash_tokens, local_hash, BlockSize, HashSeed, LocalHash};
use std::hint::black_box;

fn tokens(n: usize) -> Vec<u32> {
    // A cheap deterministic spread of token ids.
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) % 150_000).collect()
}

fn hash_prompt(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash_tokens");
    for &(len, block) in &[(4096usize, 64u32), (32_768, 64), (4096, 16)] {
        let toks = tokens(len);
        let bs = BlockSize::new(block).expect("valid block size");
        let mut out = Vec::with_capacity(len);
        g.throughput(Throughput::Elements(len as u64));
        g.bench_function(BenchmarkId::new(format!("block{block}"), len), |b| {
            b.iter(|| {
                out.clear();
                hash_tokens(black_box(&toks), bs, HashSeed::DEFAULT, &[], &mut out);
                black_box(out.len())
            })
        });
    }
    g.finish();
}

fn hash_parts(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash_parts");
    let block = tokens(64);
    g.throughput(Throughput::Elements(64));
    g.bench_function("local_hash_64_tokens", |b| b.iter(|| local_hash(black_box(&block), &[], HashSeed::DEFAULT)));
    let locals: Vec<LocalHash> = (0..1024u64).map(LocalHash).collect();
    let mut out = Vec::with_capacity(1024);
    g.throughput(Throughput::Elements(1024));
    g.bench_function("chain_1024_blocks", |b| {
        b.iter(|| {
            out.clear();
            chain_all(None, black_box(&locals), &mut out);
            black_box(out.len())
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = hash_prompt, hash_parts
}
criterion_main!(benches);
