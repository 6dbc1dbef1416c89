//! The TTFT lower bound agrees with its reference script on the bundled trace slice.

use std::process::Command;

use kvroute_sim::bound::ttft_lower_bounds_ms;
use kvroute_sim::engine::EngineTiming;
use kvroute_sim::stats::nearest_rank;
use kvroute_sim::trace::{read_trace, to_requests, LoadOptions, TraceLimits};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../benches/scripts/ttft_lower_bound.py");
const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/mooncake_conversation_head.jsonl");
/// The script's fleet: 8 workers of 16,384 blocks, passes of 8,192 tokens.
const FLEET_BLOCKS: u64 = 8 * 16_384;
const PASS_TOKENS: u32 = 8_192;
const TARGET_MS: f64 = 1521.0;

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

#[track_caller]
fn check(name: &str, mut rust: Vec<f64>, script: &serde_json::Value) {
    rust.sort_by(f64::total_cmp);
    let over = rust.iter().filter(|&&x| x > TARGET_MS).count() as u64;
    let got = serde_json::json!({
        "cache": name,
        "ttft_p50_ms": round1(nearest_rank(&rust, 50.0)),
        "ttft_p99_ms": round1(nearest_rank(&rust, 99.0)),
        "over_target": over,
    });
    assert_eq!(&got, script, "Rust bound (left) against the reference script (right)");
}

#[test]
fn ttft_lower_bound_matches_the_reference_script() {
    let out = Command::new("python3")
        .arg(SCRIPT)
        .arg(FIXTURE)
        .output()
        .expect("python3 runs the reference script (it needs only the standard library)");
    assert!(out.status.success(), "script failed: {}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    let text = std::fs::read(FIXTURE).expect("fixture");
    let records = read_trace(&text[..], &TraceLimits::default()).expect("fixture parses");
    let reqs = to_requests(&records, &LoadOptions::default()).expect("fixture hashes");
    assert_eq!(reqs.len(), 1500);
    check("unbounded", ttft_lower_bounds_ms(&reqs, None, PASS_TOKENS, &EngineTiming::MOCKER), &lines[0]);
    check("fleet LRU", ttft_lower_bounds_ms(&reqs, Some(FLEET_BLOCKS), PASS_TOKENS, &EngineTiming::MOCKER), &lines[1]);
}
