//! One event, in either encoding, into the batch arena.
//!
//! Fields are gathered by name (map form) or by position (array form) into one
//! [`Fields`] accumulator, then checked against the event type. An event that fails
//! is rewound, skipped as a whole, and its arena entries rolled back.

use router_core::Tier;

use super::{Batch, DecodeConfig, DecodeError, EngineHash, Event};
use crate::msgpack::Reader;

/// Every field name either event type has, in the positional order of `BlockStored`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    Locality,
    Ownership,
    SessionId,
}

const STORED: &[Field] = &[
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::SpecKind,
    Field::SlidingWindow,
    Field::Locality,
    Field::Ownership,
    Field::SessionId,
];
const REMOVED: &[Field] = &[Field::BlockHashes, Field::Medium, Field::GroupIdx, Field::Locality, Field::Ownership];
const CLEARED: &[Field] = &[];

fn field_by_name(name: &[u8]) -> Option<Field> {
    Some(match name {
        b"block_hashes" => Field::BlockHashes,
        b"parent_block_hash" => Field::Parent,
        b"token_ids" => Field::TokenIds,
        b"block_size" => Field::BlockSize,
        b"lora_id" => Field::LoraId,
        b"medium" => Field::Medium,
        b"lora_name" => Field::LoraName,
        b"extra_keys" => Field::ExtraKeys,
        b"group_idx" => Field::GroupIdx,
        b"kv_cache_spec_kind" => Field::SpecKind,
        b"kv_cache_spec_sliding_window" => Field::SlidingWindow,
        b"locality" => Field::Locality,
        b"ownership" => Field::Ownership,
        b"session_id" => Field::SessionId,
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

impl Kind {
    fn from_tag(tag: &[u8]) -> Option<Kind> {
        match tag {
            b"BlockStored" => Some(Kind::Stored),
            b"BlockRemoved" => Some(Kind::Removed),
            b"AllBlocksCleared" => Some(Kind::Cleared),
            _ => None,
        }
    }

    fn fields(self) -> &'static [Field] {
        match self {
            Kind::Stored => STORED,
            Kind::Removed => REMOVED,
            Kind::Cleared => CLEARED,
        }
    }
}

#[derive(Default)]
struct Fields {
    hashes: Option<core::ops::Range<usize>>,
    parent: Option<EngineHash>,
    tokens: Option<core::ops::Range<usize>>,
    block_size: Option<u32>,
    tier: Option<Tier>,
    lora: Option<core::ops::Range<usize>>,
    group_idx: u32,
    extra: Option<core::ops::Range<usize>>,
}

struct Mark {
    pos: usize,
    hashes: usize,
    tokens: usize,
    names: usize,
    block_keys: usize,
    keys: usize,
}

/// Decodes the `events` array into `out`.
pub(super) fn decode_events(r: &mut Reader<'_>, cfg: &DecodeConfig, out: &mut Batch) -> Result<(), DecodeError> {
    let n = r.array_len()?;
    out.events.reserve(n.min(1024));
    for _ in 0..n {
        let mark = Mark {
            pos: r.position(),
            hashes: out.hashes.len(),
            tokens: out.tokens.len(),
            names: out.names.len(),
            block_keys: out.block_keys.len(),
            keys: out.keys.len(),
        };
        match decode_event(r, cfg, out) {
            Ok(Some(ev)) => out.events.push(ev),
            Ok(None) => {
                out.rollback(&mark);
                out.stats.unknown_events += 1;
            }
            Err(e) => {
                // Broken structure poisons the rest of the batch; a bad value inside an
                // intact event costs only that event.
                r.rewind(mark.pos);
                r.skip().map_err(|_| e)?;
                out.rollback(&mark);
                out.stats.malformed_events += 1;
                out.stats.first_event_error.get_or_insert(e);
            }
        }
    }
    Ok(())
}

impl Batch {
    fn rollback(&mut self, m: &Mark) {
        self.hashes.truncate(m.hashes);
        self.tokens.truncate(m.tokens);
        self.names.truncate(m.names);
        self.block_keys.truncate(m.block_keys);
        self.keys.truncate(m.keys);
    }
}

fn decode_event(r: &mut Reader<'_>, cfg: &DecodeConfig, out: &mut Batch) -> Result<Option<Event>, DecodeError> {
    let mut f = Fields::default();
    let mut unknown = 0u32;
    let kind = match r.peek()? {
        0x80..=0x8f | 0xde | 0xdf => {
            let Some(kind) = map_event(r, cfg, out, &mut f, &mut unknown)? else {
                return Ok(None);
            };
            kind
        }
        0x90..=0x9f | 0xdc | 0xdd => {
            let n = r.array_len()?;
            if n == 0 {
                return Err(DecodeError::BadEvent);
            }
            let tag = r.str_or_bin().map_err(|_| DecodeError::BadEvent)?;
            let Some(kind) = Kind::from_tag(tag) else {
                for _ in 1..n {
                    r.skip()?;
                }
                return Ok(None);
            };
            for i in 1..n {
                match kind.fields().get(i - 1) {
                    Some(&field) => read_field(r, cfg, out, &mut f, field)?,
                    None => {
                        r.skip()?;
                        unknown += 1;
                    }
                }
            }
            kind
        }
        _ => return Err(DecodeError::BadEvent),
    };
    let ev = build(kind, f)?;
    out.stats.unknown_fields += unknown;
    Ok(Some(ev))
}

/// Reads a map-form event; `None` for an unknown type (already skipped).
fn map_event(
    r: &mut Reader<'_>,
    cfg: &DecodeConfig,
    out: &mut Batch,
    f: &mut Fields,
    unknown: &mut u32,
) -> Result<Option<Kind>, DecodeError> {
    let start = r.position();
    let n = r.map_len()?;
    // msgspec writes the tag first; find it anyway when another writer did not.
    let mut kind = None;
    for _ in 0..n {
        let key = r.str_or_bin()?;
        if key == b"type" {
            kind = Some(Kind::from_tag(r.str_or_bin().map_err(|_| DecodeError::BadEvent)?));
            break;
        }
        r.skip()?;
    }
    let Some(kind) = kind else {
        return Err(DecodeError::BadEvent);
    };
    let Some(kind) = kind else {
        r.rewind(start);
        r.skip()?;
        return Ok(None);
    };
    r.rewind(start);
    r.map_len()?;
    for _ in 0..n {
        let key = r.str_or_bin()?;
        if key == b"type" {
            r.skip()?;
            continue;
        }
        match field_by_name(key).filter(|fl| kind.fields().contains(fl)) {
            Some(field) => read_field(r, cfg, out, f, field)?,
            None => {
                r.skip()?;
                *unknown += 1;
            }
        }
    }
    Ok(Some(kind))
}

fn read_field(
    r: &mut Reader<'_>,
    cfg: &DecodeConfig,
    out: &mut Batch,
    f: &mut Fields,
    field: Field,
) -> Result<(), DecodeError> {
    match field {
        Field::BlockHashes => {
            let start = out.hashes.len();
            let n = r.array_len()?;
            out.hashes.reserve(n);
            for _ in 0..n {
                let h = read_hash(r, cfg)?;
                out.hashes.push(h);
            }
            f.hashes = Some(start..out.hashes.len());
        }
        Field::Parent => {
            f.parent = if r.eat_nil()? { None } else { Some(read_hash(r, cfg)?) };
        }
        Field::TokenIds => {
            let start = out.tokens.len();
            let n = r.array_len()?;
            if !r.u32_array(n, &mut out.tokens)? {
                return Err(DecodeError::TokenOutOfRange);
            }
            f.tokens = Some(start..out.tokens.len());
        }
        Field::BlockSize => f.block_size = Some(read_u32(r, "block_size")?),
        Field::GroupIdx => {
            if !r.eat_nil()? {
                f.group_idx = read_u32(r, "group_idx")?;
            }
        }
        Field::Medium => {
            if !r.eat_nil()? {
                f.tier = Some(tier_of(r.str_or_bin()?)?);
            }
        }
        Field::LoraName => {
            if !r.eat_nil()? {
                let name = r.str()?;
                let start = out.names.len();
                out.names.push_str(name);
                f.lora = Some(start..out.names.len());
            }
        }
        Field::ExtraKeys => f.extra = super::extra::read(r, out)?,
        Field::LoraId
        | Field::SpecKind
        | Field::SlidingWindow
        | Field::Locality
        | Field::Ownership
        | Field::SessionId => r.skip()?,
    }
    Ok(())
}

fn read_hash(r: &mut Reader<'_>, cfg: &DecodeConfig) -> Result<EngineHash, DecodeError> {
    match r.peek()? {
        0xa0..=0xbf | 0xc4..=0xc6 | 0xd9..=0xdb => Ok(EngineHash::from_bytes(r.str_or_bin()?, cfg.engine_hash_seed)),
        _ => EngineHash::from_int(r.int()?).ok_or(DecodeError::HashOutOfRange),
    }
}

fn read_u32(r: &mut Reader<'_>, field: &'static str) -> Result<u32, DecodeError> {
    u32::try_from(r.int()?).map_err(|_| DecodeError::IntOutOfRange { field })
}

fn tier_of(medium: &[u8]) -> Result<Tier, DecodeError> {
    let is = |s: &str| medium.eq_ignore_ascii_case(s.as_bytes());
    if is("GPU") {
        Ok(Tier::Device)
    } else if is("CPU") {
        Ok(Tier::Host)
    } else if is("STORAGE") || is("DISK") {
        Ok(Tier::Disk)
    } else {
        Err(DecodeError::UnknownMedium)
    }
}

fn build(kind: Kind, f: Fields) -> Result<Event, DecodeError> {
    let missing = |event, field| DecodeError::MissingField { event, field };
    Ok(match kind {
        Kind::Stored => Event::Stored {
            hashes: f.hashes.ok_or(missing("BlockStored", "block_hashes"))?,
            parent: f.parent,
            tokens: f.tokens.ok_or(missing("BlockStored", "token_ids"))?,
            block_size: f.block_size.ok_or(missing("BlockStored", "block_size"))?,
            tier: f.tier.unwrap_or(Tier::Device),
            lora: f.lora,
            group_idx: f.group_idx,
            extra: f.extra,
        },
        Kind::Removed => Event::Removed {
            hashes: f.hashes.ok_or(missing("BlockRemoved", "block_hashes"))?,
            tier: f.tier.unwrap_or(Tier::Device),
            group_idx: f.group_idx,
        },
        Kind::Cleared => Event::Cleared,
    })
}
