//! The async shell: one task owns the [`IngestCore`] and the sink; one task per
//! endpoint holds its subscription, reconnecting with capped exponential backoff;
//! one short-lived task per replay request. Tasks talk to the owner over bounded
//! channels, so a slow sink slows the sockets (whose high-water marks then drop
//! messages, which shows up as gaps and replays) instead of growing memory.
//!
//! Registration follows the workers: [`IngestHandle::add_endpoint`] subscribes,
//! [`IngestHandle::remove_endpoint`] closes the subscription and purges the worker.

mod tasks;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use router_core::{Instant, WorkerKey};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::frame::{parse_replay, ReplayFrame};
use crate::ingest::{Command, IngestConfig, IngestCore, IngestError, Notice, SilentStream, StreamConfig, StreamStatus};
use crate::sequence::ReplayId;
use crate::translate::EventSink;
use crate::transport::Connector;

/// Runner settings.
#[derive(Clone, Debug)]
pub struct RunnerConfig {
    /// The core's settings.
    pub ingest: IngestConfig,
    /// First reconnect delay. Default 100 ms.
    pub reconnect_backoff_min_ms: u64,
    /// Reconnect delay cap. Default 5,000 ms.
    pub reconnect_backoff_max_ms: u64,
    /// Messages queued from the sockets to the owner task. Default 1,024.
    pub inbox_messages_max: usize,
    /// Notices kept for [`IngestHandle::notices`]; older ones are dropped. Default 256.
    pub notices_max: usize,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        RunnerConfig {
            ingest: IngestConfig::default(),
            reconnect_backoff_min_ms: 100,
            reconnect_backoff_max_ms: 5_000,
            inbox_messages_max: 1_024,
            notices_max: 256,
        }
    }
}

/// One publisher to subscribe to.
#[derive(Clone, Debug)]
pub struct EndpointConfig {
    /// How its stream is translated (`has_replay` is set from `replay_endpoint`).
    pub stream: StreamConfig,
    /// The PUB address, for example `tcp://10.0.0.5:5557` (rank r listens on base + r).
    pub endpoint: String,
    /// The ROUTER replay address, if the engine has one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix; empty for all.
    pub topic: String,
}

type SinkFn<S> = Box<dyn FnOnce(&mut S) + Send>;

enum Control<S> {
    Add(EndpointConfig, oneshot::Sender<Result<(), IngestError>>),
    Remove(WorkerKey, oneshot::Sender<Result<(), IngestError>>),
    Resubscribe(WorkerKey, oneshot::Sender<Result<(), IngestError>>),
    Status(WorkerKey, oneshot::Sender<Option<StreamStatus>>),
    Silent(BTreeMap<WorkerKey, u64>, oneshot::Sender<Vec<SilentStream>>),
    Notices(oneshot::Sender<Vec<Notice>>),
    WithSink(SinkFn<S>),
    Shutdown,
}

enum InputKind {
    Live(Vec<Bytes>),
    Connection(bool),
    Replay(ReplayId, Vec<Bytes>),
    ReplayFailed(ReplayId),
}

struct Input {
    key: WorkerKey,
    /// Registration generation, so a removed endpoint's late messages are ignored.
    gen: u64,
    kind: InputKind,
}

/// Controls a running ingestion; cheap to clone.
pub struct IngestHandle<S> {
    ctl: mpsc::Sender<Control<S>>,
}

impl<S> Clone for IngestHandle<S> {
    fn clone(&self) -> Self {
        IngestHandle { ctl: self.ctl.clone() }
    }
}

/// Starts ingestion on the current tokio runtime. The join handle yields the sink
/// back after [`IngestHandle::shutdown`] (or once every handle is dropped).
pub fn spawn<C: Connector, S: EventSink + Send + 'static>(
    cfg: RunnerConfig,
    connector: C,
    sink: S,
) -> (IngestHandle<S>, JoinHandle<S>) {
    let (ctl, ctl_rx) = mpsc::channel(64);
    let (in_tx, in_rx) = mpsc::channel(cfg.inbox_messages_max.max(1));
    let owner = Owner {
        core: IngestCore::new(cfg.ingest.clone()),
        cfg,
        connector: Arc::new(connector),
        sink,
        start: tokio::time::Instant::now(),
        endpoints: BTreeMap::new(),
        next_gen: 0,
        in_tx,
        notices: VecDeque::new(),
    };
    (IngestHandle { ctl }, tokio::spawn(owner.run(ctl_rx, in_rx)))
}

impl<S: Send + 'static> IngestHandle<S> {
    async fn ask<R>(&self, make: impl FnOnce(oneshot::Sender<R>) -> Control<S>, dead: R) -> R {
        let (tx, rx) = oneshot::channel();
        if self.ctl.send(make(tx)).await.is_err() {
            return dead;
        }
        rx.await.unwrap_or(dead)
    }

    /// Subscribes to a publisher (a worker registered).
    pub async fn add_endpoint(&self, ep: EndpointConfig) -> Result<(), IngestError> {
        self.ask(|tx| Control::Add(ep, tx), Err(IngestError::Stopped)).await
    }

    /// Closes a subscription and purges the worker's entries (a worker left).
    pub async fn remove_endpoint(&self, key: WorkerKey) -> Result<(), IngestError> {
        self.ask(|tx| Control::Remove(key, tx), Err(IngestError::Stopped)).await
    }

    /// Drops a stream's subscription and opens a new one, keeping everything the stream
    /// has delivered: for a subscription that stays connected but delivers nothing (see
    /// [`Self::silent_streams`]). A publisher that lost the subscription, or a
    /// connection a middlebox dropped without a word, then hears it anew.
    pub async fn resubscribe(&self, key: WorkerKey) -> Result<(), IngestError> {
        self.ask(|tx| Control::Resubscribe(key, tx), Err(IngestError::Stopped)).await
    }

    /// A stream's status.
    pub async fn status(&self, key: WorkerKey) -> Option<StreamStatus> {
        self.ask(|tx| Control::Status(key, tx), None).await
    }

    /// Streams silent while their worker served requests; `served_total` holds each
    /// worker's cumulative served-request counter (see [`IngestCore::silent_streams`]).
    pub async fn silent_streams(&self, served_total: BTreeMap<WorkerKey, u64>) -> Vec<SilentStream> {
        self.ask(|tx| Control::Silent(served_total, tx), Vec::new()).await
    }

    /// Notices since the last call (oldest first; at most `notices_max`).
    pub async fn notices(&self) -> Vec<Notice> {
        self.ask(Control::Notices, Vec::new()).await
    }

    /// Runs `f` on the sink inside the owner task and returns its result.
    pub async fn with_sink<R: Send + 'static>(&self, f: impl FnOnce(&mut S) -> R + Send + 'static) -> Option<R> {
        let (tx, rx) = oneshot::channel();
        let job: SinkFn<S> = Box::new(move |s| {
            let _ = tx.send(f(s));
        });
        self.ctl.send(Control::WithSink(job)).await.ok()?;
        rx.await.ok()
    }

    /// Stops every task; the join handle then yields the sink.
    pub async fn shutdown(&self) {
        let _ = self.ctl.send(Control::Shutdown).await;
    }
}

struct Endpoint {
    cfg: EndpointConfig,
    gen: u64,
    sub: JoinHandle<()>,
    replay: Option<JoinHandle<()>>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.sub.abort();
        if let Some(r) = &self.replay {
            r.abort();
        }
    }
}

struct Owner<C, S> {
    core: IngestCore,
    cfg: RunnerConfig,
    connector: Arc<C>,
    sink: S,
    start: tokio::time::Instant,
    endpoints: BTreeMap<WorkerKey, Endpoint>,
    next_gen: u64,
    in_tx: mpsc::Sender<Input>,
    notices: VecDeque<Notice>,
}

impl<C: Connector, S: EventSink + Send + 'static> Owner<C, S> {
    fn now(&self) -> Instant {
        Instant::from_micros(self.start.elapsed().as_micros() as u64)
    }

    async fn run(mut self, mut ctl: mpsc::Receiver<Control<S>>, mut inbox: mpsc::Receiver<Input>) -> S {
        loop {
            let deadline = self.core.poll_timeout().map(|t| self.start + Duration::from_micros(t.as_micros()));
            tokio::select! {
                c = ctl.recv() => match c {
                    Some(Control::Shutdown) | None => break,
                    Some(c) => self.control(c),
                },
                Some(input) = inbox.recv() => self.input(input),
                _ = sleep_until(deadline) => {
                    let now = self.now();
                    self.core.handle_timeout(now, &mut self.sink);
                }
            }
            self.after_input();
        }
        self.endpoints.clear();
        self.sink
    }

    fn control(&mut self, c: Control<S>) {
        match c {
            Control::Add(ep, tx) => {
                let _ = tx.send(self.add(ep));
            }
            Control::Remove(key, tx) => {
                self.endpoints.remove(&key);
                let _ = tx.send(self.core.remove_stream(key, &mut self.sink));
            }
            Control::Resubscribe(key, tx) => {
                let _ = tx.send(self.resubscribe(key));
            }
            Control::Status(key, tx) => {
                let _ = tx.send(self.core.status(key));
            }
            Control::Silent(served, tx) => {
                let now = self.now();
                let _ = tx.send(self.core.silent_streams(now, |k| served.get(&k).copied().unwrap_or(0)));
            }
            Control::Notices(tx) => {
                let _ = tx.send(self.notices.drain(..).collect());
            }
            Control::WithSink(f) => f(&mut self.sink),
            Control::Shutdown => {}
        }
    }

    fn add(&mut self, ep: EndpointConfig) -> Result<(), IngestError> {
        let key = ep.stream.key;
        let now = self.now();
        let stream = StreamConfig { has_replay: ep.replay_endpoint.is_some(), ..ep.stream.clone() };
        self.core.add_stream(now, stream)?;
        let gen = self.next_gen;
        self.next_gen += 1;
        let sub = self.subscribe(key, gen, &ep);
        self.endpoints.insert(key, Endpoint { cfg: ep, gen, sub, replay: None });
        Ok(())
    }

    fn subscribe(&self, key: WorkerKey, gen: u64, ep: &EndpointConfig) -> JoinHandle<()> {
        let backoff = (self.cfg.reconnect_backoff_min_ms, self.cfg.reconnect_backoff_max_ms);
        tokio::spawn(tasks::subscribe(self.connector.clone(), key, gen, ep.clone(), self.in_tx.clone(), backoff))
    }

    /// The same generation: what the old subscription already queued still counts.
    fn resubscribe(&mut self, key: WorkerKey) -> Result<(), IngestError> {
        let Some(ep) = self.endpoints.get(&key) else {
            return Err(IngestError::UnknownStream(key));
        };
        ep.sub.abort();
        let sub = self.subscribe(key, ep.gen, &ep.cfg);
        if let Some(ep) = self.endpoints.get_mut(&key) {
            ep.sub = sub;
        }
        let now = self.now();
        // Down, then up when the new one connects: a stream with a replay endpoint
        // asks for what it missed meanwhile.
        self.core.handle_connection(now, key, false, &mut self.sink)
    }

    fn input(&mut self, input: Input) {
        if self.endpoints.get(&input.key).is_none_or(|e| e.gen != input.gen) {
            return;
        }
        let now = self.now();
        let (key, sink) = (input.key, &mut self.sink);
        // Problems are counted in the stream status and surfaced as notices.
        let _ = match input.kind {
            InputKind::Live(frames) => self.core.handle_live(now, key, &frames, sink),
            InputKind::Connection(up) => self.core.handle_connection(now, key, up, sink),
            InputKind::Replay(id, frames) => self.core.handle_replay(now, key, id, &frames, sink),
            InputKind::ReplayFailed(id) => self.core.handle_replay_failed(now, key, id, sink),
        };
    }

    fn after_input(&mut self) {
        while let Some(Command::Replay { key, id, from }) = self.core.poll_command() {
            self.start_replay(key, id, from);
        }
        while let Some(n) = self.core.poll_notice() {
            if self.notices.len() >= self.cfg.notices_max.max(1) {
                self.notices.pop_front();
            }
            self.notices.push_back(n);
        }
    }

    fn start_replay(&mut self, key: WorkerKey, id: ReplayId, from: u64) {
        let Some(ep) = self.endpoints.get_mut(&key) else {
            return;
        };
        let tx = self.in_tx.clone();
        let Some(addr) = ep.cfg.replay_endpoint.clone() else {
            // `add` derives has_replay from replay_endpoint, so this does not happen;
            // failing the replay beats leaving the gap open until its deadline.
            let gen = ep.gen;
            tokio::spawn(async move {
                let _ = tx.send(Input { key, gen, kind: InputKind::ReplayFailed(id) }).await;
            });
            return;
        };
        if let Some(old) = ep.replay.take() {
            old.abort();
        }
        let timeout = Duration::from_millis(self.cfg.ingest.sequencer.replay_timeout_ms);
        ep.replay = Some(tokio::spawn(tasks::replay(self.connector.clone(), key, ep.gen, id, addr, from, tx, timeout)));
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// True for a replay end marker.
fn is_replay_end(frames: &[Bytes]) -> bool {
    matches!(parse_replay(frames), Ok((ReplayFrame::End, _)))
}
