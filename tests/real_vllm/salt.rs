//! `cache_salt` and LoRA adapters: vLLM mixes both into its block hashes and publishes
//! them in `extra_keys`; kvroute must hash the blocks alike, so a salted request matches
//! its own blocks and never another tenant's or unsalted ones (the regression test for
//! salted blocks filed as unsalted), and an adapter's blocks match only that adapter.

use serde_json::{json, Value};

use crate::engine::{BLOCK_TOKENS, LORA, MODEL};
use crate::fleet::{blocks, fleet, token_prompt, tokens, Fleet};

fn salted(model: &str, ids: &[u32], salt: Option<&str>) -> Value {
    let mut b = token_prompt(model, ids);
    if let Some(s) = salt {
        b["cache_salt"] = json!(s);
    }
    b
}

/// Sends `stored` and waits until its worker holds it; then, for each probe, checks
/// the overlap kvroute predicts on that worker and that vLLM, asked on that same
/// worker, finds exactly that many blocks cached.
#[track_caller]
fn check(f: &Fleet, stored: &Value, probes: &[(&str, Value, u64)]) {
    let isl = f.preview(stored).isl_tokens();
    let w = f.send("/v1/completions", stored, None).worker;
    f.wait_overlap(stored, w, blocks(isl));
    for (what, probe, want_blocks) in probes {
        let predicted = f.preview(probe).overlap(w);
        assert_eq!(predicted, *want_blocks, "{what}: kvroute's predicted overlap on worker {w}");
        let served = f.send("/v1/completions", probe, Some(w));
        assert_eq!(served.cached_tokens(), predicted * BLOCK_TOKENS as u64, "{what}: vLLM's cache hit on worker {w}");
    }
}

#[test]
fn salted_requests_match_their_own_blocks_and_never_unsalted_ones() {
    let Some(f) = fleet() else { return };
    let ids = tokens(20, 200);
    let longer = tokens(20, 300);
    check(
        &f,
        &salted(MODEL, &ids, Some("tenant-a")),
        &[
            ("the same tenant, a longer prompt", salted(MODEL, &longer, Some("tenant-a")), 3),
            ("no salt", salted(MODEL, &longer, None), 0),
            ("another tenant", salted(MODEL, &longer, Some("tenant-b")), 0),
        ],
    );
    // And the other way round: unsalted blocks are not a salted request's.
    let ids = tokens(21, 200);
    check(
        &f,
        &salted(MODEL, &ids, None),
        &[
            ("a salted request", salted(MODEL, &ids, Some("tenant-a")), 0),
            ("unsalted again", salted(MODEL, &ids, None), 3),
        ],
    );
}

/// vLLM's CPU build serves LoRA adapters (`--enable-lora`, punica's torch ops): the
/// generated rank-8 adapter is loaded at startup as `sql-lora`.
#[test]
fn lora_requests_match_only_their_adapters_blocks() {
    let Some(f) = fleet() else { return };
    let ids = tokens(22, 200);
    check(
        &f,
        &salted(LORA, &ids, None),
        &[
            ("the adapter again", salted(LORA, &tokens(22, 260), None), 3),
            ("the base model", salted(MODEL, &ids, None), 0),
            ("the adapter with a salt", salted(LORA, &ids, Some("tenant-a")), 0),
        ],
    );
    // The adapter's name and a salt together, as vLLM keys them: [lora, salt] on the
    // first block, [lora] on the others.
    let ids = tokens(23, 200);
    check(
        &f,
        &salted(LORA, &ids, Some("tenant-b")),
        &[
            ("the same adapter and tenant", salted(LORA, &tokens(23, 260), Some("tenant-b")), 3),
            ("the adapter alone", salted(LORA, &ids, None), 0),
        ],
    );
}
