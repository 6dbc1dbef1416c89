//! The KV event publisher: a ZeroMQ PUB socket for live batches and an optional ROUTER
//! socket that replays buffered ones, both owned by one task.
//!
//! The engine task hands over batches through a bounded queue; this task numbers them
//! (from 0), encodes them ([`crate::wire`]), sends `[topic, seq, payload]` and keeps the
//! last `replay_batches_max` payloads for replay. It ends, after draining the queue, when
//! the engine task drops its sender. A PUB socket drops messages for subscribers that are
//! not connected yet, as ZeroMQ does; subscribers fill gaps through the replay socket.

use std::collections::VecDeque;

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{Endpoint, PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::metrics::Metrics;
use crate::wire::{encode_batch, WireEvent, END_SEQ};
use crate::SimServerError;

/// One engine step's events, as the engine task hands them over.
pub(crate) struct Batch {
    /// Wall-clock Unix seconds.
    pub(crate) ts: f64,
    pub(crate) events: Vec<WireEvent>,
}

/// Bound sockets, before the task starts.
pub(crate) struct Publisher {
    pub_socket: PubSocket,
    replay: Option<RouterSocket>,
    topic: Bytes,
    dp_rank: u32,
    buffer: VecDeque<(u64, Bytes)>,
    buffer_max: usize,
    next_seq: u64,
    metrics: Metrics,
}

/// Ports the sockets actually bound.
pub(crate) struct BoundPorts {
    pub(crate) events: u16,
    pub(crate) replay: Option<u16>,
}

impl Publisher {
    /// Binds the PUB socket (and the ROUTER socket if `replay_port` is set).
    pub(crate) async fn bind(
        cfg: &crate::SimServerConfig,
        metrics: Metrics,
    ) -> Result<(Self, BoundPorts), SimServerError> {
        let mut pub_socket = PubSocket::new();
        let events = bind_one(&mut pub_socket, "events", &cfg.events_bind, cfg.events_port).await?;
        let (replay, replay_port) = match cfg.replay_port {
            Some(port) => {
                let mut r = RouterSocket::new();
                let p = bind_one(&mut r, "replay", &cfg.events_bind, port).await?;
                (Some(r), Some(p))
            }
            None => (None, None),
        };
        let publisher = Publisher {
            pub_socket,
            replay,
            topic: Bytes::from(cfg.topic.clone().into_bytes()),
            dp_rank: cfg.dp_rank,
            buffer: VecDeque::with_capacity(cfg.replay_batches_max.min(1024)),
            buffer_max: cfg.replay_batches_max,
            next_seq: 0,
            metrics,
        };
        Ok((publisher, BoundPorts { events, replay: replay_port }))
    }

    /// Publishes until `rx` is closed and drained.
    pub(crate) async fn run(mut self, mut rx: mpsc::Receiver<Batch>) {
        loop {
            let replay_request = async {
                match self.replay.as_mut() {
                    Some(r) => r.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                batch = rx.recv() => match batch {
                    Some(b) => self.publish(b).await,
                    None => break,
                },
                req = replay_request => match req {
                    Ok(m) => self.serve_replay(m).await,
                    Err(e) => tracing::debug!(error = %e, "replay socket receive failed"),
                },
            }
        }
    }

    async fn publish(&mut self, b: Batch) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Bytes::from(encode_batch(b.ts, &b.events, Some(self.dp_rank)));
        let frames = vec![self.topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
        if let Ok(msg) = ZmqMessage::try_from(frames) {
            if let Err(e) = self.pub_socket.send(msg).await {
                tracing::warn!(error = %e, seq, "publishing a KV event batch failed");
            }
        }
        self.metrics.event_batches.inc();
        if self.buffer_max > 0 {
            if self.buffer.len() == self.buffer_max {
                self.buffer.pop_front();
            }
            self.buffer.push_back((seq, payload));
        }
    }

    /// Answers `[identity, "", start_seq]` with every buffered batch from `start_seq` on,
    /// then the end marker. Malformed requests are ignored, as vLLM does.
    async fn serve_replay(&mut self, m: ZmqMessage) {
        let frames = m.into_vec();
        let [id, _empty, start] = frames.as_slice() else {
            tracing::warn!(frames = frames.len(), "replay request ignored: want 3 frames");
            return;
        };
        if start.len() > 8 {
            tracing::warn!(bytes = start.len(), "replay request ignored: start seq longer than 8 bytes");
            return;
        }
        let start_seq = start.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
        let Some(replay) = self.replay.as_mut() else {
            return;
        };
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start_seq) {
            let frames = vec![
                id.clone(),
                Bytes::new(),
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ];
            if !send_frames(replay, frames).await {
                return;
            }
        }
        let end = vec![id.clone(), Bytes::new(), Bytes::new(), Bytes::copy_from_slice(&END_SEQ), Bytes::new()];
        send_frames(replay, end).await;
    }
}

async fn send_frames(socket: &mut RouterSocket, frames: Vec<Bytes>) -> bool {
    let Ok(msg) = ZmqMessage::try_from(frames) else {
        return false;
    };
    match socket.send(msg).await {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, "replay reply failed (peer gone?)");
            false
        }
    }
}

async fn bind_one<S: Socket>(s: &mut S, name: &'static str, host: &str, port: u16) -> Result<u16, SimServerError> {
    let endpoint = format!("tcp://{}:{port}", crate::server::bracket(host));
    match s.bind(&endpoint).await {
        Ok(Endpoint::Tcp(_, p)) => Ok(p),
        Ok(other) => {
            Err(SimServerError::ZmqBind { socket: name, endpoint, message: format!("bound {other}, not tcp") })
        }
        Err(e) => Err(SimServerError::ZmqBind { socket: name, endpoint, message: e.to_string() }),
    }
}
