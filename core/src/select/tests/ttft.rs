//! TTFT cost tests: the engine timing against the reference model's published figures,
//! and the cost against hand computation on a model simple enough to do by hand.

use super::super::*;
use alloc::vec;

/// `f_p(T) = 0.01·T + 10`, `f_d(p) = 5 + 10·p`, 1000-token passes, 100 KV blocks.
fn simple() -> TtftModel {
    TtftModel {
        prefill_ms_per_token_squared: 0.0,
        prefill_ms_per_token: 0.01,
        prefill_ms_per_pass: 10.0,
        decode_ms_per_step: 5.0,
        decode_ms_per_usage: 10.0,
        decode_ms_per_usage_squared: 0.0,
        decode_ms_min: 1.0,
        max_batched_tokens_default: 1000,
        kv_blocks_default: 100,
        ..TtftModel::default()
    }
}

fn cost(weights: TtftWeights) -> KvCostConfig {
    KvCostConfig { model: KvCostModel::Ttft, timing: simple(), ttft: weights, ..KvCostConfig::default() }
}

/// A worker with `prefill` queued tokens of `prefilling` requests, `decode` active
/// blocks and `requests` running in all, 10 new decode blocks for the request.
fn worker(prefill: u64, decode: u64, requests: u32, prefilling: u32) -> Candidate {
    let load = WorkerLoad { active_prefill_tokens: prefill, active_decode_blocks: decode, active_requests: requests };
    Candidate { prefill_requests: prefilling, new_decode_blocks: 10, ..Candidate::new(WorkerKey::new(1, 0), load) }
}

fn idle() -> Candidate {
    worker(0, 0, 0, 0)
}

/// Compares `ttft_cost` for a 160-token prompt (block size 16) with hand-computed
/// (prefill blocks, decode blocks, cost).
#[track_caller]
fn check(phase: Phase, cost: KvCostConfig, c: Candidate, want: (f64, f64, f64)) {
    let r = SelectRequest {
        phase,
        cost,
        isl_tokens: 160,
        block_size: BlockSize::new(16).unwrap(),
        ..SelectRequest::default()
    };
    let s = ttft_cost(&r, &c);
    let got = (s.prefill_blocks, s.decode_blocks, s.cost);
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9 || a == b;
    assert!(
        close(got.0, want.0) && close(got.1, want.1) && close(got.2, want.2),
        "{phase}: got {got:?}, want {want:?}"
    );
    assert_eq!(kv_cost(&r, &c), s, "kv_cost uses the configured model");
}

#[test]
fn default_timing_is_the_reference_engine() {
    let m = TtftModel::default();
    let close = |a: f64, b: f64| (a - b).abs() < 0.05;
    // Published pass times of the reference model: T → f_p(T).
    for (t, ms) in [(0.0, 0.0), (128.0, 18.5), (512.0, 24.4), (2048.0, 49.4), (8192.0, 169.1), (32768.0, 966.1)] {
        assert!(close(m.prefill_pass_ms(t), ms), "f_p({t}) = {}, want {ms}", m.prefill_pass_ms(t));
    }
    // p → f_d(p); usage beyond the cache counts as full, and so does NaN.
    for (p, ms) in
        [(0.0, 5.74), (0.25, 17.63), (0.5, 26.31), (0.75, 31.77), (1.0, 34.01), (2.0, 34.01), (f64::NAN, 34.01)]
    {
        assert!(close(m.decode_step_ms(p), ms), "f_d({p}) = {}, want {ms}", m.decode_step_ms(p));
    }
    // A 12,000-token prompt alone: f_p(8192) + f_p(3808), the reference's 249.562 ms TTFT.
    let (ms, passes) = m.chunked_prefill_ms(12_000.0, 8192);
    assert!((ms - 249.562).abs() < 0.01 && passes == 2.0, "{ms} in {passes} passes");
    assert_eq!(m.chunked_prefill_ms(16_384.0, 8192).1, 2.0, "full passes only");
    assert_eq!(m.chunked_prefill_ms(f64::NAN, 8192), (0.0, 0.0));
    assert_eq!(m.chunked_prefill_ms(100.0, 0).1, 100.0, "a zero budget is one token a pass");
}

/// The weights the hand computations below were made with: the defaults without the
/// decode time, store and keep terms, which `decode_time_and_store_terms` and
/// `keep_term` check alone, and with 10 ms per block short of memory.
fn base_weights() -> TtftWeights {
    TtftWeights {
        decode_time_weight: 0.0,
        memory_ms_per_block: 10.0,
        memory_kv_share: 1.0,
        store_ms_per_block: 0.0,
        keep_ms_per_block: 0.0,
        ..TtftWeights::default()
    }
}

#[test]
fn keep_term() {
    use Phase::{Aggregated as Agg, Prefill as Pre};
    // 3 ms per block the best holder has beyond this one. Idle alone costs 23.2; 6
    // cached blocks leave 64 tokens, 21.28 (see `ttft_cost_matches_hand_computation`).
    let keep = cost(TtftWeights { keep_ms_per_block: 3.0, ..base_weights() });
    let best_of = |best, device, inflight| Candidate {
        overlap: Overlap { device, host: 0, disk: 0 },
        inflight_prefix_blocks: inflight,
        prefix_best_blocks: best,
        ..idle()
    };
    // The best holder itself, and a fleet where nobody holds anything: no charge.
    check(Agg, keep, best_of(6, 6, 0), (4.0, 10.0, 21.28));
    check(Agg, keep, best_of(0, 0, 0), (10.0, 10.0, 23.2));
    // Holding nothing of a 6-block prefix: 18 ms; holding 4 of it: 6 ms.
    check(Agg, keep, best_of(6, 0, 0), (10.0, 10.0, 23.2 + 18.0));
    check(Agg, keep, best_of(6, 4, 0), (6.0, 10.0, 21.92 + 6.0));
    // Blocks in flight there count as held; so do a prefill worker's.
    check(Agg, keep, best_of(6, 0, 6), (4.0, 10.0, 21.28));
    check(Pre, keep, best_of(6, 0, 0), (10.0, 0.0, 23.2 + 18.0));
    // A best below this one's own (an unset field) never pays back.
    check(Agg, keep, best_of(2, 6, 0), (4.0, 10.0, 21.28));
    // At most keep_ms_max: 10 ms for the 6 blocks left behind, not 18.
    let capped = cost(TtftWeights { keep_ms_per_block: 3.0, keep_ms_max: 10.0, ..base_weights() });
    check(Agg, capped, best_of(6, 0, 0), (10.0, 10.0, 23.2 + 10.0));
    check(Agg, capped, best_of(6, 4, 0), (6.0, 10.0, 21.92 + 6.0));
}

/// The decode time term at weight 0.5 for 100 output tokens, uncapped.
fn decode_weights() -> KvCostConfig {
    cost(TtftWeights {
        decode_time_weight: 0.5,
        decode_time_ms_max: f64::INFINITY,
        output_tokens_default: 100,
        ..base_weights()
    })
}

#[test]
fn decode_time_and_store_terms() {
    use Phase::{Aggregated as Agg, Prefill as Pre};
    // Idle alone costs 23.2 (see below); 160 tokens = 10 uncached blocks, 10 new blocks.
    let decode = decode_weights();
    // 100 output tokens, KV 0 → (10 + 100/16 = 16.25) blocks of 100: f_d = 5 + 1.625 =
    // 6.625 a step, nobody else there: 0.5 × 100 × 6.625 = 331.25.
    check(Agg, decode, idle(), (10.0, 10.0, 23.2 + 331.25));
    // 3 requests there (2 of them prefilling: they decode beside it soon). KV 20 → 36.25
    // blocks: f_d 8.625; its 16.25 blocks slow each of the 3 by f_d(1) − f_d(0) = 10 ×
    // 0.1625 = 1.625 a step; its prompt adds 11.6 ms of passes (its work) that the 3
    // wait out: 0.5 × (100 × (8.625 + 3 × 1.625) + 3 × 11.6) = 692.4 on top of 84.2.
    check(Agg, decode, worker(1900, 20, 3, 2), (128.75, 30.0, 84.2 + 692.4));
    // A prefill worker decodes nothing.
    check(Pre, decode, worker(1900, 20, 3, 2), (128.75, 0.0, 63.2));
    // Capped at decode_time_ms_max above the floor (0 here, as no selector set one).
    let capped = |max| cost(TtftWeights { decode_time_ms_max: max, ..decode.ttft });
    check(Agg, capped(600.0), worker(1900, 20, 3, 2), (128.75, 30.0, 84.2 + 600.0));
    check(Agg, capped(600.0), idle(), (10.0, 10.0, 23.2 + 331.25));
    // The store term: 2 ms per evicted block. 10 new blocks into a 100-block cache.
    let store = cost(TtftWeights { store_ms_per_block: 2.0, ..base_weights() });
    let holding = |n| Candidate { cached_blocks: n, ..idle() };
    // Room for all 10: nothing evicted.
    check(Agg, store, holding(90), (10.0, 10.0, 23.2));
    // Room for 6: 4 evicted, 8 ms.
    check(Agg, store, holding(94), (10.0, 10.0, 31.2));
    // Full, or over (its count can run ahead of its capacity): all 10, 20 ms.
    check(Agg, store, holding(100), (10.0, 10.0, 43.2));
    check(Agg, store, holding(5000), (10.0, 10.0, 43.2));
}

#[test]
fn a_queued_backlog_is_decode_load() {
    use Phase::Aggregated as Agg;
    let decode = decode_weights();
    // 20 requests queued, none decoding yet, 900 prompt tokens and 40 blocks booked.
    // Wait: 900 + 160 in 2 passes, 20 + 10.6; the backlog's last pass (900) fills up,
    // delaying its 20 requests by 1 each; work 30.6 − 19 = 11.6: 62.2. Decode: KV 40 →
    // 56.25 blocks, f_d 10.625; the 20 queued decode beside it soon, slowed 1.625 a step
    // each, and wait out its 11.6 ms of prefill: 0.5 × (100 × (10.625 + 20 × 1.625) +
    // 20 × 11.6) = 2272.25. Counting only requests past their prefill, this worker was
    // charged 531.25 and looked cheaper than the one below, which has 2 decoding.
    check(Agg, decode, worker(900, 40, 20, 20), (66.25, 50.0, 62.2 + 2272.25));
    // 2 decoding, nothing queued: P(160) 11.6 + a 9 ms step + work 11.6 = 32.2; decode
    // 0.5 × (100 × (10.625 + 2 × 1.625) + 2 × 11.6) = 705.35.
    check(Agg, decode, worker(0, 40, 2, 0), (10.0, 50.0, 32.2 + 705.35));
}

#[test]
fn memory_term_starts_at_its_kv_share() {
    use Phase::Aggregated as Agg;
    // 95 + 10 blocks on a 100-block worker costs 87.7 with the memory term from a full
    // cache (5 blocks short, 50 ms); from 0.9 of it, 15 blocks are over: 100 ms more.
    let share = |s| cost(TtftWeights { memory_kv_share: s, ..base_weights() });
    check(Agg, share(1.0), worker(0, 95, 2, 0), (10.0, 105.0, 87.7));
    check(Agg, share(0.9), worker(0, 95, 2, 0), (10.0, 105.0, 187.7));
    // Below the share: nothing.
    check(Agg, share(0.9), worker(0, 70, 2, 0), (10.0, 80.0, 35.2));
}

#[test]
fn the_decode_time_cap_counts_from_the_cheapest_candidate() {
    // Idle: 23.2 + 331.25; busy: 84.2 + 692.4 (see `decode_time_and_store_terms`). With a
    // 100 ms cap, the busy one pays at most 100 more than the idle one's 331.25.
    let mut cost = decode_weights();
    cost.ttft.decode_time_ms_max = 100.0;
    let r =
        SelectRequest { cost, isl_tokens: 160, block_size: BlockSize::new(16).unwrap(), ..SelectRequest::default() };
    let cands = [idle(), Candidate { key: WorkerKey::new(2, 0), ..worker(1900, 20, 3, 2) }];
    let s = Selector::new().select(&r, &cands, &mut Draw(0), true).unwrap();
    let costs: Vec<f64> = s.scores.iter().map(|s| s.cost).collect();
    let want = [23.2 + 331.25, 84.2 + 431.25];
    assert!(costs.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-9), "{costs:?}, want {want:?}");
    assert_eq!(super::super::ttft::decode_time_floor_ms(&r, &cands), 331.25);
}

#[test]
fn ttft_cost_matches_hand_computation() {
    use Phase::{Aggregated as Agg, Decode as Dec, Prefill as Pre};
    let w = base_weights();
    let d = cost(w);
    let with = |f: fn(&mut Candidate)| {
        let mut c = worker(1900, 20, 3, 2);
        f(&mut c);
        c
    };
    // Idle: P(160) = 11.6 in one pass, no decode step; work 11.6. Decode blocks 0 + 10 new.
    check(Agg, d, idle(), (10.0, 10.0, 23.2));
    // 6 cached blocks (device, or in flight, or 8 host blocks at weight 0.75) leave 64
    // tokens: P = 10.64, work 10.64.
    let cached = |device, host, inflight| Candidate {
        overlap: Overlap { device, host, disk: 0 },
        inflight_prefix_blocks: inflight,
        ..idle()
    };
    check(Agg, d, cached(6, 0, 0), (4.0, 10.0, 21.28));
    check(Agg, d, cached(0, 0, 6), (4.0, 10.0, 21.28));
    check(Agg, d, cached(0, 8, 0), (4.0, 10.0, 21.28));
    check(Agg, d, cached(4, 0, 6), (4.0, 10.0, 21.28));
    // A fully cached prompt still computes one token: P(1) = 10.01.
    check(Agg, d, cached(10, 0, 0), (1.0 / 16.0, 10.0, 20.02));
    // No credit: the cache is ignored.
    check(Agg, KvCostConfig { overlap_credit: 0.0, ..d }, cached(6, 0, 0), (10.0, 10.0, 23.2));
    // Busy: 1900 queued + 160 = 2060 tokens in 3 passes: 20 + 20 + 10.6 = 50.6. One of
    // the 3 requests decodes (2 are prefilling), KV 20% used: 3 steps of 7 = 21. The
    // backlog's last pass holds 900 tokens; topping it up to 1000 delays its last
    // request by 1. Work: 50.6 − P(1900) = 50.6 − 39 = 11.6. Total 84.2.
    let busy = worker(1900, 20, 3, 2);
    check(Agg, d, busy, (128.75, 30.0, 84.2));
    check(Agg, TtftWeights { others_delay_weight: 0.0, work_weight: 0.0, ..w }.into_cost(), busy, (128.75, 30.0, 71.6));
    // Decode learned at a fifth of the prefill scale (the cost factor carries the
    // latter): the 21 ms of steps weigh 4.2. A prefill worker takes no steps to weigh.
    check(Agg, d, Candidate { decode_weight: 0.2, ..busy }, (128.75, 30.0, 67.4));
    check(Pre, d, Candidate { decode_weight: 5.0, ..busy }, (128.75, 0.0, 63.2));
    // Busy for 54 ms at 27 ms a full pass (20 + a 7 ms step): the model credits 2000
    // tokens, but none was seen finish. Trusting the model, no more than one pass
    // (1000): 900 left + 160 = 1060 in 2 passes, 20 + 10.6; 2 steps of 7; the backlog's
    // last pass (900) is topped up to 1000: 2 × 1; work 30.6 − P(900) = 11.6. Total 58.2.
    let late = with(|c| c.prefill_busy_ms = 54);
    check(Agg, TtftWeights { overdue_pass_share: 1.0, ..w }.into_cost(), late, (66.25, 30.0, 58.2));
    // The default grace trusts a model up to three passes further ahead.
    check(Agg, d, late, (66.25, 30.0, 58.2));
    // With none, a worker a whole pass late keeps half a pass (500) of credit: 1400
    // left, the same figures as 500 seen finish below.
    check(Agg, TtftWeights { overdue_grace_passes: 0.0, ..w }.into_cost(), late, (97.5, 30.0, 52.8));
    // With 1500 of them seen finish, all 2000 count: 500 of the 1900 queued are done,
    // 1400 left + 160 = 1560 in 2 passes, 20 + 15.6; 2 steps; the backlog's last pass
    // (400) is topped up to 560, delaying its one request by 1.6; work 35.6 − P(1400)
    // = 1.6. Total 52.8.
    let done = with(|c| {
        c.prefill_busy_ms = 54;
        c.prefill_done_tokens = 1500;
    });
    check(Agg, d, done, (97.5, 30.0, 52.8));
    // Progress credit 0 trusts only finished prefills.
    check(Agg, TtftWeights { progress_credit: 0.0, ..w }.into_cost(), done, (128.75, 30.0, 84.2));
    // A worker learned 4× slower than the model computed a quarter as much in 54 ms:
    // 500 tokens, 1400 left, as above.
    let slow = with(|c| {
        c.prefill_busy_ms = 54;
        c.prefill_scale = 4.0;
    });
    check(Agg, d, slow, (97.5, 30.0, 52.8));
    // 95 + 10 blocks on a 100-block worker: 5 short, 50 ms; p = 0.95: a 14.5 ms step.
    check(Agg, d, worker(0, 95, 2, 0), (10.0, 105.0, 87.7));
    // The worker's own capacity replaces the defaults: 200 blocks, p = 0.475, no shortage.
    check(Agg, d, Candidate { kv_blocks: 200, ..worker(0, 95, 2, 0) }, (10.0, 105.0, 32.95));
    // 500-token passes, nothing decoding: 400 + 160 = 500 + 60: 15 + 10.6; the backlog's
    // pass fills up: 15 − 14; work 25.6 − 14.
    let small_batch = Candidate { max_batched_tokens: 500, ..worker(400, 40, 1, 1) };
    check(Agg, d, small_batch, (35.0, 50.0, 38.2));
    // Scale 2 on the wait, 0.5 per request, taint 1.5: 1.5 · (2·50.6 + 21 + 1 + 11.6 + 1.5).
    let tuned = KvCostConfig { prefill_load_scale: 2.0, active_request_weight: 0.5, ..d };
    check(Agg, tuned, Candidate { cost_factor: 1.5, ..busy }, (128.75, 30.0, 204.45));
    // Prefill workers take no decode steps and keep no KV after the prompt.
    check(Pre, d, busy, (128.75, 0.0, 63.2));
    check(Pre, d, worker(0, 95, 2, 0), (10.0, 0.0, 23.2));
    // Decode uses the blocks formula: 20 active + 10 prompt blocks, 3 requests × 1.
    check(Dec, d, busy, (0.0, 30.0, 33.0));
    // NaN weights never produce a NaN cost.
    check(Agg, d, Candidate { cost_factor: f64::NAN, ..idle() }, (10.0, 10.0, f64::INFINITY));
}

impl TtftWeights {
    fn into_cost(self) -> KvCostConfig {
        cost(self)
    }
}

/// How often each worker wins under the default cost for a 160-token prompt of 16-token
/// blocks.
#[track_caller]
fn check_choice(cands: &[Candidate], want: &[(u64, f64)]) {
    let r = SelectRequest { isl_tokens: 160, block_size: BlockSize::new(16).unwrap(), ..SelectRequest::default() };
    let mut sel = Selector::new();
    let mut wins = alloc::collections::BTreeMap::new();
    for d in 0..2000 {
        let s = sel.select(&r, cands, &mut Draw(d), true).unwrap();
        *wins.entry(s.chosen.worker.0).or_insert(0u32) += 1;
    }
    for &(w, share) in want {
        let got = f64::from(wins.get(&w).copied().unwrap_or(0)) / 2000.0;
        assert!((got - share).abs() < 0.05, "worker {w}: {got}, want {share}; all {wins:?}");
    }
}

#[test]
fn the_default_kv_policy_weighs_cache_against_waiting() {
    assert_eq!(KvCostConfig::default().model, KvCostModel::Ttft);
    let empty = WorkerLoad::default();
    let on = |w, load| Candidate::new(WorkerKey::new(w, 0), load);
    let cached = |c: Candidate| Candidate { overlap: Overlap { device: 8, host: 0, disk: 0 }, ..c };
    // Both idle: the cached one.
    check_choice(&[on(1, empty), cached(on(2, empty))], &[(2, 1.0)]);
    // The cached one has 20,000 prompt tokens queued: the idle one.
    let queued = WorkerLoad { active_prefill_tokens: 20_000, active_requests: 3, ..empty };
    check_choice(&[on(1, empty), Candidate { prefill_requests: 3, ..cached(on(2, queued)) }], &[(1, 1.0)]);
    // A request decoding adds a decode step to every pass: the free worker.
    let decoding = WorkerLoad { active_decode_blocks: 4000, active_requests: 1, ..empty };
    check_choice(&[on(1, empty), on(2, decoding)], &[(1, 1.0)]);
    // Equal workers: a coin flip by draw.
    check_choice(&[on(1, empty), on(2, empty)], &[(1, 0.5), (2, 0.5)]);
}

/// A fleet drawn from `seed`: loads from idle to far past one pass, every tier, in-flight
/// prefixes, progress, odd pass budgets and capacities, now and then a taint.
fn random_fleet(seed: u64, n: usize) -> Vec<Candidate> {
    let mut d = Draw(seed);
    let mut pick = |choices: &[u64]| choices[d.below(choices.len())];
    let mut cands = Vec::new();
    for i in 0..n {
        let load = WorkerLoad {
            active_prefill_tokens: pick(&[0, 0, 1, 511, 8191, 8192, 8193, 16_384, 20_000, 90_001, 1 << 53, u64::MAX]),
            active_decode_blocks: pick(&[0, 5, 700, 12_000, 16_384, 40_000, (1 << 52) + 1, u64::MAX]),
            active_requests: pick(&[0, 1, 2, 7, 64]) as u32,
        };
        let mut c = Candidate::new(WorkerKey::new(i as u64 / 4, (i % 4) as u32), load);
        c.overlap = Overlap {
            device: pick(&[0, 0, 3, 40, 130, 5000]) as u32,
            host: pick(&[0, 0, 2, 17]) as u32,
            disk: pick(&[0, 0, 1, 9]) as u32,
        };
        c.inflight_prefix_blocks = pick(&[0, 0, 0, 4, 64, 200]) as u32;
        c.new_decode_blocks = pick(&[0, 1, 64, 300]) as u32;
        c.prefill_requests = pick(&[0, 0, 1, 3, 9]) as u32;
        c.prefill_busy_ms = pick(&[0, 0, 1, 30, 170, 2000]);
        c.prefill_done_tokens = pick(&[0, 100, 8192, 50_000]);
        c.max_batched_tokens = pick(&[0, 0, 0, 1, 100, 2048, 8192, 8193]) as u32;
        c.kv_blocks = pick(&[0, 0, 1, 1000, 16_384]) as u32;
        c.prefix_best_blocks = pick(&[0, 0, 3, 40, 200, 5000]) as u32;
        c.cached_blocks = pick(&[0, 0, 999, 1000, 16_383, 16_384, u64::from(u32::MAX)]) as u32;
        c.cost_factor = [1.0, 1.0, 1.0, 1.5, 0.0, f64::INFINITY][pick(&[0, 1, 2, 3, 4, 5]) as usize];
        c.prefill_scale = [1.0, 1.0, 0.25, 3.0, 32.0][pick(&[0, 1, 2, 3, 4]) as usize];
        c.decode_weight = [1.0, 1.0, 0.2, 5.0][pick(&[0, 1, 2, 3]) as usize];
        cands.push(c);
    }
    cands
}

/// The decision spelled out with the reference formula: `kv_cost` per candidate, then
/// the cheapest by the generic `pick_min` (ties by draw) or a sample.
fn reference_selection(req: &SelectRequest, cands: &[Candidate], draw: u64) -> Selection {
    let floor = match req.cost.model {
        KvCostModel::Ttft => super::super::ttft::decode_time_floor_ms(req, cands),
        KvCostModel::Blocks => 0.0,
    };
    let req = &SelectRequest { decode_time_floor_ms: floor, ..*req };
    let scores: Vec<CandidateScore> = cands.iter().map(|c| kv_cost(req, c)).collect();
    let d = &mut Draw(draw);
    let i = if req.cost.temperature > 0.0 {
        kv_pick(&scores, Cheapest::of(&scores), req.cost.temperature, d)
    } else {
        let cost = |i: usize| scores[i].cost;
        pick_min(scores.len(), d, |a, b| cost(a).partial_cmp(&cost(b)).unwrap_or(core::cmp::Ordering::Equal))
    };
    Selection { chosen: cands[i].key, scores }
}

/// Bits of every score field, so that NaN and signed zeros compare too.
fn bits(s: &Selection) -> (WorkerKey, Vec<[u64; 5]>) {
    let f = |c: &CandidateScore| {
        [c.overlap_effective, c.prefill_blocks, c.decode_blocks, c.cost, f64::from(c.overlap_raw)].map(f64::to_bits)
    };
    (s.chosen, s.scores.iter().map(f).collect())
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: 256, ..Default::default() })]

    /// The selector's batch evaluator gives the reference's scores bit for bit, hence
    /// the same decision, on random fleets and requests.
    #[test]
    fn the_fast_ttft_path_decides_like_the_reference(
        seed in proptest::prelude::any::<u64>(),
        n in 1usize..40,
        isl in proptest::sample::select(vec![0u32, 1, 63, 64, 160, 4096, 8191, 8192, 8193, 30_000, 100_000]),
        block in proptest::sample::select(vec![1u32, 16, 64, 1024]),
        phase in proptest::sample::select(Phase::ALL.to_vec()),
        out_blocks in 0u32..200,
        credit in proptest::sample::select(vec![0.0, 0.5, 1.0, 1.25, -1.0, f64::NAN]),
        host_weight in proptest::sample::select(vec![0.75, 0.0, -0.5, f64::NAN]),
        odd_timing in 0usize..4,
        progress in proptest::sample::select(vec![0.0, 0.7, 1.0, f64::NAN]),
        temperature in proptest::sample::select(vec![0.0, 0.0, 0.3]),
        small_default_batch in proptest::bool::ANY,
        draw in proptest::prelude::any::<u64>(),
        decode_time in proptest::sample::select(vec![0.0, 0.3, 1.0, f64::NAN]),
        store in proptest::sample::select(vec![0.0, 1.0, 7.5, f64::INFINITY]),
        keep in proptest::sample::select(vec![0.0, 20.0, 0.5, f64::INFINITY, f64::NAN]),
        keep_max in proptest::sample::select(vec![200.0, 0.0, f64::INFINITY, f64::NAN]),
        out_default in proptest::sample::select(vec![0u32, 128, 4096]),
        decode_max in proptest::sample::select(vec![600.0, 0.0, 35.5, f64::INFINITY, f64::NAN, -1.0]),
        memory_share in proptest::sample::select(vec![0.9, 1.0, 0.0, f64::NAN]),
        overdue in proptest::sample::select(vec![0.5, 0.0, 1.0, f64::NAN, -2.0]),
        grace in proptest::sample::select(vec![3.0, 0.0, 0.5, f64::NAN, f64::INFINITY]),
    ) {
        let mut cost = KvCostConfig { overlap_credit: credit, temperature, ..KvCostConfig::default() };
        cost.ttft.progress_credit = progress;
        cost.ttft.decode_time_weight = decode_time;
        cost.ttft.store_ms_per_block = store;
        cost.ttft.keep_ms_per_block = keep;
        cost.ttft.keep_ms_max = keep_max;
        cost.ttft.output_tokens_default = out_default;
        cost.ttft.decode_time_ms_max = decode_max;
        cost.ttft.memory_kv_share = memory_share;
        cost.ttft.overdue_pass_share = overdue;
        cost.ttft.overdue_grace_passes = grace;
        // The pile charge is added after scoring and is not `kv_cost`'s; `excess`'s tests cover it.
        cost.ttft.excess_ms_per_request = 0.0;
        cost.host_tier_weight = host_weight;
        match odd_timing {
            1 => cost.timing.decode_ms_min = f64::NAN,
            2 => cost.timing.prefill_ms_per_pass = f64::INFINITY,
            3 => cost.timing.decode_ms_per_usage = f64::NAN,
            _ => {}
        }
        if small_default_batch {
            cost.timing.max_batched_tokens_default = 512;
            cost.timing.kv_blocks_default = 2000;
        }
        let req = SelectRequest {
            phase,
            cost,
            isl_tokens: isl,
            block_size: BlockSize::new(block).unwrap(),
            expected_output_blocks: out_blocks,
            ..SelectRequest::default()
        };
        let cands = random_fleet(seed, n);
        let got = Selector::new().select(&req, &cands, &mut Draw(draw), true).unwrap();
        let want = reference_selection(&req, &cands, draw);
        proptest::prop_assert_eq!(bits(&got), bits(&want));
    }
}

/// `credited(model, done, queued, batch, share)`: the tokens taken as computed.
#[track_caller]
fn check_credited(model: f64, done: f64, queued: f64, (share, grace): (f64, f64), want: f64) {
    let w = TtftWeights { overdue_pass_share: share, overdue_grace_passes: grace, ..TtftWeights::default() };
    let got = crate::select::ttft::credited(model, done, queued, 1000.0, &w);
    assert_eq!(got, want, "model {model}, done {done}, queued {queued}, share {share}, grace {grace}");
}

#[test]
fn a_worker_late_by_the_timing_keeps_less_of_its_pass_credited() {
    // (model's tokens, seen finish, queued past them, overdue share) → credited; a
    // 1000-token pass.
    for (model, done, queued, share, want) in [
        // On time: the model's figure, up to one pass past what was seen finish.
        (600.0, 0.0, 1900.0, 0.5, 600.0),
        (1000.0, 0.0, 1900.0, 0.5, 1000.0),
        (2000.0, 1500.0, 1900.0, 0.5, 2000.0),
        // A quarter, a half and four passes late: the credit falls back to the share.
        (1250.0, 0.0, 1900.0, 0.5, 750.0),
        (1500.0, 0.0, 1900.0, 0.5, 500.0),
        (5000.0, 0.0, 1900.0, 0.5, 500.0),
        (5000.0, 0.0, 1900.0, 0.0, 0.0),
        (1250.0, 0.0, 1900.0, 0.0, 750.0),
        // Share 1 (or NaN) trusts the model up to one pass, as before the rule.
        (5000.0, 0.0, 1900.0, 1.0, 1000.0),
        (5000.0, 0.0, 1900.0, f64::NAN, 1000.0),
        // Out of range shares are clamped.
        (5000.0, 0.0, 1900.0, 7.0, 1000.0),
        (5000.0, 0.0, 1900.0, -1.0, 0.0),
        // A backlog smaller than a pass is late once the model has computed it.
        (200.0, 0.0, 300.0, 0.5, 200.0),
        (450.0, 0.0, 300.0, 0.5, 150.0),
        (475.0, 100.0, 300.0, 0.0, 325.0),
        // Nothing queued: nothing can be late.
        (5000.0, 0.0, 0.0, 0.0, 1000.0),
    ] {
        check_credited(model, done, queued, (share, 0.0), want);
    }
    // A grace of three passes: the whole pass until the model is four past what was seen
    // finish, then the same fall over the next pass. A negative grace is none.
    for (model, grace, want) in [
        (4000.0, 3.0, 1000.0),
        (4250.0, 3.0, 750.0),
        (4500.0, 3.0, 500.0),
        (9000.0, 3.0, 500.0),
        (1500.0, 3.0, 1000.0),
        (1500.0, -2.0, 500.0),
        (1500.0, f64::NAN, 500.0),
    ] {
        check_credited(model, 0.0, 1900.0, (0.5, grace), want);
    }
}
