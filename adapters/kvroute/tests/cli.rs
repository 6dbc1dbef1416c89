//! The `kvroute` binary as a user runs it: real processes, real arguments.

use std::process::{Command, Output};

fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute")).args(args).output().expect("run kvroute")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "kvroute failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout.clone()).expect("utf-8 stdout");
    assert_eq!(text.trim().lines().count(), 1, "exactly one JSON object on stdout, got:\n{text}");
    serde_json::from_str(text.trim()).expect("stdout is JSON")
}

fn without_wall(mut v: serde_json::Value) -> serde_json::Value {
    if let Some(o) = v.as_object_mut() {
        o.remove("wall_s");
    }
    v
}

#[test]
fn replay_json_has_the_documented_keys_and_is_deterministic() {
    let args = ["replay", "--bundled", "--requests", "300", "--workers", "4", "--json", "--seed", "7"];
    let a = json(&kvroute(&args));
    for key in [
        "policy",
        "workers",
        "requests",
        "completed",
        "rejected",
        "prefix_reuse_ratio",
        "ttft_ms",
        "itl_ms",
        "e2e_ms",
        "output_tokens_per_s",
        "sim_duration_s",
        "wall_s",
        "pooled_reuse_ratio",
        "infinite_reuse_ratio",
    ] {
        assert!(a.get(key).is_some(), "missing key {key} in {a}");
    }
    for key in ["mean", "p50", "p90", "p99", "max"] {
        assert!(a["ttft_ms"].get(key).is_some(), "ttft_ms.{key}");
    }
    assert_eq!(a["requests"], 300);
    assert_eq!(a["completed"], 300, "every request completes on an idle fleet");
    let b = json(&kvroute(&args));
    assert_eq!(without_wall(a), without_wall(b), "same inputs and seed give the same report");
}

#[test]
fn weighted_replays_and_every_run_reports_its_regret() {
    let out = json(&kvroute(&[
        "replay",
        "--bundled",
        "--requests",
        "200",
        "--workers",
        "4",
        "--policy",
        "weighted",
        "--json",
    ]));
    assert_eq!(out["policy"], "weighted");
    assert_eq!(out["completed"], 200, "{out}");
    let bound = &out["ttft_lower_bound_ms"];
    let (b50, b99) = (bound["p50"].as_f64().unwrap(), bound["p99"].as_f64().unwrap());
    assert!(0.0 < b50 && b50 <= b99, "{bound}");
    // No router beats the bound: a replay's TTFT is at least the bound's at each percentile.
    let regret = &out["regret"];
    for (p, key) in [("p50", "ttft_p50_ms"), ("p99", "ttft_p99_ms")] {
        let got = out["ttft_ms"][p].as_f64().unwrap() - bound[p].as_f64().unwrap();
        assert!((regret[key].as_f64().unwrap() - got).abs() < 1e-6, "{key}: {regret}");
        assert!(got >= 0.0, "{p} below its lower bound: {out}");
    }
    let reuse_gap = out["pooled_reuse_ratio"].as_f64().unwrap() - out["prefix_reuse_ratio"].as_f64().unwrap();
    assert!((regret["reuse"].as_f64().unwrap() - reuse_gap).abs() < 1e-6, "{regret}");
}

const COMPARE: [&str; 8] =
    ["replay", "--synthetic", "--requests", "200", "--workers", "3", "--compare", "kv,round-robin"];

#[test]
fn compare_prints_each_policy() {
    let out = json(&kvroute(&[&COMPARE[..], &["--json"]].concat()));
    let runs = out["runs"].as_array().expect("runs");
    let names: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["kv", "round-robin"]);
    let reuse = |i: usize| runs[i]["prefix_reuse_ratio"].as_f64().unwrap();
    assert!(
        reuse(0) >= reuse(1),
        "kv routing reuses at least as much cache as round-robin: {} vs {}",
        reuse(0),
        reuse(1)
    );
    for run in runs {
        let (bound, regret) = (&run["ttft_lower_bound_ms"], &run["regret"]);
        let gap = run["pooled_reuse_ratio"].as_f64().unwrap() - run["prefix_reuse_ratio"].as_f64().unwrap();
        assert!((regret["reuse"].as_f64().unwrap() - gap).abs() < 1e-6, "{run}");
        let p99 = run["ttft_ms"]["p99"].as_f64().unwrap() - bound["p99"].as_f64().unwrap();
        assert!((regret["ttft_p99_ms"].as_f64().unwrap() - p99).abs() < 1e-6, "{run}");
    }
}

/// The text report fits an ordinary terminal and shows each policy's regret, with the
/// JSON report's figures.
#[test]
fn compare_prints_its_regret_within_100_columns() {
    let runs = json(&kvroute(&[&COMPARE[..], &["--json"]].concat()))["runs"].clone();
    let out = kvroute(&COMPARE);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    for line in text.lines() {
        assert!(line.chars().count() <= 100, "{} columns: {line:?}", line.chars().count());
    }
    let regret = text.split("regret against the bounds").nth(1).unwrap_or_else(|| panic!("no regret:\n{text}"));
    for run in runs.as_array().expect("runs") {
        let name = run["policy"].as_str().unwrap();
        let row = regret.lines().find(|l| l.split_whitespace().next() == Some(name));
        let cells: Vec<f64> = row
            .unwrap_or_else(|| panic!("no regret row for {name}:\n{text}"))
            .split_whitespace()
            .skip(1)
            .map(|c| c.parse().expect("a number"))
            .collect();
        let g = &run["regret"];
        let want =
            [g["reuse"].as_f64().unwrap(), g["ttft_p50_ms"].as_f64().unwrap(), g["ttft_p99_ms"].as_f64().unwrap()];
        for (got, want) in cells.iter().zip(want) {
            assert!((got - want).abs() <= 0.051, "{name}: {cells:?} against {want}");
        }
        assert_eq!(cells.len(), 3, "{name}: {cells:?}");
    }
}

#[test]
fn disaggregated_replay_splits_long_prompts_and_bypasses_short_ones() {
    let out = json(&kvroute(&[
        "replay",
        "--bundled",
        "--requests",
        "300",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "3",
        "--json",
    ]));
    assert_eq!(out["workers"], 4);
    assert_eq!(out["completed"], 300);
    let d = &out["disagg"];
    let split = d["split"].as_u64().unwrap();
    let short = d["bypass_short_prompt"].as_u64().unwrap();
    assert!(split > 0 && short > 0, "both paths taken: {d}");
    assert_eq!(
        split + short + d["bypass_prefill_busy"].as_u64().unwrap() + d["bypass_no_prefill_workers"].as_u64().unwrap(),
        300
    );
}

#[test]
fn live_demo_routes_over_http_and_finishes_every_request() {
    let out = json(&kvroute(&["demo", "--duration", "8", "--speedup", "1", "--requests", "40", "--json"]));
    assert_eq!(out["mode"], "live");
    for p in ["kv", "round-robin"] {
        let r = &out["policies"][p];
        assert_eq!(r["requests"], 40, "{p}: {r}");
        assert_eq!(r["completed"], 40, "{p}: {r}");
        assert_eq!(r["errors"], 0, "{p}: {r}");
        assert!(r["ttft_ms"]["p50"].as_f64().unwrap() > 0.0, "{p}: {r}");
    }
}

#[test]
fn demo_json_has_both_policies() {
    let out = json(&kvroute(&["demo", "--offline", "--requests", "200", "--json"]));
    for p in ["kv", "round-robin"] {
        let r = &out["policies"][p];
        assert_eq!(r["requests"], 200, "{p}");
        assert_eq!(r["errors"], 0, "{p}");
        assert!(r["prefix_reuse_ratio"].as_f64().is_some(), "{p}");
        assert!(r["ttft_ms"]["p99"].as_f64().unwrap() > 0.0, "{p}");
    }
}

/// `--plot` draws the TTFT CDF, the imbalance curves and one worker × time heatmap per
/// policy, shaded by load (240 time slices per worker).
#[test]
fn plot_draws_a_heatmap_per_policy() {
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("plot-{}.svg", std::process::id()));
    let out = kvroute(&[&COMPARE[..], &["--plot", path.to_str().expect("utf-8 path")]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let svg = std::fs::read_to_string(&path).expect("the plot is written");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "an SVG document");
    for title in [
        "TTFT CDF",
        "load imbalance: busiest worker / mean",
        "kv: active KV blocks per worker",
        "round-robin: active KV blocks per worker",
    ] {
        assert!(svg.contains(title), "no {title:?}");
    }
    let fills: std::collections::BTreeSet<&str> =
        svg.split("<rect").skip(1).filter_map(|r| r.split("fill=\"").nth(1)?.split('"').next()).collect();
    let cells = svg.matches("<rect").count();
    assert!(cells >= 2 * 3 * 240, "{cells} rectangles for 2 policies × 3 workers × 240 slices");
    assert!(fills.len() > 10, "the heatmaps are shaded by load: {} fills", fills.len());
    let _ = std::fs::remove_file(&path);
}

#[test]
fn the_offline_demo_fits_100_columns() {
    let out = kvroute(&["demo", "--offline", "--requests", "200"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert!(text.contains("kv vs round-robin"), "{text}");
    for line in text.lines() {
        assert!(line.chars().count() <= 100, "{} columns: {line:?}", line.chars().count());
    }
}

#[track_caller]
fn check_error(args: &[&str], want: &str) {
    let out = kvroute(args);
    assert!(!out.status.success(), "{args:?} should fail");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(want), "{args:?}: stderr should mention {want:?}, got:\n{err}");
}

#[test]
fn bad_input_gets_a_clear_error() {
    check_error(&["replay"], "choose a workload");
    check_error(&["replay", "--trace", "no/such/trace.jsonl"], "cannot open trace no/such/trace.jsonl");
    check_error(&["replay", "--bundled", "--policy", "fastest"], "unknown policy");
    check_error(&["replay", "--bundled", "--policy", "direct"], "a trace names no workers");
    check_error(&["replay", "--bundled", "--block-size", "48"], "block size 48");
    check_error(&["replay", "--bundled", "--speedup", "0"], "--speedup must be a positive number");
    check_error(&["replay", "--bundled", "--workers", "0"], "--workers must be at least 1");
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\nnot json\n",
    )
    .unwrap();
    check_error(&["replay", "--trace", bad.to_str().unwrap()], "line 2");
}

#[test]
fn help_teaches() {
    let out = kvroute(&["--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("demo") && text.contains("replay"), "{text}");
    let out = kvroute(&["replay", "--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Examples:") && text.contains("--compare"), "{text}");
    let out = kvroute(&["--version"]);
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("kvroute "));
}
