use super::*;
use proptest::prelude::*;

const KEY: WorkerKey = WorkerKey { worker: WorkerId(1), rank: crate::DpRank(0) };

/// One sample: at `t_ms`, a first token measured `measured` ms where the model
/// predicts `predicted` ms.
type Sample = (u64, f64, f64);

fn first_token(ms: f64) -> Observation {
    Observation::FirstToken { ttft_ms: ms, uncached_tokens: 100, queued_tokens: 0 }
}

/// Feeds `samples` as prefill observations and checks the learned scale, within 1e-9.
#[track_caller]
fn check(cfg: LearnConfig, samples: &[Sample], scale: f64) {
    let mut l = CostLearner::new(LearnConfig { costs: true, ..cfg });
    for &(t, measured, predicted) in samples {
        l.observe(Instant::from_millis(t), KEY, &first_token(measured), predicted).unwrap();
    }
    let got = l.cost_scale(Instant::ZERO, KEY, Phase::Aggregated);
    assert!((got - scale).abs() < 1e-9, "scale {got}, expected {scale}");
}

fn cfg(samples_min: u32) -> LearnConfig {
    LearnConfig { samples_min, ..LearnConfig::default() }
}

#[test]
fn learned_scale_table() {
    // The prior holds until samples_min samples exist.
    check(cfg(3), &[(0, 40.0, 20.0), (1, 40.0, 20.0)], 1.0);
    check(cfg(3), &[(0, 40.0, 20.0), (1, 40.0, 20.0), (2, 40.0, 20.0)], 2.0);
    // Samples weigh by predicted time: Σ measured / Σ predicted.
    check(cfg(2), &[(0, 30.0, 20.0), (0, 20.0, 10.0)], 50.0 / 30.0);
    // A huge outlier moves the estimate by at most outlier_ratio_max of it.
    check(cfg(1), &[(0, 20.0, 20.0), (0, 950.0, 20.0)], (20.0 + 3.0 * 20.0) / 40.0);
    // A worker much slower than the prior is reached in steps, not refused.
    check(
        cfg(1),
        &[(0, 200.0, 20.0), (0, 200.0, 20.0), (0, 200.0, 20.0)],
        (3.0 * 20.0 + 9.0 * 20.0 + 10.0 * 20.0) / 60.0,
    );
    // Decay: a sample one half-life old weighs half.
    let h = LearnConfig::default().half_life_ms;
    check(cfg(1), &[(0, 40.0, 20.0), (h, 20.0, 20.0)], (0.5 * 40.0 + 20.0) / (0.5 * 20.0 + 20.0));
    // A zero half-life keeps only the newest instant.
    check(LearnConfig { half_life_ms: 0, ..cfg(1) }, &[(0, 60.0, 20.0), (5, 20.0, 20.0)], 1.0);
    // Scales stay within scale_min..=scale_max.
    check(LearnConfig { scale_max: 2.0, ..cfg(1) }, &[(0, 60.0, 20.0)], 2.0);
    check(LearnConfig { scale_min: 0.5, ..cfg(1) }, &[(0, 1.0, 20.0)], 0.5);
}

/// Eight samples make `KEY` a fast worker (scale 1) and `SLOW` four times slower (its
/// first sample clamped to 3): at `t_ms`, with `prior_samples`, `SLOW`'s scale is `want`.
#[track_caller]
fn check_optimism(prior_samples: f64, t_ms: u64, want: f64) {
    const SLOW: WorkerKey = WorkerKey { worker: WorkerId(2), rank: crate::DpRank(0) };
    let cfg = LearnConfig { costs: true, samples_min: 8, prior_samples, ..LearnConfig::default() };
    let mut l = CostLearner::new(cfg);
    for _ in 0..8 {
        l.observe(Instant::ZERO, KEY, &first_token(20.0), 20.0).unwrap();
        l.observe(Instant::ZERO, SLOW, &first_token(80.0), 20.0).unwrap();
    }
    let at = Instant::from_millis(t_ms);
    assert_eq!(l.cost_scale(at, KEY, Phase::Aggregated), 1.0, "the fastest keeps its own");
    let got = l.cost_scale(at, SLOW, Phase::Aggregated);
    assert!((got - want).abs() < 1e-9, "at {t_ms} ms: scale {got}, expected {want}");
    let learned = l.learned(at, SLOW, &TtftModel::default()).unwrap();
    assert_eq!(learned.prefill_scale, got, "/workers shows the scale in use");
}

#[test]
fn a_slow_keys_scale_drifts_to_the_fastest_as_its_samples_age() {
    let own = (3.0 * 20.0 + 7.0 * 80.0) / 160.0;
    let h = LearnConfig::default().half_life_ms;
    // Fresh: eight own samples against four of the fastest's estimate.
    check_optimism(4.0, 0, (own * 8.0 + 4.0) / 12.0);
    // One half-life on, unsampled: its own count halved.
    check_optimism(4.0, h, (own * 4.0 + 4.0) / 8.0);
    // Ten half-lives on, it is nearly the fastest, and is tried again.
    check_optimism(4.0, 10 * h, (own * 8.0 / 1024.0 + 4.0) / (8.0 / 1024.0 + 4.0));
    // Off: its own estimate at any age.
    check_optimism(0.0, 10 * h, own);
}

/// A key with fewer than `samples_min` samples is judged like the fleet's fastest, or
/// at 1 with `prior_samples` 0 (found in replay: a slow worker at 1 took the traffic of
/// workers learned 25 times slower than the model until it had eight samples).
#[test]
fn a_key_short_of_samples_is_judged_like_the_fastest() {
    const SLOW: WorkerKey = WorkerKey { worker: WorkerId(2), rank: crate::DpRank(0) };
    for (prior_samples, want) in [(4.0, (3.0 * 20.0 + 7.0 * 80.0) / 160.0), (0.0, 1.0)] {
        let mut l =
            CostLearner::new(LearnConfig { costs: true, samples_min: 8, prior_samples, ..LearnConfig::default() });
        for _ in 0..8 {
            l.observe(Instant::ZERO, SLOW, &first_token(80.0), 20.0).unwrap();
        }
        l.observe(Instant::ZERO, KEY, &first_token(20.0), 20.0).unwrap();
        let got = l.cost_scale(Instant::ZERO, KEY, Phase::Aggregated);
        assert!((got - want).abs() < 1e-9, "prior_samples {prior_samples}: scale {got}, expected {want}");
    }
}

/// Found by `scales_stay_finite_and_bounded`: with `scale_max` near `f64::MAX`, a huge
/// estimate blended with the fastest overflowed to infinity, and with a huge
/// `prior_samples` cancelled to 0.
#[test]
fn a_huge_estimate_blends_to_a_finite_scale() {
    const OTHER: WorkerKey = WorkerKey { worker: WorkerId(2), rank: crate::DpRank(0) };
    let cfg = LearnConfig {
        costs: true,
        samples_min: 1,
        scale_max: f64::MAX,
        outlier_ratio_max: f64::MAX,
        ..LearnConfig::default()
    };
    let mut l = CostLearner::new(cfg);
    l.observe(Instant::ZERO, OTHER, &first_token(1.0), 1.0).unwrap();
    for _ in 0..3 {
        l.observe(Instant::ZERO, KEY, &first_token(1e9), 1e-300).unwrap();
    }
    let s = l.cost_scale(Instant::ZERO, KEY, Phase::Aggregated);
    assert!(s.is_finite() && s > 1.0, "scale {s}");
    l.cfg.prior_samples = f64::MAX;
    assert_eq!(l.cost_scale(Instant::ZERO, KEY, Phase::Aggregated), 1.0, "all prior: the fastest's");
}

#[test]
fn costs_off_keeps_the_prior_and_decode_has_its_own_fit() {
    let mut l = CostLearner::new(LearnConfig { samples_min: 1, ..LearnConfig::default() });
    l.observe(Instant::ZERO, KEY, &first_token(40.0), 20.0).unwrap();
    assert_eq!(l.cost_scale(Instant::ZERO, KEY, Phase::Aggregated), 1.0, "costs off");
    let m = TtftModel::default();
    let learned = l.learned(Instant::ZERO, KEY, &m).unwrap();
    assert_eq!((learned.prefill_scale, learned.prefill_samples), (2.0, 1));
    assert_eq!((learned.decode_scale, learned.decode_samples), (1.0, 0));

    let mut l = CostLearner::new(LearnConfig { samples_min: 1, costs: true, ..LearnConfig::default() });
    l.observe(Instant::ZERO, KEY, &Observation::Decode { ms: 30.0, tokens: 3 }, 10.0).unwrap();
    assert_eq!(l.cost_scale(Instant::ZERO, KEY, Phase::Decode), 3.0);
    assert_eq!(l.cost_scale(Instant::ZERO, KEY, Phase::Prefill), 1.0);
    let learned = l.learned(Instant::ZERO, KEY, &m).unwrap();
    assert_eq!(learned.decode_ms_per_token, 3.0 * m.decode_step_ms(0.0));
}

/// Found by `scales_stay_finite_and_bounded`: with `scale_min` near the smallest
/// normal `f64`, a fast prefill and a slow decode made the weight overflow to infinity.
#[test]
fn a_decode_weight_between_extreme_bounds_stays_finite() {
    let cfg = LearnConfig {
        samples_min: 0,
        costs: true,
        scale_min: f64::MIN_POSITIVE,
        outlier_ratio_max: f64::MAX,
        ..LearnConfig::default()
    };
    let mut l = CostLearner::new(cfg);
    let tiny = f64::MIN_POSITIVE;
    let prefill = Observation::FirstToken { ttft_ms: 0.0, uncached_tokens: 1, queued_tokens: 0 };
    l.observe(Instant::ZERO, KEY, &prefill, tiny).unwrap();
    l.observe(Instant::ZERO, KEY, &Observation::Decode { ms: 1e9, tokens: 1 }, tiny).unwrap();
    let w = l.decode_weight(Instant::ZERO, KEY, Phase::Aggregated);
    assert!(w.is_finite() && w <= WEIGHT_LIMIT, "{w}");
}

#[test]
fn an_aggregated_cost_weighs_decode_by_its_own_scale() {
    let mut l = CostLearner::new(LearnConfig { samples_min: 1, ..LearnConfig::default() });
    // Prefill 2x the model, decode 3x: decode steps weigh 3/2 against the prefill scale
    // the cost factor carries.
    l.observe(Instant::ZERO, KEY, &first_token(40.0), 20.0).unwrap();
    l.observe(Instant::ZERO, KEY, &Observation::Decode { ms: 30.0, tokens: 3 }, 10.0).unwrap();
    let weight = |l: &CostLearner, phase| l.decode_weight(Instant::ZERO, KEY, phase);
    assert_eq!(weight(&l, Phase::Aggregated), 1.0, "costs off");
    l.cfg.costs = true;
    assert_eq!(l.cost_scale(Instant::ZERO, KEY, Phase::Aggregated), 2.0);
    assert_eq!(weight(&l, Phase::Aggregated), 1.5);
    assert_eq!((weight(&l, Phase::Prefill), weight(&l, Phase::Decode)), (1.0, 1.0), "one kind of work");
    let other = WorkerKey { worker: WorkerId(9), rank: crate::DpRank(0) };
    assert_eq!(l.decode_weight(Instant::ZERO, other, Phase::Aggregated), 1.0, "unknown");
}

/// Folds an engine report of (waiting, running, usage) `age_ms` old into `own`.
#[track_caller]
fn check_fold(report: (u32, u32, f64), age_ms: u64, own: WorkerLoad, own_prefill: u32, expected: WorkerLoad) {
    let mut l = CostLearner::new(LearnConfig { engine_load: true, ..LearnConfig::default() });
    let (waiting, running, kv_usage) = report;
    l.engine_load(Instant::ZERO, KEY, EngineLoad { waiting, running, kv_usage }).unwrap();
    assert_eq!(l.fold_load(Instant::from_millis(age_ms), KEY, own, own_prefill, 1000), expected);
}

fn load(tokens: u64, blocks: u64, requests: u32) -> WorkerLoad {
    WorkerLoad { active_prefill_tokens: tokens, active_decode_blocks: blocks, active_requests: requests }
}

#[test]
fn engine_load_folding_table() {
    // An idle router, a busy engine: its requests and blocks count, each foreign waiting
    // request is charged the default prompt.
    check_fold((2, 3, 0.25), 0, load(0, 0, 0), 0, load(1024, 250, 5));
    // The router's own waiting requests are not charged twice.
    check_fold((2, 3, 0.25), 0, load(300, 10, 2), 2, load(300, 250, 5));
    // The router's count wins where it is larger.
    check_fold((0, 1, 0.1), 0, load(300, 400, 9), 1, load(300, 400, 9));
    // A stale report is ignored.
    let stale = LearnConfig::default().engine_load_age_max_ms + 1;
    check_fold((2, 3, 0.25), stale, load(0, 0, 0), 0, load(0, 0, 0));
}

#[test]
fn waiting_requests_are_charged_the_learned_mean_prompt() {
    let mut l = CostLearner::new(LearnConfig { engine_load: true, ..LearnConfig::default() });
    for uncached_tokens in [100, 300] {
        let obs = Observation::FirstToken { ttft_ms: 10.0, uncached_tokens, queued_tokens: 0 };
        l.observe(Instant::ZERO, KEY, &obs, 10.0).unwrap();
    }
    l.engine_load(Instant::ZERO, KEY, EngineLoad { waiting: 3, running: 0, kv_usage: 0.0 }).unwrap();
    assert_eq!(l.fold_load(Instant::ZERO, KEY, load(0, 0, 0), 0, 100).active_prefill_tokens, 600);
}

#[test]
fn bad_values_and_full_tables_are_refused_and_counted() {
    let mut l = CostLearner::new(LearnConfig { keys_max: 1, ..LearnConfig::default() });
    for (ms, predicted) in [(f64::NAN, 10.0), (-1.0, 10.0), (f64::INFINITY, 10.0), (10.0, 0.0), (10.0, f64::NAN)] {
        assert_eq!(l.observe(Instant::ZERO, KEY, &first_token(ms), predicted), Err(LearnError::BadValue));
    }
    let no_tokens = Observation::Decode { ms: 1.0, tokens: 0 };
    assert_eq!(l.observe(Instant::ZERO, KEY, &no_tokens, 1.0), Err(LearnError::BadValue));
    for kv_usage in [f64::NAN, -0.1, 1.5] {
        let r = l.engine_load(Instant::ZERO, KEY, EngineLoad { waiting: 0, running: 0, kv_usage });
        assert_eq!(r, Err(LearnError::BadValue));
    }
    l.observe(Instant::ZERO, KEY, &first_token(1.0), 1.0).unwrap();
    let other = WorkerKey::new(2, 0);
    assert_eq!(l.observe(Instant::ZERO, other, &first_token(1.0), 1.0), Err(LearnError::TableFull { keys_max: 1 }));
    assert_eq!(l.stats(), LearnStats { observations: 1, clamped: 0, engine_loads: 0, dropped: 10 });
    l.remove_worker(WorkerId(1));
    assert!(l.is_empty());
}

fn any_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(0.0),
        Just(f64::MIN_POSITIVE),
        Just(f64::MAX),
        -1e6f64..1e6,
        0.0f64..1e12,
    ]
}

fn any_config() -> impl Strategy<Value = LearnConfig> {
    let knobs = (any::<u64>(), 0u32..4, any_f64(), any_f64(), any_f64(), any_f64(), any_f64(), any::<bool>());
    knobs.prop_map(|(h, n, k, lo, hi, p, doubt, costs)| LearnConfig {
        costs,
        engine_load: true,
        half_life_ms: h % 1_000_000,
        samples_min: n,
        outlier_ratio_max: k,
        scale_min: lo,
        scale_max: hi,
        prior_samples: p,
        doubt_scale_min: doubt,
        ..LearnConfig::default()
    })
}

proptest! {
    /// Whatever arrives, in whatever order, the scales stay finite and within bounds
    /// and a refused input changes nothing.
    #[test]
    fn scales_stay_finite_and_bounded(
        cfg in any_config(),
        inputs in proptest::collection::vec((0u64..1u64 << 40, any_f64(), any_f64(), any::<u32>(), any::<bool>()), 0..40),
    ) {
        let mut l = CostLearner::new(cfg);
        let (lo, hi) = bounds(&cfg);
        for (t, measured, predicted, n, decode) in inputs {
            let obs = if decode {
                Observation::Decode { ms: measured, tokens: n % 4 }
            } else {
                Observation::FirstToken { ttft_ms: measured, uncached_tokens: n, queued_tokens: u64::from(n) << 20 }
            };
            // Two keys, so each blends with the other's estimate.
            let key = WorkerKey { worker: WorkerId(1 + u64::from(n % 2)), rank: crate::DpRank(0) };
            let before = l.clone().keys;
            if l.observe(Instant::from_micros(t), key, &obs, predicted).is_err() {
                prop_assert_eq!(&before, &l.keys);
            }
            let _ = l.engine_load(Instant::from_micros(t), KEY, EngineLoad { waiting: n, running: n, kv_usage: measured });
            for phase in [Phase::Aggregated, Phase::Decode] {
                let s = l.cost_scale(Instant::from_micros(t), key, phase);
                prop_assert!(s.is_finite() && s >= lo && s <= hi, "scale {} outside {}..={}", s, lo, hi);
                // The cold wait is multiplied by it.
                let cold = l.cold_weight(&l.cost_scales(Instant::from_micros(t), key, phase));
                prop_assert!(cold.is_finite() && cold >= 0.0, "cold weight {}", cold);
                let w = l.decode_weight(Instant::from_micros(t), key, phase);
                prop_assert!((1.0 / WEIGHT_LIMIT..=WEIGHT_LIMIT).contains(&w), "decode weight {}", w);
            }
            let folded = l.fold_load(Instant::from_micros(t), KEY, WorkerLoad::default(), 0, u32::MAX);
            prop_assert!(folded.active_decode_blocks <= u64::from(u32::MAX));
        }
    }
}
