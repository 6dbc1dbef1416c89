//! `kvroute replay` on a fleet whose speeds the router is not told: fixed against
//! learned costs, and the learning flags changing nothing while switched off.

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
