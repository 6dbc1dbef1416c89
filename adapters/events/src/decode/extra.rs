//! Per-block `extra_keys` of a `BlockStored`: what else vLLM mixed into each block hash.
//!
//! vLLM publishes one entry per block: nil, or a tuple of the LoRA name (every block of
//! an adapter's request), multimodal `(hash, offset)` pairs, the request's `cache_salt`
//! (the first block of a prompt only; later blocks inherit it through the chain) and
//! prompt-embedding digests, in that order (`to_event_extra_keys` publishes them
//! untagged). The router can reproduce strings (names and salts) and media pairs
//! (`[identifier: str, offset: int]`), so a key is kept as one of those or marked
//! opaque; what each string means is [`crate::translate`]'s business.

use core::ops::Range;

use super::{Batch, DecodeError};
use crate::msgpack::Reader;

/// A span of a [`Batch`] arena, in elements.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Span {
    start: u32,
    end: u32,
}

impl Span {
    fn new(r: Range<usize>) -> Self {
        // Arena lengths are bounded by the payload, itself bounded by `event_bytes_max`.
        Span { start: r.start as u32, end: r.end as u32 }
    }

    fn range(self) -> Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// One stored key: a string in the batch's name arena, or something else.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum RawKey {
    Str(Span),
    Media(Span, i64),
    Opaque,
}

/// One item of a block's extra keys.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ExtraKey<'b> {
    /// A UTF-8 string: a LoRA name or a cache salt (or, from older vLLM, a bare
    /// multimodal hash).
    Str(&'b str),
    /// A media item overlapping the block: a `[identifier, offset]` pair with a UTF-8
    /// identifier and an offset that fits `i64`.
    Media {
        /// vLLM's identifier of the item (a digest, or the client's UUID).
        identifier: &'b str,
        /// Where the item starts, relative to the block's first token, in tokens.
        offset_tokens: i64,
    },
    /// Anything else: prompt-embedding bytes, a number, a pair of another shape. The
    /// router cannot compute these from a request.
    Opaque,
}

/// The extra keys of every block of one `BlockStored`, borrowed from its [`Batch`].
///
/// Two values are equal when they hold the same keys block by block.
#[derive(Clone, Copy, Debug)]
pub struct ExtraKeys<'b> {
    blocks: &'b [Span],
    keys: &'b [RawKey],
    names: &'b str,
}

impl<'b> ExtraKeys<'b> {
    /// Number of per-block entries (vLLM sends one per block hash).
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when there are no entries.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The keys of block `i`, in order; empty for a nil entry or past the end.
    pub fn block(&self, i: usize) -> impl Iterator<Item = ExtraKey<'b>> + 'b {
        let keys = self.blocks.get(i).map_or(&[][..], |s| &self.keys[s.range()]);
        let names = self.names;
        keys.iter().map(move |k| match *k {
            RawKey::Str(s) => ExtraKey::Str(&names[s.range()]),
            RawKey::Media(s, offset_tokens) => ExtraKey::Media { identifier: &names[s.range()], offset_tokens },
            RawKey::Opaque => ExtraKey::Opaque,
        })
    }
}

impl PartialEq for ExtraKeys<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && (0..self.len()).all(|i| self.block(i).eq(other.block(i)))
    }
}

impl Eq for ExtraKeys<'_> {}

impl Batch {
    pub(super) fn extra_keys(&self, blocks: Range<usize>) -> ExtraKeys<'_> {
        ExtraKeys { blocks: &self.block_keys[blocks], keys: &self.keys, names: &self.names }
    }
}

/// Reads an `extra_keys` value: `Ok(None)` for nil, else the range of its per-block
/// entries in `out.block_keys`. Allocates at most one arena slot per msgpack item read.
pub(super) fn read(r: &mut Reader<'_>, out: &mut Batch) -> Result<Option<Range<usize>>, DecodeError> {
    if r.eat_nil()? {
        return Ok(None);
    }
    if !matches!(r.peek()?, 0x90..=0x9f | 0xdc | 0xdd) {
        return Err(DecodeError::ExtraKeysMalformed);
    }
    let n = r.array_len()?;
    let first = out.block_keys.len();
    for _ in 0..n {
        let start = out.keys.len();
        read_block(r, out)?;
        out.block_keys.push(Span::new(start..out.keys.len()));
    }
    Ok(Some(first..out.block_keys.len()))
}

/// One block's entry: nil (no keys), a tuple of keys, or (defensively) one bare value.
fn read_block(r: &mut Reader<'_>, out: &mut Batch) -> Result<(), DecodeError> {
    if r.eat_nil()? {
        return Ok(());
    }
    if matches!(r.peek()?, 0x90..=0x9f | 0xdc | 0xdd) {
        let n = r.array_len()?;
        for _ in 0..n {
            read_key(r, out)?;
        }
        return Ok(());
    }
    read_key(r, out)
}

fn read_key(r: &mut Reader<'_>, out: &mut Batch) -> Result<(), DecodeError> {
    let key = match r.peek()? {
        0xa0..=0xbf | 0xd9..=0xdb => utf8(r.str_or_bin()?).map(|s| RawKey::Str(out.name(s))),
        0x92 => media_pair(r, out)?,
        _ => {
            r.skip()?;
            None
        }
    };
    out.keys.push(key.unwrap_or(RawKey::Opaque));
    Ok(())
}

fn utf8(b: &[u8]) -> Option<&str> {
    core::str::from_utf8(b).ok()
}

/// A two-item array: a media key when it is `[str, int]` with a UTF-8 string and an
/// `i64`, else `None` with the whole array consumed.
fn media_pair(r: &mut Reader<'_>, out: &mut Batch) -> Result<Option<RawKey>, DecodeError> {
    let start = r.position();
    r.array_len()?;
    let is_str = matches!(r.peek()?, 0xa0..=0xbf | 0xd9..=0xdb);
    let is_int = |r: &Reader<'_>| r.peek().map(|m| matches!(m, 0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3));
    if is_str {
        let id = r.str_or_bin()?;
        if let (Some(id), true) = (utf8(id), is_int(r)?) {
            if let Ok(offset) = i64::try_from(r.int()?) {
                return Ok(Some(RawKey::Media(out.name(id), offset)));
            }
            return Ok(None);
        }
    }
    r.rewind(start);
    r.skip()?;
    Ok(None)
}

impl Batch {
    /// Copies `s` into the name arena.
    fn name(&mut self, s: &str) -> Span {
        let start = self.names.len();
        self.names.push_str(s);
        Span::new(start..self.names.len())
    }
}
