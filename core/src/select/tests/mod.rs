//! Selection tests, one `check` per feature. Distributions are measured over many fixed
//! draws, so they are deterministic; tolerances are several standard deviations wide.

mod cold;
mod excess;
mod ttft;

use super::*;
use alloc::collections::BTreeMap;
use alloc::format;
use alloc::vec;
use RouterMode::*;

const TRIALS: u64 = 20_000;

/// A candidate on rank 0 of `worker` with `requests` running and `decode` decode blocks.
fn cand(worker: u64, requests: u32, decode: u64) -> Candidate {
    let load = WorkerLoad { active_prefill_tokens: 0, active_decode_blocks: decode, active_requests: requests };
    Candidate::new(WorkerKey::new(worker, 0), load)
}

fn req(mode: RouterMode) -> SelectRequest {
    SelectRequest { mode, ..SelectRequest::default() }
}

fn key(worker: u64) -> WorkerKey {
    WorkerKey::new(worker, 0)
}

/// Selects with draw `draw` (committing) and compares the chosen worker or the error.
#[track_caller]
fn check(sel: &mut Selector, req: &SelectRequest, cands: &[Candidate], draw: u64, want: Result<u64, SelectError>) {
    let got = sel.select(req, cands, &mut Draw(draw), true).map(|s| s.chosen);
    assert_eq!(got, want.map(key), "{} with draw {draw}", req.mode);
}

/// How often each worker is chosen over `TRIALS` draws, as fractions.
fn shares(req: &SelectRequest, cands: &[Candidate]) -> BTreeMap<u64, f64> {
    let mut sel = Selector::new();
    let mut n = BTreeMap::new();
    for d in 0..TRIALS {
        let s = sel.select(req, cands, &mut Draw(d), true).unwrap();
        *n.entry(s.chosen.worker.0).or_insert(0u64) += 1;
    }
    n.into_iter().map(|(w, c)| (w, c as f64 / TRIALS as f64)).collect()
}

#[track_caller]
fn check_shares(req: &SelectRequest, cands: &[Candidate], want: &[(u64, f64)]) {
    let got = shares(req, cands);
    for &(w, p) in want {
        let g = got.get(&w).copied().unwrap_or(0.0);
        assert!((g - p).abs() < 0.02, "{}: worker {w} chosen {g:.4}, want {p:.4}; all {got:?}", req.mode);
    }
    let listed: f64 = want.iter().map(|&(_, p)| p).sum();
    assert!((listed - 1.0).abs() < 1e-9, "test lists every outcome");
}

#[test]
fn modes_parse_and_print() {
    let names = ["random", "round-robin", "power-of-two", "least-loaded", "weighted", "direct", "kv"];
    for (m, name) in RouterMode::ALL.into_iter().zip(names) {
        assert_eq!(m.as_str(), name);
        assert_eq!(name.parse::<RouterMode>(), Ok(m));
        assert_eq!(format!("{m}"), name);
    }
    for bad in ["", "KV", "round_robin", "kv "] {
        assert_eq!(bad.parse::<RouterMode>(), Err(RouterModeParseError::Unknown), "{bad:?}");
    }
}

#[test]
fn empty_candidates_is_an_error_in_every_mode() {
    for mode in RouterMode::ALL {
        let want = match mode {
            Direct => SelectError::DirectTargetRequired { phase: Phase::Aggregated },
            _ => SelectError::NoCandidates,
        };
        check(&mut Selector::new(), &req(mode), &[], 0, Err(want));
    }
}

#[test]
fn random_is_uniform() {
    let cands = [cand(1, 9, 0), cand(2, 0, 0), cand(3, 0, 0), cand(4, 0, 0)];
    check_shares(&req(Random), &cands, &[(1, 0.25), (2, 0.25), (3, 0.25), (4, 0.25)]);
}

#[test]
fn round_robin_cycles_in_key_order_and_peeking_does_not_advance() {
    let mut sel = Selector::new();
    let r = req(RoundRobin);
    // Given out of order; the cycle follows key order all the same.
    let cands = [cand(3, 0, 0), cand(1, 0, 0), cand(2, 0, 0)];
    for (draw, want) in [(0, 1), (1, 2), (2, 3), (3, 1)] {
        let peek = sel.select(&r, &cands, &mut Draw(99), false).unwrap().chosen;
        assert_eq!(peek, key(want), "a peek shows the next pick");
        check(&mut sel, &r, &cands, draw, Ok(want));
    }
    // Worker 2 leaves and 5 joins: the cursor continues after the last pick (1).
    let cands = [cand(1, 0, 0), cand(3, 0, 0), cand(5, 0, 0)];
    for want in [3, 5, 1] {
        check(&mut sel, &r, &cands, 0, Ok(want));
    }
    // Each phase keeps its own cursor.
    let decode = SelectRequest { phase: Phase::Decode, ..r };
    check(&mut sel, &decode, &cands, 0, Ok(1));
    check(&mut sel, &r, &cands, 0, Ok(3));
}

#[test]
fn power_of_two_compares_two_distinct_candidates() {
    // With two candidates, distinct picks always compare both: the idle one always wins.
    check_shares(&req(PowerOfTwo), &[cand(1, 5, 0), cand(2, 1, 0)], &[(1, 0.0), (2, 1.0)]);
    // Pairs {1,2} {1,3} {2,3} are equally likely; 1 wins both of its pairs, and the tied
    // pair {2,3} splits evenly.
    let cands = [cand(1, 0, 0), cand(2, 5, 0), cand(3, 5, 0)];
    check_shares(&req(PowerOfTwo), &cands, &[(1, 2.0 / 3.0), (2, 1.0 / 6.0), (3, 1.0 / 6.0)]);
    check(&mut Selector::new(), &req(PowerOfTwo), &[cand(7, 100, 0)], 3, Ok(7));
}

#[test]
fn least_loaded_ranks_requests_then_blocks_then_draw() {
    let r = req(LeastLoaded);
    type Case<'a> = (&'a [Candidate], &'a [(u64, f64)]);
    let cases: &[Case] = &[
        (&[cand(1, 3, 0), cand(2, 1, 90), cand(3, 2, 0)], &[(2, 1.0)]),
        (&[cand(1, 1, 50), cand(2, 1, 40), cand(3, 4, 0)], &[(2, 1.0)]),
        (&[cand(1, 1, 40), cand(2, 1, 40), cand(3, 1, 41)], &[(1, 0.5), (2, 0.5)]),
    ];
    for (cands, want) in cases {
        check_shares(&r, cands, want);
    }
}

#[test]
fn weighted_is_proportional() {
    let with_weight = |c: Candidate, weight| Candidate { weight, ..c };
    let cands = [with_weight(cand(1, 0, 0), 1), with_weight(cand(2, 0, 0), 3), with_weight(cand(3, 0, 0), 0)];
    let cands = [cands[0], cands[1], cands[2], with_weight(cand(4, 0, 0), 6)];
    check_shares(&req(Weighted), &cands, &[(1, 0.1), (2, 0.3), (3, 0.0), (4, 0.6)]);
    // All weights zero: uniform rather than nothing.
    let zero = [with_weight(cand(1, 0, 0), 0), with_weight(cand(2, 0, 0), 0)];
    check_shares(&req(Weighted), &zero, &[(1, 0.5), (2, 0.5)]);
}

#[test]
fn direct_routes_to_the_named_worker_or_says_why_not() {
    let cands = [cand(1, 0, 0), cand(2, 50, 500)];
    let mut sel = Selector::new();
    let direct = |target: Option<u64>, phase| SelectRequest { phase, direct: target.map(key), ..req(Direct) };
    check(&mut sel, &direct(Some(2), Phase::Aggregated), &cands, 0, Ok(2));
    check(
        &mut sel,
        &direct(Some(3), Phase::Aggregated),
        &cands,
        0,
        Err(SelectError::DirectTargetNotEligible { target: key(3) }),
    );
    check(
        &mut sel,
        &direct(Some(1), Phase::Decode),
        &[],
        0,
        Err(SelectError::DirectTargetNotEligible { target: key(1) }),
    );
    for (phase, msg) in [
        (Phase::Aggregated, "worker ID required for aggregated request in Direct routing mode"),
        (Phase::Prefill, "worker ID required for prefill request in Direct routing mode"),
        (Phase::Decode, "worker ID required for decode request in Direct routing mode"),
    ] {
        let err = sel.select(&direct(None, phase), &cands, &mut Draw(0), true).unwrap_err();
        assert_eq!(err, SelectError::DirectTargetRequired { phase });
        assert_eq!(format!("{err}"), msg);
    }
    // Other modes ignore a named worker.
    let kv = SelectRequest { direct: Some(key(2)), ..req(Kv) };
    check(&mut sel, &kv, &cands, 0, Ok(1));
}

/// A candidate for cost cases: 32 queued prefill tokens, 10 active decode blocks,
/// 4 requests; overlap 4 device, 2 host, 4 disk blocks; 6 new decode blocks.
fn costed(cost_factor: f64) -> Candidate {
    let load = WorkerLoad { active_prefill_tokens: 32, active_decode_blocks: 10, active_requests: 4 };
    Candidate {
        overlap: Overlap { device: 4, host: 2, disk: 4 },
        new_decode_blocks: 6,
        cost_factor,
        ..Candidate::new(key(1), load)
    }
}

/// `kv_cost` of `c` for a 160-token prompt (block size 16, 10 blocks) with 3 expected
/// output blocks, compared with hand-computed (effective overlap, prefill, decode, cost).
#[track_caller]
fn check_cost(phase: Phase, cost: KvCostConfig, isl_tokens: u32, c: Candidate, want: (f64, f64, f64, f64)) {
    let bs = BlockSize::new(16).unwrap();
    let r = SelectRequest { phase, cost, isl_tokens, block_size: bs, expected_output_blocks: 3, ..req(Kv) };
    let s = kv_cost(&r, &c);
    let got = (s.overlap_effective, s.prefill_blocks, s.decode_blocks, s.cost);
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9 || a == b;
    assert!(
        close(got.0, want.0) && close(got.1, want.1) && close(got.2, want.2) && close(got.3, want.3),
        "{phase}: got {got:?}, want {want:?}"
    );
    assert_eq!((s.key, s.overlap_raw), (c.key, 10));
}

/// The specified blocks formula (the default model is the TTFT one).
fn blocks_model() -> KvCostConfig {
    KvCostConfig { model: KvCostModel::Blocks, ..KvCostConfig::default() }
}

#[test]
fn kv_cost_matches_hand_computation() {
    use Phase::{Aggregated as Agg, Decode as Dec, Prefill as Pre};
    let d = blocks_model();
    let tuned = KvCostConfig { prefill_load_scale: 2.0, active_request_weight: 0.5, ..d };
    // Effective overlap 4 + 0.75·2 + 0.25·4 = 6.5. Queued prefill (32 + 160) / 16 = 12 blocks.
    // Aggregated: prefill 12 − 6.5 = 5.5; decode 10 + 6 + 3 = 19.
    check_cost(Agg, d, 160, costed(1.0), (6.5, 5.5, 19.0, 24.5));
    // Scale 2, 0.5 per request, taint factor 1.5: 1.5 · (2·5.5 + 19 + 0.5·4) = 48.
    check_cost(Agg, tuned, 160, costed(1.5), (6.5, 5.5, 19.0, 48.0));
    // No credit: the cache is ignored.
    check_cost(Agg, KvCostConfig { overlap_credit: 0.0, ..d }, 160, costed(1.0), (6.5, 12.0, 19.0, 31.0));
    // Lower tiers count fully when weighted 1: 12 − 10 = 2.
    let flat = KvCostConfig { host_tier_weight: 1.0, disk_tier_weight: 1.0, ..d };
    check_cost(Agg, flat, 160, costed(1.0), (10.0, 2.0, 19.0, 21.0));
    // Overlap beyond the queued work never makes prefill negative.
    check_cost(Agg, KvCostConfig { overlap_credit: 5.0, ..d }, 160, costed(1.0), (6.5, 0.0, 19.0, 19.0));
    // Prefill: no decode term. 1.5 · (2·5.5 + 0.5·4) = 19.5.
    check_cost(Pre, tuned, 160, costed(1.5), (6.5, 5.5, 0.0, 19.5));
    // Decode: no prefill term, no reuse: 10 active + 10 prompt + 3 expected = 23 blocks,
    // requests weigh at least 1: 1.5 · (23 + 4) = 40.5.
    check_cost(Dec, tuned, 160, costed(1.5), (6.5, 0.0, 23.0, 40.5));
    // Decode counts full prompt blocks only: 175 tokens are still 10 blocks.
    check_cost(Dec, KvCostConfig { active_request_weight: 3.0, ..d }, 175, costed(1.0), (6.5, 0.0, 23.0, 35.0));
    // NaN weights never produce a NaN cost.
    check_cost(Agg, d, 160, costed(f64::NAN), (6.5, 5.5, 19.0, f64::INFINITY));
}

#[test]
fn overrides_replace_only_what_they_name() {
    let base = KvCostConfig { host_tier_weight: 0.5, ..KvCostConfig::default() };
    let o = KvCostOverrides { overlap_credit: Some(0.0), temperature: Some(0.7), ..KvCostOverrides::default() };
    let want = KvCostConfig { overlap_credit: 0.0, temperature: 0.7, ..base };
    assert_eq!(base.with(&o), want);
    assert_eq!(base.with(&KvCostOverrides::default()), base);
}

#[test]
fn kv_picks_the_cheapest_and_breaks_ties_by_draw() {
    let bs16 = BlockSize::new(16).unwrap();
    let r = SelectRequest { isl_tokens: 160, block_size: bs16, cost: blocks_model(), ..req(Kv) };
    let overlap = |c: Candidate, device| Candidate { overlap: Overlap { device, host: 0, disk: 0 }, ..c };
    // Worker 2 caches 8 of 10 blocks: cost 2 + 4 against 10 + 0.
    check_shares(&r, &[cand(1, 0, 0), overlap(cand(2, 3, 4), 8)], &[(2, 1.0)]);
    // Same load and overlap: a coin flip by draw.
    check_shares(&r, &[cand(1, 1, 4), cand(2, 1, 4), cand(3, 1, 5)], &[(1, 0.5), (2, 0.5)]);
    // A taint factor pushes work to the untainted worker.
    let tainted = Candidate { cost_factor: 2.0, ..overlap(cand(2, 3, 4), 8) };
    check_shares(&r, &[cand(1, 0, 0), tainted], &[(1, 1.0)]);
    // A NaN-cost candidate is never chosen while another exists.
    let broken = Candidate { cost_factor: f64::NAN, ..cand(1, 0, 0) };
    check_shares(&r, &[broken, cand(2, 9, 99)], &[(2, 1.0)]);
}

#[test]
fn temperature_samples_by_softmax_of_normalised_cost() {
    // Decode blocks 0, 1, 2 give costs 0, 1, 2: p ∝ e^0, e^-0.5, e^-1 at T = 1.
    let cands = [cand(1, 0, 0), cand(2, 0, 1), cand(3, 0, 2)];
    let at = |t: f64| SelectRequest { cost: KvCostConfig { temperature: t, ..blocks_model() }, ..req(Kv) };
    let softmax = |t: f64| {
        let w: Vec<f64> = (0..3).map(|c| std::primitive::f64::exp(-(c as f64) / (2.0 * t))).collect();
        let sum: f64 = w.iter().sum();
        vec![(1, w[0] / sum), (2, w[1] / sum), (3, w[2] / sum)]
    };
    check_shares(&at(1.0), &cands, &softmax(1.0));
    check_shares(&at(0.25), &cands, &softmax(0.25));
    // Equal costs: uniform at any temperature.
    let equal = [cand(1, 0, 3), cand(2, 0, 3), cand(3, 0, 3)];
    check_shares(&at(0.5), &equal, &[(1, 1.0 / 3.0), (2, 1.0 / 3.0), (3, 1.0 / 3.0)]);
    // An infinite temperature flattens everything; zero or NaN is plain argmin.
    check_shares(&at(f64::INFINITY), &cands, &[(1, 1.0 / 3.0), (2, 1.0 / 3.0), (3, 1.0 / 3.0)]);
    check_shares(&at(0.0), &cands, &[(1, 1.0)]);
    check_shares(&at(f64::NAN), &cands, &[(1, 1.0)]);
    // Infinite costs get no weight.
    let broken = Candidate { cost_factor: f64::INFINITY, ..cand(4, 0, 1) };
    check_shares(&at(1.0), &[cands[0], broken], &[(1, 1.0)]);
}

#[test]
fn decisions_ignore_input_order_and_previews_match_commits() {
    let mut cands = vec![];
    for w in 0..12u64 {
        let mut c = cand(w, (w * 7 % 5) as u32, w * 13 % 9);
        c.overlap.device = (w % 4) as u32;
        c.weight = (w % 3) as u32;
        cands.push(c);
    }
    let mut shuffled = cands.clone();
    shuffled.reverse();
    shuffled.swap(2, 7);
    let (ttft, blocks) = (KvCostModel::Ttft, KvCostModel::Blocks);
    let kv = [(0.0, ttft, Phase::Aggregated), (0.0, blocks, Phase::Aggregated), (0.0, ttft, Phase::Decode)];
    let modes = RouterMode::ALL.into_iter().map(|m| (m, 0.3, ttft, Phase::Aggregated));
    for (mode, temperature, model, phase) in modes.chain(kv.map(|(t, m, p)| (RouterMode::Kv, t, m, p))) {
        let r = SelectRequest {
            isl_tokens: 512,
            direct: Some(key(5)),
            phase,
            cost: KvCostConfig { temperature, model, ..KvCostConfig::default() },
            ..req(mode)
        };
        let (mut a, mut b) = (Selector::new(), Selector::new());
        for d in 0..200 {
            let preview = a.select(&r, &cands, &mut Draw(d), false).unwrap();
            let sorted = a.select(&r, &cands, &mut Draw(d), true).unwrap();
            let unsorted = b.select(&r, &shuffled, &mut Draw(d), true).unwrap();
            assert_eq!(preview, sorted, "{mode}: preview differs from commit");
            assert_eq!(sorted, unsorted, "{mode}: input order changed the decision");
            let keys: Vec<_> = sorted.scores.iter().map(|s| s.key).collect();
            assert!(keys.windows(2).all(|w| w[0] < w[1]) && keys.len() == 12, "{mode}: scores in key order");
        }
    }
}

/// `KeyOrder` agrees with comparing `WorkerKey`s, ranks included.
#[test]
fn key_order_is_worker_key_order() {
    let k = |w: u64, r: u32| WorkerKey::new(w, r);
    let cases: [&[WorkerKey]; 7] = [
        &[],
        &[k(3, 1)],
        &[k(1, 0), k(1, 1), k(2, 0)],
        &[k(1, 1), k(1, 0)],
        &[k(1, u32::MAX), k(2, 0)],
        &[k(2, 0), k(1, u32::MAX)],
        &[k(u64::MAX, 0), k(u64::MAX, 0), k(0, 5)],
    ];
    for keys in cases {
        let mut order = KeyOrder::START;
        keys.iter().for_each(|&key| order.see(key));
        assert_eq!(order.in_order, keys.windows(2).all(|w| w[0] <= w[1]), "{keys:?}");
    }
}

#[test]
fn errors_display() {
    let cases = [
        (SelectError::NoCandidates, "no eligible worker"),
        (
            SelectError::DirectTargetNotEligible { target: WorkerKey::new(3, 1) },
            "worker 3/1 named for Direct routing is not eligible",
        ),
    ];
    for (e, want) in cases {
        assert_eq!(format!("{e}"), want);
    }
    assert_eq!(
        format!("{}", RouterModeParseError::Unknown),
        "unknown router mode (expected one of random round-robin power-of-two least-loaded weighted direct kv)"
    );
}
