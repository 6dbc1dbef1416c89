use super::*;
use crate::encode::{encode_batch, WireEvent, WireForm, WireHash};

/// Records every sink call, in order.
#[derive(Default)]
struct Log(Vec<String>);

impl EventSink for Log {
    fn apply(&mut self, key: WorkerKey, ev: &RouterEvent) {
        let what = match ev {
            RouterEvent::Stored { blocks, .. } => format!("stored {}", blocks.len()),
            RouterEvent::Removed { blocks, .. } => format!("removed {}", blocks.len()),
            RouterEvent::Cleared => "cleared".into(),
        };
        self.0.push(format!("{key} {what}"));
    }
    fn clear_worker(&mut self, key: WorkerKey) {
        self.0.push(format!("{key} clear"));
    }
    fn set_trusted(&mut self, key: WorkerKey, trusted: bool) {
        self.0.push(format!("{key} trusted={trusted}"));
    }
}

const KEY: WorkerKey = WorkerKey::new(7, 0);
const T0: Instant = Instant::ZERO;

fn core(has_replay: bool) -> IngestCore {
    let mut c = IngestCore::new(IngestConfig::default());
    let cfg = StreamConfig {
        key: KEY,
        block_size: BlockSize::new(4).unwrap(),
        cache_salt: None,
        blocks_max: 1_000,
        has_replay,
    };
    c.add_stream(T0, cfg).unwrap();
    c
}

fn frames(seq: u64, payload: Vec<u8>) -> Vec<Bytes> {
    vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload)]
}

fn store(ts: f64, hash: i128, block_size: u32, rank: Option<u32>) -> Vec<u8> {
    let hashes = [WireHash::Int(hash)];
    let tokens: Vec<u32> = (0..block_size).collect();
    let ev = WireEvent::Stored {
        block_hashes: &hashes,
        parent: None,
        token_ids: &tokens,
        block_size,
        medium: None,
        lora_name: None,
    };
    encode_batch(ts, &[ev], rank, WireForm::Map)
}

#[test]
fn block_size_mismatch_is_reported_once_and_dropped() {
    let mut c = core(false);
    let mut log = Log::default();
    for seq in 0..3 {
        let r = c.handle_live(T0, KEY, &frames(seq, store(seq as f64, 1, 8, None)), &mut log);
        assert_eq!(r, Err(IngestError::Translate(TranslateError::BlockSizeMismatch { configured: 4, got: 8 })));
    }
    assert!(log.0.is_empty());
    let notices: Vec<_> = std::iter::from_fn(|| c.poll_notice()).collect();
    assert_eq!(notices.len(), 1);
    assert!(notices[0].config);
    let st = c.status(KEY).unwrap();
    assert_eq!((st.events_dropped, st.events_applied, st.last_seq), (3, 0, Some(2)));
    assert!(st.config_error.is_some());
}

#[test]
fn ranks_are_filed_apart_and_purged_together() {
    let mut c = core(false);
    let mut log = Log::default();
    c.handle_live(T0, KEY, &frames(0, store(0.0, 1, 4, None)), &mut log).unwrap();
    c.handle_live(T0, KEY, &frames(1, store(1.0, 1, 4, Some(3))), &mut log).unwrap();
    c.remove_stream(KEY, &mut log).unwrap();
    assert_eq!(log.0, ["7/0 stored 1", "7/3 stored 1", "7/0 clear", "7/3 clear"]);
    assert_eq!(c.status(KEY), None);
    assert_eq!(
        c.handle_live(T0, KEY, &frames(2, store(2.0, 1, 4, None)), &mut log),
        Err(IngestError::UnknownStream(KEY))
    );
}

#[test]
fn malformed_frames_and_payloads_are_counted_and_skipped() {
    let mut c = core(false);
    let mut log = Log::default();
    let short = vec![Bytes::new(), Bytes::from_static(b"123")];
    assert_eq!(c.handle_live(T0, KEY, &short, &mut log), Err(IngestError::Frame(FrameError::FrameCount { got: 2 })));
    assert!(matches!(c.handle_live(T0, KEY, &frames(0, vec![0xc1]), &mut log), Err(IngestError::Decode(_))));
    c.handle_live(T0, KEY, &frames(1, store(1.0, 1, 4, None)), &mut log).unwrap();
    let st = c.status(KEY).unwrap();
    assert_eq!((st.batches_malformed, st.batches_applied, st.events_applied), (2, 1, 1));
    assert_eq!(log.0, ["7/0 stored 1"]);
}

#[test]
fn gap_asks_for_replay_and_replies_close_it() {
    let mut c = core(true);
    let mut log = Log::default();
    c.handle_live(T0, KEY, &frames(0, store(0.0, 1, 4, None)), &mut log).unwrap();
    c.handle_live(T0, KEY, &frames(2, store(2.0, 3, 4, None)), &mut log).unwrap();
    let Some(Command::Replay { key, id, from }) = c.poll_command() else { panic!("no replay asked") };
    assert_eq!((key, from), (KEY, 1));
    assert_eq!(c.poll_timeout(), Some(T0.add_ms(2_000)));
    let reply = |seq: &[u8], payload: Vec<u8>| {
        vec![Bytes::new(), Bytes::from_static(b""), Bytes::copy_from_slice(seq), Bytes::from(payload)]
    };
    c.handle_replay(T0, KEY, id, &reply(&1u64.to_be_bytes(), store(1.0, 2, 4, None)), &mut log).unwrap();
    c.handle_replay(T0, KEY, id, &reply(&[0xff; 8], Vec::new()), &mut log).unwrap();
    assert_eq!(log.0, ["7/0 stored 1", "7/0 trusted=false", "7/0 stored 1", "7/0 stored 1", "7/0 trusted=true"]);
    assert_eq!(c.poll_timeout(), None);
    assert_eq!(c.status(KEY).unwrap().seq.replays_completed, 1);
}

#[test]
fn silence_is_reported_only_while_serving() {
    let mut c = core(false);
    let mut log = Log::default();
    c.handle_live(T0, KEY, &frames(0, store(0.0, 1, 4, None)), &mut log).unwrap();
    let at = |s: u64| Instant::from_millis(s * 1000);
    assert!(c.silent_streams(at(1), |_| 10).is_empty(), "first check sets the baseline");
    assert!(c.silent_streams(at(40), |_| 10).is_empty(), "silent but idle");
    assert_eq!(c.silent_streams(at(41), |_| 15), vec![SilentStream { key: KEY, silent_ms: 41_000, requests: 5 }]);
    assert!(c.silent_streams(at(10), |_| 15).is_empty(), "an earlier clock reading is not silence");
    c.handle_live(at(42), KEY, &frames(1, store(1.0, 2, 4, None)), &mut log).unwrap();
    assert!(c.silent_streams(at(80), |_| 99).is_empty(), "heard since the last check");
}

#[test]
fn registration_limits() {
    let mut c = IngestCore::new(IngestConfig { streams_max: 1, ..IngestConfig::default() });
    let cfg =
        |key| StreamConfig { key, block_size: BlockSize::DEFAULT, cache_salt: None, blocks_max: 1, has_replay: false };
    c.add_stream(T0, cfg(KEY)).unwrap();
    assert_eq!(c.add_stream(T0, cfg(KEY)), Err(IngestError::DuplicateStream(KEY)));
    assert_eq!(c.add_stream(T0, cfg(WorkerKey::new(8, 0))), Err(IngestError::TooManyStreams));
}

#[test]
fn connecting_asks_for_what_was_published_before() {
    let mut c = core(true);
    let mut log = Log::default();
    c.handle_connection(T0, KEY, true, &mut log).unwrap();
    let Some(Command::Replay { key, id, from }) = c.poll_command() else { panic!("no replay asked") };
    assert_eq!((key, from), (KEY, 0));
    let reply = |seq: &[u8], payload: Vec<u8>| {
        vec![Bytes::new(), Bytes::from_static(b""), Bytes::copy_from_slice(seq), Bytes::from(payload)]
    };
    c.handle_replay(T0, KEY, id, &reply(&0u64.to_be_bytes(), store(0.0, 1, 4, None)), &mut log).unwrap();
    c.handle_replay(T0, KEY, id, &reply(&[0xff; 8], Vec::new()), &mut log).unwrap();
    assert_eq!(log.0, ["7/0 stored 1"], "applied, and never marked untrusted");
    // A reconnect after something was applied asks nothing.
    c.handle_connection(T0, KEY, false, &mut log).unwrap();
    c.handle_connection(T0.add_ms(5_000), KEY, true, &mut log).unwrap();
    assert_eq!(c.poll_command(), None);
    let st = c.status(KEY).unwrap();
    assert!(st.connected && st.trusted);
    let s = st.seq;
    assert_eq!((s.connect_replays, s.replays_requested, s.replays_completed, s.replays_failed), (1, 1, 1, 0));
    assert_eq!(st.last_seq, Some(0));
    assert_eq!(
        c.handle_connection(T0, WorkerKey::new(1, 0), true, &mut log),
        Err(IngestError::UnknownStream(WorkerKey::new(1, 0)))
    );
}

/// Two blocks of 4 tokens: block 0 holds an image from its first token; block 1 the
/// image's rest and a prompt-embeddings digest, which the router cannot reproduce.
fn media_then_embeds() -> Vec<u8> {
    let mut w = crate::encode::Writer(Vec::new());
    w.array(2);
    w.f64(1.0);
    w.array(1);
    w.map(5);
    w.str("type");
    w.str("BlockStored");
    w.str("block_hashes");
    w.array(2);
    w.int(1);
    w.int(2);
    w.str("token_ids");
    w.array(8);
    (0..8).for_each(|t| w.int(t));
    w.str("block_size");
    w.int(4);
    w.str("extra_keys");
    w.array(2);
    w.array(1);
    w.array(2);
    w.str("img");
    w.int(0);
    w.array(2);
    w.array(2);
    w.str("img");
    w.int(-4);
    w.bin(&[7; 32]);
    w.0
}

#[test]
fn media_and_unmatchable_blocks_are_counted_per_stream() {
    let mut c = core(false);
    let mut log = Log::default();
    c.handle_live(T0, KEY, &frames(0, media_then_embeds()), &mut log).unwrap();
    assert_eq!(log.0, ["7/0 stored 1"]);
    let st = c.status(KEY).unwrap();
    assert_eq!((st.blocks_media, st.blocks_unmatchable, st.events_applied), (1, 1, 1));
}
