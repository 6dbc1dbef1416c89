//! Block hashing: how token ids become the keys of the prefix index.
//!
//! Token ids are cut into blocks of [`BlockSize`] tokens; only full blocks are hashed.
//! Each block gets a *local* hash of its own tokens and a *sequence* hash chained over
//! every block before it, so equal tokens under different prefixes never collide.
//! The constants match NVIDIA Dynamo's router, so a kvroute index and a
//! Dynamo-instrumented worker agree bit for bit:
//!
//! * `local = xxh3_64_with_seed(tokens as little-endian u32 ‖ extra keys as LE u64, seed)`
//! * `seq[0] = local[0]`, `seq[i] = xxh3_64_with_seed(seq[i-1] LE ‖ local[i] LE, 1337)`
//! * `seed = 1337 + xxh3(lora_name, 0) + xxh3(cache_salt, 1)` (wrapping; empty = absent)
//!
//! Extra keys (for example multimodal content hashes) are appended after the block's
//! tokens, in the order given, each as a little-endian u64. A block with no extra keys
//! hashes exactly as Dynamo's does. `media` turns a prompt's media items into the
//! per-block extra keys vLLM hashes them with ([`hash_tokens_with_media`]).

use alloc::vec::Vec;
use core::fmt;
use xxhash_rust::xxh3::xxh3_64_with_seed;

mod media;
pub use media::{hash_tokens_with_media, MediaError, MediaItem, MediaItems, MediaKey, MEDIA_ITEMS_MAX};

/// The unsalted seed, and the seed of every chain step.
pub(crate) const SEED_DEFAULT: u64 = 1337;

/// The largest block size accepted, in tokens.
pub const BLOCK_SIZE_MAX_TOKENS: u32 = 1024;

/// Hash of one block's own tokens (Dynamo's `LocalBlockHash`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct LocalHash(pub u64);

/// Hash of a block and every block before it (Dynamo's `ExternalSequenceBlockHash`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SeqHash(pub u64);

/// One hashed block: its sequence hash (the index key) and its local hash.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct BlockHash {
    /// Chained hash, the identity of the block and its whole prefix.
    pub seq: SeqHash,
    /// Hash of the block's own tokens.
    pub local: LocalHash,
}

/// A validated block size: a power of two in `1..=1024` tokens.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct BlockSize(u32);

/// Why a block size was refused.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum BlockSizeError {
    /// The size is 0, above 1024, or not a power of two.
    Invalid {
        /// The refused size, in tokens.
        tokens: u32,
    },
}

impl fmt::Display for BlockSizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockSizeError::Invalid { tokens } => {
                write!(f, "block size {tokens} is not a power of two in 1..=1024 tokens")
            }
        }
    }
}

impl core::error::Error for BlockSizeError {}

impl BlockSize {
    /// The default, 64 tokens.
    pub const DEFAULT: BlockSize = BlockSize(64);

    /// Validates `tokens`.
    pub const fn new(tokens: u32) -> Result<Self, BlockSizeError> {
        if tokens == 0 || tokens > BLOCK_SIZE_MAX_TOKENS || !tokens.is_power_of_two() {
            return Err(BlockSizeError::Invalid { tokens });
        }
        Ok(BlockSize(tokens))
    }

    /// The size in tokens.
    pub const fn tokens(self) -> u32 {
        self.0
    }

    /// Number of full blocks in `len_tokens` tokens.
    pub const fn full_blocks(self, len_tokens: usize) -> usize {
        len_tokens / self.0 as usize
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The seed for local hashes, salted per LoRA adapter and tenant cache salt.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct HashSeed(pub u64);

impl HashSeed {
    /// The unsalted seed, 1337.
    pub const DEFAULT: HashSeed = HashSeed(SEED_DEFAULT);

    /// `1337 + xxh3(lora_name, 0) + xxh3(cache_salt, 1)`, wrapping; `None` or an empty
    /// string adds nothing, so a request without either hashes like an unsalted one.
    pub fn salted(lora_name: Option<&str>, cache_salt: Option<&str>) -> Self {
        let mut seed = SEED_DEFAULT;
        if let Some(l) = lora_name.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(l.as_bytes(), 0));
        }
        if let Some(s) = cache_salt.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(s.as_bytes(), 1));
        }
        HashSeed(seed)
    }
}

impl Default for HashSeed {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Local hash of one block of tokens, with optional extra keys appended.
///
/// Works for any slice length; callers pass exactly one block.
pub fn local_hash(tokens: &[u32], extra_keys: &[u64], seed: HashSeed) -> LocalHash {
    let need = tokens.len() * 4 + extra_keys.len() * 8;
    // The default 64-token block fits a small stack buffer that is cheap to zero; larger
    // blocks (up to 1024 tokens) go through a bigger one, and only exotic inputs allocate.
    if need <= SMALL_BUF_BYTES {
        let mut buf = [0u8; SMALL_BUF_BYTES];
        fill(&mut buf[..need], tokens, extra_keys);
        return LocalHash(xxh3_64_with_seed(&buf[..need], seed.0));
    }
    if need <= LARGE_BUF_BYTES {
        let mut buf = [0u8; LARGE_BUF_BYTES];
        fill(&mut buf[..need], tokens, extra_keys);
        return LocalHash(xxh3_64_with_seed(&buf[..need], seed.0));
    }
    let mut buf = alloc::vec![0u8; need];
    fill(&mut buf, tokens, extra_keys);
    LocalHash(xxh3_64_with_seed(&buf, seed.0))
}

const SMALL_BUF_BYTES: usize = 4 * 64 + 8 * 4;
const LARGE_BUF_BYTES: usize = 4 * BLOCK_SIZE_MAX_TOKENS as usize + 8 * 16;

fn fill(buf: &mut [u8], tokens: &[u32], extra_keys: &[u64]) {
    let (tok_bytes, extra_bytes) = buf.split_at_mut(tokens.len() * 4);
    for (dst, t) in tok_bytes.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    for (dst, k) in extra_bytes.chunks_exact_mut(8).zip(extra_keys) {
        dst.copy_from_slice(&k.to_le_bytes());
    }
}

/// One chain step: the sequence hash of a block whose parent is `parent`.
pub fn chain(parent: SeqHash, local: LocalHash) -> SeqHash {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.0.to_le_bytes());
    buf[8..].copy_from_slice(&local.0.to_le_bytes());
    SeqHash(xxh3_64_with_seed(&buf, SEED_DEFAULT))
}

/// Sequence hashes from local hashes, continuing after `parent` if there is one.
pub fn chain_all(parent: Option<SeqHash>, locals: &[LocalHash], out: &mut Vec<BlockHash>) {
    let mut prev = parent;
    out.reserve(locals.len());
    for &local in locals {
        let seq = match prev {
            None => SeqHash(local.0),
            Some(p) => chain(p, local),
        };
        out.push(BlockHash { seq, local });
        prev = Some(seq);
    }
}

/// Hashes every full block of `tokens`, appending to `out`.
///
/// `extra_keys`, if given, is per block (index `i` for block `i`); missing entries mean
/// no extra keys. Work is linear in `tokens.len()`.
pub fn hash_tokens(
    tokens: &[u32],
    block_size: BlockSize,
    seed: HashSeed,
    extra_keys: &[&[u64]],
    out: &mut Vec<BlockHash>,
) {
    let mut prev: Option<SeqHash> = None;
    out.reserve(block_size.full_blocks(tokens.len()));
    for (i, block) in tokens.chunks_exact(block_size.tokens() as usize).enumerate() {
        let extra = extra_keys.get(i).copied().unwrap_or(&[]);
        let local = local_hash(block, extra, seed);
        let seq = match prev {
            None => SeqHash(local.0),
            Some(p) => chain(p, local),
        };
        out.push(BlockHash { seq, local });
        prev = Some(seq);
    }
}

/// Convenience: the sequence hashes of every full block of `tokens`.
pub fn seq_hashes(tokens: &[u32], block_size: BlockSize, seed: HashSeed) -> Vec<SeqHash> {
    let mut blocks = Vec::new();
    hash_tokens(tokens, block_size, seed, &[], &mut blocks);
    blocks.into_iter().map(|b| b.seq).collect()
}

#[cfg(test)]
mod tests;
