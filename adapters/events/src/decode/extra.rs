//! Per-block `extra_keys` of a `BlockStored`: what else vLLM mixed into each block hash.
//!
//! vLLM publishes one entry per block: nil, or a tuple of the LoRA name (every block of
//! an adapter's request), multimodal `(hash, offset)` pairs, the request's `cache_salt`
//! (the first block of a prompt only; later blocks inherit it through the chain) and
//! prompt-embedding digests, in that order. The router can reproduce strings (names and
//! salts) and nothing else, so a key is kept as a string or marked opaque; what each
//! string means is [`crate::translate`]'s business.

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
    Opaque,
}

/// One item of a block's extra keys.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ExtraKey<'b> {
    /// A UTF-8 string: a LoRA name or a cache salt (or, from older vLLM, a bare
    /// multimodal hash).
    Str(&'b str),
    /// Anything else: a multimodal `(hash, offset)` pair, prompt-embedding bytes, a
    /// number. The router cannot compute these from a request's tokens.
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
    if matches!(r.peek()?, 0xa0..=0xbf | 0xd9..=0xdb) {
        if let Ok(s) = core::str::from_utf8(r.str_or_bin()?) {
            let start = out.names.len();
            out.names.push_str(s);
            out.keys.push(RawKey::Str(Span::new(start..out.names.len())));
            return Ok(());
        }
    } else {
        r.skip()?;
    }
    out.keys.push(RawKey::Opaque);
    Ok(())
}
