//! KV events over ZeroMQ: frames, sequence numbers, the msgpack batch shape, hashes that
//! router-core recomputes from the published tokens, and the replay ROUTER socket.

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use kvroute_sim::prompt::OUTPUT_TOKEN_ID_BASE;
use kvroute_sim_server::wire::END_SEQ;
use kvroute_sim_server::SimServerHandle;
use rmpv::Value;
use router_core::{chain, local_hash, seq_hashes, BlockSize, HashSeed, LocalHash, SeqHash};
use serde_json::json;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::support::{bounded, fast_config, get, post, start};

const BS: usize = 4;

/// One published message: `[topic, seq, payload]`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Frames {
    topic: Bytes,
    seq: u64,
    pub(crate) payload: Bytes,
}

fn frames(m: ZmqMessage) -> Frames {
    let f = m.into_vec();
    assert_eq!(f.len(), 3, "a PUB message is [topic, seq, payload]: {f:?}");
    let seq: [u8; 8] = f[1].as_ref().try_into().expect("seq is 8 bytes");
    Frames { topic: f[0].clone(), seq: u64::from_be_bytes(seq), payload: f[2].clone() }
}

async fn subscribe(w: &SimServerHandle) -> SubSocket {
    let mut sub = SubSocket::new();
    bounded(sub.connect(&w.events_endpoint())).await.expect("SUB connects");
    bounded(sub.subscribe("")).await.expect("subscribe");
    sub
}

/// A PUB socket drops messages until the subscription reaches it (ZeroMQ's slow
/// joiner): send distinct small requests until one batch arrives.
async fn warm_up(w: &SimServerHandle, sub: &mut SubSocket) -> Frames {
    for i in 0..100 {
        let body = json!({"prompt": format!("warm-up request {i:03}"), "max_tokens": 1}).to_string();
        post(w.http_addr(), "/v1/completions", &body).await;
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            return frames(m.expect("recv"));
        }
    }
    panic!("no KV event batch reached the subscriber");
}

/// Asks the replay socket for every batch from `start`; returns them and checks the
/// end marker.
pub(crate) async fn replay(w: &SimServerHandle, start: u64) -> Vec<Frames> {
    let mut dealer = DealerSocket::new();
    bounded(dealer.connect(&w.replay_endpoint().expect("replay enabled"))).await.expect("DEALER connects");
    let req = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())]).expect("frames");
    bounded(dealer.send(req)).await.expect("send");
    let mut out = Vec::new();
    loop {
        let f = bounded(dealer.recv()).await.expect("recv").into_vec();
        assert_eq!(f.len(), 4, "a replay reply is ['', topic, seq, payload]: {f:?}");
        assert!(f[0].is_empty(), "empty delimiter first");
        if f[2].as_ref() == END_SEQ {
            assert!(f[1].is_empty() && f[3].is_empty(), "end marker is ['', '', -1, '']");
            return out;
        }
        let seq: [u8; 8] = f[2].as_ref().try_into().expect("seq is 8 bytes");
        out.push(Frames { topic: f[1].clone(), seq: u64::from_be_bytes(seq), payload: f[3].clone() });
    }
}

pub(crate) fn decode(payload: &[u8]) -> Value {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).expect("payload is msgpack");
    assert!(rd.is_empty(), "one value per payload");
    v
}

pub(crate) fn field<'a>(event: &'a [(Value, Value)], key: &str) -> &'a Value {
    &event.iter().find(|(k, _)| k.as_str() == Some(key)).unwrap_or_else(|| panic!("no {key} in {event:?}")).1
}

pub(crate) fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("unsigned int")).collect()
}

/// What a router would rebuild from the event stream.
#[derive(Default)]
struct Replica {
    resident: BTreeSet<u64>,
    stored_blocks: Vec<Vec<u32>>,
    stored_hashes: Vec<u64>,
    removed: usize,
}

impl Replica {
    /// Applies one batch, checking its shape and every hash against router-core.
    #[track_caller]
    fn apply(&mut self, f: &Frames, dp_rank: u64) {
        assert!(f.topic.is_empty(), "default topic is empty");
        let v = decode(&f.payload);
        let batch = v.as_array().expect("batch is an array");
        assert_eq!(batch.len(), 3, "[ts, events, data_parallel_rank]");
        let ts = batch[0].as_f64().expect("ts is a float");
        assert!(ts > 1.5e9 && ts < 1e10, "ts is Unix seconds: {ts}");
        assert_eq!(batch[2].as_u64(), Some(dp_rank));
        let events = batch[1].as_array().expect("events is an array");
        assert!(!events.is_empty(), "no empty batches");
        for e in events {
            let m = e.as_map().expect("event is a map");
            let keys: Vec<&str> = m.iter().map(|(k, _)| k.as_str().expect("string keys")).collect();
            match field(m, "type").as_str() {
                Some("BlockStored") => {
                    let want = [
                        "type",
                        "block_hashes",
                        "parent_block_hash",
                        "token_ids",
                        "block_size",
                        "lora_id",
                        "medium",
                        "lora_name",
                    ];
                    assert_eq!(keys, want);
                    self.stored(m);
                }
                Some("BlockRemoved") => {
                    assert_eq!(keys, ["type", "block_hashes", "medium"]);
                    assert_eq!(field(m, "medium").as_str(), Some("GPU"));
                    for h in u64s(field(m, "block_hashes")) {
                        assert!(self.resident.remove(&h), "removed block {h} was stored");
                        self.removed += 1;
                    }
                }
                other => panic!("unexpected event type {other:?}"),
            }
        }
    }

    #[track_caller]
    fn stored(&mut self, m: &[(Value, Value)]) {
        assert_eq!(field(m, "block_size").as_u64(), Some(BS as u64));
        assert!(field(m, "lora_id").is_nil() && field(m, "lora_name").is_nil());
        assert_eq!(field(m, "medium").as_str(), Some("GPU"));
        let hashes = u64s(field(m, "block_hashes"));
        let tokens: Vec<u32> =
            u64s(field(m, "token_ids")).into_iter().map(|t| u32::try_from(t).expect("u32 id")).collect();
        assert_eq!(tokens.len(), hashes.len() * BS, "token_ids covers the stored blocks");
        let mut parent = match field(m, "parent_block_hash") {
            Value::Nil => None,
            p => {
                let p = p.as_u64().expect("parent is an unsigned int");
                assert!(self.resident.contains(&p), "parent {p} is resident");
                Some(SeqHash(p))
            }
        };
        for (h, block) in hashes.iter().zip(tokens.chunks(BS)) {
            let local: LocalHash = local_hash(block, &[], HashSeed::DEFAULT);
            let seq = parent.map_or(SeqHash(local.0), |p| chain(p, local));
            assert_eq!(seq.0, *h, "router-core recomputes the published hash from token_ids");
            assert!(self.resident.insert(*h), "block {h} stored twice");
            self.stored_blocks.push(block.to_vec());
            self.stored_hashes.push(*h);
            parent = Some(seq);
        }
    }
}

/// Every block stored so far, in order, as `(hash, tokens)`, each checked as
/// [`Replica::apply`] checks it. Needs the replay socket and dp rank 0.
pub(crate) async fn stored_blocks(w: &SimServerHandle) -> Vec<(u64, Vec<u32>)> {
    let mut replica = Replica::default();
    for f in &replay(w, 0).await {
        replica.apply(f, 0);
    }
    replica.stored_hashes.into_iter().zip(replica.stored_blocks).collect()
}

#[tokio::test]
async fn published_events_rebuild_the_cache() {
    let mut cfg = fast_config();
    cfg.engine.blocks_per_worker = 16;
    cfg.replay_port = Some(0);
    cfg.dp_rank = 3;
    let w = start(cfg).await;
    let a = w.http_addr();
    let mut sub = subscribe(&w).await;
    let first = warm_up(&w, &mut sub).await;

    // 10 prompt tokens and 6 generated: blocks [1..4], [5..8] and [9, 10, g0, g1].
    post(a, "/v1/completions", &json!({"prompt": (1..=10).collect::<Vec<u32>>(), "max_tokens": 6}).to_string()).await;
    // 21 prompt tokens and 4 generated, 6 blocks each: the 16-block pool must evict.
    for i in 0..6 {
        post(
            a,
            "/v1/completions",
            &json!({"prompt": format!("evict me {i:02} please ok"), "max_tokens": 4}).to_string(),
        )
        .await;
    }

    let history = replay(&w, 0).await;
    let seqs: Vec<u64> = history.iter().map(|f| f.seq).collect();
    assert_eq!(seqs, (0..history.len() as u64).collect::<Vec<_>>(), "seq counts from 0 without gaps");
    let mut replica = Replica::default();
    for f in &history {
        replica.apply(f, 3);
    }
    assert!(replica.removed > 0, "the small pool evicted");

    // The live stream carries the same bytes as the replay buffer, from the first
    // message the subscriber saw to the last one published.
    let last = history.last().expect("history").seq;
    let mut live = vec![first];
    while live.last().expect("one").seq < last {
        live.push(frames(bounded(sub.recv()).await.expect("recv")));
    }
    for (i, f) in live.iter().enumerate() {
        assert_eq!(f.seq, live[0].seq + i as u64, "no gaps in the live stream");
        assert_eq!(Some(f), history.get(f.seq as usize), "live seq {} matches the replay", f.seq);
    }

    // The token-id prompt's blocks were announced, including the block that holds
    // generated tokens (ids from the reserved range, as the engine hashed them).
    let want = seq_hashes(&(1..=10).collect::<Vec<u32>>(), BlockSize::new(BS as u32).expect("bs"), HashSeed::DEFAULT);
    assert!(want.iter().all(|h| replica.stored_hashes.contains(&h.0)), "prompt blocks stored");
    assert!(
        replica.stored_blocks.iter().any(|b| b[..2] == [9, 10] && b[2..].iter().all(|&t| t >= OUTPUT_TOKEN_ID_BASE)),
        "the block promoted from generated tokens was stored with their ids"
    );

    // Everything resident is idle now, and the worker's own gauge agrees.
    let m = get(a, "/metrics").await;
    let text = std::str::from_utf8(&m.body).expect("utf-8");
    let want_line = format!("kvroute_sim:kv_inactive_blocks {}", replica.resident.len());
    assert!(text.lines().any(|l| l == want_line), "{want_line} in {text}");

    // Replay from the middle starts exactly there.
    let mid = last / 2;
    let tail = replay(&w, mid).await;
    assert_eq!(tail.first().map(|f| f.seq), Some(mid));
    assert_eq!(tail.as_slice(), &history[mid as usize..]);
    // Past the end: only the end marker.
    assert!(replay(&w, last + 100).await.is_empty());
    w.shutdown().await;
}

#[tokio::test]
async fn replay_buffer_keeps_only_the_newest_batches() {
    let mut cfg = fast_config();
    cfg.replay_port = Some(0);
    cfg.replay_batches_max = 3;
    cfg.topic = "kv".to_string();
    let w = start(cfg).await;
    for i in 0..6 {
        post(
            w.http_addr(),
            "/v1/completions",
            &json!({"prompt": format!("{i} distinct prompt"), "max_tokens": 1}).to_string(),
        )
        .await;
    }
    let kept = replay(&w, 0).await;
    let seqs: Vec<u64> = kept.iter().map(|f| f.seq).collect();
    let n = seqs.last().copied().expect("some batches") + 1;
    assert!(n >= 6, "one batch per request at least");
    assert_eq!(seqs, vec![n - 3, n - 2, n - 1]);
    assert!(kept.iter().all(|f| f.topic.as_ref() == b"kv"), "the topic frame is the configured topic");
    w.shutdown().await;
}

#[tokio::test]
async fn malformed_replay_requests_are_ignored() {
    let mut cfg = fast_config();
    cfg.replay_port = Some(0);
    let w = start(cfg).await;
    post(w.http_addr(), "/v1/completions", r#"{"prompt":"some blocks here","max_tokens":1}"#).await;
    let mut dealer = DealerSocket::new();
    bounded(dealer.connect(&w.replay_endpoint().expect("replay"))).await.expect("connect");
    for bad in [
        vec![Bytes::from_static(b"x")],
        vec![Bytes::new(), Bytes::from(vec![0u8; 9])],
        vec![Bytes::new(), Bytes::new(), Bytes::new()],
    ] {
        bounded(dealer.send(ZmqMessage::try_from(bad).expect("frames"))).await.expect("send");
    }
    // A good request after the bad ones is still answered, and only it.
    let good = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())]).expect("frames");
    bounded(dealer.send(good)).await.expect("send");
    let first = bounded(dealer.recv()).await.expect("recv").into_vec();
    assert_eq!(first[2].as_ref(), &0u64.to_be_bytes(), "the reply to the good request starts at seq 0");
    w.shutdown().await;
}
