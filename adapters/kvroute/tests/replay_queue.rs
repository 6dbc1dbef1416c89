//! `kvroute replay` with the router holding requests back (`--busy-prefill-batches`,
//! `--busy-kv-share`) and ordering its queue (`--queue-order`), as `serve` does with the
//! same knobs.

use std::process::{Command, Output};

fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute")).args(args).output().expect("run kvroute")
}

const BASE: [&str; 7] = ["replay", "--bundled", "--requests", "200", "--workers", "3", "--json"];

fn check(extra: &[&str]) -> serde_json::Value {
    let out = kvroute(&[&BASE[..], extra].concat());
    assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    let mut v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    v.as_object_mut().expect("an object").remove("wall_s");
    assert_eq!(v["completed"], 200, "{extra:?}: every request completes: {v}");
    assert_eq!(v["unfinished"], 0, "{extra:?}");
    v
}

#[test]
fn holding_requests_in_the_router_changes_the_schedule() {
    let free = check(&[]);
    let held = check(&["--busy-prefill-batches", "0.1"]);
    assert_ne!(free["ttft_ms"], held["ttft_ms"], "held requests start later or elsewhere");
}

#[test]
fn the_queue_order_matters_only_when_requests_are_held() {
    assert_eq!(check(&[]), check(&["--queue-order", "wspt"]));
    let fcfs = check(&["--busy-prefill-batches", "0.1"]);
    let wspt = check(&["--busy-prefill-batches", "0.1", "--queue-order", "wspt"]);
    assert_ne!(fcfs["ttft_ms"], wspt["ttft_ms"]);
}

#[test]
fn zero_batches_is_off_as_in_serve() {
    assert_eq!(check(&[]), check(&["--busy-prefill-batches", "0"]));
}

#[test]
fn a_bad_batch_count_is_refused() {
    for bad in ["NaN", "inf", "-0.5", "lots"] {
        let out = kvroute(&[&BASE[..], &[&format!("--busy-prefill-batches={bad}")[..]]].concat());
        assert!(!out.status.success(), "{bad}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("number of batches"), "{bad}");
    }
}

#[test]
fn a_bad_queue_order_is_refused_by_name() {
    let out = kvroute(&[&BASE[..], &["--queue-order", "lifo"]].concat());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid value 'lifo' for '--queue-order") && err.contains("wspt"), "{err}");
}

#[test]
fn a_bad_kv_share_is_refused() {
    for bad in ["NaN", "inf", "-0.5", "lots"] {
        let out = kvroute(&[&BASE[..], &[&format!("--busy-kv-share={bad}")[..]]].concat());
        assert!(!out.status.success(), "{bad}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("share of KV blocks"), "{bad}");
    }
}

#[test]
fn a_kv_share_bound_passes_full_workers_over_and_zero_is_off() {
    assert_eq!(check(&[]), check(&["--busy-kv-share", "0"]));
    let bounded = check(&["--busy-kv-share", "0.1"]);
    assert_ne!(check(&[])["ttft_ms"], bounded["ttft_ms"], "full workers are passed over");
}
