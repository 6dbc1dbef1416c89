//! One request inside an engine: its token counters, the blocks it holds, and the two
//! block operations that touch the pool (grow to cover more tokens, release all).
//!
//! A request holds `computed / block_size` registered full blocks, in order, plus one
//! private partial block when `computed` is not block-aligned. Blocks become resident
//! (and are announced) at the moment a pass schedules the tokens that fill them, so a
//! later request in the same pass can already hit them, as in vLLM v1.

use router_core::{chain, local_hash, BlockHash, SeqHash};

use super::pool::{Pool, NIL};
use super::{EngineOutput, KvEvent};
use crate::prompt::{Prompt, OUTPUT_TOKEN_ID_BASE};

#[derive(Clone)]
pub(crate) struct Req {
    pub(crate) id: u64,
    pub(crate) prompt: Prompt,
    pub(crate) prompt_len: u32,
    /// Tokens to sample in total, counting `generated_before`.
    pub(crate) target_tokens: u32,
    /// Tokens sampled so far (the last one is not yet computed).
    pub(crate) generated: u32,
    /// Tokens whose KV is computed (or pinned from cache).
    pub(crate) computed: u32,
    pub(crate) held: Vec<u32>,
    pub(crate) has_private: bool,
    /// Hashes of full blocks past the prompt's own, filled lazily.
    pub(crate) gen_hashes: Vec<BlockHash>,
    /// Offset of this request's generated token ids in the engine's reserved range.
    pub(crate) out_base: u32,
    pub(crate) admitted: bool,
    pub(crate) first_token_ms: f64,
    pub(crate) emitted: u32,
    pub(crate) preemptions: u32,
    pub(crate) scheduled: bool,
    /// The prompt's KV arrived from a prefill worker (a decode-role engine's handoff):
    /// catching up on the prompt is free. A decode-role engine given a whole request
    /// (a disaggregation bypass) computes the prompt itself.
    pub(crate) kv_arrived: bool,
}

impl Req {
    pub(crate) fn seq_len(&self) -> u32 {
        self.prompt_len + self.generated
    }

    pub(crate) fn prompt_blocks(&self) -> usize {
        self.prompt.blocks().len()
    }

    /// Hash of full block `i`; blocks past the prompt need [`Req::ensure_hashes`] first.
    pub(crate) fn block_hash(&self, i: usize) -> BlockHash {
        let pb = self.prompt_blocks();
        if i < pb {
            self.prompt.blocks()[i]
        } else {
            self.gen_hashes[i - pb]
        }
    }

    /// Computes the hashes of full blocks `..upto` that cover generated tokens.
    /// Each block's tokens must already exist (`upto * block_size <= seq_len`).
    pub(crate) fn ensure_hashes(&mut self, upto: usize, bs: u32) {
        let pb = self.prompt_blocks();
        if pb + self.gen_hashes.len() >= upto {
            return;
        }
        let mut buf = [0u32; router_core::BLOCK_SIZE_MAX_TOKENS as usize];
        while pb + self.gen_hashes.len() < upto {
            let i = pb + self.gen_hashes.len();
            let start = i as u64 * u64::from(bs);
            for (k, slot) in buf[..bs as usize].iter_mut().enumerate() {
                *slot = self.token_at(start + k as u64);
            }
            // Only the block holding the prompt's tail can overlap an image.
            let extra = if i == pb { self.prompt.tail_extra_keys() } else { &[] };
            let local = local_hash(&buf[..bs as usize], extra, self.prompt.seed());
            let seq = if i == 0 { SeqHash(local.0) } else { chain(self.block_hash(i - 1).seq, local) };
            self.gen_hashes.push(BlockHash { seq, local });
        }
    }

    fn token_at(&self, pos: u64) -> u32 {
        let p = u64::from(self.prompt_len);
        if pos < p {
            let tail_start = (self.prompt_blocks() * self.prompt.block_size().tokens() as usize) as u64;
            self.prompt.tail()[(pos - tail_start) as usize]
        } else {
            // Generated ids live in [2^31, 2^32); the offset wraps inside that range.
            let k = (u64::from(self.out_base) + (pos - p)) as u32 & (OUTPUT_TOKEN_ID_BASE - 1);
            OUTPUT_TOKEN_ID_BASE | k
        }
    }

    /// Longest leading run of this request's known full blocks resident in `pool`,
    /// leaving at least the last token to compute (a fully cached prompt still
    /// computes its last block).
    pub(crate) fn prefix_hit(&mut self, pool: &Pool, bs: u32) -> u32 {
        let max_hit = (self.seq_len().saturating_sub(1) / bs) as usize;
        self.ensure_hashes(max_hit, bs);
        let mut h = 0;
        while h < max_hit && pool.lookup(self.block_hash(h).seq).is_some() {
            h += 1;
        }
        h as u32
    }
}

/// Where a grow operation reports its KV events.
pub(crate) struct Events<'a> {
    pub(crate) out: &'a mut Vec<EngineOutput>,
    pub(crate) next_id: &'a mut u64,
    pub(crate) at_ms: f64,
    pub(crate) stored_blocks: &'a mut u64,
    pub(crate) evicted_blocks: &'a mut u64,
}

impl Events<'_> {
    fn push(&mut self, event: KvEvent) {
        let event_id = *self.next_id;
        *self.next_id += 1;
        self.out.push(EngineOutput::Kv { at_ms: self.at_ms, event_id, event });
    }
}

/// Grows `req`'s blocks to cover `to` tokens, all or nothing. Returns false (and
/// changes nothing) when the pool cannot make room without preempting someone.
///
/// Resident blocks are pinned before fresh capacity is reserved, so a request's own
/// hits are never evicted to make room for it. Work is linear in the blocks added.
pub(crate) fn grow(
    pool: &mut Pool,
    scratch: &mut Vec<u32>,
    req: &mut Req,
    to: u32,
    bs: u32,
    ev: &mut Events<'_>,
) -> bool {
    let from_full = req.held.len();
    let to_full = (to / bs) as usize;
    let to_private = !to.is_multiple_of(bs);
    if to_full == from_full && to_private == req.has_private {
        return true; // the decode fast path: the partial block just gets one more token
    }
    req.ensure_hashes(to_full, bs);
    scratch.clear();
    let mut pinned_inactive = 0u32;
    let mut absent = 0u32;
    for i in from_full..to_full {
        match pool.lookup(req.block_hash(i).seq) {
            Some(s) => {
                if pool.slot(s).refs == 0 {
                    pinned_inactive += 1;
                }
                scratch.push(s);
            }
            None => {
                absent += 1;
                scratch.push(NIL);
            }
        }
    }
    let need = absent + u32::from(to_private);
    let released = u32::from(req.has_private);
    let free = pool.capacity() - pool.used() + released;
    if need > free + pool.inactive().saturating_sub(pinned_inactive) {
        return false;
    }

    if req.has_private {
        pool.remove_private();
        req.has_private = false;
    }
    for &s in scratch.iter().filter(|&&s| s != NIL) {
        pool.pin(s);
    }
    let mut removed = Vec::new();
    while pool.used() + need > pool.capacity() {
        match pool.evict_lru() {
            Some(h) => removed.push(h),
            None => break, // unreachable: the room was checked above
        }
    }
    if !removed.is_empty() {
        *ev.evicted_blocks += removed.len() as u64;
        ev.push(KvEvent::Removed { blocks: removed });
    }
    let mut run: Vec<BlockHash> = Vec::new();
    let mut run_parent = None;
    for (k, i) in (from_full..to_full).enumerate() {
        let bh = req.block_hash(i);
        let slot = match scratch[k] {
            NIL => match pool.lookup(bh.seq) {
                Some(s) => {
                    pool.pin(s); // only on a hash collision inside this run
                    s
                }
                None => {
                    if run.is_empty() {
                        run_parent = (i > 0).then(|| req.block_hash(i - 1).seq);
                    }
                    run.push(bh);
                    pool.insert(bh.seq)
                }
            },
            s => {
                flush_stored(&mut run, run_parent, ev);
                s
            }
        };
        req.held.push(slot);
    }
    flush_stored(&mut run, run_parent, ev);
    if to_private {
        pool.add_private();
        req.has_private = true;
    }
    true
}

fn flush_stored(run: &mut Vec<BlockHash>, parent: Option<SeqHash>, ev: &mut Events<'_>) {
    if !run.is_empty() {
        *ev.stored_blocks += run.len() as u64;
        ev.push(KvEvent::Stored { parent, blocks: std::mem::take(run) });
    }
}

/// Releases every block `req` holds, leaf first, so its suffix enters the LRU before
/// its prefix and is evicted first.
pub(crate) fn release(pool: &mut Pool, req: &mut Req) {
    if req.has_private {
        pool.remove_private();
        req.has_private = false;
    }
    for &s in req.held.iter().rev() {
        pool.unpin(s);
    }
    req.held.clear();
}
