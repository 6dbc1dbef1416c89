//! With a timing model that has a cold term (the CPU build's), a worker that has been
//! idle pays the wait its first pass takes, and one whose backlog began idle keeps
//! paying it until that first pass is over.

use super::*;
use crate::learn::DOUBT_SCALE_MIN;
use crate::{Observation, TtftModel};

/// What worker 0 or 1 has done before the request `check` routes.
#[derive(Clone, Copy, Debug)]
enum Past {
    /// Nothing.
    Never,
    /// Ran a request that ended at this many ms.
    EndedAt(u64),
    /// Runs a request booked at 0 (when it had run nothing); `true` once its prefill
    /// is done.
    Running(bool),
}

fn at(ms: u64) -> Instant {
    T0.add_ms(ms)
}

/// Request `id` on `worker`, with blocks no one holds, as `past` says.
fn live(r: &mut Router, id: u64, worker: u64, past: Past) {
    let mut q = req(id, &[id * 100, id * 100 + 1, id * 100 + 2]);
    q.hints.decode_worker_id = Some(WorkerId(worker));
    let run = |r: &mut Router| {
        let d = routed(r.handle_request(T0, q, Draw(0)));
        r.handle_dispatched(T0, d.id, d.phase).unwrap();
        d
    };
    match past {
        Past::Never => {}
        Past::EndedAt(ms) => {
            let d = run(r);
            r.handle_prefill_done(T0, d.id, d.phase).unwrap();
            r.handle_finished(at(ms), d.id, d.phase).unwrap();
        }
        Past::Running(prefilled) => {
            let d = run(r);
            if prefilled {
                r.handle_prefill_done(T0, d.id, d.phase).unwrap();
            }
        }
    }
}

/// Two workers on the CPU build's timing with `past`, and `holder` (if any) holding
/// all three blocks of a request sent at `now_ms`, which goes to `want`. `cold` off
/// runs the same with no cold term. Worker 0's first tokens have shown the timing true.
#[track_caller]
fn check(past: [Past; 2], holder: Option<u64>, now_ms: u64, cold: bool, want: u64) {
    check_with(past, holder, now_ms, cold, (DOUBT_SCALE_MIN, TIMED), want);
}

/// First tokens that show the timing, as many as the learner needs.
const TIMED: u32 = 8;

/// [`check`] with the learner's `doubt_scale_min` and as many first tokens on worker
/// 0, each as the timing predicts.
#[track_caller]
fn check_with(past: [Past; 2], holder: Option<u64>, now_ms: u64, cold: bool, learn: (f64, u32), want: u64) {
    let (doubt_scale_min, samples) = learn;
    let mut cfg = RouterConfig { mode: RouterMode::Kv, ..RouterConfig::default() };
    cfg.cost.timing = TtftModel::vllm_cpu();
    cfg.learn.doubt_scale_min = doubt_scale_min;
    if !cold {
        cfg.cost.timing.cold_ms_max = 0.0;
    }
    let predicted_ms = cfg.cost.timing.chunked_prefill_ms(200.0, cfg.cost.timing.max_batched_tokens_default).0;
    let mut r = router_with(cfg, 2);
    for _ in 0..samples {
        let obs = Observation::FirstToken { ttft_ms: predicted_ms, uncached_tokens: 200, queued_tokens: 0 };
        r.handle_observation(T0, WorkerKey::new(0, 0), obs).unwrap();
    }
    for (w, p) in past.into_iter().enumerate() {
        live(&mut r, w as u64 + 1, w as u64, p);
    }
    if let Some(w) = holder {
        store(&mut r, w, 900..=902);
    }
    let d = routed(r.handle_request(at(now_ms), req(9, &[900, 901, 902]), Draw(0)));
    assert_eq!(d.target.worker.0, want, "{past:?}, holder {holder:?}, at {now_ms} ms, cold {cold}, learn {learn:?}");
    invariants(&r);
}

#[test]
fn an_idle_worker_pays_its_cold_wait() {
    use Past::{EndedAt, Never, Running};
    // A second idle costs 20 ms, a worker never used the cap, 250.
    check([EndedAt(0), Never], None, 1_000, true, 0);
    check([Never, EndedAt(0)], None, 1_000, true, 1);
    // Idle 10 s (200 ms) against 1 s (20 ms).
    check([EndedAt(0), EndedAt(9_000)], None, 10_000, true, 1);
    check([EndedAt(9_000), EndedAt(0)], None, 10_000, true, 0);
    // A worker decoding one request is cheaper than a cold one...
    check([Running(true), Never], None, 0, true, 0);
    // ...unless that request's first pass, which began cold, is still running: the
    // wait behind it includes the 250 ms the timing model's progress credit does not
    // know of, and the never-used worker's own 250 is the cheaper.
    check([Running(false), Never], None, 0, true, 1);
    check([Never, Running(false)], None, 0, true, 0);
    // A holder of the request's whole prefix pays none: idle 20 s, it keeps the request
    // a warm worker would otherwise take, and with it the hits.
    check([EndedAt(0), EndedAt(19_900)], Some(0), 20_000, true, 0);
    check([EndedAt(0), EndedAt(19_900)], None, 20_000, true, 1);
    // Without the cold term an empty worker beats a busy one.
    check([Running(true), Never], None, 0, false, 1);
}

/// Worker 0 decoding one request, worker 1 never used, and worker 0's first tokens
/// measured `slowdown` times what the CPU timing predicts (twelve of them, 200 prompt
/// tokens each), routed with `doubt_scale_min` and, if `costs`, learned costs on.
#[track_caller]
fn check_doubt(slowdown: f64, doubt_scale_min: f64, costs: bool, want: u64) {
    let mut cfg = RouterConfig { mode: RouterMode::Kv, ..RouterConfig::default() };
    cfg.cost.timing = TtftModel::vllm_cpu();
    cfg.learn.doubt_scale_min = doubt_scale_min;
    cfg.learn.costs = costs;
    let predicted_ms = cfg.cost.timing.chunked_prefill_ms(200.0, cfg.cost.timing.max_batched_tokens_default).0;
    let mut r = router_with(cfg, 2);
    live(&mut r, 1, 0, Past::Running(true));
    let key = WorkerKey::new(0, 0);
    for i in 0..12 {
        let obs = Observation::FirstToken { ttft_ms: predicted_ms * slowdown, uncached_tokens: 200, queued_tokens: 0 };
        r.handle_observation(at(i), key, obs).unwrap();
    }
    let d = routed(r.handle_request(at(20), req(9, &[900, 901, 902]), Draw(0)));
    assert_eq!(d.target.worker.0, want, "slowdown {slowdown}, doubt from {doubt_scale_min}, costs {costs}");
    invariants(&r);
}

#[test]
fn a_fleet_far_slower_than_its_timing_weighs_the_cold_wait_less() {
    // As measured, the never-used worker's 250 ms outweighs a queue of one.
    check_doubt(1.0, 2.0, false, 0);
    check_doubt(1.5, 2.0, false, 0);
    // Twenty times slower than predicted, that queue is twenty times longer than the
    // timing says, and the cold wait is not: the idle worker is the cheaper.
    check_doubt(20.0, 2.0, false, 1);
    // Off, the timing is trusted however wrong; a bar above the slowdown keeps it too.
    check_doubt(20.0, 0.0, false, 0);
    check_doubt(20.0, 32.0, false, 0);
    // Learned costs scale the queue by the worker's own speed and leave the wait as is.
    check_doubt(20.0, 0.0, true, 1);
}

#[test]
fn the_cold_wait_counts_once_first_tokens_have_shown_the_timing() {
    use Past::{EndedAt, Never, Running};
    // Too few first tokens: the cold wait is a figure from engines that kept to the
    // timing, and nothing yet says these do. The empty worker beats the busy one.
    for samples in [0, 1, TIMED - 1] {
        check_with([Running(true), Never], None, 0, true, (DOUBT_SCALE_MIN, samples), 1);
    }
    // Enough of them, and it counts.
    check_with([Running(true), Never], None, 0, true, (DOUBT_SCALE_MIN, TIMED), 0);
    check_with([EndedAt(0), Never], None, 1_000, true, (DOUBT_SCALE_MIN, TIMED), 0);
    // With doubt off the timing is trusted from the start.
    check_with([Running(true), Never], None, 0, true, (0.0, 0), 0);
}
