//! The cold charge: each candidate pays its `cold_ms` (times its cost factor) after
//! scoring, under the TTFT model and outside the decode phase.

use super::super::*;
use alloc::vec::Vec;

/// Workers 1.. with `cold_ms` each, none loaded, worker 1 holding 4 of the prompt's
/// 5 blocks.
fn fleet(cold_ms: &[f64]) -> Vec<Candidate> {
    let cand = |(i, &cold_ms): (usize, &f64)| {
        let c = Candidate::new(WorkerKey::new(i as u64 + 1, 0), WorkerLoad::default());
        let device = if i == 0 { 4 } else { 0 };
        Candidate { overlap: Overlap { device, host: 0, disk: 0 }, cold_ms, ..c }
    };
    cold_ms.iter().enumerate().map(cand).collect()
}

/// The CPU build's timing, the request's prompt 5 blocks.
fn request(phase: Phase, model: KvCostModel) -> SelectRequest {
    let cost = KvCostConfig { model, timing: TtftModel::vllm_cpu(), ..KvCostConfig::default() };
    SelectRequest { isl_tokens: 5 * 64, phase, cost, ..SelectRequest::default() }
}

/// Each worker's cost rises by `want_ms` over the same fleet with no cold waits, and
/// the pick is `want_worker`.
#[track_caller]
fn check(phase: Phase, model: KvCostModel, cold_ms: &[f64], factor: f64, want_ms: &[f64], want_worker: u64) {
    let scaled = |mut cands: Vec<Candidate>| {
        cands[0].cost_factor = factor;
        cands
    };
    let (warm, cold) = (scaled(fleet(&alloc::vec![0.0; cold_ms.len()])), scaled(fleet(cold_ms)));
    let r = request(phase, model);
    let pick = |cands: &[Candidate]| Selector::new().select(&r, cands, &mut Draw(0), false).unwrap();
    let (plain, charged) = (pick(&warm), pick(&cold));
    let got: Vec<f64> = plain.scores.iter().zip(&charged.scores).map(|(a, b)| b.cost - a.cost).collect();
    assert_eq!(got, want_ms, "{phase:?}, {model:?}, cold {cold_ms:?}");
    assert_eq!(charged.chosen.worker.0, want_worker, "{phase:?}, {model:?}, cold {cold_ms:?}");
}

#[test]
fn a_cold_worker_pays_its_wait() {
    use KvCostModel::{Blocks, Ttft};
    use Phase::{Aggregated as Agg, Decode, Prefill as Pre};
    // Leaving 4 cached blocks costs about 95 ms on the CPU build (their recompute and
    // the work it passes on): 250 ms of cold moves the request off its cache, 50 does not.
    check(Agg, Ttft, &[250.0, 0.0], 1.0, &[250.0, 0.0], 2);
    check(Agg, Ttft, &[50.0, 0.0], 1.0, &[50.0, 0.0], 1);
    // Both cold alike: the cache decides.
    check(Agg, Ttft, &[250.0, 250.0], 1.0, &[250.0, 250.0], 1);
    check(Pre, Ttft, &[250.0, 0.0], 1.0, &[250.0, 0.0], 2);
    // The cost factor scales it, as every other term (worker 1's doubled cost sends
    // the request away either way).
    check(Agg, Ttft, &[50.0, 0.0], 2.0, &[100.0, 0.0], 2);
    // A decode worker computes no prompt, and the blocks model predicts no time: each
    // goes where it would uncharged.
    check(Decode, Ttft, &[250.0, 0.0], 1.0, &[0.0, 0.0], 2);
    check(Agg, Blocks, &[250.0, 0.0], 1.0, &[0.0, 0.0], 1);
    // An unreadable wait charges nothing.
    check(Agg, Ttft, &[f64::NAN, -5.0], 1.0, &[0.0, 0.0], 1);
}

#[test]
fn the_timing_models_cold_wait_grows_with_idle_time_up_to_its_cap() {
    let (cpu, gpu) = (TtftModel::vllm_cpu(), TtftModel::default());
    for (idle_ms, want) in [(0, 0.0), (500, 10.0), (5_000, 100.0), (12_500, 250.0), (60_000, 250.0), (u64::MAX, 250.0)]
    {
        assert_eq!(cpu.cold_ms(idle_ms), want, "idle {idle_ms} ms");
        assert_eq!(gpu.cold_ms(idle_ms), 0.0, "a GPU's, idle {idle_ms} ms");
    }
    let half_off = TtftModel { cold_ms_max: 0.0, ..cpu };
    assert_eq!(half_off.cold_ms(5_000), 0.0);
}
