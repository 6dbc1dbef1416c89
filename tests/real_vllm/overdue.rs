//! The overdue rule on a real engine. kvroute credits a busy worker with the prompt
//! tokens its timing model says it has computed, up to one pass past the prefills seen
//! finish. vLLM's CPU build prefills far slower than that model (a GPU's, by default):
//! here a 1,900-token prompt takes seconds where the model says about 40 ms. Once the
//! model runs `overdue_grace_passes` (3) passes ahead of the first token, kvroute counts
//! all but `overdue_pass_share` of that pass as queued again, so a worker whose engine is
//! late does not look idle. The preview shows it: a row's `prefill_blocks` is the queued
//! tokens kvroute believes in plus the probe's own, in blocks.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::engine::{BLOCK_TOKENS, MODEL};
use crate::fleet::{fleet, token_prompt, tokens, Fleet, Preview};
use crate::http;
use crate::router::{build_binary, config, Kvroute};

/// The late prompt's length: one pass (the config's batch is 8,192) that fits the
/// engines' 2,048-token context with its 2 output tokens.
const LATE_TOKENS: usize = 1_900;
/// The model is 4–5 passes past the first token by about 200 ms; from here on the rule
/// has fully applied (samples are counted from when the prompt was sent).
const LATE_FROM_MS: u64 = 400;
/// Samples this close to the answer may already have seen the first token.
const ANSWER_MARGIN_MS: u64 = 300;

/// Worker 1's queued prompt tokens by kvroute's preview, in time order, while a fresh
/// prompt pinned there is served, and when its answer came.
struct Served {
    samples: Vec<(u64, f64)>,
    answered_ms: u64,
}

#[test]
fn a_late_engines_pass_counts_as_queued_by_the_overdue_share() {
    let Some(f) = fleet() else { return };
    // (overdue_pass_share, or the default; share of the late pass still queued).
    for (row, &(share, queued_share)) in [(None, 0.5), (Some(1.0), 0.0), (Some(0.0), 1.0)].iter().enumerate() {
        let seed = 9_100 + 10 * row as u64;
        match share {
            None => check(&f.router, seed, "the default", queued_share),
            Some(s) => {
                let router = with_keys(&f, &format!("overdue-{s}"), &format!("overdue_pass_share = {s:?}"), "");
                check(&router, seed, &format!("overdue_pass_share = {s}"), queued_share);
            }
        }
    }
}

/// Sends a fresh late prompt to worker 1 through `router` and checks what it believed
/// was queued there: the whole prompt when booked, none while the model is within its
/// grace, `queued_share` of it once the engine is late, and none after the answer.
fn check(router: &Kvroute, seed: u64, what: &str, queued_share: f64) {
    let late = token_prompt(MODEL, &tokens(seed, LATE_TOKENS));
    let probe = token_prompt(MODEL, &tokens(seed + 1, 130));
    assert_eq!(router.preview(&late).overlap(1), 0, "{what}: the late prompt is fresh on worker 1");
    let own = router.preview(&probe).isl_tokens() as f64;
    let queued = |p: &Preview| p.prefill_blocks(1) * BLOCK_TOKENS as f64 - own;
    let served = serve_sampling(router, &late, &probe, queued);
    let in_window = |lo: u64, hi: u64| served.samples.iter().filter(move |(t, _)| (lo..hi).contains(t)).map(|s| s.1);
    let late_end = served.answered_ms.saturating_sub(ANSWER_MARGIN_MS);
    let late_samples: Vec<f64> = in_window(LATE_FROM_MS, late_end).collect();
    assert!(
        late_samples.len() >= 3,
        "{what}: vLLM answered {LATE_TOKENS} tokens in {} ms, too soon to see it late (samples {:?}); the host is \
         faster than this test assumes",
        served.answered_ms,
        served.samples
    );
    // The model credits about 50 tokens a ms from the booking on, so the first sample
    // after it sees most of the prompt, not all.
    let booked = served.samples.iter().map(|s| s.1).fold(0.0, f64::max);
    let (lo, hi) = (LATE_TOKENS as f64 / 2.0, LATE_TOKENS as f64 + 1.0);
    assert!((lo..hi).contains(&booked), "{what}: the booking shows ({booked} of {LATE_TOKENS} tokens queued at most)");
    let booked_ms = served.samples.iter().find(|s| s.1 > lo).map_or(0, |s| s.0);
    let trusted = in_window(booked_ms, LATE_FROM_MS).fold(f64::INFINITY, f64::min);
    assert!(trusted < 1.0, "{what}: within the grace the model's progress is trusted (least queued {trusted})");
    eprintln!(
        "real_vllm: {what}: answered in {} ms; queued once late {:?} ({} samples)",
        served.answered_ms,
        late_samples.first(),
        late_samples.len()
    );
    let want = queued_share * LATE_TOKENS as f64;
    for q in &late_samples {
        assert!((q - want).abs() < 1.0, "{what}: once late, {want} tokens queued, saw {q} ({:?})", served.samples);
    }
    // The answer releases the booking.
    let t0 = Instant::now();
    while queued(&router.preview(&probe)) > 0.5 {
        assert!(t0.elapsed() < Duration::from_secs(10), "{what}: worker 1's booking was never released");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `late` pinned to worker 1 through `router` and previews `probe` until it is
/// answered: worker 1's `queued(preview)` by ms since the send.
fn serve_sampling(router: &Kvroute, late: &Value, probe: &Value, queued: impl Fn(&Preview) -> f64) -> Served {
    let (addr, body) = (router.addr(), late.clone());
    let t0 = Instant::now();
    let answer = std::thread::spawn(move || send_pinned(addr, &body));
    let mut samples = Vec::new();
    while !answer.is_finished() {
        samples.push((t0.elapsed().as_millis() as u64, queued(&router.preview(probe))));
        std::thread::sleep(Duration::from_millis(5));
    }
    let answered_ms = answer.join().expect("the late prompt's sender");
    Served { samples, answered_ms }
}

/// `body` to worker 1 through kvroute at `addr`; ms until the answer (200).
fn send_pinned(addr: SocketAddr, body: &Value) -> u64 {
    let t0 = Instant::now();
    let r =
        http::request(addr, "POST", "/v1/completions", &[("x-worker-id", "1")], Some(body), Duration::from_secs(120))
            .expect("the late prompt through kvroute");
    assert_eq!(r.status, 200, "the late prompt: {}", r.text());
    t0.elapsed().as_millis() as u64
}

/// A second kvroute over the fleet's engines, named `kvroute-<name>`, with `lines`
/// added to its router section and `sections` (whole tables) after the rest.
pub(crate) fn with_keys(f: &Fleet, name: &str, lines: &str, sections: &str) -> Kvroute {
    let dir = crate::procs::scratch_dir("kvroute-real-vllm-overdue");
    Kvroute::start_with(&build_binary(), &dir, &format!("kvroute-{name}"), |port| {
        let mode = "mode = \"kv\"\n";
        let text = config(&f.env.model, port, &f.engines);
        assert!(text.contains(mode), "the router's section is where the keys go: {text}");
        format!("{}\n{sections}", text.replacen(mode, &format!("{mode}{lines}\n"), 1))
    })
}
