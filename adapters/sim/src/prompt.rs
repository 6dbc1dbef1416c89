//! A request's prompt as the engines and the router see it: block hashes computed once.
//!
//! A [`Prompt`] holds the full-block hashes of the prompt at one engine block size
//! (shared behind an `Arc`, so the router and the engine read the same slice) and the
//! trailing partial block's token ids, which an engine needs to hash that block once
//! decoding fills it. Hashing is router-core's [`hash_tokens`](router_core::hash_tokens), so the engines and the
//! router agree bit for bit. Tokenization and trace parsing are left to others.
//!
//! Hashing here is a faster route to exactly router-core's [`hash_tokens`](router_core::hash_tokens) (its chain
//! step is reused; the local hash is the same `xxh3_64_with_seed` over the same bytes,
//! written into a reused buffer), checked against it by the tests. A prompt holding
//! images ([`Prompt::from_tokens_with_media`]) hashes through router-core's
//! [`hash_tokens_with_media`] itself, the call the router makes for the same request.

use std::fmt;
use std::sync::Arc;

use router_core::{chain, hash_tokens_with_media, BlockHash, BlockSize, HashSeed, LocalHash, MediaItems, SeqHash};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// First token id of the range reserved for generated tokens. Prompt token ids must be
/// below it, so a generated block can never match a prompt block.
pub const OUTPUT_TOKEN_ID_BASE: u32 = 1 << 31;

/// The longest prompt accepted, in tokens.
pub const PROMPT_TOKENS_MAX: u32 = 1 << 24;

/// Why a prompt could not be built.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PromptError {
    /// A token id is in the range reserved for generated tokens.
    ReservedTokenId {
        /// Position of the token in the prompt.
        index: usize,
        /// The refused id.
        id: u32,
    },
    /// The prompt is longer than [`PROMPT_TOKENS_MAX`].
    TooLong {
        /// The prompt length, in tokens.
        tokens: u64,
    },
    /// The hash ids cover fewer tokens than the input length.
    HashIdsTooShort {
        /// Input length, in tokens.
        input_tokens: u32,
        /// Tokens the hash ids cover.
        covered_tokens: u64,
    },
    /// The trace block size is zero.
    ZeroTraceBlock,
}

impl fmt::Display for PromptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PromptError::ReservedTokenId { index, id } => {
                write!(f, "token {index} has id {id}, in the range reserved for generated tokens")
            }
            PromptError::TooLong { tokens } => {
                write!(f, "prompt of {tokens} tokens is longer than {PROMPT_TOKENS_MAX}")
            }
            PromptError::HashIdsTooShort { input_tokens, covered_tokens } => {
                write!(f, "hash ids cover {covered_tokens} tokens, fewer than the input length {input_tokens}")
            }
            PromptError::ZeroTraceBlock => f.write_str("trace block size is zero"),
        }
    }
}

impl std::error::Error for PromptError {}

/// A hashed prompt: full-block hashes plus the partial tail's token ids.
#[derive(Clone, Debug)]
pub struct Prompt {
    blocks: Arc<[BlockHash]>,
    tail: Arc<[u32]>,
    /// Media keys of the block the tail starts (an image may end inside it), which
    /// decoding fills; empty without media.
    tail_extra_keys: Arc<[u64]>,
    block_size: BlockSize,
    seed: HashSeed,
}

impl Prompt {
    /// Hashes `tokens` at `block_size`. Work is linear in the prompt length.
    pub fn from_tokens(tokens: &[u32], block_size: BlockSize, seed: HashSeed) -> Result<Self, PromptError> {
        Self::check_tokens(tokens)?;
        let bs = block_size.tokens() as usize;
        let mut blocks = Vec::with_capacity(tokens.len() / bs);
        let mut bytes = Vec::with_capacity(bs * 4);
        let mut prev = None;
        for block in tokens.chunks_exact(bs) {
            let local = local_of(block, seed, &mut bytes);
            prev = Some(push_chained(&mut blocks, prev, local));
        }
        let full = blocks.len() * bs;
        Ok(Prompt { blocks: blocks.into(), tail: tokens[full..].into(), tail_extra_keys: empty(), block_size, seed })
    }

    /// Hashes `tokens` holding `media`'s placeholder tokens: each block with the keys of
    /// the items it overlaps, as vLLM does (router-core's [`hash_tokens_with_media`]).
    /// `media` must have been built for these tokens. Work is linear in the prompt
    /// length plus the items.
    pub fn from_tokens_with_media(
        tokens: &[u32],
        block_size: BlockSize,
        seed: HashSeed,
        media: &MediaItems,
    ) -> Result<Self, PromptError> {
        if media.is_empty() {
            return Self::from_tokens(tokens, block_size, seed);
        }
        Self::check_tokens(tokens)?;
        let mut blocks = Vec::with_capacity(block_size.full_blocks(tokens.len()));
        hash_tokens_with_media(tokens, block_size, seed, media, &mut blocks);
        let full = (blocks.len() * block_size.tokens() as usize) as u64;
        let mut tail_keys = Vec::new();
        media.block_extra_keys(full, full + u64::from(block_size.tokens()), &mut tail_keys);
        let tail = tokens[full as usize..].into();
        Ok(Prompt { blocks: blocks.into(), tail, tail_extra_keys: tail_keys.into(), block_size, seed })
    }

    fn check_tokens(tokens: &[u32]) -> Result<(), PromptError> {
        if tokens.len() as u64 > u64::from(PROMPT_TOKENS_MAX) {
            return Err(PromptError::TooLong { tokens: tokens.len() as u64 });
        }
        match tokens.iter().enumerate().find(|(_, &t)| t >= OUTPUT_TOKEN_ID_BASE) {
            Some((index, &id)) => Err(PromptError::ReservedTokenId { index, id }),
            None => Ok(()),
        }
    }

    /// Expands a trace's hash ids (each id becomes `trace_block_tokens` copies of token
    /// id `id`, truncated to `input_tokens`) and hashes the result at `block_size`.
    ///
    /// `scratch` is reused between calls so a long trace expands without reallocating.
    pub fn from_hash_ids(
        hash_ids: &[u32],
        input_tokens: u32,
        trace_block_tokens: u32,
        block_size: BlockSize,
        seed: HashSeed,
        scratch: &mut Vec<u32>,
    ) -> Result<Self, PromptError> {
        if trace_block_tokens == 0 {
            return Err(PromptError::ZeroTraceBlock);
        }
        if input_tokens > PROMPT_TOKENS_MAX {
            return Err(PromptError::TooLong { tokens: u64::from(input_tokens) });
        }
        let covered = hash_ids.len() as u64 * u64::from(trace_block_tokens);
        if covered < u64::from(input_tokens) {
            return Err(PromptError::HashIdsTooShort { input_tokens, covered_tokens: covered });
        }
        if let Some(t) = hash_ids.iter().position(|&id| id >= OUTPUT_TOKEN_ID_BASE) {
            let index = t * trace_block_tokens as usize;
            return Err(PromptError::ReservedTokenId { index, id: hash_ids[t] });
        }
        let bs = block_size.tokens();
        if !trace_block_tokens.is_multiple_of(bs) {
            scratch.clear();
            let mut left = input_tokens as usize;
            for &id in hash_ids {
                if left == 0 {
                    break;
                }
                let n = left.min(trace_block_tokens as usize);
                scratch.resize(scratch.len() + n, id);
                left -= n;
            }
            return Prompt::from_tokens(scratch, block_size, seed);
        }
        // Every engine block lies inside one trace block, so it is `bs` copies of one
        // id: hash that once per trace block.
        let full_blocks = (input_tokens / bs) as usize;
        let per_trace = (trace_block_tokens / bs) as usize;
        let mut blocks = Vec::with_capacity(full_blocks);
        let mut prev = None;
        let mut bytes = Vec::with_capacity(bs as usize * 4);
        for (t, &id) in hash_ids.iter().enumerate() {
            let first = t * per_trace;
            if first >= full_blocks {
                break;
            }
            scratch.clear();
            scratch.resize(bs as usize, id);
            let local = local_of(scratch, seed, &mut bytes);
            for _ in first..(first + per_trace).min(full_blocks) {
                prev = Some(push_chained(&mut blocks, prev, local));
            }
        }
        let tail_len = (input_tokens % bs) as usize;
        let tail: Vec<u32> = if tail_len == 0 {
            Vec::new()
        } else {
            let start = full_blocks * bs as usize;
            (start..start + tail_len).map(|pos| hash_ids[pos / trace_block_tokens as usize]).collect()
        };
        Ok(Prompt { blocks: blocks.into(), tail: tail.into(), tail_extra_keys: empty(), block_size, seed })
    }

    /// Full-block hashes, in order; share this `Arc` with the router.
    pub fn blocks(&self) -> &Arc<[BlockHash]> {
        &self.blocks
    }

    /// Token ids of the trailing partial block (shorter than one block).
    pub fn tail(&self) -> &[u32] {
        &self.tail
    }

    /// The extra keys of the block that starts with the tail: the media keys of an image
    /// that ends inside it (empty when none does).
    pub fn tail_extra_keys(&self) -> &[u64] {
        &self.tail_extra_keys
    }

    /// The block size the hashes were computed at.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// The hash seed (LoRA / cache-salt) the hashes were computed with.
    pub fn seed(&self) -> HashSeed {
        self.seed
    }

    /// Prompt length in tokens.
    pub fn len_tokens(&self) -> u32 {
        // Both terms are bounded by PROMPT_TOKENS_MAX at construction.
        (self.blocks.len() * self.block_size.tokens() as usize + self.tail.len()) as u32
    }
}

fn empty() -> Arc<[u64]> {
    Arc::from(Vec::new())
}

/// router-core's local hash (`xxh3_64_with_seed` of the tokens as little-endian u32),
/// through a reused buffer.
fn local_of(tokens: &[u32], seed: HashSeed, bytes: &mut Vec<u8>) -> LocalHash {
    bytes.clear();
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    LocalHash(xxh3_64_with_seed(bytes, seed.0))
}

fn push_chained(out: &mut Vec<BlockHash>, prev: Option<SeqHash>, local: LocalHash) -> SeqHash {
    let seq = match prev {
        None => SeqHash(local.0),
        Some(p) => chain(p, local),
    };
    out.push(BlockHash { seq, local });
    seq
}

#[cfg(test)]
mod tests {
    use super::*;
    use router_core::hash_tokens;

    #[track_caller]
    fn check_hash_ids(ids: &[u32], input: u32, want_blocks: usize, want_tail: &[u32]) {
        let mut scratch = Vec::new();
        let p = Prompt::from_hash_ids(ids, input, 512, BlockSize::DEFAULT, HashSeed::DEFAULT, &mut scratch)
            .expect("valid prompt");
        assert_eq!(p.blocks().len(), want_blocks);
        assert_eq!(p.tail(), want_tail);
        assert_eq!(p.len_tokens(), input);
        // Same hashes as hashing the expanded tokens directly.
        let mut tokens = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            for _ in 0..512 {
                if tokens.len() < input as usize && tokens.len() / 512 == i {
                    tokens.push(id);
                }
            }
        }
        let direct = Prompt::from_tokens(&tokens, BlockSize::DEFAULT, HashSeed::DEFAULT).expect("valid");
        assert_eq!(&p.blocks()[..], &direct.blocks()[..]);
        assert_eq!(direct.tail(), want_tail);
        let mut reference = Vec::new();
        hash_tokens(&tokens, BlockSize::DEFAULT, HashSeed::DEFAULT, &[], &mut reference);
        assert_eq!(&p.blocks()[..], &reference[..], "same hashes as router-core");
    }

    #[test]
    fn matches_router_core_for_many_shapes() {
        let mut rng = crate::rng::SplitMix64::new(9);
        let mut s = Vec::new();
        for bs in [1u32, 4, 16, 64, 128, 512, 1024] {
            let block_size = BlockSize::new(bs).unwrap();
            for seed in [HashSeed::DEFAULT, HashSeed::salted(Some("lora"), Some("tenant"))] {
                let tokens: Vec<u32> = (0..3000).map(|_| rng.below(1 << 31) as u32).collect();
                let mut reference = Vec::new();
                hash_tokens(&tokens, block_size, seed, &[], &mut reference);
                let p = Prompt::from_tokens(&tokens, block_size, seed).unwrap();
                assert_eq!(&p.blocks()[..], &reference[..], "bs {bs}");
                for trace_bs in [bs, 512, 1000] {
                    let ids: Vec<u32> = (0..8).map(|_| rng.below(1000) as u32).collect();
                    let len =
                        (ids.len() as u32 * trace_bs).saturating_sub(rng.below(u64::from(trace_bs)) as u32).max(1);
                    let expanded: Vec<u32> = (0..len as usize).map(|i| ids[i / trace_bs as usize]).collect();
                    let mut reference = Vec::new();
                    hash_tokens(&expanded, block_size, seed, &[], &mut reference);
                    let p = Prompt::from_hash_ids(&ids, len, trace_bs, block_size, seed, &mut s).unwrap();
                    assert_eq!(&p.blocks()[..], &reference[..], "bs {bs} trace {trace_bs}");
                    assert_eq!(p.tail(), &expanded[reference.len() * bs as usize..]);
                }
            }
        }
    }

    /// A prompt of `len` tokens with images at `items` (offset, length) hashes as
    /// router-core does, and the block its tail starts carries the keys that the same
    /// tokens followed by generated ones get from router-core.
    #[track_caller]
    fn check_media(len: u32, items: &[(u32, u32)]) {
        use router_core::{hash_tokens_with_media, local_hash, MediaItem};
        let bs = BlockSize::new(4).unwrap();
        let tokens: Vec<u32> = (100..100 + len).collect();
        let list = items.iter().enumerate().map(|(i, &(off, n))| MediaItem::new(&[i as u8], off, n)).collect();
        let media = MediaItems::new(list, tokens.len(), 8).unwrap();
        let p = Prompt::from_tokens_with_media(&tokens, bs, HashSeed::DEFAULT, &media).unwrap();
        let mut want = Vec::new();
        hash_tokens_with_media(&tokens, bs, HashSeed::DEFAULT, &media, &mut want);
        assert_eq!(&p.blocks()[..], &want[..]);
        let mut filled = tokens.clone();
        filled.resize(want.len() * 4 + 4, OUTPUT_TOKEN_ID_BASE);
        let mut longer = Vec::new();
        hash_tokens_with_media(&filled, bs, HashSeed::DEFAULT, &media, &mut longer);
        let next = &filled[want.len() * 4..];
        assert_eq!(local_hash(next, p.tail_extra_keys(), HashSeed::DEFAULT), longer[want.len()].local);
        let plain = Prompt::from_tokens(&tokens, bs, HashSeed::DEFAULT).unwrap();
        assert_ne!(p.blocks()[items[0].0 as usize / 4], plain.blocks()[items[0].0 as usize / 4], "an image block");
    }

    #[test]
    fn media_hashes_as_router_core_does() {
        check_media(10, &[(2, 3)]);
        check_media(11, &[(1, 2), (6, 4)]);
        check_media(12, &[(0, 12)]);
        assert!(Prompt::from_tokens(&[1; 9], BlockSize::new(4).unwrap(), HashSeed::DEFAULT)
            .unwrap()
            .tail_extra_keys()
            .is_empty());
    }

    #[test]
    fn hash_id_expansion() {
        check_hash_ids(&[1, 2], 1024, 16, &[]);
        check_hash_ids(&[1, 2], 1000, 15, &[2; 40]);
        check_hash_ids(&[7], 63, 0, &[7; 63]);
        check_hash_ids(&[1, 2, 3], 1100, 17, &[3; 12]);
    }

    #[test]
    fn equal_tokens_under_different_prefixes_differ() {
        let mut s = Vec::new();
        let a = Prompt::from_hash_ids(&[1, 4], 1024, 512, BlockSize::DEFAULT, HashSeed::DEFAULT, &mut s).unwrap();
        let b = Prompt::from_hash_ids(&[2, 4], 1024, 512, BlockSize::DEFAULT, HashSeed::DEFAULT, &mut s).unwrap();
        assert_ne!(a.blocks()[8].seq, b.blocks()[8].seq);
        assert_eq!(a.blocks()[8].local, b.blocks()[8].local);
    }

    #[test]
    fn refusals() {
        let mut s = Vec::new();
        let bs = BlockSize::DEFAULT;
        let seed = HashSeed::DEFAULT;
        assert_eq!(
            Prompt::from_hash_ids(&[1], 600, 512, bs, seed, &mut s).unwrap_err(),
            PromptError::HashIdsTooShort { input_tokens: 600, covered_tokens: 512 }
        );
        assert_eq!(Prompt::from_hash_ids(&[1], 10, 0, bs, seed, &mut s).unwrap_err(), PromptError::ZeroTraceBlock);
        assert_eq!(
            Prompt::from_tokens(&[1, OUTPUT_TOKEN_ID_BASE], bs, seed).unwrap_err(),
            PromptError::ReservedTokenId { index: 1, id: OUTPUT_TOKEN_ID_BASE }
        );
        assert!(matches!(
            Prompt::from_hash_ids(&[1], PROMPT_TOKENS_MAX + 1, 1 << 30, bs, seed, &mut s),
            Err(PromptError::TooLong { .. })
        ));
    }
}
