//! KV-event abuse, from a publisher that is broken or hostile:
//!
//! * allocation bombs (a few bytes claiming 2³² elements or 4 GiB) are typed errors
//!   and allocate nothing large, measured by a counting global allocator;
//! * garbage mixed into a stream (malformed messages, undecodable or oversized
//!   payloads, well-formed events with impossible values) leaves every valid event
//!   applied, exactly as a clean stream would;
//! * a sequence reset (a gap with no replay, a failed or timed-out replay, a publisher
//!   restart) clears only the worker whose stream it is, every rank of it, and no other.
//!
//! Its own test binary, so the counting allocator sees only these tests.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use kvroute_events::decode::{decode_batch, Batch, DecodeConfig};
use kvroute_events::encode::{encode_batch, WireEvent, WireForm, WireHash, Writer};
use kvroute_events::ingest::{Command, IngestError};
use kvroute_events::{EventSink, IngestConfig, IngestCore, RouterEvent, StreamConfig};
use router_core::{BlockSize, Instant, SeqHash, WorkerKey};

// ---- a counting allocator, per thread ----

/// Counts what the current thread allocates while [`measured`] runs; otherwise it is
/// the system allocator.
struct Counting;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    static TOTAL: Cell<usize> = const { Cell::new(0) };
}

fn note(bytes: usize) {
    // `try_with`: the allocator may run while a thread's locals are torn down.
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            LARGEST.with(|l| l.set(l.get().max(bytes)));
            TOTAL.with(|s| s.set(s.get() + bytes));
        }
    });
}

// SAFETY: every call forwards to `System` with the caller's arguments unchanged; the
// bookkeeping touches only const-initialised thread-locals, which never allocate.
#[allow(unsafe_code)] // A global allocator can only be written with `unsafe`.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f`, returning its result, the largest single allocation and the bytes
/// allocated in all, on this thread.
fn measured<R>(f: impl FnOnce() -> R) -> (R, usize, usize) {
    LARGEST.with(|l| l.set(0));
    TOTAL.with(|s| s.set(0));
    TRACKING.with(|t| t.set(true));
    let r = f();
    TRACKING.with(|t| t.set(false));
    (r, LARGEST.with(Cell::get), TOTAL.with(Cell::get))
}

#[test]
fn the_counting_allocator_counts() {
    let (v, largest, total) = measured(|| vec![7u8; 1 << 20]);
    assert_eq!(v.len(), 1 << 20);
    assert!(largest >= 1 << 20 && total >= 1 << 20, "{largest} {total}");
}

// ---- helpers ----

const T0: Instant = Instant::ZERO;
const BS: u32 = 4;

fn frames(seq: u64, payload: &[u8]) -> Vec<Bytes> {
    vec![Bytes::from_static(b"kv"), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::copy_from_slice(payload)]
}

fn stream(key: WorkerKey, has_replay: bool) -> StreamConfig {
    StreamConfig {
        key,
        block_size: BlockSize::new(BS).expect("valid"),
        cache_salt: None,
        blocks_max: 10_000,
        has_replay,
    }
}

/// Blocks per worker key, as the index would hold them, plus every `clear_worker` call.
#[derive(Default, Debug, PartialEq)]
struct Model {
    keys: BTreeMap<WorkerKey, BTreeSet<SeqHash>>,
    clears: Vec<WorkerKey>,
}

impl EventSink for Model {
    fn apply(&mut self, key: WorkerKey, ev: &RouterEvent) {
        let set = self.keys.entry(key).or_default();
        match ev {
            RouterEvent::Stored { blocks, .. } => set.extend(blocks.iter().map(|b| b.seq)),
            RouterEvent::Removed { blocks, .. } => blocks.iter().for_each(|h| {
                set.remove(h);
            }),
            RouterEvent::Cleared => set.clear(),
        }
    }
    fn clear_worker(&mut self, key: WorkerKey) {
        self.clears.push(key);
        self.keys.remove(&key);
    }
    fn set_trusted(&mut self, _: WorkerKey, _: bool) {}
}

/// A stored chain of `blocks` blocks, engine hashes `first..`, continuing `parent`.
fn stored(
    first: i128,
    blocks: u32,
    parent: Option<i128>,
) -> (Vec<WireHash<'static>>, Option<WireHash<'static>>, Vec<u32>) {
    let hashes = (0..blocks).map(|i| WireHash::Int(first + i128::from(i))).collect();
    let tokens = (0..blocks * BS).map(|t| (first as u32).wrapping_mul(31).wrapping_add(t)).collect();
    (hashes, parent.map(WireHash::Int), tokens)
}

/// One batch storing the chain `(first, blocks, parent)`, with an optional rank.
fn store_batch(ts: f64, first: i128, blocks: u32, parent: Option<i128>, rank: Option<u32>) -> Vec<u8> {
    let (h, p, t) = stored(first, blocks, parent);
    let ev = WireEvent::Stored {
        block_hashes: &h,
        parent: p,
        token_ids: &t,
        block_size: BS,
        medium: Some("GPU"),
        lora_name: None,
    };
    encode_batch(ts, &[ev], rank, WireForm::Map)
}

// ---- allocation bombs ----

/// `[ts, [ {"type": tag, field: <bomb>} ]]`.
fn in_event(tag: &str, field: &str, bomb: &[u8]) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    w.array(2);
    w.f64(1.0);
    w.array(1);
    w.map(2);
    w.str("type");
    w.str(tag);
    w.str(field);
    w.0.extend_from_slice(bomb);
    w.0
}

/// A tiny payload claiming a 2³²-element array (or 4 GiB) somewhere.
fn bombs() -> Vec<(&'static str, Vec<u8>)> {
    const ARRAY32: &[u8] = &[0xdd, 0xff, 0xff, 0xff, 0xff];
    const MAP32: &[u8] = &[0xdf, 0xff, 0xff, 0xff, 0xff];
    const BIN32: &[u8] = &[0xc6, 0xff, 0xff, 0xff, 0xff, 0x00];
    const STR32: &[u8] = &[0xdb, 0xff, 0xff, 0xff, 0xff, b'x'];
    const EXT32: &[u8] = &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01];
    let mut events32 = vec![0x92, 0xcb];
    events32.extend_from_slice(&1.0f64.to_be_bytes());
    events32.extend_from_slice(ARRAY32);
    vec![
        ("envelope array32", ARRAY32.to_vec()),
        ("envelope map32", MAP32.to_vec()),
        ("events array32", events32),
        ("token_ids array32", in_event("BlockStored", "token_ids", ARRAY32)),
        ("block_hashes array32", in_event("BlockStored", "block_hashes", ARRAY32)),
        ("removed block_hashes array32", in_event("BlockRemoved", "block_hashes", ARRAY32)),
        ("block hash bin32", in_event("BlockStored", "block_hashes", &[&[0x91][..], BIN32].concat())),
        ("lora_name str32", in_event("BlockStored", "lora_name", STR32)),
        ("unknown field map32", in_event("BlockStored", "extra_keys", MAP32)),
        ("unknown field ext32", in_event("BlockStored", "mystery", EXT32)),
        ("type str32", [&[0x92, 0x00, 0x91, 0x81, 0xa4][..], b"type", STR32].concat()),
        ("positional event array32", [&[0x92, 0x00, 0x91][..], ARRAY32].concat()),
    ]
}

/// Nothing a bomb makes the decoder or the ingestion core allocate comes near what it
/// claims: the largest allocation stays under this.
const BOMB_ALLOC_BYTES_MAX: usize = 64 << 10;

#[test]
fn allocation_bombs_are_typed_errors_and_allocate_nothing_large() {
    let cfg = DecodeConfig::default();
    let mut batch = Batch::new();
    for (name, payload) in bombs() {
        let (r, largest, total) = measured(|| decode_batch(&payload, &cfg, &mut batch));
        assert!(r.is_err(), "{name}: decoded as {:?}", batch.events().collect::<Vec<_>>());
        assert!(largest <= BOMB_ALLOC_BYTES_MAX, "{name}: one allocation of {largest} bytes ({r:?})");
        assert!(total <= BOMB_ALLOC_BYTES_MAX, "{name}: {total} bytes allocated in all ({r:?})");
    }
}

#[test]
fn allocation_bombs_through_the_ingestion_core_apply_nothing() {
    let key = WorkerKey::new(3, 0);
    let mut core = IngestCore::new(IngestConfig::default());
    core.add_stream(T0, stream(key, false)).expect("stream");
    let mut sink = Model::default();
    // A valid batch first, so the stream is running and has something to lose.
    core.handle_live(T0, key, &frames(0, &store_batch(1.0, 100, 2, None, None)), &mut sink).expect("valid");
    let before = sink.keys.clone();
    for (seq, (name, payload)) in (1..).zip(bombs()) {
        let msg = frames(seq, &payload);
        let (r, largest, _) = measured(|| core.handle_live(T0, key, &msg, &mut sink));
        assert!(matches!(r, Err(IngestError::Decode(_))), "{name}: {r:?}");
        assert!(largest <= BOMB_ALLOC_BYTES_MAX, "{name}: one allocation of {largest} bytes");
        assert_eq!(sink.keys, before, "{name} changed the index");
    }
    let st = core.status(key).expect("stream");
    assert_eq!(st.batches_malformed, bombs().len() as u64);
}

/// Deep nesting claims nothing, but a recursive reader would overflow its stack.
#[test]
fn deep_nesting_is_read_in_bounded_memory() {
    let payload = [vec![0x92, 0x00, 0x91], vec![0x81, 0xa1, b'k'], vec![0x91; 200_000], vec![0x90]].concat();
    let mut batch = Batch::new();
    let (r, largest, _) = measured(|| decode_batch(&payload, &DecodeConfig::default(), &mut batch));
    assert!(largest <= BOMB_ALLOC_BYTES_MAX, "one allocation of {largest} bytes ({r:?})");
    assert_eq!(batch.len(), 0, "{r:?}");
}

#[test]
fn an_oversized_payload_is_refused_unread() {
    let cfg = DecodeConfig { event_bytes_max: 1 << 20, ..DecodeConfig::default() };
    let payload = vec![0x90; (1 << 20) + 1];
    let mut batch = Batch::new();
    let (r, largest, _) = measured(|| decode_batch(&payload, &cfg, &mut batch));
    assert!(r.is_err() && largest == 0, "{r:?}, {largest} bytes");
}

// ---- garbage mixed with valid events ----

/// Well-formed msgpack events carrying impossible values or unknown types: each is
/// dropped alone, and its batch's other events are applied.
fn garbage_events() -> Vec<Vec<u8>> {
    let ev = |f: &dyn Fn(&mut Writer)| {
        let mut w = Writer(Vec::new());
        f(&mut w);
        w.0
    };
    vec![
        ev(&|w| {
            w.map(2);
            w.str("type");
            w.str("BlockMangled");
            w.str("x");
            w.int(1);
        }),
        ev(&|w| {
            w.map(4);
            w.str("type");
            w.str("BlockStored");
            w.str("block_hashes");
            w.array(1);
            w.int(9_999);
            w.str("token_ids");
            w.array(4);
            for t in [1, -2, 3, 4] {
                w.int(t);
            }
            w.str("block_size");
            w.int(i128::from(BS));
        }),
        ev(&|w| {
            w.map(3);
            w.str("type");
            w.str("BlockRemoved");
            w.str("block_hashes");
            w.array(1);
            w.int(i128::from(u64::MAX) + 1);
            w.str("medium");
            w.str("TAPE");
        }),
        ev(&|w| {
            w.array(3);
            w.str("Nonsense");
            w.int(1);
            w.nil();
        }),
    ]
}

/// The encoding of one event, cut out of a one-event batch.
fn event_bytes(ev: WireEvent<'_>) -> Vec<u8> {
    let one = encode_batch(1.0, &[ev], None, WireForm::Map);
    // [0x92, 0xcb + 8 bytes of ts, 0x91, event...]
    assert_eq!((one[0], one[1], one[10]), (0x92, 0xcb, 0x91), "the batch prefix the cut assumes");
    one[11..].to_vec()
}

/// `[ts, [events...]]` from encoded events.
fn raw_batch(ts: f64, events: &[Vec<u8>]) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    w.array(2);
    w.f64(ts);
    w.array(events.len());
    for e in events {
        w.0.extend_from_slice(e);
    }
    w.0
}

/// Batch `k` of a valid stream: a chain of three blocks continuing batch `k - 1`'s, and
/// every third batch a removal of an older block.
fn valid_events(k: i128) -> Vec<Vec<u8>> {
    let (h, p, t) = stored(10 * k, 3, (k > 0).then(|| 10 * (k - 1) + 2));
    let mut out = vec![event_bytes(WireEvent::Stored {
        block_hashes: &h,
        parent: p,
        token_ids: &t,
        block_size: BS,
        medium: None,
        lora_name: None,
    })];
    if k % 3 == 2 {
        let gone = [WireHash::Int(10 * (k - 2))];
        out.push(event_bytes(WireEvent::Removed { block_hashes: &gone, medium: Some("GPU") }));
    }
    out
}

#[test]
fn garbage_mixed_with_valid_events_leaves_the_valid_ones_applied() {
    const BATCHES: u64 = 30;
    let key = WorkerKey::new(5, 0);
    let run = |abused: bool| -> (Model, u64) {
        let mut core = IngestCore::new(IngestConfig {
            decode: DecodeConfig { event_bytes_max: 4096, ..DecodeConfig::default() },
            ..IngestConfig::default()
        });
        core.add_stream(T0, stream(key, false)).expect("stream");
        let mut sink = Model::default();
        let garbage = garbage_events();
        for k in 0..BATCHES {
            let ts = 1.0 + k as f64;
            let mut events = valid_events(k as i128);
            if abused {
                // Garbage events before, between and after the valid ones.
                let g = |i: u64| garbage[(i as usize) % garbage.len()].clone();
                events.insert(0, g(k));
                events.insert(1, g(k + 1));
                events.push(g(k + 2));
                // Whole messages of garbage: none may cost a valid batch.
                let junk: [Vec<Bytes>; 5] = [
                    vec![Bytes::from_static(b"kv")],
                    vec![Bytes::from_static(b"kv"), Bytes::from_static(b"\x00\x01"), Bytes::from_static(b"\x90")],
                    vec![Bytes::new(), Bytes::new(), Bytes::new(), Bytes::new()],
                    // At a sequence number already applied: dropped as a duplicate.
                    frames(k.saturating_sub(1), &[0xc1, 0xc1]),
                    frames(k.saturating_sub(1), &vec![0x90; 5_000]),
                ];
                for m in &junk[..if k == 0 { 3 } else { 5 }] {
                    assert!(core.handle_live(T0, key, m, &mut sink).is_err() || m.len() == 3);
                }
            }
            let r = core.handle_live(T0, key, &frames(k, &raw_batch(ts, &events)), &mut sink);
            assert!(r.is_ok() || abused, "batch {k}: {r:?}");
        }
        let st = core.status(key).expect("stream");
        assert_eq!(st.batches_applied, BATCHES, "every valid batch applied ({st:?})");
        if abused {
            // The garbage was seen and counted, not silently absent.
            assert!(st.events_unknown > 0 && st.events_dropped > 0 && st.batches_malformed > 0, "{st:?}");
            assert!(st.seq.duplicates > 0, "{st:?}");
        }
        (sink, st.events_applied)
    };
    let (clean, clean_events) = run(false);
    let (abused, abused_events) = run(true);
    assert!(!clean.keys.get(&key).is_none_or(BTreeSet::is_empty));
    assert_eq!(abused, clean, "the abused stream must leave exactly the clean stream's blocks");
    assert_eq!(abused_events, clean_events);
}

// ---- a reset clears only its worker ----

#[derive(Clone, Copy, Debug)]
enum Reset {
    /// A gap on a stream with no replay endpoint.
    GapWithoutReplay,
    /// A replay that fails.
    ReplayFailed,
    /// A replay that never answers.
    ReplayTimedOut,
    /// The publisher restarts: numbering from 0 again, with newer timestamps.
    Restart,
}

/// Two workers, the first with two ranks, each holding blocks; then `how` resets the
/// first worker's stream. Every rank of the first worker is cleared (then refilled by
/// the batch after the reset), and the second worker keeps all it had.
#[track_caller]
fn check(how: Reset) {
    let (a0, a1, b) = (WorkerKey::new(1, 0), WorkerKey::new(1, 1), WorkerKey::new(2, 0));
    let has_replay = !matches!(how, Reset::GapWithoutReplay);
    let mut core = IngestCore::new(IngestConfig::default());
    core.add_stream(T0, stream(a0, has_replay)).expect("stream");
    core.add_stream(T0, stream(b, has_replay)).expect("stream");
    let mut sink = Model::default();
    for seq in 0..3u64 {
        let ts = 1.0 + seq as f64;
        let first = 100 * seq as i128;
        // The middle batch comes from rank 1 of the first worker.
        let rank = (seq == 1).then_some(1);
        core.handle_live(T0, a0, &frames(seq, &store_batch(ts, first, 2, None, rank)), &mut sink)
            .expect("a valid batch");
        core.handle_live(T0, b, &frames(seq, &store_batch(ts, 5_000 + first, 2, None, None)), &mut sink)
            .expect("a valid batch");
    }
    let b_before = sink.keys[&b].clone();
    assert_eq!((sink.keys[&a0].len(), sink.keys[&a1].len(), b_before.len()), (4, 2, 6));
    let after = store_batch(9.0, 7_000, 1, None, None);
    let now = Instant::from_millis(60_000);
    match how {
        Reset::GapWithoutReplay => {
            core.handle_live(now, a0, &frames(10, &after), &mut sink).expect("applied after the reset");
        }
        Reset::ReplayFailed | Reset::ReplayTimedOut => {
            core.handle_live(now, a0, &frames(10, &after), &mut sink).expect("held");
            let Some(Command::Replay { key, id, .. }) = core.poll_command() else { panic!("no replay asked") };
            assert_eq!(key, a0);
            if matches!(how, Reset::ReplayFailed) {
                core.handle_replay_failed(now, a0, id, &mut sink).expect("stream");
            } else {
                core.handle_timeout(now.add_ms(3_600_000), &mut sink);
            }
        }
        Reset::Restart => {
            core.handle_live(now, a0, &frames(0, &after), &mut sink).expect("a restart");
        }
    }
    let mut cleared = sink.clears.clone();
    cleared.sort();
    cleared.dedup();
    assert_eq!(cleared, [a0, a1], "{how:?} cleared other keys");
    assert_eq!(sink.keys.get(&a1).map_or(0, BTreeSet::len), 0, "{how:?}: rank 1 kept blocks");
    assert_eq!(sink.keys.get(&a0).map_or(0, BTreeSet::len), 1, "{how:?}: the batch after the reset");
    assert_eq!(sink.keys[&b], b_before, "{how:?} touched the other worker");
    let st = core.status(b).expect("stream");
    assert_eq!((st.seq.resets, st.seq.restarts), (0, 0));
}

#[test]
fn a_sequence_reset_clears_only_that_worker() {
    for how in [Reset::GapWithoutReplay, Reset::ReplayFailed, Reset::ReplayTimedOut, Reset::Restart] {
        check(how);
    }
}
