//! The KV-event path of the soak: a sink that applies what the ingestion core decides
//! to the router and to a plain model of the index, and the wire between publisher and
//! ingestion, which loses, repeats and garbles messages and answers replays late,
//! partly or not at all.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use kvroute_events::ingest::Command;
use kvroute_events::sequence::ReplayId;
use kvroute_events::{EventSink, IngestCore, RouterEvent};
use router_core::{Instant, Router, SeqHash, WorkerId, WorkerKey};

/// What the index must hold: per worker key, the blocks of every event the router
/// accepted, minus removals and clears.
#[derive(Default, Debug)]
pub struct IndexModel {
    pub keys: BTreeMap<WorkerKey, BTreeSet<SeqHash>>,
}

impl IndexModel {
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.keys.retain(|k, _| k.worker != worker);
    }
}

/// Applies ingestion output to the router, mirroring every accepted event in the model.
pub struct Sink<'a> {
    pub router: &'a mut Router,
    pub model: &'a mut IndexModel,
    pub now: Instant,
}

impl EventSink for Sink<'_> {
    fn apply(&mut self, key: WorkerKey, ev: &RouterEvent) {
        if self.router.handle_kv_event(self.now, key, ev.as_index_event()).is_err() {
            return;
        }
        let set = self.model.keys.entry(key).or_default();
        match ev {
            RouterEvent::Stored { blocks, .. } => set.extend(blocks.iter().map(|b| b.seq)),
            RouterEvent::Removed { blocks, .. } => {
                for h in blocks {
                    set.remove(h);
                }
            }
            RouterEvent::Cleared => set.clear(),
        }
    }

    fn clear_worker(&mut self, key: WorkerKey) {
        self.router.handle_kv_clear(key);
        if let Some(set) = self.model.keys.get_mut(&key) {
            set.clear();
        }
    }

    fn set_trusted(&mut self, key: WorkerKey, trusted: bool) {
        self.router.handle_overlap_trust(key, trusted);
    }
}

/// How the wire treats replay requests right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayMode {
    /// Answered at once.
    Serve,
    /// Answered at a later step (or never, if the sequencer times out first).
    Defer,
    /// Refused.
    Fail,
}

/// A replay asked for and not answered yet.
#[derive(Clone, Copy, Debug)]
pub struct PendingReplay {
    pub key: WorkerKey,
    pub id: ReplayId,
    pub from: u64,
}

/// Malformed multipart messages: wrong frame counts and sequence frames of the wrong
/// length. Each must be refused before it reaches the sequencer.
pub fn garbage(pick: u64) -> Vec<Bytes> {
    let seq = Bytes::copy_from_slice(&7u64.to_be_bytes());
    match pick % 4 {
        0 => vec![Bytes::from_static(b"kv@soak")],
        1 => vec![Bytes::from_static(b"kv@soak"), Bytes::from_static(b"\x01\x02\x03"), Bytes::from_static(b"\x92")],
        2 => vec![Bytes::new(), seq.clone(), Bytes::from_static(b"\x92"), Bytes::new()],
        _ => vec![Bytes::new(), seq],
    }
}

/// Drains the ingestion core's commands into `pending` and its notices into a count.
pub fn drain_ingest(ingest: &mut IngestCore, pending: &mut Vec<PendingReplay>) -> u64 {
    while let Some(c) = ingest.poll_command() {
        match c {
            Command::Replay { key, id, from } => pending.push(PendingReplay { key, id, from }),
        }
    }
    let mut notices = 0;
    while ingest.poll_notice().is_some() {
        notices += 1;
    }
    notices
}
