//! Media in block hashes: the images (or other items) whose placeholder tokens a block
//! holds.
//!
//! vLLM mixes into each block's hash one `("mm", identifier, offset)` key for every
//! media item whose placeholder tokens overlap the block, in the order the items appear
//! in the prompt; `offset` is where the item starts relative to the block's first
//! token, so it is negative for an item that began in an earlier block (see
//! `_gen_mm_extra_hash_keys` in vLLM's `vllm/v1/core/kv_cache_utils.py`). Equal tokens
//! with different images therefore hash apart, and so does the same image at another
//! position.
//!
//! The router keeps its own hash function, so it folds each such key into the block's
//! extra keys as two words: the identifier's 64-bit [`MediaKey`] and the offset as a
//! two's-complement `i64`. Requests (from what the client sent) and KV events (from the
//! keys vLLM publishes) fold the same keys the same way, so their hashes agree.

use alloc::vec::Vec;
use core::fmt;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{chain, local_hash, BlockHash, BlockSize, HashSeed, SeqHash};

/// Seed of [`MediaKey::of`]; any fixed value works, it only has to be shared.
const MEDIA_KEY_SEED: u64 = 0x6d6d; // "mm"

/// The largest `items_max` [`MediaItems::new`] accepts.
pub const MEDIA_ITEMS_MAX: usize = 1024;

/// The router's 64-bit key for one media identifier (vLLM's `identifier` string, for
/// example a hex digest or a client's `multi_modal_uuids` entry).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct MediaKey(pub u64);

impl MediaKey {
    /// The key of `identifier`'s bytes (UTF-8 for vLLM's string identifiers).
    pub fn of(identifier: &[u8]) -> Self {
        MediaKey(xxh3_64_with_seed(identifier, MEDIA_KEY_SEED))
    }

    /// The two extra-key words for this item starting `offset_tokens` after the
    /// block's first token (negative: before it).
    pub fn extra_keys(self, offset_tokens: i64) -> [u64; 2] {
        [self.0, offset_tokens as u64]
    }
}

/// One media item of a prompt: its key and where its placeholder tokens are.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MediaItem {
    /// The item's identifier, as a key.
    pub key: MediaKey,
    /// Index of its first placeholder token in the prompt.
    pub offset_tokens: u32,
    /// Number of placeholder tokens.
    pub len_tokens: u32,
}

impl MediaItem {
    /// An item with `identifier` covering `len_tokens` tokens from `offset_tokens`.
    pub fn new(identifier: &[u8], offset_tokens: u32, len_tokens: u32) -> Self {
        MediaItem { key: MediaKey::of(identifier), offset_tokens, len_tokens }
    }

    fn end_tokens(&self) -> u64 {
        u64::from(self.offset_tokens) + u64::from(self.len_tokens)
    }
}

/// Why a request's media items were refused.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum MediaError {
    /// More items than `items_max` (or `items_max` above [`MEDIA_ITEMS_MAX`]).
    TooMany {
        /// Items given.
        items: usize,
        /// The limit in force.
        items_max: usize,
    },
    /// An item covers no tokens.
    EmptySpan {
        /// The item's position in the list given.
        index: usize,
    },
    /// An item's placeholder tokens run past the end of the prompt.
    OutOfRange {
        /// The item's position in the list given.
        index: usize,
        /// Where its span ends, in tokens.
        end_tokens: u64,
        /// The prompt's length, in tokens.
        prompt_tokens: usize,
    },
    /// Two items' placeholder tokens overlap.
    Overlap {
        /// The position, in the list given, of the later-starting item.
        index: usize,
    },
}

impl fmt::Display for MediaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MediaError::TooMany { items, items_max } => {
                write!(f, "{items} media items, more than the {items_max} allowed")
            }
            MediaError::EmptySpan { index } => write!(f, "media item {index} covers no tokens"),
            MediaError::OutOfRange { index, end_tokens, prompt_tokens } => {
                write!(f, "media item {index} ends at token {end_tokens}, past the prompt's {prompt_tokens} tokens")
            }
            MediaError::Overlap { index } => write!(f, "media item {index} overlaps an earlier one"),
        }
    }
}

impl core::error::Error for MediaError {}

/// A prompt's media items, validated and in prompt order.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct MediaItems {
    items: Vec<MediaItem>,
}

impl MediaItems {
    /// Checks `items` against a prompt of `prompt_tokens` tokens and sorts them by
    /// offset, as vLLM orders a request's items. At most `items_max` items (itself at
    /// most [`MEDIA_ITEMS_MAX`]); each covers at least one token, ends within the
    /// prompt, and overlaps no other. Work is `O(n log n)` in the items.
    pub fn new(mut items: Vec<MediaItem>, prompt_tokens: usize, items_max: usize) -> Result<Self, MediaError> {
        let limit = items_max.min(MEDIA_ITEMS_MAX);
        if items.len() > limit {
            return Err(MediaError::TooMany { items: items.len(), items_max: limit });
        }
        for (index, it) in items.iter().enumerate() {
            if it.len_tokens == 0 {
                return Err(MediaError::EmptySpan { index });
            }
            if it.end_tokens() > prompt_tokens as u64 {
                return Err(MediaError::OutOfRange { index, end_tokens: it.end_tokens(), prompt_tokens });
            }
        }
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&i| items[i].offset_tokens);
        if let Some(w) = order.windows(2).find(|w| items[w[0]].end_tokens() > u64::from(items[w[1]].offset_tokens)) {
            return Err(MediaError::Overlap { index: w[1] });
        }
        items.sort_by_key(|it| it.offset_tokens);
        Ok(MediaItems { items })
    }

    /// No media: hashes exactly as [`super::hash_tokens`] without extra keys.
    pub const fn none() -> Self {
        MediaItems { items: Vec::new() }
    }

    /// The items, in prompt order.
    pub fn items(&self) -> &[MediaItem] {
        &self.items
    }

    /// True when there are no items.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Appends to `out` the extra keys of the block `[start, end)` (in tokens): two
    /// words per item overlapping it, in prompt order. Work is linear in the items.
    pub fn block_extra_keys(&self, start: u64, end: u64, out: &mut Vec<u64>) {
        let mut cursor = 0;
        self.extra_keys_from(&mut cursor, start, end, out);
    }

    /// As [`Self::block_extra_keys`], starting the scan at `*cursor` and leaving it at
    /// the first item that may overlap a later block, so that consecutive blocks cost
    /// linear time in blocks plus items.
    fn extra_keys_from(&self, cursor: &mut usize, start: u64, end: u64, out: &mut Vec<u64>) {
        while let Some(it) = self.items.get(*cursor) {
            if it.end_tokens() <= start {
                *cursor += 1;
                continue;
            }
            break;
        }
        for it in &self.items[*cursor..] {
            if u64::from(it.offset_tokens) >= end {
                break;
            }
            let rel = i64::from(it.offset_tokens) - start as i64;
            out.extend_from_slice(&it.key.extra_keys(rel));
        }
    }
}

/// Hashes every full block of `tokens` as [`super::hash_tokens`] does, with each
/// block's media keys (see the module doc) as its extra keys. Work is linear in the
/// tokens plus the items.
pub fn hash_tokens_with_media(
    tokens: &[u32],
    block_size: BlockSize,
    seed: HashSeed,
    media: &MediaItems,
    out: &mut Vec<BlockHash>,
) {
    let bs = block_size.tokens() as usize;
    let mut prev: Option<SeqHash> = None;
    let mut cursor = 0;
    let mut extra = Vec::new();
    out.reserve(block_size.full_blocks(tokens.len()));
    for (i, block) in tokens.chunks_exact(bs).enumerate() {
        let start = (i * bs) as u64;
        extra.clear();
        media.extra_keys_from(&mut cursor, start, start + bs as u64, &mut extra);
        let local = local_hash(block, &extra, seed);
        let seq = match prev {
            None => SeqHash(local.0),
            Some(p) => chain(p, local),
        };
        out.push(BlockHash { seq, local });
        prev = Some(seq);
    }
}
