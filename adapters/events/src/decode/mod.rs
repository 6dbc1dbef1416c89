//! Decoding of one KV-event payload (a msgpack `EventBatch`) into typed events.
//!
//! Both encodings vLLM and SGLang have used are accepted: the batch as a positional
//! array `[ts, events, data_parallel_rank?]` (or, defensively, a map of those names),
//! and each event either as a map tagged by `"type"` or as a positional array whose
//! first element is the tag. Unknown event types and unknown fields are skipped and
//! counted; an event whose fields are well-formed msgpack but carry impossible values
//! (a negative token id, an unknown medium) is dropped alone and counted; a payload
//! whose msgpack structure is broken is rejected whole. Payloads above
//! [`DecodeConfig::event_bytes_max`] are refused before a byte is read.
//!
//! Decoded data lands in a reusable [`Batch`] arena: hashes and token ids of every
//! event share two vectors, so decoding allocates nothing once the arena is warm.
//! What the events mean for the router is left to [`crate::translate`].

mod event;
mod extra;

pub use extra::{ExtraKey, ExtraKeys};

use core::fmt;
use core::ops::Range;
use router_core::Tier;
use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::msgpack::{MsgpackError, Reader};

/// Limits and keys for decoding.
#[derive(Clone, Debug)]
pub struct DecodeConfig {
    /// Payloads longer than this are dropped undecoded. Default 16 MiB.
    pub event_bytes_max: usize,
    /// Seed for folding byte-string engine hashes into [`EngineHash`]. Default 0;
    /// set a random value per process so an engine cannot steer collisions.
    pub engine_hash_seed: u64,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        DecodeConfig { event_bytes_max: 16 << 20, engine_hash_seed: 0 }
    }
}

/// An engine's opaque block hash: a 64-bit int (signed or unsigned, kept apart) or a
/// byte string of any length folded to a seeded 127-bit digest.
///
/// The top bit separates the two kinds, so an int never equals a byte-string digest.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct EngineHash(pub u128);

impl EngineHash {
    const INT_TAG: u128 = 1 << 127;
    const INT_MASK: u128 = (1 << 65) - 1;

    /// The hash of an int hash, or `None` outside `i64::MIN..=u64::MAX`.
    pub fn from_int(v: i128) -> Option<Self> {
        if v < i128::from(i64::MIN) || v > i128::from(u64::MAX) {
            return None;
        }
        // Two's complement in 65 bits keeps -1 and u64::MAX distinct.
        Some(EngineHash(Self::INT_TAG | (v as u128 & Self::INT_MASK)))
    }

    /// The hash of a byte-string hash under `seed`.
    pub fn from_bytes(bytes: &[u8], seed: u64) -> Self {
        EngineHash(xxh3_128_with_seed(bytes, seed) & !Self::INT_TAG)
    }
}

/// Why a payload, or one event in it, was not decoded.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload exceeds `event_bytes_max` and was not read.
    TooLarge {
        /// Payload length in bytes.
        bytes: usize,
        /// The configured limit in bytes.
        max: usize,
    },
    /// The msgpack structure is broken.
    Msgpack(MsgpackError),
    /// The top level is not an `EventBatch` (array or map with `ts` and `events`).
    NotABatch,
    /// An event is neither a map with a string `"type"` nor an array led by a tag.
    BadEvent,
    /// A required field of an event is absent.
    MissingField {
        /// The event type.
        event: &'static str,
        /// The absent field.
        field: &'static str,
    },
    /// A token id is negative or above `u32::MAX`.
    TokenOutOfRange,
    /// An int block hash is outside `i64::MIN..=u64::MAX`.
    HashOutOfRange,
    /// A block size, group index or dp rank is negative or above `u32::MAX`.
    IntOutOfRange {
        /// The field holding it.
        field: &'static str,
    },
    /// `medium` is none of GPU, CPU, STORAGE, DISK or nil.
    UnknownMedium,
    /// `extra_keys` is neither nil nor a list.
    ExtraKeysMalformed,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::TooLarge { bytes, max } => {
                write!(f, "payload of {bytes} bytes exceeds the {max}-byte limit")
            }
            DecodeError::Msgpack(e) => write!(f, "malformed msgpack: {e}"),
            DecodeError::NotABatch => f.write_str("payload is not an EventBatch"),
            DecodeError::BadEvent => f.write_str("event is not a tagged map or array"),
            DecodeError::MissingField { event, field } => {
                write!(f, "{event} lacks required field {field}")
            }
            DecodeError::TokenOutOfRange => f.write_str("token id outside 0..=u32::MAX"),
            DecodeError::HashOutOfRange => f.write_str("int block hash outside 64 bits"),
            DecodeError::IntOutOfRange { field } => write!(f, "{field} outside 0..=u32::MAX"),
            DecodeError::UnknownMedium => f.write_str("unknown medium"),
            DecodeError::ExtraKeysMalformed => f.write_str("extra_keys is neither nil nor a list"),
        }
    }
}

impl std::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DecodeError::Msgpack(e) => Some(e),
            _ => None,
        }
    }
}

impl From<MsgpackError> for DecodeError {
    fn from(e: MsgpackError) -> Self {
        DecodeError::Msgpack(e)
    }
}

/// Counts of what decoding one batch skipped.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct BatchStats {
    /// Fields not known for their event type (or batch), skipped.
    pub unknown_fields: u32,
    /// Events of an unknown type, skipped.
    pub unknown_events: u32,
    /// Events dropped for impossible values; the rest of the batch was kept.
    pub malformed_events: u32,
    /// The first reason an event was dropped, if any.
    pub first_event_error: Option<DecodeError>,
}

/// One decoded event, borrowing from its [`Batch`].
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum EventRef<'b> {
    /// `BlockStored`.
    Stored(StoredRef<'b>),
    /// `BlockRemoved`.
    Removed(RemovedRef<'b>),
    /// `AllBlocksCleared`.
    Cleared,
}

/// A decoded `BlockStored`.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct StoredRef<'b> {
    /// Engine hashes of the stored blocks, in order.
    pub block_hashes: &'b [EngineHash],
    /// Engine hash of the block before the first one, if any.
    pub parent: Option<EngineHash>,
    /// Tokens of every stored block, concatenated.
    pub token_ids: &'b [u32],
    /// Tokens per block, as the engine states it.
    pub block_size: u32,
    /// Where the blocks live (GPU or nil: device; CPU: host; STORAGE/DISK: disk).
    pub tier: Tier,
    /// The LoRA adapter name salting the blocks, if any.
    pub lora_name: Option<&'b str>,
    /// KV-cache group (hybrid models); 0 when absent.
    pub group_idx: u32,
    /// Per-block `extra_keys`, when the event carries them (not nil).
    pub extra_keys: Option<ExtraKeys<'b>>,
}

/// A decoded `BlockRemoved`.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct RemovedRef<'b> {
    /// Engine hashes of the removed blocks.
    pub block_hashes: &'b [EngineHash],
    /// The tier they left.
    pub tier: Tier,
    /// KV-cache group; 0 when absent.
    pub group_idx: u32,
}

#[derive(Clone, Debug)]
enum Event {
    Stored {
        hashes: Range<usize>,
        parent: Option<EngineHash>,
        tokens: Range<usize>,
        block_size: u32,
        tier: Tier,
        lora: Option<Range<usize>>,
        group_idx: u32,
        extra: Option<Range<usize>>,
    },
    Removed {
        hashes: Range<usize>,
        tier: Tier,
        group_idx: u32,
    },
    Cleared,
}

/// A decoded `EventBatch`: a reusable arena; [`decode_batch`] clears it first.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// Publisher timestamp, seconds.
    pub ts: f64,
    /// The publisher's data-parallel rank, when the batch carries one.
    pub dp_rank: Option<u32>,
    /// What was skipped.
    pub stats: BatchStats,
    events: Vec<Event>,
    hashes: Vec<EngineHash>,
    tokens: Vec<u32>,
    names: String,
    /// Per-block spans of `keys`, for every event's `extra_keys`.
    block_keys: Vec<extra::Span>,
    keys: Vec<extra::RawKey>,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of decoded events.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// True when no event was decoded.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The decoded events, in order.
    pub fn events(&self) -> impl Iterator<Item = EventRef<'_>> + '_ {
        self.events.iter().map(|e| self.view(e))
    }

    fn view<'b>(&'b self, e: &Event) -> EventRef<'b> {
        match e {
            Event::Stored { hashes, parent, tokens, block_size, tier, lora, group_idx, extra } => {
                EventRef::Stored(StoredRef {
                    block_hashes: &self.hashes[hashes.clone()],
                    parent: *parent,
                    token_ids: &self.tokens[tokens.clone()],
                    block_size: *block_size,
                    tier: *tier,
                    lora_name: lora.clone().map(|r| &self.names[r]),
                    group_idx: *group_idx,
                    extra_keys: extra.clone().map(|r| self.extra_keys(r)),
                })
            }
            Event::Removed { hashes, tier, group_idx } => EventRef::Removed(RemovedRef {
                block_hashes: &self.hashes[hashes.clone()],
                tier: *tier,
                group_idx: *group_idx,
            }),
            Event::Cleared => EventRef::Cleared,
        }
    }

    fn clear(&mut self) {
        self.ts = 0.0;
        self.dp_rank = None;
        self.stats = BatchStats::default();
        self.events.clear();
        self.hashes.clear();
        self.tokens.clear();
        self.names.clear();
        self.block_keys.clear();
        self.keys.clear();
    }
}

/// Decodes `payload` into `out` (cleared first). Work is linear in `payload.len()`.
///
/// On `Err` the batch must not be applied; `out` may hold a partial decode.
pub fn decode_batch(payload: &[u8], cfg: &DecodeConfig, out: &mut Batch) -> Result<(), DecodeError> {
    out.clear();
    if payload.len() > cfg.event_bytes_max {
        return Err(DecodeError::TooLarge { bytes: payload.len(), max: cfg.event_bytes_max });
    }
    let mut r = Reader::new(payload);
    match r.peek()? {
        0x90..=0x9f | 0xdc | 0xdd => decode_array_batch(&mut r, cfg, out),
        0x80..=0x8f | 0xde | 0xdf => decode_map_batch(&mut r, cfg, out),
        _ => Err(DecodeError::NotABatch),
    }
}

/// The batch timestamp alone, read cheaply (used to tell a restart from a duplicate).
pub fn peek_ts(payload: &[u8]) -> Option<f64> {
    let mut r = Reader::new(payload);
    if let Ok(n) = r.array_len() {
        return if n >= 1 { r.float().ok() } else { None };
    }
    let n = r.map_len().ok()?;
    for _ in 0..n {
        if r.str().ok()? == "ts" {
            return r.float().ok();
        }
        r.skip().ok()?;
    }
    None
}

fn decode_array_batch(r: &mut Reader<'_>, cfg: &DecodeConfig, out: &mut Batch) -> Result<(), DecodeError> {
    let n = r.array_len()?;
    if n < 2 {
        return Err(DecodeError::NotABatch);
    }
    out.ts = r.float().map_err(|_| DecodeError::NotABatch)?;
    event::decode_events(r, cfg, out)?;
    if n >= 3 {
        out.dp_rank = read_rank(r)?;
    }
    for _ in 3..n {
        r.skip()?;
        out.stats.unknown_fields += 1;
    }
    Ok(())
}

fn decode_map_batch(r: &mut Reader<'_>, cfg: &DecodeConfig, out: &mut Batch) -> Result<(), DecodeError> {
    let n = r.map_len()?;
    let (mut ts, mut events) = (false, false);
    for _ in 0..n {
        match r.str()? {
            "ts" => {
                out.ts = r.float().map_err(|_| DecodeError::NotABatch)?;
                ts = true;
            }
            "events" => {
                event::decode_events(r, cfg, out)?;
                events = true;
            }
            "data_parallel_rank" => out.dp_rank = read_rank(r)?,
            _ => {
                r.skip()?;
                out.stats.unknown_fields += 1;
            }
        }
    }
    if !(ts && events) {
        return Err(DecodeError::NotABatch);
    }
    Ok(())
}

fn read_rank(r: &mut Reader<'_>) -> Result<Option<u32>, DecodeError> {
    if r.eat_nil()? {
        return Ok(None);
    }
    let v = r.int()?;
    u32::try_from(v).map(Some).map_err(|_| DecodeError::IntOutOfRange { field: "data_parallel_rank" })
}

#[cfg(test)]
mod tests;
