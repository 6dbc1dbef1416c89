//! The verified single-worker scenarios of the mocker model (MOCKER_MODEL section 9):
//! default engine, Mooncake lines, exact TTFT / ITL / reuse figures.

use crate::common::{replay_rr, requests};

/// What one request of a scenario must show (ms, tokens); `None` = not checked.
#[derive(Default)]
struct Want {
    id: u64,
    ttft: Option<f64>,
    itl: Option<f64>,
    reused: Option<u32>,
    admitted: Option<f64>,
}

const TOL_MS: f64 = 1e-3;

#[track_caller]
fn check(trace: &str, wants: &[Want]) {
    let reqs = requests(trace);
    let report = replay_rr(&reqs, 1);
    assert_eq!(report.summary.completed as usize, reqs.len(), "every request finishes");
    assert_eq!(report.summary.preemptions, 0);
    for w in wants {
        let r = report.records.iter().find(|r| r.id == w.id).expect("request exists");
        let close = |name: &str, got: Option<f64>, want: Option<f64>| {
            if let Some(want) = want {
                let got = got.unwrap_or(f64::NAN);
                assert!((got - want).abs() < TOL_MS, "request {} {name}: got {got:.4}, want {want}", w.id);
            }
        };
        close("ttft", r.ttft_ms(), w.ttft);
        close("itl", r.itl_ms(), w.itl);
        close("admitted", r.admitted_ms, w.admitted);
        if let Some(reused) = w.reused {
            assert_eq!(r.cached_tokens, Some(reused), "request {} reused tokens", w.id);
        }
    }
}

#[test]
fn s1_to_s3_cold_then_fully_cached_then_full_budget() {
    let trace = r#"
{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}
{"timestamp": 5000, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}
{"timestamp": 10000, "input_length": 8192, "output_length": 2, "hash_ids": [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]}
"#;
    check(
        trace,
        &[
            // f_p(1024), no decode step; ITL = f_d(16/16384).
            Want { id: 0, ttft: Some(32.491), itl: Some(5.793), reused: Some(0), ..Want::default() },
            // Fully cached prompt still computes its last block: 15 of 16 hit, f_p(64).
            Want { id: 1, ttft: Some(17.475), reused: Some(960), ..Want::default() },
            // f_p(8192); then f_d(128/16384).
            Want { id: 2, ttft: Some(169.137), itl: Some(6.160), reused: Some(0), ..Want::default() },
        ],
    );
}

#[test]
fn s4_two_prompts_share_one_pass() {
    let trace = r#"
{"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]}
{"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [3, 4]}
"#;
    check(
        trace,
        &[
            Want { id: 0, ttft: Some(49.363), itl: Some(5.846), ..Want::default() },
            Want { id: 1, ttft: Some(49.363), itl: Some(5.846), ..Want::default() },
        ],
    );
}

#[test]
fn s5_mid_pass_arrival_waits_for_next_pass() {
    let trace = r#"
{"timestamp": 5000, "input_length": 1024, "output_length": 50, "hash_ids": [5, 6]}
{"timestamp": 5040, "input_length": 2048, "output_length": 3, "hash_ids": [7, 8, 9, 10]}
"#;
    // Admitted at 5000 + 32.491 + 5.793 + 5.793; mixed pass f_p(2048) + f_d(16/16384).
    check(trace, &[Want { id: 1, ttft: Some(59.232), admitted: Some(5044.076), ..Want::default() }]);
}

#[test]
fn s6_long_prompt_is_chunked() {
    let ids: Vec<String> = (11..=34).map(|i| i.to_string()).collect();
    let trace = format!(
        r#"{{"timestamp": 9000, "input_length": 12000, "output_length": 2, "hash_ids": [{}]}}"#,
        ids.join(", ")
    );
    // f_p(8192) + f_p(3808).
    check(&trace, &[Want { id: 0, ttft: Some(249.562), ..Want::default() }]);
}

#[test]
fn s7_to_s9_partial_blocks_are_never_cached() {
    let trace = r#"
{"timestamp": 0, "input_length": 1000, "output_length": 2, "hash_ids": [1, 2]}
{"timestamp": 1000, "input_length": 1000, "output_length": 2, "hash_ids": [1, 2]}
{"timestamp": 2000, "input_length": 1536, "output_length": 2, "hash_ids": [1, 2, 3]}
{"timestamp": 3000, "input_length": 1024, "output_length": 2, "hash_ids": [1, 4]}
"#;
    check(
        trace,
        &[
            // 15 full blocks cached, the partial one never is: f_p(40).
            Want { id: 1, ttft: Some(17.109), reused: Some(960), ..Want::default() },
            // Block 16 was partial before, so not cached: f_p(576).
            Want { id: 2, ttft: Some(25.387), reused: Some(960), ..Want::default() },
            // Only the first trace block is shared (8 engine blocks): f_p(512).
            Want { id: 3, ttft: Some(24.386), reused: Some(512), ..Want::default() },
        ],
    );
}
