//! Evictions under a small cache reach kvroute's index as removal events, and vLLM's
//! own prefix-cache counters add up to what kvroute predicted.

use crate::engine::{BLOCK_TOKENS, MODEL};
use crate::fleet::{blocks, fleet, token_prompt, tokens, SMALL_CACHE_BLOCKS};

/// Worker 2 runs with `--num-gpu-blocks-override` 96: a dozen prompts of 10 blocks
/// evict the first one, and the index must forget it as vLLM did.
#[test]
fn evictions_under_a_small_cache_reach_the_index() {
    let Some(f) = fleet() else { return };
    let small = 2;
    let len = 10 * BLOCK_TOKENS + 10;
    let first = token_prompt(MODEL, &tokens(40, len));
    f.send("/v1/completions", &first, Some(small));
    f.wait_overlap(&first, small, 10);
    let fillers = SMALL_CACHE_BLOCKS / 10 + 2;
    for i in 0..fillers {
        let filler = token_prompt(MODEL, &tokens(41 + i as u64, len));
        f.send("/v1/completions", &filler, Some(small));
        f.wait_overlap(&filler, small, 10);
    }
    // Every filler is indexed, so the first prompt's removals were applied before
    // them (events arrive in order); vLLM's LRU evicted it first.
    let predicted = f.preview(&first).overlap(small);
    assert!(predicted < 10, "the first prompt's blocks left the index ({predicted} of 10 remain)");
    let again = f.send("/v1/completions", &first, Some(small));
    assert_eq!(again.cached_tokens(), predicted * BLOCK_TOKENS as u64, "vLLM holds what the index says");
}

/// A sequence of requests with shared prefixes: for each, the preview names the worker
/// and overlap; the request goes there and vLLM hits exactly that; and the engines'
/// `vllm:prefix_cache_hits_total` / `queries_total` grow by the predicted sums.
#[test]
fn vllm_prefix_cache_counters_agree_with_kvroutes_predictions() {
    let Some(f) = fleet() else { return };
    let hits =
        |f: &crate::fleet::Fleet| f.engines.iter().map(|e| e.metric("vllm:prefix_cache_hits_total")).sum::<f64>();
    let queries =
        |f: &crate::fleet::Fleet| f.engines.iter().map(|e| e.metric("vllm:prefix_cache_queries_total")).sum::<f64>();
    let (hits0, queries0) = (hits(&f), queries(&f));
    let groups = [tokens(60, 400), tokens(61, 400), tokens(62, 400)];
    // Each group's prompts extend its earlier ones; none is a multiple of the block size.
    let lens = [130, 200, 270, 330, 390];
    let (mut predicted_tokens, mut prompt_tokens) = (0u64, 0u64);
    for (round, len) in lens.iter().enumerate() {
        for (g, ids) in groups.iter().enumerate() {
            let body = token_prompt(MODEL, &ids[..*len]);
            let p = f.preview(&body);
            let served = f.send("/v1/completions", &body, None);
            let what = format!("round {round}, group {g}");
            // With nothing cached anywhere the choice is a draw, which a preview does
            // not share with the request; with a prefix cached it is not.
            if p.overlap(p.worker()) > 0 {
                assert_eq!(served.worker, p.worker(), "{what}: served where previewed");
            }
            let predicted = p.overlap(served.worker) * BLOCK_TOKENS as u64;
            assert_eq!(served.cached_tokens(), predicted, "{what}: vLLM's hit is the predicted overlap");
            predicted_tokens += predicted;
            prompt_tokens += served.prompt_tokens();
            f.wait_overlap(&body, served.worker, blocks(*len as u64));
        }
    }
    assert!(predicted_tokens >= 8 * 2 * BLOCK_TOKENS as u64, "the sequence reuses prefixes: {predicted_tokens} tokens");
    assert_eq!(hits(&f) - hits0, predicted_tokens as f64, "vllm:prefix_cache_hits_total grew by the predicted hits");
    assert_eq!(queries(&f) - queries0, prompt_tokens as f64, "vllm:prefix_cache_queries_total grew by the prompts");
}
