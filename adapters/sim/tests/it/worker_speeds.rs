//! Heterogeneous fleets: per-worker speed factors scale every modelled duration.

use kvroute_sim::replay::{replay, Dispatch, Dispatcher, ReplayConfig, SimRequest};
use kvroute_sim::trace::{parse_str, to_requests, LoadOptions, TraceLimits};

const FIXTURE: &str = include_str!("../../fixtures/mooncake_conversation_head.jsonl");

/// Sends everything to one worker.
struct To(u32);

impl Dispatcher for To {
    fn on_arrival(&mut self, _now_ms: f64, _req: &SimRequest) -> Dispatch {
        Dispatch::To(self.0)
    }
}

/// The first request's TTFT on `worker` of a fleet with `speeds`.
#[track_caller]
fn ttft_ms(speeds: &[f64], worker: u32) -> f64 {
    let recs = parse_str(FIXTURE, &TraceLimits::default()).unwrap();
    let reqs = to_requests(&recs, &LoadOptions { requests_max: Some(1), ..LoadOptions::default() }).unwrap();
    let cfg = ReplayConfig { workers: 2, speeds: speeds.to_vec(), ..ReplayConfig::default() };
    let report = replay(&cfg, &reqs, &mut To(worker)).unwrap();
    report.records[0].ttft_ms().unwrap()
}

#[test]
fn a_half_speed_worker_takes_twice_as_long() {
    let base = ttft_ms(&[], 0);
    assert!(base > 0.0);
    // Missing entries are 1.0; the listed worker is slower, the other untouched.
    assert_eq!(ttft_ms(&[1.0, 0.5], 0), base);
    assert!((ttft_ms(&[1.0, 0.5], 1) / base - 2.0).abs() < 1e-9);
    assert!((ttft_ms(&[4.0], 0) / base - 0.25).abs() < 1e-9);
}

#[test]
fn a_bad_speed_is_a_configuration_error() {
    let cfg = ReplayConfig { workers: 2, speeds: vec![1.0, 0.0], ..ReplayConfig::default() };
    assert!(replay(&cfg, &[], &mut To(0)).is_err());
    let cfg = ReplayConfig { workers: 1, speeds: vec![f64::NAN], ..ReplayConfig::default() };
    assert!(replay(&cfg, &[], &mut To(0)).is_err());
}
