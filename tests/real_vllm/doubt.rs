//! The cold wait against a real engine's first tokens. With a cold term on, an idle
//! worker's cost carries the wait its first pass adds (250 ms here at most), a figure
//! measured where engines kept to the timing. kvroute counts it only once some worker
//! has `samples_min` (8) first tokens, and then over the slowdown they show. vLLM's
//! CPU build answers far later than the default (GPU) timing, so here the wait counts
//! nothing at first and, after 8 first tokens, at most half. The preview shows it in
//! the cost of worker 2, which neither router ever uses.

use crate::engine::MODEL;
use crate::fleet::{fleet, token_prompt, tokens};
use crate::http;
use crate::overdue::with_keys;
use crate::router::Kvroute;
use std::time::Duration;

/// The cold wait of a worker a router never used: the cap.
const COLD_MS: f64 = 250.0;
/// `[learn] samples_min`'s default.
const SAMPLES_MIN: u64 = 8;

#[test]
fn the_cold_wait_counts_once_first_tokens_show_the_timing_and_over_their_slowdown() {
    let Some(f) = fleet() else { return };
    let cold = format!("cold_ms_per_idle_s = 20.0\ncold_ms_max = {COLD_MS:?}");
    let doubting = with_keys(&f, "cold-doubted", &cold, "");
    let trusting = with_keys(&f, "cold-trusted", &cold, "[learn]\ndoubt_scale_min = 0.0\n");
    let probe = token_prompt(MODEL, &tokens(9_400, 130));
    let cost2 = |router: &Kvroute| router.preview(&probe).cost(2);
    // Before any first token: the trusting router counts the whole wait, the other none.
    let idle = cost2(&doubting);
    let gap = cost2(&trusting) - idle;
    assert!((gap - COLD_MS).abs() < 1e-6, "before first tokens only the trusting router counts the wait ({gap})");
    // Fresh prompts to worker 1, one at a time: no change until the eighth answer.
    for i in 0..SAMPLES_MIN {
        // Streamed: the router times a first token only where it comes before the end.
        let mut prompt = token_prompt(MODEL, &tokens(9_410 + i, 130));
        prompt["stream"] = true.into();
        let r = http::request(
            doubting.addr(),
            "POST",
            "/v1/completions",
            &[("x-worker-id", "1")],
            Some(&prompt),
            Duration::from_secs(60),
        )
        .expect("a prompt through kvroute");
        assert_eq!(r.status, 200, "prompt {i}: {}", r.text());
        if i + 1 < SAMPLES_MIN {
            let now = cost2(&doubting);
            assert!((now - idle).abs() < 1e-6, "after {} first tokens the wait counts nothing ({now})", i + 1);
        } else {
            // The answer can reach the client a moment before its first token is fed in.
            doubting.wait(Duration::from_secs(5), "the eighth first token counts", |k| cost2(k) > idle);
            let counted = cost2(&doubting) - idle;
            eprintln!("real_vllm: the cold wait after {SAMPLES_MIN} first tokens counts {counted:.1} ms");
            assert!(
                counted > 0.0 && counted <= COLD_MS / 2.0,
                "after {SAMPLES_MIN} first tokens at least twice as late as the timing, the wait counts over \
                 that slowdown ({counted} of {COLD_MS})"
            );
        }
    }
}
