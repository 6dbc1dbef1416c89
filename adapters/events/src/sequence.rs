//! The per-publisher sequencing state machine: what to apply, when to ask for a
//! replay, and when to give up and start over. Pure: no I/O, no clock, no decoding.
//!
//! A publisher numbers its batches 0, 1, 2, … . Inputs are live batches
//! ([`Sequencer::handle_live`]), replayed batches and the replay's end or failure,
//! connection changes ([`Sequencer::handle_connection`]) and time
//! ([`Sequencer::handle_timeout`]). Outputs come from [`Sequencer::poll_output`],
//! drained until `None` after every input, in order:
//!
//! * A live batch numbered `last + 1` is applied.
//! * One numbered `≤ last` is a duplicate and dropped, unless it is a restart: its
//!   timestamp is newer than the last applied batch's (a duplicate carries its
//!   original, older timestamp), or it lies `restart_backstep_seqs` or more behind.
//!   A restart clears the worker and joins the new run as a first batch does (below):
//!   one numbered above 0 asks for a replay from 0, since after a reconnect the new
//!   run's first batches are lost to ZeroMQ's slow joiner.
//! * One numbered `> last + 1` opens a gap. With a replay endpoint the sequencer marks
//!   the worker untrusted, asks for a replay from `last + 1`, and holds live batches
//!   (at most `pending_batches_max`) until the replay fills the hole; then it applies
//!   them in order and trusts the worker again. A replay that ends with a hole left
//!   after the stream moved forward (more live batches went missing while it ran) is
//!   followed by another, at most `replay_attempts_max` per gap. One that makes no progress,
//!   skips a sequence number (the publisher's buffer no longer reaches back), fails
//!   or times out resets: clear the worker, then start over from the held batches.
//!   Without a replay endpoint a gap resets at once.
//!
//! The first batch ever seen, if numbered above 0, asks for a replay from 0 (when the
//! number is within `join_replay_seqs_max`); otherwise, or after a reset, a batch is
//! applied whatever its number: history before it is unknown, so the index
//! under-reports until the engine stores blocks again.
//!
//! A restarted publisher first seen at a number above `last + 1` cannot be told from a
//! gap; the replay then brings the new publisher's batches, which is what it holds.
//! While a gap is open, a batch (live or replayed) whose timestamp is newer than a held
//! batch numbered after it is a restart too: the held batches are the previous run's,
//! and applying them on top of the new run would announce blocks no engine holds.
//!
//! Connecting ([`Sequencer::handle_connection`]) before anything was applied asks for a
//! replay from 0 at once (a connect replay, `connect_replay`), so batches lost to
//! ZeroMQ's slow-joiner effect arrive even if the publisher then stays idle:
//! * Its batches are applied in order; a first one above 0 is where the publisher's
//!   buffer starts and is applied as the new start. Live batches that follow on are
//!   applied too, duplicates on either side dropped.
//! * A live batch beyond the next expected one abandons it and is sequenced as if it
//!   had not been asked: it joins (nothing applied yet) or opens a gap (not counted as
//!   one if it is the first live batch), with a replay asked now, since the connect
//!   replay may have been answered before that batch was published.
//! * Otherwise its end, failure or timeout just closes it (the latter two counted as
//!   failed): no hole is known, so no reset, no clear, and the worker stays trusted;
//!   the next live batch is sequenced as usual (a first one above 0 asks to join).
//! * One that ends with still nothing applied is followed by one more, once per
//!   connect, `connect_replay_interval_ms` after it was asked: it catches a batch
//!   published after the first was answered but before the subscription reached the
//!   publisher. Only a batch published in that window later than that is missed
//!   until the next live batch.
//! * A reconnect with still nothing applied asks again; one after batches were applied
//!   asks nothing (gaps then show in the numbers), nor does a connect while any replay
//!   runs, so at most one is outstanding. Connect replays start at least
//!   `connect_replay_interval_ms` apart: a connect sooner asks when the interval ends,
//!   unless disconnected or no longer needed by then. A disconnect does not cancel a
//!   running one.

use std::collections::{BTreeMap, VecDeque};

use router_core::Instant;

/// Sequencing limits.
#[derive(Clone, Debug)]
pub struct SequencerConfig {
    /// How long a replay may take before the sequencer resets. Default 2,000 ms.
    pub replay_timeout_ms: u64,
    /// Live batches held while a gap is open; one more resets. Default 4,096.
    pub pending_batches_max: usize,
    /// A batch this far behind the last one is a restart even with an old timestamp.
    /// Default 10,000 (vLLM's replay buffer depth: no genuine duplicate is older).
    pub restart_backstep_seqs: u64,
    /// Follow-up replays asked for one gap. A replay that made progress but ended
    /// with a hole left (live batches skipped more while it ran) is followed by
    /// another from the new hole; one that made no progress resets. Default 8.
    pub replay_attempts_max: u32,
    /// A first-ever batch numbered `1..=` this asks for a replay from 0, so joining
    /// a young publisher, or losing its first messages to ZeroMQ's slow-joiner
    /// effect, still yields the whole history. 0 disables. Default 10,000.
    pub join_replay_seqs_max: u64,
    /// Ask for a replay from 0 on connecting while nothing was applied yet, so a
    /// publisher that published right before or as we subscribed and then went idle is
    /// not missed (see the module docs). Needs a replay endpoint. Default true.
    pub connect_replay: bool,
    /// Connect replays start at least this far apart, so a flapping connection cannot
    /// flood the publisher; a connect sooner asks when the interval ends. Also the delay
    /// of the one follow-up after an empty connect replay. Default 1,000 ms.
    pub connect_replay_interval_ms: u64,
}

impl Default for SequencerConfig {
    fn default() -> Self {
        SequencerConfig {
            replay_timeout_ms: 2_000,
            pending_batches_max: 4_096,
            restart_backstep_seqs: 10_000,
            replay_attempts_max: 8,
            join_replay_seqs_max: 10_000,
            connect_replay: true,
            connect_replay_interval_ms: 1_000,
        }
    }
}

/// Names one replay request, so batches of an abandoned replay are ignored.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct ReplayId(pub u64);

/// What the caller must do next.
#[derive(Clone, PartialEq, Debug)]
pub enum SeqOutput<P> {
    /// Apply this batch to the index.
    Apply {
        /// Its sequence number.
        seq: u64,
        /// The batch.
        payload: P,
    },
    /// Forget everything known about the worker.
    Clear,
    /// Mark the worker's index entries (un)trusted.
    Trusted(bool),
    /// Ask the publisher's replay endpoint for every batch from `from` on.
    RequestReplay {
        /// Pass back with the replayed batches.
        id: ReplayId,
        /// First sequence number wanted.
        from: u64,
    },
}

/// Counters.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct SeqStats {
    /// Batches handed out to apply.
    pub applied: u64,
    /// Batches dropped as already applied.
    pub duplicates: u64,
    /// Gaps seen in the live stream.
    pub gaps: u64,
    /// Replays asked for (connect replays included).
    pub replays_requested: u64,
    /// Replays asked for on connecting (see [`SequencerConfig::connect_replay`]).
    pub connect_replays: u64,
    /// Replays that closed their gap, and connect replays that ended.
    pub replays_completed: u64,
    /// Replays that ended early, skipped, failed or timed out.
    pub replays_failed: u64,
    /// Worker cleared because history could not be recovered.
    pub resets: u64,
    /// Publisher restarts detected.
    pub restarts: u64,
    /// Replayed batches ignored because their replay was abandoned.
    pub stale_replay: u64,
}

struct Recovery<P> {
    id: ReplayId,
    deadline: Instant,
    pending: BTreeMap<u64, (Option<f64>, P)>,
    /// Replays asked for this gap so far.
    attempts: u32,
    /// Where the current replay starts; the gap moved if `next_seq` passed it.
    from: u64,
    /// A connect replay: it holds nothing, no hole is known and the worker was not
    /// marked untrusted.
    connect: bool,
}

/// Sequencing of one publisher's stream.
pub struct Sequencer<P> {
    cfg: SequencerConfig,
    has_replay: bool,
    last: Option<u64>,
    last_ts: Option<f64>,
    /// Nothing has arrived yet.
    fresh: bool,
    recovery: Option<Recovery<P>>,
    /// When the last connect replay was asked for.
    connect_at: Option<Instant>,
    /// When a connect replay put off by the interval is due.
    connect_due: Option<Instant>,
    /// Whether an empty connect replay may be followed by one more (once per connect).
    connect_follow_up: bool,
    next_id: u64,
    out: VecDeque<SeqOutput<P>>,
    stats: SeqStats,
}

impl<P> Sequencer<P> {
    /// A sequencer that has seen nothing; `has_replay` says whether gaps can be filled.
    pub fn new(cfg: SequencerConfig, has_replay: bool) -> Self {
        Sequencer {
            cfg,
            has_replay,
            last: None,
            last_ts: None,
            fresh: true,
            recovery: None,
            connect_at: None,
            connect_due: None,
            connect_follow_up: false,
            next_id: 0,
            out: VecDeque::new(),
            stats: SeqStats::default(),
        }
    }

    /// The last applied sequence number.
    pub fn last_seq(&self) -> Option<u64> {
        self.last
    }

    /// The timestamp of the last applied batch that had a readable one.
    pub fn last_ts(&self) -> Option<f64> {
        self.last_ts
    }

    /// Live batches held while a gap is open.
    pub fn pending(&self) -> usize {
        self.recovery.as_ref().map_or(0, |r| r.pending.len())
    }

    /// True while a gap is open.
    pub fn recovering(&self) -> bool {
        self.recovery.is_some()
    }

    /// The counters.
    pub fn stats(&self) -> &SeqStats {
        &self.stats
    }

    /// The next output; drain until `None` after every input.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<SeqOutput<P>> {
        self.out.pop_front()
    }

    /// When [`Sequencer::handle_timeout`] is next due.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.recovery.as_ref().map(|r| r.deadline).into_iter().chain(self.connect_due).min()
    }

    /// The transport connected (`true`) or lost its connection (`false`). Connecting
    /// before anything was applied may ask for a connect replay (see the module docs).
    pub fn handle_connection(&mut self, now: Instant, connected: bool) {
        self.connect_due = None;
        if connected {
            self.connect_follow_up = true;
            self.connect_replay(now);
        }
    }

    fn connect_replay(&mut self, now: Instant) {
        if !self.cfg.connect_replay || !self.has_replay || self.stats.applied > 0 || self.recovery.is_some() {
            return;
        }
        if let Some(at) = self.connect_at {
            let due = at.add_ms(self.cfg.connect_replay_interval_ms);
            // A clock that went backwards does not hold the replay off.
            if now >= at && now < due {
                self.connect_due = Some(due);
                return;
            }
        }
        self.connect_at = Some(now);
        self.stats.connect_replays += 1;
        let (id, pending) = (ReplayId(0), BTreeMap::new());
        self.recovery = Some(Recovery { id, deadline: now, pending, attempts: 0, from: 0, connect: true });
        self.request_replay(now, 0);
    }

    /// A batch from the live stream, with its timestamp if readable.
    pub fn handle_live(&mut self, now: Instant, seq: u64, ts: Option<f64>, payload: P) {
        let first = core::mem::take(&mut self.fresh);
        if let Some(last) = self.last {
            if seq <= last {
                if self.is_restart(last, seq, ts) {
                    self.restart_live(now, seq, ts, payload);
                } else {
                    self.stats.duplicates += 1;
                }
                return;
            }
        }
        let next = self.next_seq();
        if self.held_are_older(seq, ts) {
            self.restart_live(now, seq, ts, payload);
            return;
        }
        // A connect replay holds nothing: a batch that follows on is applied at once, one
        // beyond abandons it for a replay asked now, as the old one may predate the batch.
        if seq != next && self.recovery.as_ref().is_some_and(|r| r.connect) {
            self.recovery = None;
        }
        if let Some(rec) = self.recovery.as_mut().filter(|r| !r.connect) {
            if rec.pending.len() >= self.cfg.pending_batches_max && !rec.pending.contains_key(&seq) {
                self.fail_recovery(now);
                self.handle_live(now, seq, ts, payload);
                return;
            }
            if rec.pending.insert(seq, (ts, payload)).is_some() {
                self.stats.duplicates += 1;
            }
            self.advance();
            return;
        }
        let join = first && self.has_replay && seq > 0 && seq <= self.cfg.join_replay_seqs_max;
        if seq == next || (self.last.is_none() && !join) {
            self.apply(seq, ts, payload);
            return;
        }
        // Not a gap if the connect replay brought batches the live stream never had.
        if self.last.is_some() && !first {
            self.stats.gaps += 1;
        }
        if !self.has_replay {
            self.reset();
            self.apply(seq, ts, payload);
            return;
        }
        let mut pending = BTreeMap::new();
        pending.insert(seq, (ts, payload));
        let (id, deadline) = (ReplayId(0), now);
        self.recovery = Some(Recovery { id, deadline, pending, attempts: 0, from: next, connect: false });
        self.out.push_back(SeqOutput::Trusted(false));
        self.request_replay(now, next);
    }

    /// The sequence number expected next (0 before anything was applied).
    fn next_seq(&self) -> u64 {
        self.last.map_or(0, |l| l + 1)
    }

    fn request_replay(&mut self, now: Instant, from: u64) {
        let Some(rec) = &mut self.recovery else {
            return;
        };
        rec.id = ReplayId(self.next_id);
        rec.deadline = now.add_ms(self.cfg.replay_timeout_ms);
        rec.attempts += 1;
        rec.from = from;
        self.next_id += 1;
        self.stats.replays_requested += 1;
        self.out.push_back(SeqOutput::RequestReplay { id: rec.id, from });
    }

    /// A batch from replay `id`.
    pub fn handle_replay(&mut self, now: Instant, id: ReplayId, seq: u64, ts: Option<f64>, payload: P) {
        if !self.is_current(id) {
            self.stats.stale_replay += 1;
            return;
        }
        let next = self.next_seq();
        if seq < next {
            self.stats.duplicates += 1;
        } else if seq == next && self.held_are_older(seq, ts) {
            self.restart(seq, ts, payload);
        } else if seq == next || (self.last.is_none() && self.recovery.as_ref().is_some_and(|r| r.connect)) {
            // A connect replay starting above 0: the publisher's buffer starts there.
            self.apply(seq, ts, payload);
            self.advance();
        } else {
            // The publisher's buffer no longer reaches back to the hole.
            self.stats.replays_failed += 1;
            self.fail_recovery(now);
        }
    }

    /// Replay `id` sent its end marker.
    pub fn handle_replay_end(&mut self, now: Instant, id: ReplayId) {
        if !self.is_current(id) {
            return;
        }
        if self.recovery.as_ref().is_some_and(|r| r.connect) {
            self.recovery = None;
            self.stats.replays_completed += 1;
            if core::mem::take(&mut self.connect_follow_up) {
                self.connect_replay(now);
            }
            return;
        }
        // Had the gap closed, `advance` would have ended the recovery: a hole is left.
        // Worth another replay only if the stream moved forward meanwhile (by replay
        // or by late live batches): then the hole is newer than this replay.
        let retry = self
            .recovery
            .as_ref()
            .is_some_and(|r| self.next_seq() > r.from && r.attempts < self.cfg.replay_attempts_max);
        if retry {
            self.request_replay(now, self.next_seq());
        } else {
            self.stats.replays_failed += 1;
            self.fail_recovery(now);
        }
    }

    /// Replay `id` could not be done (no connection, transport error): reset (a
    /// connect replay just ends).
    pub fn handle_replay_failed(&mut self, now: Instant, id: ReplayId) {
        if self.is_current(id) {
            self.stats.replays_failed += 1;
            self.fail_recovery(now);
        }
    }

    /// Time passed; a replay past its deadline resets (a connect replay just ends), and
    /// a put-off connect replay is asked for. Spurious calls are harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.recovery.as_ref().is_some_and(|r| r.deadline <= now) {
            self.stats.replays_failed += 1;
            self.fail_recovery(now);
        }
        if self.connect_due.is_some_and(|d| d <= now) {
            self.connect_due = None;
            self.connect_replay(now);
        }
    }

    fn is_current(&self, id: ReplayId) -> bool {
        self.recovery.as_ref().is_some_and(|r| r.id == id)
    }

    fn is_restart(&self, last: u64, seq: u64, ts: Option<f64>) -> bool {
        let newer = matches!((ts, self.last_ts), (Some(t), Some(lt)) if t > lt);
        newer || last - seq >= self.cfg.restart_backstep_seqs
    }

    /// Whether a batch held after `seq` is older than `ts`: then the publisher restarted
    /// while the gap was open. Linear in the held batches after `seq`.
    fn held_are_older(&self, seq: u64, ts: Option<f64>) -> bool {
        let (Some(rec), Some(t)) = (&self.recovery, ts) else {
            return false;
        };
        let after = (core::ops::Bound::Excluded(seq), core::ops::Bound::Unbounded);
        rec.pending.range(after).any(|(_, (held, _))| held.is_some_and(|h| t > h))
    }

    fn apply(&mut self, seq: u64, ts: Option<f64>, payload: P) {
        self.last = Some(seq);
        if ts.is_some() {
            self.last_ts = ts;
        }
        self.stats.applied += 1;
        self.out.push_back(SeqOutput::Apply { seq, payload });
    }

    /// Applies held batches that have become contiguous; closes the gap when none wait.
    /// A connect replay holds nothing and closes at its end instead.
    fn advance(&mut self) {
        loop {
            let next = self.next_seq();
            let Some(rec) = self.recovery.as_mut().filter(|r| !r.connect) else {
                return;
            };
            let Some(entry) = rec.pending.first_entry() else {
                self.recovery = None;
                self.stats.replays_completed += 1;
                self.out.push_back(SeqOutput::Trusted(true));
                return;
            };
            let seq = *entry.key();
            if seq > next {
                return;
            }
            let (ts, payload) = entry.remove();
            if seq < next {
                self.stats.duplicates += 1;
            } else {
                self.apply(seq, ts, payload);
            }
        }
    }

    fn reset(&mut self) {
        self.stats.resets += 1;
        self.last = None;
        self.last_ts = None;
        self.out.push_back(SeqOutput::Clear);
    }

    /// A restart seen in a replay: clear, and apply the batch as the new start.
    fn restart(&mut self, seq: u64, ts: Option<f64>, payload: P) {
        self.forget_run();
        self.apply(seq, ts, payload);
    }

    /// What every restart does first: count it, drop any recovery and clear the worker.
    fn forget_run(&mut self) {
        self.stats.restarts += 1;
        let was_untrusted = self.recovery.take().is_some_and(|r| !r.connect);
        self.reset();
        if was_untrusted {
            self.out.push_back(SeqOutput::Trusted(true));
        }
    }

    /// A restart seen on the live stream: clear, then join the new run as a first batch
    /// does, so a batch numbered above 0 asks for the ones the new run published before
    /// the subscription reached it (lost to ZeroMQ's slow joiner after a reconnect).
    fn restart_live(&mut self, now: Instant, seq: u64, ts: Option<f64>, payload: P) {
        self.forget_run();
        self.fresh = true;
        self.handle_live(now, seq, ts, payload);
    }

    /// Gives up on the hole: clear, trust the (empty) state, replay held live batches.
    /// A connect replay knows of no hole and holds nothing: it just ends.
    fn fail_recovery(&mut self, now: Instant) {
        let Some(rec) = self.recovery.take().filter(|r| !r.connect) else {
            return;
        };
        self.reset();
        self.out.push_back(SeqOutput::Trusted(true));
        for (seq, (ts, payload)) in rec.pending {
            self.handle_live(now, seq, ts, payload);
        }
    }
}

#[cfg(test)]
mod tests;
