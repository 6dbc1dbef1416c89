//! A real publisher process (tests/py/publisher.py: pyzmq XPUB + ROUTER) on
//! loopback, against the zeromq runner. Each test is bounded by deadlines; waiting
//! is polling with a deadline, never a bare sleep.

use std::time::Duration;

use kvroute_events::ingest::StreamStatus;
use kvroute_events::{spawn, EndpointConfig, IngestHandle, RunnerConfig, StreamConfig, ZmqConnector};
use router_core::{BlockSize, WorkerKey};
use serde_json::json;

use crate::support::{Engine, ModelSink, Publisher};

const KEY: WorkerKey = WorkerKey::new(9, 0);
const BLOCK: u32 = 4;

struct Rig {
    publisher: Publisher,
    engine: Engine,
    handle: IngestHandle<ModelSink>,
    last_seq: Option<u64>,
}

impl Rig {
    async fn start(replay_form: &str, seed: u64) -> Rig {
        Rig::start_after(replay_form, seed, 0, RunnerConfig::default()).await
    }

    /// Starts the publisher, lets it publish `before` batches to nobody, then subscribes.
    async fn start_after(replay_form: &str, seed: u64, before: usize, runner: RunnerConfig) -> Rig {
        let mut publisher = Publisher::start(replay_form);
        let mut engine = Engine::new(seed, BLOCK);
        let mut last_seq = None;
        for _ in 0..before {
            last_seq = publish(&mut publisher, &mut engine, true, "map");
        }
        let (handle, _join) = spawn(runner, ZmqConnector::default(), ModelSink::default());
        let ep = EndpointConfig {
            stream: StreamConfig {
                key: KEY,
                block_size: BlockSize::new(BLOCK).expect("4"),
                cache_salt: None,
                blocks_max: 1 << 16,
                has_replay: true,
            },
            endpoint: format!("tcp://127.0.0.1:{}", publisher.pub_port),
            replay_endpoint: Some(format!("tcp://127.0.0.1:{}", publisher.replay_port)),
            topic: String::new(),
        };
        handle.add_endpoint(ep).await.expect("add endpoint");
        // Blocks this (non-runtime) thread until the SUB socket has subscribed.
        assert_eq!(publisher.cmd(json!({"op": "wait_sub"}))["ok"], "wait_sub");
        Rig { publisher, engine, handle, last_seq }
    }

    /// Publishes one engine batch (or only buffers it when `send` is false).
    fn batch(&mut self, send: bool, form: &str) {
        self.last_seq = publish(&mut self.publisher, &mut self.engine, send, form);
    }

    fn raw(&mut self, hex: &str) {
        let r = self.publisher.cmd(json!({"op": "raw", "hex": hex}));
        self.last_seq = r["seq"].as_u64();
    }

    /// Waits until the stream applied the last published seq and is trusted, then
    /// checks the sink against the engine.
    async fn converge(&self) -> StreamStatus {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let st = self.handle.status(KEY).await.expect("stream");
            if st.last_seq == self.last_seq && st.trusted && st.pending_batches == 0 {
                let sink = self.handle.with_sink(|s| s.clone()).await.expect("sink");
                assert_eq!(sink.blocks(KEY), self.engine.expected(), "index equals the engine's cache");
                return st;
            }
            assert!(tokio::time::Instant::now() < deadline, "no convergence: {st:?}, want seq {:?}", self.last_seq);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Converges, then waits (up to 3 s) until every replay asked for has ended; one the
    /// sequencer abandoned never does, and its replies are ignored as stale.
    async fn settle(&self) -> StreamStatus {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        loop {
            let st = self.converge().await;
            let s = &st.seq;
            if s.replays_requested == s.replays_completed + s.replays_failed || tokio::time::Instant::now() > deadline {
                return st;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Publishes one engine batch (or only buffers it when `send` is false); its seq.
fn publish(publisher: &mut Publisher, engine: &mut Engine, send: bool, form: &str) -> Option<u64> {
    let events: Vec<_> = engine.batch().iter().map(|e| e.json(BLOCK)).collect();
    publisher.cmd(json!({"op": "batch", "events": events, "form": form, "send": send}))["seq"].as_u64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_flow_in_both_encodings() {
    let mut rig = Rig::start("topic", 1).await;
    for i in 0..20 {
        rig.batch(true, if i % 2 == 0 { "map" } else { "array" });
    }
    let st = rig.converge().await;
    assert_eq!((st.batches_applied, st.seq.gaps, st.batches_malformed), (20, 0, 0));
    assert!(st.connected);
}

async fn dropped_range_is_replayed(form: &str) {
    let mut rig = Rig::start(form, 2).await;
    for i in 0..15 {
        rig.batch(!(6..10).contains(&i), "map");
    }
    let st = rig.converge().await;
    assert_eq!((st.seq.gaps, st.seq.replays_failed, st.seq.resets), (1, 0, 0), "{st:?}");
    // One replay besides those asked on connecting.
    assert_eq!(st.seq.replays_requested, st.seq.connect_replays + 1, "{st:?}");
}

/// ZeroMQ's slow joiner: a batch published before the subscription reached the
/// publisher never shows in the live stream. The replay asked on connecting brings it,
/// although the publisher stays idle afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_published_before_subscribing_arrives_without_another() {
    let rig = Rig::start_after("topic", 5, 1, RunnerConfig::default()).await;
    let st = rig.converge().await;
    assert_eq!((st.last_seq, st.batches_applied, st.seq.gaps, st.seq.resets), (Some(0), 1, 0, 0), "{st:?}");
    assert!(st.seq.connect_replays >= 1, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_range_is_replayed_topic_framing() {
    dropped_range_is_replayed("topic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_range_is_replayed_vllm_framing() {
    dropped_range_is_replayed("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_clears_and_starts_over() {
    let mut rig = Rig::start("topic", 3).await;
    for _ in 0..8 {
        rig.batch(true, "map");
    }
    rig.converge().await;
    rig.publisher.cmd(json!({"op": "restart"}));
    rig.engine.restart();
    for _ in 0..3 {
        rig.batch(true, "array");
    }
    let st = rig.converge().await;
    assert_eq!((st.seq.restarts, st.last_seq), (1, Some(2)));
}

/// An engine that dies and comes back on its ports after `DOWN` is followed again on
/// the runner's own backoff (capped at 200 ms here), not the socket's built-in one,
/// which by then waits about 13 s between tries (it doubles from 100 ms up to 30 s):
/// without the runner's resubscription, this test waits 10 s and more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restarted_on_its_ports_is_followed_again() {
    const DOWN: Duration = Duration::from_secs(15);
    const RESUBSCRIBED_WITHIN: Duration = Duration::from_secs(5);
    let runner = RunnerConfig { reconnect_backoff_max_ms: 200, ..RunnerConfig::default() };
    let mut rig = Rig::start_after("topic", 6, 0, runner).await;
    for _ in 0..4 {
        rig.batch(true, "map");
    }
    rig.converge().await;
    let (pub_port, replay_port) = (rig.publisher.pub_port, rig.publisher.replay_port);
    rig.publisher.kill();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while rig.handle.status(KEY).await.expect("stream").connected {
        assert!(tokio::time::Instant::now() < deadline, "the runner never saw the publisher go");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(DOWN).await;
    rig.publisher = Publisher::start_at("topic", pub_port, replay_port);
    let back = std::time::Instant::now();
    assert_eq!(rig.publisher.cmd(json!({"op": "wait_sub"}))["ok"], "wait_sub");
    let waited = back.elapsed();
    eprintln!("subscribed again {waited:?} after the publisher came back");
    assert!(waited < RESUBSCRIBED_WITHIN, "subscribed again {waited:?} after the publisher came back");
    rig.engine.restart();
    for _ in 0..3 {
        rig.batch(true, "array");
    }
    let st = rig.converge().await;
    assert_eq!((st.seq.restarts, st.last_seq), (1, Some(2)), "the new run replaces the old one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_a_malformed_payload_are_counted() {
    let mut rig = Rig::start("topic", 4).await;
    for _ in 0..5 {
        rig.batch(true, "map");
    }
    // The connect replay may bring a batch the live stream also brings: count from here.
    let before = rig.settle().await;
    rig.raw("c1ffff");
    for seq in [1, 3, 4] {
        rig.publisher.cmd(json!({"op": "resend", "seq": seq}));
    }
    for _ in 0..5 {
        rig.batch(true, "map");
    }
    let st = rig.converge().await;
    let duplicates = st.seq.duplicates - before.seq.duplicates;
    assert_eq!((duplicates, st.batches_malformed, st.batches_applied), (3, 1, 10), "{st:?}");
    let notices = rig.handle.notices().await;
    assert_eq!(notices.len(), 1, "{notices:?}");
}
