//! Requests for the unit tests: a prompt built from trace hash ids.

use router_core::{BlockSize, HashSeed};

use crate::prompt::Prompt;
use crate::replay::SimRequest;

/// Request `id` arriving at `id` ms, `len` tokens over `hash_ids` (512 tokens each),
/// hashed in blocks of `block_tokens`, one output token.
pub(crate) fn request(id: u64, hash_ids: &[u32], len: u32, block_tokens: u32) -> SimRequest {
    let block = BlockSize::new(block_tokens).expect("a valid block size");
    let prompt =
        Prompt::from_hash_ids(hash_ids, len, 512, block, HashSeed::DEFAULT, &mut Vec::new()).expect("a valid prompt");
    SimRequest { id, arrival_ms: id as f64, prompt, output_len: 1, session_id: None, priority: None, follows: None }
}
