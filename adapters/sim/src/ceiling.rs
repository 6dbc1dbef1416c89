//! Cache-only ceilings for prefix reuse: what fraction of prompt tokens a single cache
//! holding the whole fleet's capacity (or an unbounded one) would serve, ignoring time.
//!
//! Requests are fed in arrival order. Each takes the leading run of its full blocks that
//! is cached (stopping at the first miss), then uses all its blocks root to leaf and
//! releases them leaf to root, exactly as an engine does, so the LRU keeps prefixes
//! longer than suffixes. By default the engine's rule applies too: a fully cached prompt
//! still computes its last block, so the ceiling is comparable with a replay's
//! `prefix_reuse_ratio`. Pass `recompute_last_block = false` for the plain token hit
//! ratio that trace statistics usually quote.

use crate::engine::pool::Pool;
use crate::replay::SimRequest;

/// Reuse ratio of one LRU cache of `capacity_blocks` blocks (the fleet's total), with
/// the engine's last-block rule.
pub fn pooled_reuse_ratio(requests: &[SimRequest], capacity_blocks: u64) -> f64 {
    reuse_ratio(requests, Some(capacity_blocks), true)
}

/// Reuse ratio of an unbounded cache, with the engine's last-block rule.
pub fn infinite_reuse_ratio(requests: &[SimRequest]) -> f64 {
    reuse_ratio(requests, None, true)
}

/// Cached prompt tokens ÷ all prompt tokens for a cache of `capacity_blocks` blocks
/// (`None` = unbounded). Linear in the total number of prompt blocks.
pub fn reuse_ratio(requests: &[SimRequest], capacity_blocks: Option<u64>, recompute_last_block: bool) -> f64 {
    let cached: u64 =
        cached_tokens(requests, capacity_blocks, recompute_last_block).iter().map(|&c| u64::from(c)).sum();
    let total: u64 = requests.iter().map(|r| u64::from(r.prompt.len_tokens())).sum();
    if total == 0 {
        0.0
    } else {
        cached as f64 / total as f64
    }
}

/// Prompt tokens each request finds cached in one LRU cache of `capacity_blocks` blocks
/// (`None` = unbounded), in request order. Linear in the total number of prompt blocks.
pub fn cached_tokens(requests: &[SimRequest], capacity_blocks: Option<u64>, recompute_last_block: bool) -> Vec<u32> {
    let cap = capacity_blocks.map_or(u32::MAX, |c| c.min(u64::from(u32::MAX)) as u32);
    let mut pool = Pool::new(cap, 0x6365_696c);
    let mut held: Vec<u32> = Vec::new();
    let mut out = Vec::with_capacity(requests.len());
    for r in requests {
        let blocks = r.prompt.blocks();
        let len = r.prompt.len_tokens();
        let bs = r.prompt.block_size().tokens();
        let max_hit = if recompute_last_block { (len.saturating_sub(1) / bs) as usize } else { blocks.len() };
        let hit = blocks.iter().take(max_hit).take_while(|b| pool.lookup(b.seq).is_some()).count();
        out.push((hit as u64 * u64::from(bs)).min(u64::from(len)) as u32);
        held.clear();
        for b in blocks.iter() {
            let slot = match pool.lookup(b.seq) {
                Some(s) => {
                    pool.pin(s);
                    s
                }
                None => {
                    if pool.used() >= pool.capacity() && pool.evict_lru().is_none() {
                        break; // everything cached is this request's own prefix
                    }
                    pool.insert(b.seq)
                }
            };
            held.push(slot);
        }
        for &s in held.iter().rev() {
            pool.unpin(s);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: u64, ids: &[u32], len: u32) -> SimRequest {
        crate::test_requests::request(id, ids, len, 512)
    }

    #[track_caller]
    fn check(reqs: &[SimRequest], cap: Option<u64>, rule: bool, want: f64) {
        let got = reuse_ratio(reqs, cap, rule);
        assert!((got - want).abs() < 1e-12, "cap {cap:?} rule {rule}: got {got}, want {want}");
    }

    #[test]
    fn ratios() {
        let reqs = vec![req(0, &[1, 2], 1024), req(1, &[1, 2], 1024), req(2, &[1, 3], 1000), req(3, &[4], 512)];
        let total = 1024.0 + 1024.0 + 1000.0 + 512.0;
        // Unbounded, plain hit: second request all 1024, third 512.
        check(&reqs, None, false, (1024.0 + 512.0) / total);
        // Last-block rule: the second request recomputes its last block.
        check(&reqs, None, true, (512.0 + 512.0) / total);
        // One block of room: request 1 finds only block [1] (released last, kept).
        check(&reqs, Some(1), false, (512.0 + 512.0) / total);
        check(&reqs, Some(0), false, 0.0);
        assert_eq!(infinite_reuse_ratio(&reqs), reuse_ratio(&reqs, None, true));
        assert_eq!(pooled_reuse_ratio(&reqs, 8), reuse_ratio(&reqs, Some(8), true));
    }
}
