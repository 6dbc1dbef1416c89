//! The replay loop: determinism, event lag, queueing dispatchers and timeouts,
//! rejections, prefill/decode splits, the step bound.

use kvroute_sim::engine::{EngineConfig, EngineRole, KvEvent};
use kvroute_sim::replay::{replay, Dispatch, Dispatcher, ReplayConfig, SimRequest, WorkerLoadSample};
use kvroute_sim::synth::{generate, SynthConfig};
use kvroute_sim::trace::{parse_str, to_requests, LoadOptions, TraceLimits};

use crate::common::RoundRobin;

const FIXTURE: &str = include_str!("../../fixtures/mooncake_conversation_head.jsonl");

fn fixture(n: usize, speedup: f64) -> Vec<SimRequest> {
    let recs = parse_str(FIXTURE, &TraceLimits::default()).unwrap();
    assert_eq!(recs.len(), 1500);
    to_requests(&recs, &LoadOptions { speedup, requests_max: Some(n), ..LoadOptions::default() }).unwrap()
}

fn rr(n: u32) -> RoundRobin {
    RoundRobin::new(n)
}

#[test]
fn same_inputs_same_bytes() {
    let reqs = fixture(400, 4.0);
    let cfg = ReplayConfig { workers: 3, kv_event_lag_ms: 2.5, ..ReplayConfig::default() };
    let a = serde_json::to_string(&replay(&cfg, &reqs, &mut rr(3)).unwrap()).unwrap();
    let b = serde_json::to_string(&replay(&cfg, &reqs, &mut rr(3)).unwrap()).unwrap();
    assert_eq!(a, b);
    let synth = to_requests(
        &generate(&SynthConfig { duration_ms: 5_000.0, ..SynthConfig::default() }),
        &LoadOptions::default(),
    )
    .unwrap();
    let c = serde_json::to_string(&replay(&cfg, &synth, &mut rr(3)).unwrap()).unwrap();
    let d = serde_json::to_string(&replay(&cfg, &synth, &mut rr(3)).unwrap()).unwrap();
    assert_eq!(c, d);
}

#[test]
fn fixture_replay_is_sane() {
    let reqs = fixture(400, 1.0);
    let report = replay(&ReplayConfig { workers: 4, ..ReplayConfig::default() }, &reqs, &mut rr(4)).unwrap();
    let s = &report.summary;
    assert_eq!((s.completed, s.rejected, s.unfinished), (400, 0, 0));
    assert!(!report.truncated);
    // Every prompt shares its first trace block (512 of ~12k tokens) at least.
    assert!(s.prefix_reuse_ratio > 0.02 && s.prefix_reuse_ratio < 0.5, "{}", s.prefix_reuse_ratio);
    assert!(s.ttft_ms.p50 > 16.5 && s.ttft_ms.p50 <= s.ttft_ms.p99 && s.ttft_ms.p99 <= s.ttft_ms.max);
    assert!(s.itl_ms.mean >= 5.74, "a decode step takes at least f_d(0)");
    let tokens: u64 = reqs.iter().map(|r| u64::from(r.output_len.max(1))).sum();
    assert_eq!(report.records.iter().map(|r| u64::from(r.output_tokens)).sum::<u64>(), tokens);
    assert_eq!(report.workers.iter().map(|w| w.requests).sum::<u64>(), 400);
}

/// Records when each KV event reached the dispatcher.
struct Recorder {
    inner: RoundRobin,
    seen: Vec<(u32, u64, f64)>,
    stored: u64,
    peak_active_blocks: u32,
}

impl Dispatcher for Recorder {
    fn on_arrival(&mut self, now_ms: f64, req: &SimRequest) -> Dispatch {
        self.inner.on_arrival(now_ms, req)
    }
    fn on_worker_load(&mut self, _now_ms: f64, _worker: u32, load: WorkerLoadSample) {
        assert!(load.active_blocks + load.inactive_blocks <= 16_384);
        self.peak_active_blocks = self.peak_active_blocks.max(load.active_blocks);
    }
    fn on_kv_event(&mut self, now_ms: f64, worker: u32, event_id: u64, event: &KvEvent) {
        self.seen.push((worker, event_id, now_ms));
        if let KvEvent::Stored { blocks, .. } = event {
            self.stored += blocks.len() as u64;
        }
    }
}

#[test]
fn kv_events_arrive_after_the_lag_in_order() {
    let reqs = fixture(150, 2.0);
    let run = |lag: f64| {
        let mut d = Recorder { inner: rr(2), seen: Vec::new(), stored: 0, peak_active_blocks: 0 };
        let cfg = ReplayConfig { workers: 2, kv_event_lag_ms: lag, ..ReplayConfig::default() };
        let report = replay(&cfg, &reqs, &mut d).unwrap();
        let stored: u64 = report.workers.iter().map(|w| w.engine.stored_blocks).sum();
        assert_eq!(d.stored, stored, "every stored block is delivered");
        assert!(d.peak_active_blocks > 100, "load samples show the running prompts");
        for w in 0..2 {
            // Delivery order per worker is event-id order, with none missing.
            let ids: Vec<u64> = d.seen.iter().filter(|e| e.0 == w).map(|e| e.1).collect();
            assert_eq!(ids, (0..ids.len() as u64).collect::<Vec<_>>(), "worker {w}");
        }
        d.seen.sort_by_key(|&(w, id, _)| (w, id));
        d.seen
    };
    let now = run(0.0);
    let later = run(7.0);
    assert_eq!(now.len(), later.len());
    for (a, b) in now.iter().zip(&later) {
        assert_eq!((a.0, a.1), (b.0, b.1));
        assert!((b.2 - a.2 - 7.0).abs() < 1e-9, "event {:?} delivered at {} vs {}", (a.0, a.1), b.2, a.2);
    }
}

/// Holds every request, releasing one per 100 ms tick; rejects odd ids; sends one
/// bogus answer.
#[derive(Default)]
struct Gate {
    queue: std::collections::VecDeque<u64>,
    release_at: Option<f64>,
    open: u32,
    bogus_sent: bool,
    finished: u64,
    prefill_done: u64,
}

impl Dispatcher for Gate {
    fn on_arrival(&mut self, now_ms: f64, req: &SimRequest) -> Dispatch {
        if req.id % 2 == 1 {
            return Dispatch::Reject;
        }
        self.queue.push_back(req.id);
        self.release_at.get_or_insert(now_ms + 100.0);
        Dispatch::Queued
    }
    fn on_prefill_done(&mut self, _now_ms: f64, _worker: u32, _req_id: u64) {
        self.prefill_done += 1;
    }
    fn on_finished(&mut self, _now_ms: f64, _worker: u32, _req_id: u64) {
        self.finished += 1;
    }
    fn poll_dispatch(&mut self, _now_ms: f64) -> Option<(u64, Dispatch)> {
        if !self.bogus_sent {
            self.bogus_sent = true;
            return Some((u64::MAX, Dispatch::To(0)));
        }
        if self.open == 0 {
            return None;
        }
        self.open -= 1;
        let id = self.queue.pop_front()?;
        Some((id, Dispatch::To((id / 2 % 2) as u32)))
    }
    fn next_timeout(&self) -> Option<f64> {
        self.release_at
    }
    fn on_timeout(&mut self, now_ms: f64) {
        match self.release_at {
            Some(t) if t <= now_ms => {
                self.open += 1;
                self.release_at = if self.queue.len() > 1 { Some(now_ms + 100.0) } else { None };
            }
            _ => {}
        }
    }
}

#[test]
fn queued_dispatch_timeouts_and_rejections() {
    let reqs = fixture(40, 1.0);
    let mut gate = Gate::default();
    let report = replay(&ReplayConfig { workers: 2, ..ReplayConfig::default() }, &reqs, &mut gate).unwrap();
    let s = &report.summary;
    assert_eq!((s.completed, s.rejected, s.unfinished), (20, 20, 0));
    assert_eq!(report.invalid_dispatches, 1);
    assert_eq!((gate.finished, gate.prefill_done), (20, 20));
    for r in report.records.iter().filter(|r| !r.rejected) {
        // Released on a 100 ms tick, so the wait shows in the TTFT.
        assert!(r.ttft_ms().unwrap() >= 100.0 - 1e-9, "request {} ttft {:?}", r.id, r.ttft_ms());
    }
}

/// Prefill on worker 0, decode on worker 1.
struct Splitter {
    finished_on: Vec<u32>,
}

impl Dispatcher for Splitter {
    fn on_arrival(&mut self, _now_ms: f64, _req: &SimRequest) -> Dispatch {
        Dispatch::Split { prefill: 0, decode: 1 }
    }
    fn on_finished(&mut self, _now_ms: f64, worker: u32, _req_id: u64) {
        self.finished_on.push(worker);
    }
}

#[test]
fn split_requests_prefill_then_decode() {
    let reqs = fixture(30, 1.0);
    let cfg =
        ReplayConfig { workers: 2, roles: vec![EngineRole::Prefill, EngineRole::Decode], ..ReplayConfig::default() };
    let mut d = Splitter { finished_on: Vec::new() };
    let report = replay(&cfg, &reqs, &mut d).unwrap();
    assert_eq!(report.summary.completed, 30);
    for (r, q) in report.records.iter().zip(&reqs) {
        assert_eq!(r.output_tokens, q.output_len.max(1), "request {}", r.id);
        assert_eq!(r.worker, Some(1));
        assert!(r.cached_tokens.is_some());
    }
    let multi = reqs.iter().filter(|r| r.output_len > 1).count();
    assert_eq!(d.finished_on.iter().filter(|&&w| w == 0).count(), 30);
    assert_eq!(d.finished_on.iter().filter(|&&w| w == 1).count(), multi);
    assert_eq!(report.workers[0].engine.preemptions + report.workers[1].engine.preemptions, report.summary.preemptions);
}

#[test]
fn step_bound_stops_a_long_run() {
    let reqs = fixture(50, 1.0);
    let cfg = ReplayConfig { workers: 2, steps_max: 100, ..ReplayConfig::default() };
    let report = replay(&cfg, &reqs, &mut rr(2)).unwrap();
    assert!(report.truncated);
    assert_eq!(report.steps, 100);
    assert!(report.summary.unfinished > 0);
}

/// Sends everything to one worker and counts what comes back.
struct Fixed {
    to: Dispatch,
    finished: u64,
}

impl Dispatcher for Fixed {
    fn on_arrival(&mut self, _now_ms: f64, _req: &SimRequest) -> Dispatch {
        self.to
    }
    fn on_finished(&mut self, _now_ms: f64, _worker: u32, _req_id: u64) {
        self.finished += 1;
    }
}

#[test]
fn wrong_roles_are_invalid_and_engine_refusals_are_reported() {
    let reqs = fixture(10, 1.0);
    let split =
        ReplayConfig { workers: 2, roles: vec![EngineRole::Prefill, EngineRole::Decode], ..ReplayConfig::default() };
    for to in [Dispatch::To(0), Dispatch::Split { prefill: 1, decode: 0 }, Dispatch::To(9)] {
        let mut d = Fixed { to, finished: 0 };
        let report = replay(&split, &reqs, &mut d).unwrap();
        assert_eq!((report.invalid_dispatches, report.summary.rejected), (10, 10), "{to:?}");
        assert_eq!(d.finished, 0);
    }
    // A pool of 4 blocks of 64 tokens cannot hold any of these prompts.
    let tiny = ReplayConfig {
        workers: 1,
        engine: EngineConfig { blocks_per_worker: 4, ..EngineConfig::default() },
        ..ReplayConfig::default()
    };
    let mut d = Fixed { to: Dispatch::To(0), finished: 0 };
    let report = replay(&tiny, &reqs, &mut d).unwrap();
    assert_eq!((report.invalid_dispatches, report.summary.rejected, d.finished), (0, 10, 10));
}
