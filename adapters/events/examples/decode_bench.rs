//! Decode + translate throughput on one core, through the whole sans-IO path
//! (frame parsing, sequencing, msgpack decoding, hash recomputation, engine-hash
//! bookkeeping, sink calls). Prints one JSON object per configuration.
//!
//! Run: `cargo run --release -p kvroute-events --example decode_bench [seconds]`

use std::time::{Duration, Instant as WallInstant};

use bytes::Bytes;
use kvroute_events::encode::{encode_batch, WireEvent, WireForm, WireHash};
use kvroute_events::{EventSink, IngestConfig, IngestCore, RouterEvent, StreamConfig};
use router_core::{BlockSize, Instant, WorkerKey};

/// Counts stored blocks; does nothing else.
#[derive(Default)]
struct Count(u64);

impl EventSink for Count {
    fn apply(&mut self, _: WorkerKey, ev: &RouterEvent) {
        if let RouterEvent::Stored { blocks, .. } = ev {
            self.0 += blocks.len() as u64;
        }
    }
    fn clear_worker(&mut self, _: WorkerKey) {}
    fn set_trusted(&mut self, _: WorkerKey, _: bool) {}
}

const BATCHES: usize = 256;
const EVENTS_PER_BATCH: usize = 8;
const BLOCKS_PER_EVENT: usize = 8;

/// Batches of stored events; each event continues the previous one's chain, as a
/// request's successive steps do, so every parent lookup hits.
fn payloads(block_size: u32, form: WireForm) -> Vec<Bytes> {
    let mut next_hash: i128 = 1 << 40;
    let mut token: u32 = 0;
    let mut parent: Option<i128> = None;
    (0..BATCHES)
        .map(|b| {
            let mut hashes: Vec<Vec<WireHash<'static>>> = Vec::new();
            let mut tokens: Vec<Vec<u32>> = Vec::new();
            let mut parents = Vec::new();
            for e in 0..EVENTS_PER_BATCH {
                if e % 4 == 0 {
                    parent = None;
                }
                parents.push(parent);
                let hs: Vec<WireHash<'static>> = (0..BLOCKS_PER_EVENT)
                    .map(|_| {
                        next_hash += 1;
                        WireHash::Int(next_hash)
                    })
                    .collect();
                parent = Some(next_hash);
                hashes.push(hs);
                tokens.push(
                    (0..BLOCKS_PER_EVENT * block_size as usize)
                        .map(|_| {
                            token = token.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                            token % 128_000
                        })
                        .collect(),
                );
            }
            let events: Vec<WireEvent<'_>> = (0..EVENTS_PER_BATCH)
                .map(|e| WireEvent::Stored {
                    block_hashes: &hashes[e],
                    parent: parents[e].map(WireHash::Int),
                    token_ids: &tokens[e],
                    block_size,
                    medium: Some("GPU"),
                    lora_name: None,
                })
                .collect();
            Bytes::from(encode_batch(b as f64, &events, Some(0), form))
        })
        .collect()
}

fn run(block_size: u32, form: WireForm, budget: Duration) -> String {
    let key = WorkerKey::new(1, 0);
    let data = payloads(block_size, form);
    let bytes: usize = data.iter().map(Bytes::len).sum();
    let mut core = IngestCore::new(IngestConfig::default());
    let cfg = StreamConfig {
        key,
        block_size: BlockSize::new(block_size).expect("power of two"),
        cache_salt: None,
        blocks_max: 1 << 20,
        has_replay: false,
    };
    core.add_stream(Instant::ZERO, cfg).expect("add");
    let mut sink = Count::default();
    let (mut seq, mut rounds) = (0u64, 0u64);
    let start = WallInstant::now();
    let cpu_start = thread_cpu_ns();
    while start.elapsed() < budget {
        for p in &data {
            let frames = [Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), p.clone()];
            core.handle_live(Instant::ZERO, key, &frames, &mut sink).expect("valid batch");
            seq += 1;
        }
        rounds += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    // On a shared machine wall time includes waiting for a core; CPU time does not.
    let cpu = cpu_start.zip(thread_cpu_ns()).map(|(a, b)| (b - a) as f64 / 1e9);
    let per_cpu = cpu.map_or("null".to_string(), |c| format!("{:.0}", sink.0 as f64 / c));
    format!(
        "{{\"bench\":\"decode_translate\",\"block_size\":{block_size},\"form\":\"{}\",\"blocks\":{},\"wall_secs\":{secs:.3},\"blocks_per_sec\":{:.0},\"blocks_per_cpu_sec\":{per_cpu},\"payload_mib_per_sec\":{:.1}}}",
        if form == WireForm::Map { "map" } else { "array" },
        sink.0,
        sink.0 as f64 / secs,
        (bytes as f64 * rounds as f64) / secs / (1 << 20) as f64,
    )
}

/// This thread's time on a CPU, in ns (Linux), from /proc.
fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let budget = Duration::from_secs_f64(secs);
    for block_size in [16, 64] {
        for form in [WireForm::Map, WireForm::Array] {
            println!("{}", run(block_size, form, budget));
        }
    }
}
