//! The fuzz targets' bodies. Each takes raw bytes and must never panic except on a bug:
//! the `fuzz/` crate calls them under libFuzzer, and `tests/it/fuzz_corpus.rs` replays
//! every committed corpus and regression file through them on stable.
//!
//! * [`kv_event_decode`]: bytes as a KV-event payload and as a multipart message, through
//!   the decoder, the frame parsers and the ingestion core into a prefix index.
//! * [`router_ops`]: bytes as a configuration and a sequence of router operations, run
//!   by the simulation driver of `core/tests/sim` with its model checks after each step.
//! * [`trace_parse`]: bytes as a Mooncake JSONL trace, line by line and whole.
//! * [`proxy_request`]: bytes as a client's request line, headers and body, through the
//!   proxy's body parser, routing-header reader, trust stripping and upstream headers.
//! * [`config_parse`]: bytes as the proxy's TOML configuration, with overrides.
//! * [`media_hash`]: bytes as an image part and as media items hashed over a prompt.
//! * [`tenant_auth`]: bytes as `[[tenants]]` and `Authorization` headers, through the
//!   key loader and the proxy's authentication.

use arbitrary::{Arbitrary, Unstructured};
use bytes::Bytes;
use kvroute_events::decode::{decode_batch, peek_ts, Batch, DecodeConfig, EventRef};
use kvroute_events::frame::{parse_live, parse_replay};
use kvroute_events::{IngestConfig, IngestCore, StreamConfig};
use router_core::{BlockSize, IndexConfig, Instant, PrefixIndex, WorkerKey};

#[path = "../../core/tests/sim/mod.rs"]
mod sim;

mod media;
mod proxy;
mod tenants;
pub use media::media_hash;
pub use proxy::{config_parse, proxy_request};
pub use tenants::tenant_auth;

/// A target's body: any bytes in, a panic only on a bug.
pub type Target = fn(&[u8]);

/// Every target by name, as the corpus folders are named.
pub const TARGETS: [(&str, Target); 7] = [
    ("kv_event_decode", kv_event_decode),
    ("router_ops", router_ops),
    ("trace_parse", trace_parse),
    ("proxy_request", proxy_request),
    ("config_parse", config_parse),
    ("media_hash", media_hash),
    ("tenant_auth", tenant_auth),
];

// ---- kv_event_decode ----

/// Decodes `data` as one payload, then splits it into frames (lengths from its first
/// bytes) and feeds them to the frame parsers and to an ingestion core backed by a
/// prefix index. Every result is an `Ok` or a typed error.
pub fn kv_event_decode(data: &[u8]) {
    let cfg = DecodeConfig::default();
    let mut batch = Batch::new();
    let decoded = decode_batch(data, &cfg, &mut batch);
    // A partial decode stays readable, even though it must not be applied.
    let mut events = 0;
    for ev in batch.events() {
        events += 1;
        if let EventRef::Stored(s) = ev {
            let _ = (s.block_hashes.len(), s.token_ids.len(), s.lora_name);
        }
    }
    assert_eq!(events, batch.len(), "{decoded:?}");
    let _ = peek_ts(data);

    let frames = split_frames(data);
    if let Ok((_, at)) = parse_live(&frames) {
        assert!(at < frames.len(), "payload index {at} out of {} frames", frames.len());
    }
    if let Ok((_, at)) = parse_replay(&frames) {
        assert!(at < frames.len(), "payload index {at} out of {} frames", frames.len());
    }
    let key = WorkerKey::new(1, 0);
    let mut ingest = IngestCore::new(IngestConfig::default());
    let stream = StreamConfig {
        key,
        block_size: BlockSize::new(4).expect("4 is a valid block size"),
        cache_salt: None,
        blocks_max: 256,
        has_replay: false,
    };
    ingest.add_stream(Instant::ZERO, stream).expect("first stream");
    let mut index = PrefixIndex::new(IndexConfig::default());
    // The same message twice: the second is a duplicate or a restart, never a panic.
    for t in 0..2 {
        let _ = ingest.handle_live(Instant::from_millis(t), key, &frames, &mut index);
    }
    ingest.handle_timeout(Instant::from_millis(60_000), &mut index);
    while ingest.poll_command().is_some() {}
    while ingest.poll_notice().is_some() {}
}

/// Up to four frames: the first byte's low two bits give the count minus one, and the
/// next bytes the lengths of all but the last frame.
fn split_frames(data: &[u8]) -> Vec<Bytes> {
    let Some((&head, mut rest)) = data.split_first() else {
        return vec![Bytes::new(); 3];
    };
    let count = usize::from(head & 3) + 1;
    let mut frames = Vec::with_capacity(count);
    for _ in 1..count {
        let Some((&len, tail)) = rest.split_first() else { break };
        let (frame, tail) = tail.split_at(usize::from(len).min(tail.len()));
        frames.push(Bytes::copy_from_slice(frame));
        rest = tail;
    }
    frames.push(Bytes::copy_from_slice(rest));
    frames
}

// ---- router_ops ----

/// A configuration and up to [`OPS_MAX`] operations drawn from `data`, run through the
/// simulation driver; a failed model check panics with the step that broke it.
pub fn router_ops(data: &[u8]) {
    let Ok(case) = FuzzCase::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let mut d = sim::driver::Driver::new(case.knobs.into());
    for op in case.ops.iter().take(OPS_MAX) {
        if let Err(e) = d.step(op.into()) {
            panic!("router_ops: {e}\nknobs: {:?}", case.knobs);
        }
    }
    if let Err(e) = d.settle() {
        panic!("router_ops: {e}\nknobs: {:?}", case.knobs);
    }
}

/// For triage: decodes `data` as [`router_ops`] does and, if it fails, removes
/// operations while it still fails the same way (same message, digits aside). Returns
/// the knobs, the remaining operations and the failure, ready to turn into a test;
/// `None` when `data` passes.
pub fn router_ops_reduce(data: &[u8]) -> Option<String> {
    let case = FuzzCase::arbitrary_take_rest(Unstructured::new(data)).ok()?;
    let knobs: sim::ops::Knobs = case.knobs.into();
    let ops: Vec<sim::ops::Op> = case.ops.iter().take(OPS_MAX).map(Into::into).collect();
    let (ops, failure) = sim::reduce::reduce(knobs, ops)?;
    Some(sim::reduce::report(knobs, &ops, &failure))
}

/// The kinds of operation (`Upsert`, `Tokens`, ...) [`router_ops`] runs for `data`, in
/// order; so a test can tell which kinds the committed seeds exercise.
pub fn router_ops_kinds(data: &[u8]) -> Vec<String> {
    let Ok(case) = FuzzCase::arbitrary_take_rest(Unstructured::new(data)) else { return Vec::new() };
    case.ops.iter().take(OPS_MAX).map(op_kind).collect()
}

/// Every kind of operation `arbitrary` can decode for [`router_ops`]: it picks a variant
/// from the top of a `u32`, so 256 evenly spaced values reach every one of up to 256.
pub fn router_ops_every_kind() -> Vec<String> {
    let mut kinds: Vec<String> = (0..=255u8)
        .filter_map(|top| {
            let mut bytes = [0u8; 64];
            bytes[3] = top; // The `u32` is read little-endian.
            FuzzOp::arbitrary(&mut Unstructured::new(&bytes)).ok().map(|op| op_kind(&op))
        })
        .collect();
    kinds.dedup();
    kinds
}

fn op_kind(op: &FuzzOp) -> String {
    format!("{op:?}").chars().take_while(char::is_ascii_alphanumeric).collect()
}

/// Operations run per input at most, so one input stays fast.
pub const OPS_MAX: usize = 512;

#[derive(Arbitrary, Debug)]
struct FuzzCase {
    knobs: FuzzKnobs,
    ops: Vec<FuzzOp>,
}

#[derive(Arbitrary, Clone, Copy, Debug)]
struct FuzzKnobs {
    mode: u8,
    flags: u8,
    sessions_max: u8,
    leases_max: u8,
    lease_ttl: u8,
    waiters_max: u8,
    queued_max: u8,
    queue_timeout: u8,
    class_limit: u8,
    request_age: u8,
    load_requests_max: u8,
    requests_max: u8,
    prefill_tokens_max: u8,
    blocks_cap: u8,
    keys_max: u8,
    workers_max: u8,
}

impl From<FuzzKnobs> for sim::ops::Knobs {
    fn from(k: FuzzKnobs) -> Self {
        sim::ops::Knobs {
            mode: k.mode,
            approximate: k.flags & 1 != 0,
            soft_affinity: k.flags & 2 != 0,
            wspt: k.flags & 4 != 0,
            reject_unknown_parent: k.flags & 8 != 0,
            // A spare bit, so the corpus's inputs decode as before.
            cpu_timing: k.flags & 16 != 0,
            sessions_max: k.sessions_max,
            leases_max: k.leases_max,
            lease_ttl: k.lease_ttl,
            waiters_max: k.waiters_max,
            queued_max: k.queued_max,
            queue_timeout: k.queue_timeout,
            class_limit: k.class_limit,
            request_age: k.request_age,
            load_requests_max: k.load_requests_max,
            requests_max: k.requests_max,
            prefill_tokens_max: k.prefill_tokens_max,
            blocks_cap: k.blocks_cap,
            keys_max: k.keys_max,
            workers_max: k.workers_max,
        }
    }
}

/// `sim::ops::Op` with the derive the core's test code cannot carry.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum FuzzOp {
    Upsert { worker: u8, role: u8, ranks: u8, weight: u8, small_kv: bool, zone: u8, taint: u8 },
    Remove { worker: u8 },
    Health { worker: u8, health: u8 },
    Taints { worker: u8, taints: u8 },
    Stored { worker: u8, rank: u8, chain: u8, start: u8, len: u8, parent: bool, tier: u8 },
    Removed { worker: u8, rank: u8, chain: u8, start: u8, len: u8, tier: u8 },
    Cleared { worker: u8, rank: u8 },
    KvClear { worker: u8, rank: u8 },
    Trust { worker: u8, rank: u8, trusted: bool },
    Request(FuzzReq),
    Dispatched { pick: u16 },
    DispatchFailed { pick: u16, failure: u8 },
    PrefillDone { pick: u16 },
    Progress { pick: u16, tokens: u16 },
    Finished { pick: u16 },
    Cancel { pick: u16 },
    Late { pick: u16, kind: u8 },
    Advance { ms: u32 },
    Back { ms: u32 },
    Jump { hours: u16 },
    Timeout,
    Query { chain: u8, len: u8, twist: u8 },
    // Last, and added in session 31: inputs saved before it decode to other operations.
    Tokens { worker: u8, agrees: bool },
}

#[derive(Arbitrary, Clone, Copy, Debug)]
struct FuzzReq {
    chain: u8,
    len: u8,
    tail: u8,
    phase: u8,
    session: u8,
    pin: u8,
    pin_rank: u8,
    allow: u8,
    flags: u8,
    label: u8,
    planned: u8,
    strict: i8,
    jump_ms: i16,
    class: u8,
    expected_out: u16,
    draw: u64,
}

impl From<&FuzzOp> for sim::ops::Op {
    fn from(op: &FuzzOp) -> Self {
        use sim::ops::Op;
        match *op {
            FuzzOp::Upsert { worker, role, ranks, weight, small_kv, zone, taint } => {
                Op::Upsert { worker, role, ranks, weight, small_kv, zone, taint }
            }
            FuzzOp::Remove { worker } => Op::Remove { worker },
            FuzzOp::Health { worker, health } => Op::Health { worker, health },
            FuzzOp::Taints { worker, taints } => Op::Taints { worker, taints },
            FuzzOp::Stored { worker, rank, chain, start, len, parent, tier } => {
                Op::Stored { worker, rank, chain, start, len, parent, tier }
            }
            FuzzOp::Removed { worker, rank, chain, start, len, tier } => {
                Op::Removed { worker, rank, chain, start, len, tier }
            }
            FuzzOp::Cleared { worker, rank } => Op::Cleared { worker, rank },
            FuzzOp::KvClear { worker, rank } => Op::KvClear { worker, rank },
            FuzzOp::Trust { worker, rank, trusted } => Op::Trust { worker, rank, trusted },
            FuzzOp::Request(r) => Op::Request(sim::ops::ReqOp {
                chain: r.chain,
                len: r.len,
                tail: r.tail,
                phase: r.phase,
                session: r.session,
                pin: r.pin,
                pin_rank: r.pin_rank,
                allow: r.allow,
                tolerate: r.flags & 1 != 0,
                preview: r.flags & 2 != 0,
                duplicate: r.flags & 4 != 0,
                label: r.label,
                planned: r.planned,
                strict: r.strict,
                jump_ms: r.jump_ms,
                class: r.class,
                expected_out: r.expected_out,
                draw: r.draw,
            }),
            FuzzOp::Dispatched { pick } => Op::Dispatched { pick },
            FuzzOp::DispatchFailed { pick, failure } => Op::DispatchFailed { pick, failure },
            FuzzOp::PrefillDone { pick } => Op::PrefillDone { pick },
            FuzzOp::Progress { pick, tokens } => Op::Progress { pick, tokens },
            FuzzOp::Finished { pick } => Op::Finished { pick },
            FuzzOp::Cancel { pick } => Op::Cancel { pick },
            FuzzOp::Late { pick, kind } => Op::Late { pick, kind },
            FuzzOp::Advance { ms } => Op::Advance { ms },
            FuzzOp::Back { ms } => Op::Back { ms },
            FuzzOp::Jump { hours } => Op::Jump { hours },
            FuzzOp::Timeout => Op::Timeout,
            FuzzOp::Query { chain, len, twist } => Op::Query { chain, len, twist },
            FuzzOp::Tokens { worker, agrees } => Op::Tokens { worker, agrees },
        }
    }
}

// ---- trace_parse ----

/// Replays a small parsed trace on two workers (later turns waiting on their `delay`).
/// Round robin holds nothing back, so unless the step bound cut the replay short every
/// request ends: each later turn is released by the one before it.
fn replay_small(records: &[kvroute_sim::trace::TraceRecord]) {
    use kvroute_sim::replay::{replay, ReplayConfig, RoundRobin};
    use kvroute_sim::trace::{to_requests, LoadOptions};
    let tokens: u64 = records.iter().map(|r| u64::from(r.input_length) + u64::from(r.output_length)).sum();
    if records.len() > 32 || tokens > 200_000 {
        return;
    }
    let Ok(reqs) = to_requests(records, &LoadOptions::default()) else { return };
    let cfg = ReplayConfig { workers: 2, steps_max: 1_000_000, ..ReplayConfig::default() };
    let report = replay(&cfg, &reqs, &mut RoundRobin::new(2)).expect("a valid fleet");
    let s = &report.summary;
    assert!(report.truncated || s.unfinished == 0, "{s:?}");
    for r in &report.records {
        assert!(!r.arrival_ms.is_nan(), "{r:?}");
    }
}

/// Parses `data` as a trace, whole through the reader and line by line, with the
/// default limits. Errors are typed; a line number is always within the input.
pub fn trace_parse(data: &[u8]) {
    use kvroute_sim::trace::{parse_line, read_trace, TraceLimits};
    let limits = TraceLimits::default();
    let lines = data.iter().filter(|&&b| b == b'\n').count() + 1;
    match read_trace(data, &limits) {
        Ok(records) => {
            assert!(records.len() <= lines);
            replay_small(&records);
        }
        Err(e) => assert!(e.line >= 1 && e.line <= lines + 1, "error on line {} of {lines}", e.line),
    }
    if let Ok(text) = std::str::from_utf8(data) {
        for line in text.lines() {
            if let Ok(rec) = parse_line(line, &limits) {
                assert!(rec.input_length > 0 && rec.input_length <= limits.input_tokens_max);
            }
        }
    }
}
