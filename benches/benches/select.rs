//! Worker selection cost: one decision over 16, 128 and 1,024 candidates, in kv mode
//! (temperature 0 and 0.5) and in least-loaded mode, plus the load-tracker calls the
//! router makes around a decision. The target is 20 µs per decision at 1,024 workers.
//!
//! `kv-reference` is the baseline for `kv` in the same run: the same scores computed one
//! candidate at a time with the plain formula (`kv_cost`), then the cheapest.
//!
//! `SELECT_AB=1` skips criterion and times `kv`, `kv-reference` and `kv-blocks` (the
//! blocks formula) in interleaved rounds on the same fleets, printing one JSON line per
//! fleet size with the median CPU time per decision and the ratios, which stay
//! comparable on a machine whose speed drifts while other jobs run.
//!
//! `SELECT_KV_ONLY=<workers>[:<calls>]` skips criterion and makes only `calls` (default
//! 1,000) kv decisions over that many workers, untimed: for counting instructions under
//! an instruction-level profiler, where the difference between two call counts divided
//! by their difference is the cost of one decision.
//!
//! `BENCH_CLOCK=cpu` measures the benchmark thread's CPU time (64-bit Linux only) instead
//! of wall time, which keeps figures honest on a machine shared with other jobs.

use criterion::measurement::{Measurement, ValueFormatter};
use criterion::{BenchmarkId, Criterion, Throughput};
use router_core::{
    chain_all, internals::kv_cost, internals::Candidate, internals::LoadTracker, internals::SelectRequest,
    internals::Selector, BlockSize, CandidateScore, Draw, Instant, KvCostConfig, KvCostModel, LoadConfig, LocalHash,
    Overlap, Phase, RequestId, RouterMode, SeqHash, WorkerKey, WorkerLoad,
};
use std::hint::black_box;

const SIZES: [usize; 3] = [16, 128, 1024];

/// `n` candidates in key order with varied load and overlap, from a fixed seed.
fn candidates(n: usize) -> Vec<Candidate> {
    let mut d = Draw(42);
    (0..n)
        .map(|i| {
            let load = WorkerLoad {
                active_prefill_tokens: d.below(20_000) as u64,
                active_decode_blocks: d.below(5_000) as u64,
                active_requests: d.below(64) as u32,
            };
            let mut c = Candidate::new(WorkerKey::new(i as u64 / 8, (i % 8) as u32), load);
            c.overlap = Overlap { device: d.below(32) as u32, host: d.below(8) as u32, disk: d.below(8) as u32 };
            c.new_decode_blocks = 64 - c.overlap.device;
            c
        })
        .collect()
}

fn request(mode: RouterMode, temperature: f64) -> SelectRequest {
    SelectRequest {
        mode,
        phase: Phase::Aggregated,
        cost: KvCostConfig { temperature, ..KvCostConfig::default() },
        isl_tokens: 4096,
        block_size: BlockSize::DEFAULT,
        expected_output_blocks: 8,
        direct: None,
        decode_time_floor_ms: 0.0,
    }
}

fn blocks_request() -> SelectRequest {
    let cost = KvCostConfig { model: KvCostModel::Blocks, ..KvCostConfig::default() };
    SelectRequest { cost, ..request(RouterMode::Kv, 0.0) }
}

/// The plain formula, one candidate at a time, then the cheapest: the baseline.
fn reference_pick(req: &SelectRequest, cands: &[Candidate]) -> (Option<usize>, Vec<CandidateScore>) {
    let scores: Vec<_> = cands.iter().map(|c| kv_cost(req, c)).collect();
    let best = scores.iter().enumerate().min_by(|a, b| a.1.cost.total_cmp(&b.1.cost)).map(|(i, _)| i);
    (best, scores)
}

/// Interleaved A/B rounds (see the module docs).
fn ab() {
    const ROUNDS: usize = 41;
    let (kv, blocks) = (request(RouterMode::Kv, 0.0), blocks_request());
    for n in SIZES {
        let cands = candidates(n);
        let calls = (100_000 / n).max(20);
        let mut sel = Selector::new();
        let mut ns: [Vec<f64>; 3] = Default::default();
        for round in 0..ROUNDS {
            for (v, out) in ns.iter_mut().enumerate() {
                let t = thread_cpu_ns();
                for i in 0..calls {
                    let d = &mut Draw((round * calls + i) as u64);
                    match v {
                        0 => drop(black_box(sel.select(&kv, black_box(&cands), d, true))),
                        1 => drop(black_box(reference_pick(&kv, black_box(&cands)))),
                        _ => drop(black_box(sel.select(&blocks, black_box(&cands), d, true))),
                    }
                }
                out.push((thread_cpu_ns() - t) as f64 / calls as f64);
            }
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let [a, b, c] = ns.each_mut().map(med);
        let line = serde_json::json!({
            "bench": "select-ab",
            "workers": n,
            "rounds": ROUNDS,
            "kv_ns_median": a,
            "kv_reference_ns_median": b,
            "kv_blocks_ns_median": c,
            "kv_over_reference": a / b,
            "kv_over_blocks": a / c,
        });
        println!("{line}");
    }
}

/// `SELECT_KV_ONLY` (see the module docs).
fn kv_only(spec: &str) {
    let mut parts = spec.split(':').map(|p| p.parse::<usize>().expect("SELECT_KV_ONLY=<workers>[:<calls>]"));
    let n = parts.next().unwrap_or(1024);
    let calls = parts.next().unwrap_or(1000);
    let (req, cands) = (request(RouterMode::Kv, 0.0), candidates(n));
    let mut sel = Selector::new();
    for i in 0..calls {
        drop(black_box(sel.select(&req, black_box(&cands), &mut Draw(i as u64), true)));
    }
}

fn select<M: Measurement>(c: &mut Criterion<M>) {
    let mut g = c.benchmark_group("select");
    let cases = [
        ("kv", request(RouterMode::Kv, 0.0)),
        ("kv-temperature", request(RouterMode::Kv, 0.5)),
        ("kv-blocks", blocks_request()),
        ("least-loaded", request(RouterMode::LeastLoaded, 0.0)),
    ];
    for n in SIZES {
        let cands = candidates(n);
        g.throughput(Throughput::Elements(n as u64));
        let req = &cases[0].1;
        g.bench_with_input(BenchmarkId::new("kv-reference", n), &cands, |b, cands| {
            b.iter(|| reference_pick(req, black_box(cands)))
        });
        for (name, req) in &cases {
            g.bench_with_input(BenchmarkId::new(*name, n), &cands, |b, cands| {
                let mut sel = Selector::new();
                let mut seed = 0u64;
                b.iter(|| {
                    seed += 1;
                    sel.select(req, black_box(cands), &mut Draw(seed), true)
                })
            });
        }
    }
    g.finish();
}

/// The tracker work around one decision on a busy fleet: counting a 64-block prompt's new
/// blocks on every candidate (linear and chain variants), then booking and freeing it.
fn load<M: Measurement>(c: &mut Criterion<M>) {
    let mut g = c.benchmark_group("load");
    let locals: Vec<LocalHash> = (0..64).map(LocalHash).collect();
    let mut chain = Vec::new();
    chain_all(None, &locals, &mut chain);
    let prompt: Vec<SeqHash> = chain.iter().map(|b| b.seq).collect();
    for n in SIZES {
        let mut t = LoadTracker::new(LoadConfig::default());
        let keys: Vec<WorkerKey> = (0..n).map(|i| WorkerKey::new(i as u64, 0)).collect();
        // Eight bookings per key, each holding a different leading run of the prompt.
        for (i, &k) in keys.iter().enumerate() {
            for r in 0..8 {
                let held = &prompt[..(i * 13 + r * 5) % 64];
                let id = RequestId((i * 8 + r) as u64);
                t.add(Instant::ZERO, id, Phase::Aggregated, k, held, 512, 4).unwrap();
            }
        }
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("new-blocks", n), &keys, |b, keys| {
            b.iter(|| keys.iter().map(|&k| t.new_blocks(k, black_box(&prompt))).sum::<u32>())
        });
        g.bench_with_input(BenchmarkId::new("new-blocks-chain", n), &keys, |b, keys| {
            b.iter(|| keys.iter().map(|&k| t.new_blocks_chain(k, black_box(&prompt))).sum::<u32>())
        });
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("add-free", n), |b| {
            b.iter(|| {
                let req = RequestId(u64::MAX);
                t.add(Instant::ZERO, req, Phase::Aggregated, keys[0], black_box(&prompt), 4096, 8).unwrap();
                t.free(req, Phase::Aggregated).unwrap();
            })
        });
    }
    g.finish();
}

fn main() {
    if let Ok(spec) = std::env::var("SELECT_KV_ONLY") {
        kv_only(&spec);
        return;
    }
    if std::env::var_os("SELECT_AB").is_some() {
        ab();
        return;
    }
    if std::env::var("BENCH_CLOCK").is_ok_and(|v| v == "cpu") {
        let mut c = Criterion::default().with_measurement(CpuTime).configure_from_args();
        select(&mut c);
        load(&mut c);
        c.final_summary();
    } else {
        let mut c = Criterion::default().configure_from_args();
        select(&mut c);
        load(&mut c);
        c.final_summary();
    }
}

/// CPU time of the calling thread, in nanoseconds.
struct CpuTime;

#[repr(C)]
struct Timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

extern "C" {
    // From the C library std already links; declared here to avoid a dependency.
    fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
}

/// Linux's `CLOCK_THREAD_CPUTIME_ID`.
const CLOCK_THREAD_CPUTIME_ID: i32 = 3;

#[allow(unsafe_code)] // A call into the C library; std has no thread CPU clock.
fn thread_cpu_ns() -> u64 {
    let mut ts = Timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, exclusively borrowed timespec (two i64 on 64-bit Linux),
    // and clock_gettime writes only into it.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "BENCH_CLOCK=cpu needs clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Measurement for CpuTime {
    type Intermediate = u64;
    type Value = u64;

    fn start(&self) -> u64 {
        thread_cpu_ns()
    }
    fn end(&self, start: u64) -> u64 {
        thread_cpu_ns().saturating_sub(start)
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, v: &u64) -> f64 {
        *v as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &NanosFormatter
    }
}

struct NanosFormatter;

impl ValueFormatter for NanosFormatter {
    fn scale_values(&self, ns: f64, values: &mut [f64]) -> &'static str {
        let (factor, unit) = match ns {
            ns if ns < 1e3 => (1.0, "ns (cpu)"),
            ns if ns < 1e6 => (1e-3, "µs (cpu)"),
            ns if ns < 1e9 => (1e-6, "ms (cpu)"),
            _ => (1e-9, "s (cpu)"),
        };
        values.iter_mut().for_each(|v| *v *= factor);
        unit
    }

    fn scale_throughputs(&self, _typical: f64, throughput: &Throughput, values: &mut [f64]) -> &'static str {
        let n = match *throughput {
            Throughput::Bytes(n) | Throughput::BytesDecimal(n) | Throughput::Elements(n) => n as f64,
        };
        values.iter_mut().for_each(|v| *v = n * 1e3 / *v);
        "M/s (cpu)"
    }

    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns"
    }
}
