//! A prefix-cache reset on a real engine (`POST /reset_prefix_cache`, which
//! `VLLM_SERVER_DEV_MODE=1` serves). vLLM queues its `AllBlocksCleared` event until its
//! scheduler next steps, so until the engine runs something, kvroute's index keeps the
//! cleared blocks, and a kvroute started then replays them from the engine's buffer. Once
//! the engine steps, every router forgets them, the one that replayed them included, and
//! vLLM finds nothing cached. The fleet benchmark runs one step after each reset for this
//! reason: its next router would otherwise route to a cache that is not there.

use std::time::Duration;

use serde_json::json;

use crate::engine::MODEL;
use crate::fleet::{fleet, token_prompt, tokens};
use crate::http;
use crate::router::{build_binary, config, Kvroute};

#[test]
fn a_reset_cache_leaves_the_index_when_the_engine_next_steps() {
    let Some(f) = fleet() else { return };
    let (w, blocks) = (1, 5);
    let body = token_prompt(MODEL, &tokens(90, 330));
    f.send("/v1/completions", &body, Some(w));
    f.wait_overlap(&body, w, blocks);
    let engine = f.engines.iter().find(|e| e.id == w).expect("engine 1").addr();
    let reset = http::request(engine, "POST", "/reset_prefix_cache", &[], None, Duration::from_secs(30))
        .expect("POST /reset_prefix_cache");
    assert_eq!(reset.status, 200, "vLLM resets its prefix cache: {}", reset.text());

    // Not yet published: a router started now replays the cleared blocks too.
    let dir = crate::procs::scratch_dir("kvroute-real-vllm-reset");
    let late =
        Kvroute::start_with(&build_binary(), &dir, "kvroute-reset", |port| config(&f.env.model, port, &f.engines));
    let overlap = |k: &Kvroute| k.preview(&body).overlap(w);
    late.wait(Duration::from_secs(20), "the new router replays worker 1's stored blocks", |k| overlap(k) == blocks);
    assert_eq!(f.preview(&body).overlap(w), blocks, "the running router has heard of no reset either");

    // One step (a prompt shorter than a block stores nothing) publishes the event.
    let step = json!({"model": MODEL, "prompt": [300], "max_tokens": 1});
    let stepped = http::request(engine, "POST", "/v1/completions", &[], Some(&step), Duration::from_secs(60))
        .expect("a one-token completion");
    assert_eq!(stepped.status, 200, "one step: {}", stepped.text());
    f.wait_overlap(&body, w, 0);
    late.wait(Duration::from_secs(20), "the replaying router hears the reset", |k| overlap(k) == 0);
    let again = f.send("/v1/completions", &body, Some(w));
    assert_eq!(again.cached_tokens(), 0, "vLLM holds none of it, as the index says");
}
