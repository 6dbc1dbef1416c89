//! A lower bound on time to first token that no router can beat on a given fleet.
//!
//! Every request is served alone on an idle worker: no queueing, no decode steps beside
//! it. It pays only for the prompt tokens the cache does not hold, computed in passes of
//! the engine's token budget with the engine's prefill timing. The cache is one LRU pool
//! with the whole fleet's capacity, fed in arrival order (see [`crate::ceiling`]): a
//! router that spreads the same blocks over separate workers can only hold less.
//!
//! `benches/scripts/ttft_lower_bound.py` is the reference this port is checked against.

use crate::ceiling::cached_tokens;
use crate::engine::EngineTiming;
use crate::replay::SimRequest;
use crate::stats::Dist;

/// Prefill time of `tokens` uncached tokens computed alone, in passes of `pass_tokens`
/// (a pass budget of 0 is taken as 1), under `timing`.
pub fn prefill_alone_ms(tokens: u64, pass_tokens: u32, timing: &EngineTiming) -> f64 {
    let pass = u64::from(pass_tokens.max(1));
    (tokens / pass) as f64 * timing.prefill_ms(pass, 1) + timing.prefill_ms(tokens % pass, 1)
}

/// Each request's TTFT under the bound, in request order, for a cache of
/// `capacity_blocks` blocks (`None` = unbounded). Linear in the total number of prompt
/// blocks.
pub fn ttft_lower_bounds_ms(
    requests: &[SimRequest],
    capacity_blocks: Option<u64>,
    pass_tokens: u32,
    timing: &EngineTiming,
) -> Vec<f64> {
    let cached = cached_tokens(requests, capacity_blocks, true);
    requests
        .iter()
        .zip(cached)
        .map(|(r, c)| prefill_alone_ms(u64::from(r.prompt.len_tokens().saturating_sub(c)), pass_tokens, timing))
        .collect()
}

/// The bound's distribution for one fleet LRU pool of `capacity_blocks` blocks.
pub fn fleet_lru_ttft_bound(
    requests: &[SimRequest],
    capacity_blocks: u64,
    pass_tokens: u32,
    timing: &EngineTiming,
) -> Dist {
    Dist::of(&mut ttft_lower_bounds_ms(requests, Some(capacity_blocks), pass_tokens, timing))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::prefill_ms;

    const M: &EngineTiming = &EngineTiming::MOCKER;

    fn req(id: u64, ids: &[u32], len: u32) -> SimRequest {
        crate::test_requests::request(id, ids, len, 64)
    }

    #[track_caller]
    fn check(got: f64, want: f64) {
        assert!((got - want).abs() < 1e-9, "got {got}, want {want}");
    }

    #[test]
    fn prefill_alone_splits_into_passes() {
        check(prefill_alone_ms(0, 8192, M), 0.0);
        check(prefill_alone_ms(100, 8192, M), prefill_ms(100));
        check(prefill_alone_ms(8192, 8192, M), prefill_ms(8192));
        check(prefill_alone_ms(20_000, 8192, M), 2.0 * prefill_ms(8192) + prefill_ms(20_000 - 2 * 8192));
        check(prefill_alone_ms(3, 0, M), 3.0 * prefill_ms(1));
    }

    #[test]
    fn cached_prefixes_shorten_the_bound() {
        let reqs =
            [req(0, &[1, 2], 1024), req(1, &[1, 2], 1024), req(2, &[1, 3], 1000), req(3, &[1], 100), req(4, &[1], 60)];
        let b = ttft_lower_bounds_ms(&reqs, None, 8192, M);
        check(b[0], prefill_ms(1024));
        // Fully cached: the last block is computed again.
        check(b[1], prefill_ms(64));
        // Shares the first 512-token trace block only.
        check(b[2], prefill_ms(1000 - 512));
        // One full block cached, the rest computed.
        check(b[3], prefill_ms(100 - 64));
        // Shorter than one block: nothing to reuse.
        check(b[4], prefill_ms(60));
        // No room at all: everything is computed.
        let cold = ttft_lower_bounds_ms(&reqs, Some(0), 8192, M);
        for (r, t) in reqs.iter().zip(cold) {
            check(t, prefill_ms(u64::from(r.prompt.len_tokens())));
        }
        let d = fleet_lru_ttft_bound(&reqs, 1 << 20, 8192, M);
        check(d.max, prefill_ms(1024));
        check(d.p50, prefill_ms(64));
    }

    #[test]
    fn the_bound_follows_the_engine_timing() {
        let slow = EngineTiming { prefill_ms_per_token: 0.5, ..EngineTiming::MOCKER };
        let reqs = [req(0, &[1, 2], 1024)];
        check(ttft_lower_bounds_ms(&reqs, None, 8192, &slow)[0], slow.prefill_ms(1024, 1));
        assert!(slow.prefill_ms(1024, 1) > prefill_ms(1024) + 400.0);
    }
}
