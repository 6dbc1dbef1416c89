//! The wire format: one msgpack [`Envelope`] per NATS message, carrying a batch of
//! updates of one kind from one replica for one model.
//!
//! Everything decoded here comes from the network, so decoding is total: malformed
//! bytes, an unknown version, an oversized batch or an impossible phase are a typed
//! [`WireError`], which the caller counts and drops. Stamps travel as wall-clock
//! microseconds since the Unix epoch; the caller maps them onto its router's clock.

use std::fmt;

use router_core::{
    BindStamp, DpRank, Instant, Phase, ReplicaId, ReplicaUpdate, RequestId, SeqHash, WorkerId, WorkerKey,
};
use serde::{Deserialize, Serialize};

/// The version every envelope carries; others are refused.
pub const WIRE_VERSION: u8 = 1;

/// Most updates one envelope may carry; larger batches are split when encoding and
/// refused when decoding.
pub const UPDATES_PER_MESSAGE_MAX: usize = 1024;

/// Most prompt blocks one update may carry; more are cut when encoding and refused when
/// decoding.
pub const BLOCKS_PER_UPDATE_MAX: usize = 4096;

/// Prompt blocks one envelope carries at most, so a message stays far below NATS's
/// default 1 MiB payload limit; batches are split to respect it.
pub const BLOCKS_PER_MESSAGE_MAX: usize = 32_768;

/// One NATS message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// [`WIRE_VERSION`].
    pub v: u8,
    /// The sending replica.
    pub from: u64,
    /// The sender's epoch: it changes when the sender restarts or reconnects, and then
    /// receivers drop everything it said before.
    pub epoch: u64,
    /// The model (pool) the updates are for; empty for heartbeats and goodbyes.
    pub model: String,
    /// The updates, in the order the sender's router made them.
    pub msgs: Vec<Msg>,
}

/// One update, compactly.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// [`ReplicaUpdate::Added`].
    #[serde(rename = "a")]
    Added {
        /// Request id.
        id: u64,
        /// Phase index.
        phase: u8,
        /// Worker id.
        worker: u64,
        /// Dp rank.
        rank: u32,
        /// Prefill tokens.
        prefill: u32,
        /// Predicted output blocks.
        output: u32,
        /// The prompt's sequence hashes.
        blocks: Vec<u64>,
    },
    /// [`ReplicaUpdate::PrefillDone`].
    #[serde(rename = "p")]
    PrefillDone {
        /// Request id.
        id: u64,
        /// Phase index.
        phase: u8,
    },
    /// [`ReplicaUpdate::Finished`].
    #[serde(rename = "f")]
    Finished {
        /// Request id.
        id: u64,
        /// Phase index.
        phase: u8,
    },
    /// [`ReplicaUpdate::Bound`].
    #[serde(rename = "b")]
    Bound {
        /// Session id.
        session: Vec<u8>,
        /// Phase index.
        phase: u8,
        /// Worker id.
        worker: u64,
        /// Dp rank, when bound to one.
        rank: Option<u32>,
        /// Commit time, wall-clock µs since the Unix epoch.
        at_unix_us: u64,
        /// The committing replica.
        replica: u64,
    },
    /// [`ReplicaUpdate::Unbound`].
    #[serde(rename = "u")]
    Unbound {
        /// Session id.
        session: Vec<u8>,
        /// Phase index.
        phase: u8,
        /// Commit time of the binding dropped, wall-clock µs.
        at_unix_us: u64,
        /// Its committing replica.
        replica: u64,
    },
    /// The sender is alive.
    #[serde(rename = "h")]
    Heartbeat,
    /// The sender is leaving: drop everything it said.
    #[serde(rename = "x")]
    Bye,
}

/// Which subject a message goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Load updates.
    Load,
    /// Session bindings.
    Affinity,
    /// Heartbeats and goodbyes.
    Heartbeat,
}

impl Msg {
    /// Prompt blocks it carries.
    pub fn blocks(&self) -> usize {
        match self {
            Msg::Added { blocks, .. } => blocks.len(),
            _ => 0,
        }
    }

    /// The subject kind it travels on.
    pub fn kind(&self) -> Kind {
        match self {
            Msg::Added { .. } | Msg::PrefillDone { .. } | Msg::Finished { .. } => Kind::Load,
            Msg::Bound { .. } | Msg::Unbound { .. } => Kind::Affinity,
            Msg::Heartbeat | Msg::Bye => Kind::Heartbeat,
        }
    }
}

/// Why bytes from the network were refused.
#[derive(Debug)]
#[non_exhaustive]
pub enum WireError {
    /// Not a msgpack envelope.
    Decode(rmp_serde::decode::Error),
    /// An envelope of another version.
    Version {
        /// The version it carried.
        got: u8,
    },
    /// More than [`UPDATES_PER_MESSAGE_MAX`] updates.
    TooManyUpdates {
        /// How many it carried.
        count: usize,
    },
    /// A phase index that names no phase.
    Phase {
        /// The index.
        index: u8,
    },
    /// An update with more than [`BLOCKS_PER_UPDATE_MAX`] prompt blocks.
    TooManyBlocks {
        /// How many it carried.
        count: usize,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Decode(e) => write!(f, "not a replica envelope: {e}"),
            WireError::Version { got } => write!(f, "wire version {got}, expected {WIRE_VERSION}"),
            WireError::TooManyUpdates { count } => {
                write!(f, "{count} updates in one message, at most {UPDATES_PER_MESSAGE_MAX}")
            }
            WireError::Phase { index } => write!(f, "phase index {index} names no phase"),
            WireError::TooManyBlocks { count } => {
                write!(f, "{count} prompt blocks in one update, at most {BLOCKS_PER_UPDATE_MAX}")
            }
        }
    }
}

impl std::error::Error for WireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WireError::Decode(e) => Some(e),
            _ => None,
        }
    }
}

/// Encodes an envelope. Cannot fail for these types; an empty vector would only mean a
/// serializer bug, and is dropped by the receiver as undecodable.
pub fn encode(env: &Envelope) -> Vec<u8> {
    rmp_serde::to_vec(env).unwrap_or_default()
}

/// Decodes and checks an envelope.
pub fn decode(bytes: &[u8]) -> Result<Envelope, WireError> {
    let env: Envelope = rmp_serde::from_slice(bytes).map_err(WireError::Decode)?;
    if env.v != WIRE_VERSION {
        return Err(WireError::Version { got: env.v });
    }
    if env.msgs.len() > UPDATES_PER_MESSAGE_MAX {
        return Err(WireError::TooManyUpdates { count: env.msgs.len() });
    }
    if let Some(count) = env.msgs.iter().map(Msg::blocks).find(|&n| n > BLOCKS_PER_UPDATE_MAX) {
        return Err(WireError::TooManyBlocks { count });
    }
    Ok(env)
}

/// The message for a router update, with stamps mapped to wall time by `unix_us`.
/// `None` for an update kind this version does not carry.
pub fn to_msg(u: &ReplicaUpdate, unix_us: impl Fn(Instant) -> u64) -> Option<Msg> {
    let phase_ix = |p: Phase| p.index() as u8;
    Some(match u {
        ReplicaUpdate::Added { id, phase, key, prefill_tokens, blocks, output_blocks } => Msg::Added {
            id: id.0,
            phase: phase_ix(*phase),
            worker: key.worker.0,
            rank: key.rank.0,
            prefill: *prefill_tokens,
            output: *output_blocks,
            blocks: blocks.iter().take(BLOCKS_PER_UPDATE_MAX).map(|b| b.0).collect(),
        },
        ReplicaUpdate::PrefillDone { id, phase } => Msg::PrefillDone { id: id.0, phase: phase_ix(*phase) },
        ReplicaUpdate::Finished { id, phase } => Msg::Finished { id: id.0, phase: phase_ix(*phase) },
        ReplicaUpdate::Bound { session, phase, worker, rank, stamp } => Msg::Bound {
            session: session.clone(),
            phase: phase_ix(*phase),
            worker: worker.0,
            rank: rank.map(|r| r.0),
            at_unix_us: unix_us(stamp.committed_at),
            replica: stamp.replica.0,
        },
        ReplicaUpdate::Unbound { session, phase, stamp } => Msg::Unbound {
            session: session.clone(),
            phase: phase_ix(*phase),
            at_unix_us: unix_us(stamp.committed_at),
            replica: stamp.replica.0,
        },
        _ => return None,
    })
}

/// The router update a message stands for, with wall-clock stamps mapped onto the
/// router's clock by `instant`. `Ok(None)` for heartbeats and goodbyes.
pub fn to_update(m: Msg, instant: impl Fn(u64) -> Instant) -> Result<Option<ReplicaUpdate>, WireError> {
    let stamp = |at: u64, replica: u64| BindStamp { committed_at: instant(at), replica: ReplicaId(replica) };
    Ok(Some(match m {
        Msg::Added { id, phase, worker, rank, prefill, output, blocks } => ReplicaUpdate::Added {
            id: RequestId(id),
            phase: phase_of(phase)?,
            key: WorkerKey::new(worker, rank),
            prefill_tokens: prefill,
            blocks: blocks.into_iter().map(SeqHash).collect(),
            output_blocks: output,
        },
        Msg::PrefillDone { id, phase } => ReplicaUpdate::PrefillDone { id: RequestId(id), phase: phase_of(phase)? },
        Msg::Finished { id, phase } => ReplicaUpdate::Finished { id: RequestId(id), phase: phase_of(phase)? },
        Msg::Bound { session, phase, worker, rank, at_unix_us, replica } => ReplicaUpdate::Bound {
            session,
            phase: phase_of(phase)?,
            worker: WorkerId(worker),
            rank: rank.map(DpRank),
            stamp: stamp(at_unix_us, replica),
        },
        Msg::Unbound { session, phase, at_unix_us, replica } => {
            ReplicaUpdate::Unbound { session, phase: phase_of(phase)?, stamp: stamp(at_unix_us, replica) }
        }
        Msg::Heartbeat | Msg::Bye => return Ok(None),
    }))
}

fn phase_of(index: u8) -> Result<Phase, WireError> {
    Phase::ALL.get(usize::from(index)).copied().ok_or(WireError::Phase { index })
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use super::*;

    fn env(msgs: Vec<Msg>) -> Envelope {
        Envelope { v: WIRE_VERSION, from: 7, epoch: 3, model: "m".into(), msgs }
    }

    #[track_caller]
    fn check_roundtrip(u: ReplicaUpdate) {
        // A clock offset of one second each way, as between two replicas' drivers.
        let msg = to_msg(&u, |t| t.as_micros() + 1_000_000).expect("carried");
        let bytes = encode(&env(vec![msg]));
        let back = decode(&bytes).expect("decodes").msgs.remove(0);
        let got = to_update(back, |us| Instant::from_micros(us - 1_000_000)).unwrap().unwrap();
        assert_eq!(got, u);
    }

    #[test]
    fn every_update_survives_the_wire() {
        let stamp = BindStamp { committed_at: Instant::from_millis(42), replica: ReplicaId(9) };
        for phase in Phase::ALL {
            let id = RequestId(u64::MAX - 1);
            check_roundtrip(ReplicaUpdate::Added {
                id,
                phase,
                key: WorkerKey::new(3, 2),
                prefill_tokens: 4096,
                blocks: vec![SeqHash(1), SeqHash(u64::MAX)],
                output_blocks: 70,
            });
            check_roundtrip(ReplicaUpdate::PrefillDone { id, phase });
            check_roundtrip(ReplicaUpdate::Finished { id, phase });
            let session = b"caf\xc3\xa9-\x00\xff".to_vec();
            for rank in [None, Some(DpRank(1))] {
                let (worker, session) = (WorkerId(5), session.clone());
                check_roundtrip(ReplicaUpdate::Bound { session, phase, worker, rank, stamp });
            }
            check_roundtrip(ReplicaUpdate::Unbound { session, phase, stamp });
        }
    }

    #[track_caller]
    fn check_refused(bytes: &[u8], want: fn(&WireError) -> bool) {
        match decode(bytes) {
            Err(e) => assert!(want(&e), "wrong error {e}"),
            Ok(env) => panic!("decoded garbage {bytes:?} as {env:?}"),
        }
    }

    #[test]
    fn bad_bytes_are_typed_errors() {
        // The decoder's own error is kept as the source, not flattened into text.
        let undecodable = |e: &WireError| {
            matches!(e, WireError::Decode(_)) && e.source().is_some_and(|s| s.is::<rmp_serde::decode::Error>())
        };
        check_refused(b"", undecodable);
        check_refused(b"\xc1\xc1\xc1", undecodable);
        check_refused(b"{\"v\":1}", undecodable);
        let mut future = env(vec![Msg::Heartbeat]);
        future.v = 2;
        check_refused(&encode(&future), |e| matches!(e, WireError::Version { got: 2 }) && e.source().is_none());
        let flood = env(vec![Msg::Heartbeat; UPDATES_PER_MESSAGE_MAX + 1]);
        check_refused(&encode(&flood), |e| matches!(e, WireError::TooManyUpdates { .. }));
        // Every truncation of a valid envelope is refused, never a panic.
        let good = encode(&env(vec![Msg::Finished { id: 1, phase: 0 }, Msg::Bye]));
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_err(), "prefix of {cut} bytes");
        }
        let huge = Msg::Added {
            id: 1,
            phase: 0,
            worker: 0,
            rank: 0,
            prefill: 0,
            output: 0,
            blocks: vec![7; BLOCKS_PER_UPDATE_MAX + 1],
        };
        check_refused(&encode(&env(vec![huge])), |e| matches!(e, WireError::TooManyBlocks { .. }));
        let bad_phase = Msg::Finished { id: 1, phase: 3 };
        assert!(matches!(to_update(bad_phase, Instant::from_micros), Err(WireError::Phase { index: 3 })));
    }

    #[test]
    fn heartbeats_carry_no_update() {
        assert!(matches!(to_update(Msg::Heartbeat, Instant::from_micros), Ok(None)));
        assert!(matches!(to_update(Msg::Bye, Instant::from_micros), Ok(None)));
        assert_eq!(Msg::Bye.kind(), Kind::Heartbeat);
    }
}
