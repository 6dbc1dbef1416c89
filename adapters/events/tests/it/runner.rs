//! The async runner over a fake transport, on paused tokio time: reconnect backoff,
//! connection status, removal, and a replay that cannot be carried out.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use kvroute_events::encode::WireForm;
use kvroute_events::transport::{Connector, ReplayReplies, SubEvent, Subscription, TransportError};
use kvroute_events::{spawn, EndpointConfig, IngestHandle, RunnerConfig, StreamConfig};
use router_core::{BlockSize, WorkerKey};
use tokio::sync::mpsc;

use crate::support::{encode_sim, Engine, ModelSink};

const KEY: WorkerKey = WorkerKey::new(5, 0);

/// Hands out queued subscriptions; `None` in the queue is a failed connect.
#[derive(Clone, Default)]
struct Fake {
    subs: Arc<Mutex<Vec<Option<mpsc::Receiver<SubEvent>>>>>,
    attempts: Arc<Mutex<Vec<tokio::time::Instant>>>,
}

struct FakeSub(mpsc::Receiver<SubEvent>);

#[async_trait]
impl Subscription for FakeSub {
    async fn next(&mut self) -> Result<SubEvent, TransportError> {
        self.0.recv().await.ok_or(TransportError::Recv("closed".into()))
    }
}

#[async_trait]
impl Connector for Fake {
    async fn subscribe(&self, _: &str, _: &str) -> Result<Box<dyn Subscription>, TransportError> {
        self.attempts.lock().expect("lock").push(tokio::time::Instant::now());
        let next = {
            let mut q = self.subs.lock().expect("lock");
            if q.is_empty() {
                None
            } else {
                q.remove(0)
            }
        };
        match next {
            Some(rx) => Ok(Box::new(FakeSub(rx))),
            None => Err(TransportError::Connect("refused".into())),
        }
    }
    async fn replay(&self, _: &str, _: u64) -> Result<Box<dyn ReplayReplies>, TransportError> {
        Err(TransportError::Connect("no replay today".into()))
    }
}

impl Fake {
    fn queue(&self, ok: bool) -> Option<mpsc::Sender<SubEvent>> {
        let (tx, rx) = mpsc::channel(16);
        self.subs.lock().expect("lock").push(ok.then_some(rx));
        ok.then_some(tx)
    }
}

async fn start(fake: &Fake) -> IngestHandle<ModelSink> {
    let (h, _join) = spawn(RunnerConfig::default(), fake.clone(), ModelSink::default());
    let ep = EndpointConfig {
        stream: StreamConfig {
            key: KEY,
            block_size: BlockSize::new(4).expect("4"),
            cache_salt: None,
            blocks_max: 1024,
            has_replay: true,
        },
        endpoint: "tcp://fake:1".into(),
        replay_endpoint: Some("tcp://fake:2".into()),
        topic: String::new(),
    };
    h.add_endpoint(ep).await.expect("add");
    h
}

fn msg(seq: u64, engine: &mut Engine) -> SubEvent {
    let payload = encode_sim(&engine.batch(), 4, seq as f64, WireForm::Map);
    SubEvent::Message(vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload)])
}

/// Lets the runner's tasks run until they wait on something.
async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn reconnects_with_capped_backoff() {
    let fake = Fake::default();
    fake.queue(false);
    fake.queue(false);
    let first = fake.queue(true).expect("ok");
    let second = fake.queue(true).expect("ok");
    let h = start(&fake).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(h.status(KEY).await.expect("stream").connected);
    drop(first);
    settle().await;
    assert!(!h.status(KEY).await.expect("stream").connected, "a closed subscription shows");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(h.status(KEY).await.expect("stream").connected);
    let at = fake.attempts.lock().expect("lock").clone();
    let offsets: Vec<u128> = at.iter().map(|t| (*t - at[0]).as_millis()).collect();
    // Fail, +100 fail, +200 connect; dropped at 400, reconnect after the reset 100.
    assert_eq!(offsets, [0, 100, 300, 500], "backoff doubles, then resets after a success");
    drop(second);
}

#[tokio::test(start_paused = true)]
async fn removal_purges_and_failed_replay_resets() {
    let fake = Fake::default();
    let tx = fake.queue(true).expect("ok");
    let h = start(&fake).await;
    let mut engine = Engine::new(7, 4);
    for seq in [0, 1, 2] {
        tx.send(msg(seq, &mut engine)).await.expect("send");
    }
    settle().await;
    let expected = engine.expected();
    assert_eq!(h.with_sink(|s| s.blocks(KEY)).await.expect("sink"), expected);

    // seq 3 is lost; the replay endpoint refuses, so the worker is cleared and the
    // stream starts over from seq 4. (The replay asked on connecting failed too, but
    // harmlessly: batches 0 to 2 were applied.)
    let _lost = msg(3, &mut engine);
    tx.send(msg(4, &mut Engine::new(9, 4))).await.expect("send");
    settle().await;
    let st = h.status(KEY).await.expect("stream");
    let s = st.seq;
    assert_eq!((s.gaps, s.connect_replays, s.replays_failed, s.resets, st.last_seq), (1, 1, 2, 1, Some(4)));
    assert!(st.trusted);
    let after = h.with_sink(|s| s.blocks(KEY)).await.expect("sink");
    assert!(after.keys().all(|k| !expected.contains_key(k)), "pre-gap entries were cleared");

    h.remove_endpoint(KEY).await.expect("remove");
    assert_eq!(h.status(KEY).await, None);
    assert!(h.with_sink(|s| s.blocks(KEY)).await.expect("sink").is_empty());
    assert!(tx.send(msg(5, &mut engine)).await.is_err(), "the subscription was closed");
}

#[tokio::test(start_paused = true)]
async fn a_resubscribed_stream_keeps_what_it_was_told() {
    let fake = Fake::default();
    let first = fake.queue(true).expect("ok");
    let second = fake.queue(true).expect("ok");
    let h = start(&fake).await;
    let mut engine = Engine::new(7, 4);
    first.send(msg(0, &mut engine)).await.expect("send");
    settle().await;
    // The first subscription stays open but delivers nothing more: replace it.
    h.resubscribe(KEY).await.expect("resubscribe");
    settle().await;
    assert!(first.is_closed(), "the old subscription was dropped");
    second.send(msg(1, &mut engine)).await.expect("send");
    settle().await;
    let st = h.status(KEY).await.expect("stream");
    assert_eq!((st.connected, st.last_seq, st.seq.gaps), (true, Some(1), 0), "{st:?}");
    assert_eq!(h.with_sink(|s| s.blocks(KEY)).await.expect("sink"), engine.expected(), "both batches count");
    assert_eq!(fake.attempts.lock().expect("lock").len(), 2, "one new subscription");
    let other = WorkerKey::new(9, 0);
    assert!(
        matches!(h.resubscribe(other).await, Err(kvroute_events::ingest::IngestError::UnknownStream(k)) if k == other)
    );
}
