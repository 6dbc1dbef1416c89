//! The sans-IO ingestion core: one stream per publisher, from raw ZeroMQ frames to
//! [`EventSink`] calls. No sockets, no clock, no tasks.
//!
//! Calling order, as in quinn-proto: feed an input (`handle_live`, `handle_replay`,
//! `handle_replay_failed`, `handle_connection`, `handle_timeout`), then drain
//! [`IngestCore::poll_command`] (replay requests to carry out) and
//! [`IngestCore::poll_notice`] (things to report) until `None`, then sleep until
//! [`IngestCore::poll_timeout`]. Index updates go to the sink passed to each input.
//! Streams are added and removed as workers register and leave; removal purges.
//! Report every connection change: a stream with a replay endpoint that connects
//! before anything was applied asks for a replay from 0 at once (see
//! [`crate::sequence`]), so a publisher idle after its first batches is not missed.
//!
//! A stream is named by the [`WorkerKey`] it was registered under. A batch that carries
//! a `data_parallel_rank` is filed under that rank of the same worker (at most
//! `ranks_max_per_stream` ranks per stream), otherwise under the registered rank.

mod apply;

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use core::fmt;
use router_core::{BlockSize, DpRank, Instant, WorkerKey};

use crate::decode::{peek_ts, Batch, DecodeConfig, DecodeError};
use crate::frame::{parse_live, parse_replay, FrameError, ReplayFrame};
use crate::sequence::{ReplayId, SeqStats, Sequencer, SequencerConfig};
use crate::translate::{EventSink, RouterEvent, TranslateError, Translator};

/// Settings shared by every stream.
#[derive(Clone, Debug)]
pub struct IngestConfig {
    /// Payload limits and the engine-hash seed.
    pub decode: DecodeConfig,
    /// Gap, replay and restart handling.
    pub sequencer: SequencerConfig,
    /// Streams at most. Default 4,096.
    pub streams_max: usize,
    /// Distinct dp ranks one stream may report. Default 16.
    pub ranks_max_per_stream: usize,
    /// KV-cache group tracked (see [`crate::translate::TranslateConfig::kv_group`]). Default 0.
    pub kv_group: u32,
    /// Seed of the translators' hash maps. Default 0; set per process.
    pub map_seed: u64,
    /// A stream quiet this long while its worker serves requests is reported.
    /// Default 30,000 ms.
    pub silent_after_ms: u64,
    /// Requests served during the silence before it is reported. Default 1.
    pub silent_requests_min: u64,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            decode: DecodeConfig::default(),
            sequencer: SequencerConfig::default(),
            streams_max: 4_096,
            ranks_max_per_stream: 16,
            kv_group: 0,
            map_seed: 0,
            silent_after_ms: 30_000,
            silent_requests_min: 1,
        }
    }
}

/// One publisher as registered.
#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// The worker and the rank its batches default to.
    pub key: WorkerKey,
    /// The block size the router hashes with.
    pub block_size: BlockSize,
    /// The worker's cache salt, if any.
    pub cache_salt: Option<String>,
    /// Engine hashes remembered per rank (about the worker's KV capacity in blocks).
    pub blocks_max: usize,
    /// Whether a replay endpoint exists to fill gaps.
    pub has_replay: bool,
}

/// Why an input was refused or a batch not applied.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum IngestError {
    /// No stream is registered under this key.
    UnknownStream(WorkerKey),
    /// A stream is already registered under this key.
    DuplicateStream(WorkerKey),
    /// `streams_max` streams exist already.
    TooManyStreams,
    /// The message is not a stream frame.
    Frame(FrameError),
    /// The payload did not decode.
    Decode(DecodeError),
    /// An event could not be translated.
    Translate(TranslateError),
    /// The batch names a rank beyond `ranks_max_per_stream`.
    TooManyRanks,
    /// The runner has shut down; nothing was done.
    Stopped,
}

impl fmt::Display for IngestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IngestError::UnknownStream(k) => write!(f, "no stream registered for {k}"),
            IngestError::DuplicateStream(k) => write!(f, "stream {k} is already registered"),
            IngestError::TooManyStreams => f.write_str("stream limit reached"),
            IngestError::Frame(e) => write!(f, "bad frame: {e}"),
            IngestError::Decode(e) => write!(f, "bad payload: {e}"),
            IngestError::Translate(e) => write!(f, "untranslatable event: {e}"),
            IngestError::TooManyRanks => f.write_str("too many dp ranks on one stream"),
            IngestError::Stopped => f.write_str("the ingestion runner has stopped"),
        }
    }
}

impl std::error::Error for IngestError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            IngestError::Frame(e) => Some(e),
            IngestError::Decode(e) => Some(e),
            IngestError::Translate(e) => Some(e),
            _ => None,
        }
    }
}

/// Work for the I/O layer.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Command {
    /// Ask `key`'s replay endpoint for batches from `from` on; report under `id`.
    Replay {
        /// The stream.
        key: WorkerKey,
        /// Pass back with every reply.
        id: ReplayId,
        /// First sequence number wanted.
        from: u64,
    },
}

/// Something worth reporting (rate: at most one per dropped batch or event).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Notice {
    /// The stream concerned.
    pub key: WorkerKey,
    /// What happened.
    pub error: IngestError,
    /// True for a configuration error, reported only the first time per stream.
    pub config: bool,
}

/// A stream's health, for status pages and metrics.
#[derive(Clone, PartialEq, Debug, Default)]
pub struct StreamStatus {
    /// Whether the transport reports a live connection.
    pub connected: bool,
    /// Whether the index entries are trusted (false while a gap is open).
    pub trusted: bool,
    /// Last applied sequence number.
    pub last_seq: Option<u64>,
    /// Publisher timestamp of the last applied batch, seconds.
    pub last_ts: Option<f64>,
    /// When the last message of any kind arrived.
    pub last_message_at: Option<Instant>,
    /// Batches held while a gap is open.
    pub pending_batches: usize,
    /// Batches decoded and applied.
    pub batches_applied: u64,
    /// Batches whose frame or payload was malformed.
    pub batches_malformed: u64,
    /// Engine events applied.
    pub events_applied: u64,
    /// Engine events dropped (untranslatable or malformed).
    pub events_dropped: u64,
    /// Engine events of unknown types, skipped.
    pub events_unknown: u64,
    /// Unknown fields skipped.
    pub fields_unknown: u64,
    /// Blocks indexed with media keys (images) folded into their hashes.
    pub blocks_media: u64,
    /// Blocks kept out of the index because their extra keys (audio, video, prompt
    /// embeddings, unknown shapes) or a parent's cannot be reproduced from a request.
    pub blocks_unmatchable: u64,
    /// The first configuration error, kept until the stream is re-added.
    pub config_error: Option<TranslateError>,
    /// Sequencing counters.
    pub seq: SeqStats,
}

impl StreamStatus {
    /// Seconds between the last applied batch's publisher timestamp and `wall_now_s`
    /// (both Unix time), in ms; `None` before the first batch. Clock skew shows here.
    pub fn lag_ms(&self, wall_now_s: f64) -> Option<u64> {
        self.last_ts.map(|ts| ((wall_now_s - ts).max(0.0) * 1000.0) as u64)
    }
}

/// A stream silent while its worker serves traffic.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct SilentStream {
    /// The stream.
    pub key: WorkerKey,
    /// Time since its last message, ms.
    pub silent_ms: u64,
    /// Requests the worker served meanwhile (as far as the counters tell).
    pub requests: u64,
}

struct Stream {
    cfg: StreamConfig,
    seq: Sequencer<Bytes>,
    ranks: BTreeMap<DpRank, Translator>,
    status: StreamStatus,
    /// The caller's served-requests counter when a message last arrived, and whether
    /// one arrived since the last silence check.
    served_base: Option<u64>,
    heard_since_check: bool,
    added_at: Instant,
}

/// The ingestion core over every registered stream.
pub struct IngestCore {
    cfg: IngestConfig,
    streams: BTreeMap<WorkerKey, Stream>,
    batch: Batch,
    scratch: Vec<RouterEvent>,
    commands: VecDeque<Command>,
    notices: VecDeque<Notice>,
}

impl IngestCore {
    /// A core with no streams.
    pub fn new(cfg: IngestConfig) -> Self {
        IngestCore {
            cfg,
            streams: BTreeMap::new(),
            batch: Batch::new(),
            scratch: Vec::new(),
            commands: VecDeque::new(),
            notices: VecDeque::new(),
        }
    }

    /// Registers a stream.
    pub fn add_stream(&mut self, now: Instant, cfg: StreamConfig) -> Result<(), IngestError> {
        if self.streams.contains_key(&cfg.key) {
            return Err(IngestError::DuplicateStream(cfg.key));
        }
        if self.streams.len() >= self.cfg.streams_max {
            return Err(IngestError::TooManyStreams);
        }
        let seq = Sequencer::new(self.cfg.sequencer.clone(), cfg.has_replay);
        let status = StreamStatus { trusted: true, ..StreamStatus::default() };
        let stream = Stream {
            cfg,
            seq,
            ranks: BTreeMap::new(),
            status,
            served_base: None,
            heard_since_check: false,
            added_at: now,
        };
        self.streams.insert(stream.cfg.key, stream);
        Ok(())
    }

    /// Unregisters a stream and purges every rank it reported from the sink.
    pub fn remove_stream(&mut self, key: WorkerKey, sink: &mut impl EventSink) -> Result<(), IngestError> {
        let stream = self.streams.remove(&key).ok_or(IngestError::UnknownStream(key))?;
        for k in stream_keys(&stream) {
            sink.clear_worker(k);
        }
        Ok(())
    }

    /// Registered stream keys, in order.
    pub fn streams(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.streams.keys().copied()
    }

    /// A stream's status.
    pub fn status(&self, key: WorkerKey) -> Option<StreamStatus> {
        let s = self.streams.get(&key)?;
        let mut st = s.status.clone();
        st.last_seq = s.seq.last_seq();
        st.last_ts = s.seq.last_ts();
        st.pending_batches = s.seq.pending();
        st.seq = *s.seq.stats();
        Some(st)
    }

    /// The transport connected (`true`) or lost its connection (`false`). Connecting
    /// before anything was applied may ask for a replay from 0 (see
    /// [`SequencerConfig::connect_replay`]).
    pub fn handle_connection(
        &mut self,
        now: Instant,
        key: WorkerKey,
        connected: bool,
        sink: &mut impl EventSink,
    ) -> Result<(), IngestError> {
        let stream = self.streams.get_mut(&key).ok_or(IngestError::UnknownStream(key))?;
        stream.status.connected = connected;
        stream.seq.handle_connection(now, connected);
        self.drain(key, sink)
    }

    /// A live message `[topic, seq, payload]` from `key`'s publisher.
    ///
    /// Returns the first problem met (also counted in the status); the stream goes on.
    pub fn handle_live(
        &mut self,
        now: Instant,
        key: WorkerKey,
        frames: &[Bytes],
        sink: &mut impl EventSink,
    ) -> Result<(), IngestError> {
        let stream = self.streams.get_mut(&key).ok_or(IngestError::UnknownStream(key))?;
        heard(stream, now);
        let (seq, at) = match parse_live(frames) {
            Ok(p) => p,
            Err(e) => {
                stream.status.batches_malformed += 1;
                return Err(IngestError::Frame(e));
            }
        };
        let payload = frames[at].clone();
        stream.seq.handle_live(now, seq, peek_ts(&payload), payload);
        self.drain(key, sink)
    }

    /// A reply to replay `id` of `key`.
    pub fn handle_replay(
        &mut self,
        now: Instant,
        key: WorkerKey,
        id: ReplayId,
        frames: &[Bytes],
        sink: &mut impl EventSink,
    ) -> Result<(), IngestError> {
        let stream = self.streams.get_mut(&key).ok_or(IngestError::UnknownStream(key))?;
        heard(stream, now);
        match parse_replay(frames) {
            Ok((ReplayFrame::End, _)) => stream.seq.handle_replay_end(now, id),
            Ok((ReplayFrame::Batch { seq, .. }, at)) => {
                let payload = frames[at].clone();
                stream.seq.handle_replay(now, id, seq, peek_ts(&payload), payload);
            }
            Err(e) => {
                stream.status.batches_malformed += 1;
                stream.seq.handle_replay_failed(now, id);
                self.drain(key, sink)?;
                return Err(IngestError::Frame(e));
            }
        }
        self.drain(key, sink)
    }

    /// Replay `id` of `key` could not be carried out.
    pub fn handle_replay_failed(
        &mut self,
        now: Instant,
        key: WorkerKey,
        id: ReplayId,
        sink: &mut impl EventSink,
    ) -> Result<(), IngestError> {
        let stream = self.streams.get_mut(&key).ok_or(IngestError::UnknownStream(key))?;
        stream.seq.handle_replay_failed(now, id);
        self.drain(key, sink)
    }

    /// Time passed. Spurious calls are harmless. Work is linear in the stream count.
    pub fn handle_timeout(&mut self, now: Instant, sink: &mut impl EventSink) {
        let due: Vec<WorkerKey> = self
            .streams
            .iter()
            .filter(|(_, s)| s.seq.poll_timeout().is_some_and(|t| t <= now))
            .map(|(k, _)| *k)
            .collect();
        for key in due {
            if let Some(s) = self.streams.get_mut(&key) {
                s.seq.handle_timeout(now);
            }
            // A decode problem here has been counted and noticed already.
            let _ = self.drain(key, sink);
        }
    }

    /// When [`IngestCore::handle_timeout`] is next due.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.streams.values().filter_map(|s| s.seq.poll_timeout()).min()
    }

    /// The next replay to carry out.
    #[must_use]
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// The next thing to report.
    #[must_use]
    pub fn poll_notice(&mut self) -> Option<Notice> {
        self.notices.pop_front()
    }

    /// Streams quiet for `silent_after_ms` while their worker served at least
    /// `silent_requests_min` requests.
    ///
    /// `served_total` gives each worker's cumulative served-request counter (any
    /// monotonic count the router keeps). Call this periodically: a stream's baseline
    /// is the counter seen at the first check after its last message. Work is linear
    /// in the stream count.
    pub fn silent_streams(
        &mut self,
        now: Instant,
        mut served_total: impl FnMut(WorkerKey) -> u64,
    ) -> Vec<SilentStream> {
        let mut out = Vec::new();
        for (key, s) in &mut self.streams {
            let total = served_total(*key);
            if s.heard_since_check || s.served_base.is_none() {
                s.served_base = Some(total);
                s.heard_since_check = false;
                continue;
            }
            let since = s.status.last_message_at.unwrap_or(s.added_at);
            let silent_ms = now.micros_since(since) / 1000;
            let requests = total.saturating_sub(s.served_base.unwrap_or(total));
            if silent_ms >= self.cfg.silent_after_ms && requests >= self.cfg.silent_requests_min {
                out.push(SilentStream { key: *key, silent_ms, requests });
            }
        }
        out
    }
}

fn heard(stream: &mut Stream, now: Instant) {
    stream.status.last_message_at = Some(now);
    stream.heard_since_check = true;
}

/// Every key a stream may have touched: its own and each rank it reported.
fn stream_keys(s: &Stream) -> Vec<WorkerKey> {
    let mut keys: Vec<WorkerKey> = s.ranks.keys().map(|r| WorkerKey { worker: s.cfg.key.worker, rank: *r }).collect();
    if !s.ranks.contains_key(&s.cfg.key.rank) {
        keys.push(s.cfg.key);
    }
    keys.sort();
    keys
}

#[cfg(test)]
mod tests;
