//! `kvroute replay` on a fleet whose speeds the router is not told: fixed against
//! learned costs, the learning flags changing nothing while switched off, and a fleet
//! far slower than its timing doubted out of a pile and not credited with a backlog its
//! first tokens deny.

use std::process::{Command, Output};

fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute")).args(args).output().expect("run kvroute")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "kvroute failed: {}", String::from_utf8_lossy(&out.stderr));
    let mut v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    v.as_object_mut().expect("an object").remove("wall_s");
    v
}

const BASE: [&str; 7] = ["replay", "--bundled", "--requests", "300", "--workers", "4", "--json"];

fn replay(extra: &[&str]) -> serde_json::Value {
    json(&kvroute(&[&BASE[..], extra].concat()))
}

fn requests(r: &serde_json::Value) -> Vec<u64> {
    r["worker_requests"].as_array().unwrap().iter().map(|n| n.as_u64().unwrap()).collect()
}

/// Writes a generated trace for one test, named so parallel tests never share it.
fn write_trace(name: &str, lines: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvroute-{name}-{}.jsonl", std::process::id()));
    std::fs::write(&path, lines).unwrap();
    path
}

/// `trace` on three workers of 256 16-token blocks, each `speed` times as fast as the CPU
/// timing the router predicts with, and `extra` flags.
fn slow_cpu_replay(trace: &std::path::Path, speed: &str, extra: &[&str]) -> serde_json::Value {
    let speeds = [speed; 3].join(",");
    let args = [
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--trace-block-tokens",
        "16",
        "--block-size",
        "16",
        "--workers",
        "3",
        "--blocks-per-worker",
        "256",
        "--engine-timing",
        "vllm-cpu",
        "--router-knows-timing",
        "--worker-speeds",
        &speeds,
        "--json",
    ];
    json(&kvroute(&[&args[..], extra].concat()))
}

/// Every one of `bad` as `flag`'s value is refused with a message naming the flag.
#[track_caller]
fn check_refused(flag: &str, bad: &[&str]) {
    for v in bad {
        let arg = format!("{flag}={v}");
        let out = kvroute(&[&BASE[..], &[arg.as_str()]].concat());
        assert!(!out.status.success(), "{arg} was accepted");
        assert!(String::from_utf8_lossy(&out.stderr).contains(flag), "{arg}");
    }
}

#[test]
fn learned_costs_route_around_workers_slower_than_the_model() {
    let speeds = ["--worker-speeds", "1,1,0.25,0.25"];
    let fixed = replay(&speeds);
    let learned = replay(&[&speeds[..], &["--learn-costs"]].concat());
    let (f, l) = (requests(&fixed), requests(&learned));
    assert!(l[2] + l[3] < f[2] + f[3], "learned sends less to the slow workers: {f:?} vs {l:?}");
    let mean = |r: &serde_json::Value| r["ttft_ms"]["mean"].as_f64().unwrap();
    assert!(mean(&learned) < mean(&fixed), "{} vs {}", mean(&learned), mean(&fixed));
}

#[test]
fn learning_knobs_without_the_switches_change_nothing() {
    let plain = replay(&[]);
    let knobs = replay(&["--learn-samples-min", "1", "--learn-half-life-ms", "10", "--worker-speeds", "1,1"]);
    assert_eq!(plain, knobs);
}

#[test]
fn a_bad_speed_is_refused() {
    let out = kvroute(&[&BASE[..], &["--worker-speeds", "1,0"]].concat());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--worker-speeds"));
}

/// Twenty chats of five turns, a new one every 2.3 s, each turn 1.3 s after the last
/// ends, on 16-token blocks: light traffic whose follow-ups stay with their history.
fn chats_trace() -> std::path::PathBuf {
    let mut lines = String::new();
    let mut recs = Vec::new();
    for s in 0..20u64 {
        let mut ids: Vec<u64> = (s * 100..s * 100 + 12).collect();
        for k in 0..5u64 {
            if k > 0 {
                ids.extend([s * 100 + 50 + 2 * k, s * 100 + 51 + 2 * k]);
            }
            let at = s as f64 * 2300.0 + k as f64 * 1500.0;
            let delay = if k > 0 { r#","delay":1300.0"# } else { "" };
            let line = format!(
                r#"{{"timestamp":{at},"input_length":{},"output_length":8,"hash_ids":{ids:?},"session_id":"c{s}"{delay}}}"#,
                16 * ids.len() - 5
            );
            recs.push((at, line));
        }
    }
    recs.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (_, l) in recs {
        lines.push_str(&l);
        lines.push('\n');
    }
    write_trace("doubt-chats", &lines)
}

#[test]
fn a_fleet_far_slower_than_its_timing_is_doubted_out_of_a_pile() {
    let trace = chats_trace();
    let run = |doubt: &str| slow_cpu_replay(&trace, "0.2", &["--learn-doubt-scale-min", doubt]);
    let (trusting, doubting) = (run("0"), run("2"));
    std::fs::remove_file(&trace).ok();
    let (t, d) = (requests(&trusting), requests(&doubting));
    // Five times slower than predicted, a queue of several chats still looks cheaper
    // than an idle worker's cold wait, unless that wait is weighed as the wall time it is.
    assert_eq!(t.iter().max(), Some(&100), "trusting piles every turn on one worker: {t:?}");
    assert!(d.iter().all(|&n| n < 60), "doubting spreads them: {d:?}");
    let f = |r: &serde_json::Value, k: &str| r[k]["mean"].as_f64().unwrap();
    assert!(f(&doubting, "ttft_ms") < f(&trusting, "ttft_ms"));
    assert!(f(&doubting, "e2e_ms") < f(&trusting, "e2e_ms"));
    assert_eq!(trusting["prefix_reuse_ratio"], doubting["prefix_reuse_ratio"], "follow-ups keep their history");
}

#[test]
fn a_bad_doubt_scale_is_refused() {
    check_refused("--learn-doubt-scale-min", &["0.5", "-1", "inf", "NaN"]);
}

/// Twenty-five bursts of four 384-token prompts, 6 s apart, sharing a 64-token opening.
fn bursts_trace() -> std::path::PathBuf {
    let mut lines = String::new();
    for b in 0..25u64 {
        for k in 0..4u64 {
            let n = b * 4 + k;
            let ids: Vec<u64> = [0, 1, 2, 3].into_iter().chain(100 + n * 20..120 + n * 20).collect();
            let at = b as f64 * 6000.0;
            lines.push_str(&format!(r#"{{"timestamp":{at},"input_length":384,"output_length":8,"hash_ids":{ids:?}}}"#));
            lines.push('\n');
        }
    }
    write_trace("overdue-bursts", &lines)
}

#[test]
fn a_worker_whose_first_tokens_stay_away_is_not_credited_with_its_backlog() {
    // Engines 33 times slower than the CPU timing the router predicts with: trusting
    // it, a backlog reads as computed long before it is, and the queues pile up. Doubt
    // off keeps the timing, and its cold charge, trusted throughout; with the default
    // doubt the cold charge waits for first tokens and the pile is smaller (share 0.5
    // then gives 0.76 of share 1's TTFT at 1.02 of its end-to-end time).
    let trace = bursts_trace();
    let run =
        |share: &str| slow_cpu_replay(&trace, "0.03", &["--overdue-pass-share", share, "--learn-doubt-scale-min", "0"]);
    let (trusting, default) = (run("1"), run("0.5"));
    std::fs::remove_file(&trace).ok();
    let f = |r: &serde_json::Value, k: &str| r[k]["mean"].as_f64().unwrap();
    assert!(
        f(&default, "ttft_ms") < 0.7 * f(&trusting, "ttft_ms"),
        "{} vs {}",
        f(&default, "ttft_ms"),
        f(&trusting, "ttft_ms")
    );
    assert!(f(&default, "e2e_ms") < f(&trusting, "e2e_ms"), "{} vs {}", f(&default, "e2e_ms"), f(&trusting, "e2e_ms"));
    let hits = |r: &serde_json::Value| r["prefix_reuse_ratio"].as_f64().unwrap();
    assert!(hits(&default) >= hits(&trusting), "{} vs {}", hits(&default), hits(&trusting));
}

#[test]
fn a_bad_overdue_share_is_refused() {
    check_refused("--overdue-pass-share", &["1.5", "-0.1", "nan"]);
}
