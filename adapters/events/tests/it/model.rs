//! Model test: whatever the network does to a valid stream (drops, duplicates,
//! reordering) and however replies to replay requests interleave with live batches,
//! and whenever the transport reports connecting (asking for a connect replay), the
//! sink ends equal to a lossless run, which in turn equals what the simulated engine
//! holds.
//!
//! Plain proptest rather than proptest-state-machine: the input is a delivery
//! schedule of one stream, not a sequence of API operations with preconditions.

use std::collections::VecDeque;

use bytes::Bytes;
use kvroute_events::encode::WireForm;
use kvroute_events::ingest::Command;
use kvroute_events::sequence::ReplayId;
use kvroute_events::{IngestConfig, IngestCore, StreamConfig};
use proptest::prelude::*;
use router_core::{BlockSize, Instant, WorkerKey};

use crate::support::{encode_sim, Blocks, Engine, ModelSink};

const KEY: WorkerKey = WorkerKey::new(3, 0);
const BLOCK: u32 = 4;

#[derive(Clone, Copy, Debug)]
enum Fate {
    Deliver,
    Drop,
    Duplicate(usize),
    Delay(usize),
}

fn fate() -> impl Strategy<Value = Fate> {
    prop_oneof![
        6 => Just(Fate::Deliver),
        2 => Just(Fate::Drop),
        1 => (1usize..4).prop_map(Fate::Duplicate),
        1 => (1usize..4).prop_map(Fate::Delay),
    ]
}

/// Encodes `n` engine batches (ts = seq; every third one in the positional form).
fn stream(seed: u64, n: usize) -> (Vec<Bytes>, Blocks) {
    let mut engine = Engine::new(seed, BLOCK);
    let payloads = (0..n)
        .map(|seq| {
            let form = if seq % 3 == 0 { WireForm::Array } else { WireForm::Map };
            Bytes::from(encode_sim(&engine.batch(), BLOCK, seq as f64, form))
        })
        .collect();
    (payloads, engine.expected())
}

fn new_core() -> IngestCore {
    let mut c = IngestCore::new(IngestConfig::default());
    let cfg = StreamConfig {
        key: KEY,
        block_size: BlockSize::new(BLOCK).expect("4"),
        cache_salt: None,
        blocks_max: 1 << 16,
        has_replay: true,
    };
    c.add_stream(Instant::ZERO, cfg).expect("add");
    c
}

fn live(seq: u64, payload: &Bytes) -> Vec<Bytes> {
    vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()]
}

fn replay_msg(seq: Option<u64>, payload: &Bytes) -> Vec<Bytes> {
    let seq = seq.map_or([0xff; 8], u64::to_be_bytes);
    vec![Bytes::new(), Bytes::new(), Bytes::copy_from_slice(&seq), payload.clone()]
}

/// The live delivery order: (seq, highest seq published by then).
fn schedule(fates: &[Fate]) -> Vec<(u64, u64)> {
    let n = fates.len();
    let mut later: Vec<Vec<u64>> = vec![Vec::new(); n + 4];
    let mut out = Vec::new();
    for (i, f) in fates.iter().enumerate() {
        let seq = i as u64;
        let f = if i + 1 == n { Fate::Deliver } else { *f };
        match f {
            Fate::Deliver => out.push((seq, seq)),
            Fate::Drop => {}
            Fate::Duplicate(k) => {
                out.push((seq, seq));
                later[(i + k).min(n - 1)].push(seq);
            }
            Fate::Delay(k) => later[(i + k).min(n - 1)].push(seq),
        }
        for s in std::mem::take(&mut later[i]) {
            out.push((s, seq));
        }
    }
    out
}

/// Runs the schedule, answering replays from the publisher's buffer one reply per
/// live batch, then draining what is left. The transport reports a connection before
/// delivering `sched[i]` for each `i` in `connects` (none past the end).
fn run(payloads: &[Bytes], sched: &[(u64, u64)], connects: &[usize]) -> (ModelSink, IngestCore) {
    let mut core = new_core();
    let mut sink = ModelSink::default();
    let mut replies: VecDeque<(ReplayId, Vec<Bytes>)> = VecDeque::new();
    let now = Instant::ZERO;
    let step = |core: &mut IngestCore, replies: &mut VecDeque<_>, published: Option<u64>| {
        while let Some(Command::Replay { id, from, .. }) = core.poll_command() {
            for s in (from..).take_while(|s| published.is_some_and(|p| *s <= p)) {
                replies.push_back((id, replay_msg(Some(s), &payloads[s as usize])));
            }
            replies.push_back((id, replay_msg(None, &Bytes::new())));
        }
    };
    let mut published = None;
    for (i, &(seq, pubd)) in sched.iter().enumerate() {
        if connects.contains(&i) {
            let _ = core.handle_connection(now, KEY, true, &mut sink);
            step(&mut core, &mut replies, published);
        }
        published = Some(pubd);
        let _ = core.handle_live(now, KEY, &live(seq, &payloads[seq as usize]), &mut sink);
        step(&mut core, &mut replies, published);
        if let Some((id, msg)) = replies.pop_front() {
            let _ = core.handle_replay(now, KEY, id, &msg, &mut sink);
            step(&mut core, &mut replies, published);
        }
    }
    for _ in 0..10_000 {
        let Some((id, msg)) = replies.pop_front() else {
            break;
        };
        let _ = core.handle_replay(now, KEY, id, &msg, &mut sink);
        step(&mut core, &mut replies, published);
    }
    (sink, core)
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64)
}

proptest! {
    // PROPTEST_CASES raises the count for longer local runs.
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn any_delivery_ends_like_a_lossless_run(
        seed in any::<u64>(),
        fates in prop::collection::vec(fate(), 2..40),
        connects in prop::collection::vec(0usize..50, 0..3),
    ) {
        let (payloads, expected) = stream(seed, fates.len());
        let lossless: Vec<(u64, u64)> = (0..fates.len() as u64).map(|s| (s, s)).collect();
        let (clean, _) = run(&payloads, &lossless, &[]);
        prop_assert_eq!(&clean.blocks(KEY), &expected, "the lossless run matches the engine");

        let (sink, core) = run(&payloads, &schedule(&fates), &connects);
        let st = core.status(KEY).expect("stream");
        prop_assert_eq!(st.last_seq, Some(fates.len() as u64 - 1));
        prop_assert_eq!(st.seq.resets, 0);
        prop_assert!(st.trusted && sink.untrusted.is_empty());
        prop_assert_eq!(sink.blocks(KEY), expected);
    }
}
