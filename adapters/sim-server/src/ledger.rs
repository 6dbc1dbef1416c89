//! The token ledger: which tokens (and images) each block hash covers, so `BlockStored`
//! events can carry `token_ids` and the images' `extra_keys`.
//!
//! The engine's KV events name blocks by hash only. Every block an engine can store
//! belongs to a running request, so the engine task registers each request's whole token
//! sequence (prompt, then the ids the engine gives its generated tokens) with the hashes
//! of its full blocks, and looks stored hashes up here. Requests sharing a prefix share
//! entries (equal hashes mean equal tokens), counted by reference. The generated ids
//! mirror the engine's own rule (see [`generated_token_id`]); the tests recompute every
//! published hash from the published tokens, so a drift would fail them.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_sim::prompt::OUTPUT_TOKEN_ID_BASE;
use router_core::{hash_tokens, hash_tokens_with_media, BlockHash, BlockSize, HashSeed, SeqHash};

use crate::media::{BlockMediaKey, PromptMedia};

/// Id the engine gives a request's `k`-th generated token when the request's output
/// range starts at `out_base` (the engine counts output ranges up from 0 per engine, in
/// submission order, `target` tokens per request).
pub(crate) fn generated_token_id(out_base: u32, k: u32) -> u32 {
    OUTPUT_TOKEN_ID_BASE | (out_base.wrapping_add(k) & (OUTPUT_TOKEN_ID_BASE - 1))
}

/// A request's registered sequence.
pub(crate) struct Registered {
    blocks: Vec<BlockHash>,
}

struct Entry {
    tokens: Arc<[u32]>,
    media: Option<Arc<PromptMedia>>,
    block: u32,
    refs: u32,
}

pub(crate) struct Ledger {
    bs: BlockSize,
    map: HashMap<SeqHash, Entry>,
}

impl Ledger {
    pub(crate) fn new(bs: BlockSize) -> Self {
        Ledger { bs, map: HashMap::new() }
    }

    /// Registers a request's full-block hashes over `prompt` (holding `media`'s images)
    /// followed by `generated` tokens (the most the engine will ever hold for it).
    /// Linear in the tokens plus the items.
    pub(crate) fn register(
        &mut self,
        prompt: &[u32],
        media: Option<&Arc<PromptMedia>>,
        generated: impl Iterator<Item = u32>,
    ) -> Registered {
        let mut all = Vec::with_capacity(prompt.len());
        all.extend_from_slice(prompt);
        all.extend(generated);
        let tokens: Arc<[u32]> = all.into();
        let mut blocks = Vec::new();
        match media {
            Some(m) => hash_tokens_with_media(&tokens, self.bs, HashSeed::DEFAULT, &m.items, &mut blocks),
            None => hash_tokens(&tokens, self.bs, HashSeed::DEFAULT, &[], &mut blocks),
        }
        for (i, b) in blocks.iter().enumerate() {
            let e = self.map.entry(b.seq).or_insert_with(|| Entry {
                tokens: tokens.clone(),
                media: media.cloned(),
                block: i as u32,
                refs: 0,
            });
            e.refs += 1;
        }
        Registered { blocks }
    }

    /// Drops a request's references.
    pub(crate) fn release(&mut self, r: &Registered) {
        for b in &r.blocks {
            if let Some(e) = self.map.get_mut(&b.seq) {
                e.refs -= 1;
                if e.refs == 0 {
                    self.map.remove(&b.seq);
                }
            }
        }
    }

    /// Appends the tokens of block `hash` to `out` and sets `keys` to the images it
    /// holds; false if no running request has it.
    pub(crate) fn block_of(&self, hash: SeqHash, out: &mut Vec<u32>, keys: &mut Vec<BlockMediaKey>) -> bool {
        keys.clear();
        let Some(e) = self.map.get(&hash) else {
            return false;
        };
        let bs = self.bs.tokens() as usize;
        let start = e.block as usize * bs;
        let Some(t) = e.tokens.get(start..start + bs) else {
            return false;
        };
        out.extend_from_slice(t);
        if let Some(m) = &e.media {
            m.block_keys(start as u64, (start + bs) as u64, keys);
        }
        true
    }

    /// Distinct block hashes registered (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

impl Registered {
    /// Full blocks registered.
    #[cfg(test)]
    pub(crate) fn block_count(&self) -> usize {
        self.blocks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_are_counted_and_released() {
        let bs = BlockSize::new(4).expect("valid");
        let mut l = Ledger::new(bs);
        let a = l.register(&[1, 2, 3, 4, 5, 6, 7, 8, 9], None, std::iter::empty());
        let b = l.register(&[1, 2, 3, 4, 0, 0], None, [generated_token_id(0, 0), generated_token_id(0, 1)].into_iter());
        assert_eq!((a.block_count(), b.block_count(), l.len()), (2, 2, 3));
        let (mut out, mut keys) = (Vec::new(), Vec::new());
        assert!(l.block_of(b.blocks[1].seq, &mut out, &mut keys));
        assert!(keys.is_empty(), "text holds no images");
        assert_eq!(out, vec![0, 0, OUTPUT_TOKEN_ID_BASE, OUTPUT_TOKEN_ID_BASE | 1]);
        l.release(&a);
        out.clear();
        assert!(l.block_of(a.blocks[0].seq, &mut out, &mut keys), "b still holds the shared block");
        assert!(!l.block_of(a.blocks[1].seq, &mut out, &mut keys));
        l.release(&b);
        assert_eq!(l.len(), 0);
    }

    #[test]
    fn generated_ids_wrap_inside_the_reserved_range() {
        assert_eq!(generated_token_id(0, 0), 1 << 31);
        assert_eq!(generated_token_id(u32::MAX, 2), (1 << 31) | 1);
        assert_eq!(generated_token_id((1 << 31) - 1, 1), 1 << 31);
    }
}
