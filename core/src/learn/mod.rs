//! Online cost learning: how fast each worker really prefills and decodes, fitted from
//! what the adapters observe, and the load its engine reports about itself.
//!
//! The kv cost model predicts time with one engine timing model ([`TtftModel`]) for the
//! whole fleet, and counts only the load this router placed. A [`CostLearner`] corrects
//! both, per worker key:
//!
//! - **Speed.** Each [`Observation`] compares a measured time with what the timing model
//!   predicts for the same work: a first token after `queued + uncached` prompt tokens,
//!   or a run of decode steps. The learned *scale* is the decayed ratio of the two,
//!   `Σ wᵢ·measuredᵢ / Σ wᵢ·predictedᵢ`, the samples weighted by their predicted time and
//!   by `2^(−age / half_life_ms)`. A worker twice as slow as the model has scale 2.
//! - **Outliers.** Before it is folded in, a sample's ratio is clamped to within
//!   `outlier_ratio_max` of the current estimate (and to `scale_min..=scale_max`): an idle
//!   engine that takes a second to pick a request up moves the estimate by a bounded
//!   step, never to the outlier.
//! - **Prior.** Until a key has `samples_min` samples of a kind, its scale is the
//!   fleet's fastest (1, the fixed coefficients, before any key has enough).
//! - **Optimism.** A key's estimate is blended with the fastest one in the fleet,
//!   weighted `prior_samples` against the key's own decayed count of samples. A worker that
//!   looked slow and so stopped getting traffic drifts back towards the fastest as its
//!   evidence ages, and is tried again. Without it, a worker judged on a few bad samples
//!   (an idle CPU engine takes up to a second to pick a request up) is never sampled
//!   again, and traffic collapses onto the others.
//! - **Engine load.** An [`EngineLoad`] (requests waiting and running, KV usage) scraped
//!   from the worker counts traffic that reached it by another way. While it is younger
//!   than `engine_load_age_max_ms`, the load a candidate is scored with is the larger of
//!   the router's own count and the engine's, and waiting requests the router did not
//!   place are charged the key's mean uncached prompt.
//!
//! - **Doubt.** The cold charge is a wall-clock wait measured where engines kept to
//!   the timing, so it counts only against a timing first tokens have shown: until
//!   some key has `samples_min` of them it counts nothing. Once the fleet's fastest
//!   prefill estimate is `doubt_scale_min` times the model's or more, the timing is off
//!   for every worker (a model, or a host, slower than its preset), and the charge,
//!   which the slowdown does not stretch, is divided by that scale, as if every
//!   predicted time were multiplied by it. Without it a CPU engine forty times slower
//!   than its preset looked cheaper with a queue of eight requests than idle, and the
//!   real fleet sent every chat to one server; charged in full before the samples came,
//!   it cost shared-doc hits and TTFT there (the fleet benchmark's README, session
//!   40). With `costs` on, each key's cold wait is divided by its own prefill scale.
//!   `doubt_scale_min = 0` trusts the timing throughout.
//!
//! How the cost uses it: with [`LearnConfig::costs`] on, a candidate's cost factor is
//! multiplied by its prefill scale (decode scale in the decode phase), which scales every
//! time the TTFT model predicts for that worker, and in an aggregated cost its decode
//! steps are weighed by its decode scale over its prefill scale
//! ([`CostScales::decode_weight`]), so each kind of work carries its own scale: an
//! engine whose prefill is slower against its decode than the model's (a CPU engine
//! under the GPU model) has its queued prefill weigh more than its decode steps. With
//! [`LearnConfig::engine_load`] on, its load is the folded one. Both are off by default,
//! and observations are fitted either way, so the learned figures can be watched before
//! they are trusted.
//!
//! State is one fixed-size entry per key, at most `keys_max` keys; a removed worker's
//! entries go with it. Every input is O(log keys). No input panics or poisons an entry:
//! NaN, infinite and negative values are refused and counted.

#[cfg(test)]
mod tests;

use alloc::collections::BTreeMap;
use core::fmt;

use crate::mathf;
use crate::select::TtftModel;
use crate::types::{Phase, WorkerId, WorkerKey, WorkerLoad};
use crate::Instant;

/// Knobs of the cost learner. `Default` gives the documented defaults.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct LearnConfig {
    /// Scale each worker's predicted times by its learned speed. Default false.
    pub costs: bool,
    /// Fold engine-reported load into the load candidates are scored with. Default false.
    pub engine_load: bool,
    /// Age at which a sample weighs half as much as a new one, ms. Default 20,000.
    pub half_life_ms: u64,
    /// Weight of the fleet's fastest estimate in each key's, in samples (see
    /// "Optimism" above); 0 turns it off. Default 4.
    pub prior_samples: f64,
    /// Samples of a kind a key needs before its own learned scale is used; until then it
    /// is the fleet's fastest (1 with `prior_samples` 0, or before any key has one).
    /// Default 8.
    pub samples_min: u32,
    /// Furthest a sample's ratio may stray from the current estimate, as a factor
    /// either way (values below 1 count as 1). Default 3.0.
    pub outlier_ratio_max: f64,
    /// Smallest learned scale. Default 1/1024.
    pub scale_min: f64,
    /// Largest learned scale. Default 1,024: a CPU engine routed with a GPU's timing
    /// is some 100 times slower than predicted, and a cap below that would hide which
    /// worker is slower still.
    pub scale_max: f64,
    /// Worker keys tracked at once. Default 4,096.
    pub keys_max: usize,
    /// An engine report older than this is ignored, ms. Default 10,000.
    pub engine_load_age_max_ms: u64,
    /// Uncached prompt tokens charged per engine-waiting request this router did not
    /// place, until the key has a learned mean. Default 512.
    pub waiting_tokens_default: u32,
    /// The fleet's fastest prefill scale at which the timing is doubted (see "Doubt"
    /// above); 0, NaN and infinity turn it off, values below 1 count as 1. Default 2.
    pub doubt_scale_min: f64,
}

impl LearnConfig {
    /// Whether a configuration should accept `v` as [`Self::doubt_scale_min`]: 0 (off)
    /// or a finite number of at least 1. (The learner reads any value, as documented.)
    pub fn doubt_scale_min_ok(v: f64) -> bool {
        v == 0.0 || (v.is_finite() && v >= 1.0)
    }
}

impl Default for LearnConfig {
    fn default() -> Self {
        LearnConfig {
            costs: false,
            engine_load: false,
            half_life_ms: 20_000,
            prior_samples: 4.0,
            samples_min: 8,
            outlier_ratio_max: 3.0,
            scale_min: 1.0 / SCALE_LIMIT,
            scale_max: SCALE_LIMIT,
            keys_max: 4096,
            engine_load_age_max_ms: 10_000,
            waiting_tokens_default: 512,
            doubt_scale_min: DOUBT_SCALE_MIN,
        }
    }
}

/// What an adapter measured about one request on one worker key.
#[derive(Clone, Copy, PartialEq, Debug)]
#[non_exhaustive]
pub enum Observation {
    /// The first token (or first response byte) came `ttft_ms` after dispatch. The
    /// worker had `queued_tokens` prompt tokens ahead of this request's
    /// `uncached_tokens` (take both from the decision's score).
    FirstToken {
        /// Dispatch to first token, ms.
        ttft_ms: f64,
        /// Prompt tokens of this request the worker had to compute.
        uncached_tokens: u32,
        /// Prompt tokens queued ahead of it.
        queued_tokens: u64,
    },
    /// `tokens` output tokens after the first took `ms` in all.
    Decode {
        /// Time from the first token to the last, ms.
        ms: f64,
        /// Tokens produced in that time.
        tokens: u32,
    },
}

/// Load an engine reports about itself (vLLM's `num_requests_waiting`,
/// `num_requests_running` and `kv_cache_usage_perc`).
#[derive(Clone, Copy, PartialEq, Debug, Default)]
pub struct EngineLoad {
    /// Requests queued in the engine, not yet scheduled.
    pub waiting: u32,
    /// Requests in the engine's running batch.
    pub running: u32,
    /// Share of its KV cache in use, 0..=1.
    pub kv_usage: f64,
}

/// Why an observation or engine report was refused. Each is counted in [`LearnStats`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum LearnError {
    /// The worker is not registered.
    UnknownWorker {
        /// The worker named.
        worker: WorkerId,
    },
    /// A time or share was NaN, infinite or negative, or the observation covered no work.
    BadValue,
    /// `keys_max` keys are tracked already.
    TableFull {
        /// The bound.
        keys_max: usize,
    },
}

impl fmt::Display for LearnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LearnError::UnknownWorker { worker } => write!(f, "unknown worker {}", worker.0),
            LearnError::BadValue => f.write_str("observation is not a finite, non-negative amount of work"),
            LearnError::TableFull { keys_max } => write!(f, "cost learner tracks {keys_max} keys already"),
        }
    }
}

impl core::error::Error for LearnError {}

/// Counters of the learner.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LearnStats {
    /// Observations fitted.
    pub observations: u64,
    /// Of those, samples clamped as outliers.
    pub clamped: u64,
    /// Engine reports stored.
    pub engine_loads: u64,
    /// Inputs refused (any [`LearnError`]).
    pub dropped: u64,
}

/// What the learner knows about one key, as of `now`.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct Learned {
    /// Learned prefill scale (1 until `samples_min` prefill samples).
    pub prefill_scale: f64,
    /// Learned decode scale (1 until `samples_min` decode samples).
    pub decode_scale: f64,
    /// The timing model's linear prefill coefficient times the prefill scale, ms/token.
    pub prefill_ms_per_token: f64,
    /// The timing model's empty-cache decode step times the decode scale, ms/token.
    pub decode_ms_per_token: f64,
    /// Prefill samples fitted.
    pub prefill_samples: u64,
    /// Decode samples fitted.
    pub decode_samples: u64,
    /// The last engine report and its age in ms, if any.
    pub engine: Option<(EngineLoad, u64)>,
}

/// A decayed ratio estimate: `num / den`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Fit {
    num: f64,
    den: f64,
    /// Samples, decayed like `num` and `den`.
    weight: f64,
    samples: u64,
    last: Instant,
}

/// How one worker's learned scales enter a candidate's cost in one phase.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CostScales {
    /// Multiplies the whole cost: the decode scale for [`Phase::Decode`], the prefill
    /// scale otherwise.
    pub(crate) factor: f64,
    /// The prefill scale, whatever the phase: the worker's backlog progress is divided
    /// by it.
    pub(crate) prefill_scale: f64,
    /// The weight of decode steps in an aggregated TTFT cost whose factor carries the
    /// prefill scale: decode scale over prefill scale, so each kind of work carries its
    /// own; 1 in the other phases (a cost of one kind of work). Bounded to
    /// 1/1024² ..= 1024².
    pub(crate) decode_weight: f64,
}

impl CostScales {
    /// Nothing learned, or learning off: every scale 1.
    pub(crate) const NONE: CostScales = CostScales { factor: 1.0, prefill_scale: 1.0, decode_weight: 1.0 };
}

/// The default bound on learned scales, either way.
const SCALE_LIMIT: f64 = 1024.0;
/// Default [`LearnConfig::doubt_scale_min`]: vLLM's CPU build learned about 0.4 against
/// its own fitted timing on a 2-layer model, and 38 to 145 on a 6-layer one on a host
/// without AVX-512.
pub(crate) const DOUBT_SCALE_MIN: f64 = 2.0;
/// Bound of [`CostLearner::decode_weight`] and its inverse: the default scale bounds' widest ratio.
pub(crate) const WEIGHT_LIMIT: f64 = SCALE_LIMIT * SCALE_LIMIT;
/// Largest measured or predicted time one sample may carry, ms (about 11 days).
const SAMPLE_MS_MAX: f64 = 1e9;
/// Sums are scaled down past this; the ratio is unchanged.
const SUM_MAX: f64 = 1e15;

impl Fit {
    fn ratio(&self) -> Option<f64> {
        (self.den > 0.0).then(|| self.num / self.den).filter(|r| r.is_finite())
    }

    /// Folds in one sample; true when it was clamped.
    fn add(&mut self, now: Instant, measured_ms: f64, predicted_ms: f64, cfg: &LearnConfig) -> bool {
        let f = decay(now.micros_since(self.last), cfg.half_life_ms);
        self.last = self.last.max(now);
        self.num *= f;
        self.den *= f;
        self.weight *= f;
        if self.den < 1e-300 {
            // Everything fitted so far has decayed away: start again from the prior.
            *self = Fit { last: self.last, ..Fit::default() };
        }
        let (lo, hi) = bounds(cfg);
        let est = self.ratio().unwrap_or(1.0).clamp(lo, hi);
        let k = if cfg.outlier_ratio_max >= 1.0 { cfg.outlier_ratio_max } else { 1.0 };
        let predicted = predicted_ms.min(SAMPLE_MS_MAX);
        let raw = measured_ms.min(SAMPLE_MS_MAX) / predicted;
        let r = raw.clamp(est / k, est * k).clamp(lo, hi);
        self.num += r * predicted;
        self.den += predicted;
        self.weight += 1.0;
        if self.den > SUM_MAX {
            self.num *= 1e-6;
            self.den *= 1e-6;
        }
        self.samples = self.samples.saturating_add(1);
        r != raw
    }

    /// The own estimate once `samples_min` samples exist.
    fn own(&self, cfg: &LearnConfig) -> Option<f64> {
        let (lo, hi) = bounds(cfg);
        (self.samples >= u64::from(cfg.samples_min)).then(|| self.ratio().unwrap_or(1.0).clamp(lo, hi))
    }

    /// The scale to use at `now`: before `samples_min` samples, `best` (1 without
    /// optimism); then the own estimate blended with `best`, the own weighing its
    /// evidence decayed to `now`.
    fn scale(&self, now: Instant, best: f64, cfg: &LearnConfig) -> f64 {
        let prior = if cfg.prior_samples > 0.0 && cfg.prior_samples.is_finite() { cfg.prior_samples } else { 0.0 };
        let Some(own) = self.own(cfg) else {
            // A key new to the learner is judged like the fleet's fastest, not the model:
            // against workers learned 30 times slower than the model, a scale of 1
            // would draw all traffic to it until it had its samples.
            return if prior > 0.0 { best } else { 1.0 };
        };
        let evidence = self.weight * decay(now.micros_since(self.last), cfg.half_life_ms);
        if prior == 0.0 || best >= own {
            return own;
        }
        // Written so that neither a huge `own` nor a huge `prior` overflows or cancels.
        let t = prior / (evidence + prior);
        let (lo, hi) = bounds(cfg);
        (own * (1.0 - t) + best * t).clamp(lo, hi)
    }
}

/// `scale_min..=scale_max`, repaired if the config is NaN or inverted.
fn bounds(cfg: &LearnConfig) -> (f64, f64) {
    let lo = if cfg.scale_min > 0.0 && cfg.scale_min <= 1.0 { cfg.scale_min } else { 1.0 / SCALE_LIMIT };
    let hi = if cfg.scale_max >= 1.0 && cfg.scale_max < f64::INFINITY { cfg.scale_max } else { SCALE_LIMIT };
    (lo, hi)
}

/// `2^(−elapsed / half_life)`; a zero half-life forgets everything older than now.
fn decay(elapsed_us: u64, half_life_ms: u64) -> f64 {
    if elapsed_us == 0 {
        return 1.0;
    }
    if half_life_ms == 0 {
        return 0.0;
    }
    let halves = elapsed_us as f64 / (half_life_ms as f64 * 1000.0);
    mathf::exp(-halves * core::f64::consts::LN_2)
}

/// One key's state.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Entry {
    prefill: Fit,
    decode: Fit,
    /// Decayed sums of uncached prompt tokens and of their weights.
    uncached: (f64, f64),
    engine: Option<(Instant, EngineLoad)>,
}

/// The learner: one fixed-size entry per worker key. See the module documentation.
#[derive(Clone, Debug)]
pub(crate) struct CostLearner {
    cfg: LearnConfig,
    keys: BTreeMap<WorkerKey, Entry>,
    stats: LearnStats,
    /// The fastest own prefill and decode estimates over the keys (1 when none has one).
    best: (f64, f64),
    /// Whether some key has its own prefill estimate (`samples_min` first tokens).
    timed: bool,
}

impl CostLearner {
    /// An empty learner.
    pub(crate) fn new(cfg: LearnConfig) -> Self {
        CostLearner { cfg, keys: BTreeMap::new(), stats: LearnStats::default(), best: (1.0, 1.0), timed: false }
    }

    /// Counters.
    pub(crate) fn stats(&self) -> LearnStats {
        self.stats
    }

    /// Keys tracked.
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// True when no key is tracked.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Fits one observation of `key`. `predicted_ms` is what the timing model predicts
    /// for the same work at scale 1 (the router works it out; see
    /// `Router::handle_observation`).
    pub(crate) fn observe(
        &mut self,
        now: Instant,
        key: WorkerKey,
        obs: &Observation,
        predicted_ms: f64,
    ) -> Result<(), LearnError> {
        let measured = match *obs {
            Observation::FirstToken { ttft_ms, .. } => ttft_ms,
            Observation::Decode { ms, tokens } if tokens > 0 => ms,
            Observation::Decode { .. } => return Err(self.refuse(LearnError::BadValue)),
        };
        if !(measured >= 0.0 && measured.is_finite() && predicted_ms > 0.0 && predicted_ms.is_finite()) {
            return Err(self.refuse(LearnError::BadValue));
        }
        let cfg = self.cfg;
        let e = self.entry(key)?;
        let clamped = match *obs {
            Observation::FirstToken { uncached_tokens, .. } => {
                let f = decay(now.micros_since(e.prefill.last), cfg.half_life_ms);
                e.uncached = (e.uncached.0 * f + f64::from(uncached_tokens), e.uncached.1 * f + 1.0);
                e.prefill.add(now, measured, predicted_ms, &cfg)
            }
            Observation::Decode { .. } => e.decode.add(now, measured, predicted_ms, &cfg),
        };
        self.stats.observations += 1;
        self.stats.clamped += u64::from(clamped);
        self.update_best();
        Ok(())
    }

    /// Stores `key`'s engine report, replacing the last one. A KV usage outside 0..=1 or
    /// NaN is refused.
    pub(crate) fn engine_load(&mut self, now: Instant, key: WorkerKey, load: EngineLoad) -> Result<(), LearnError> {
        if !(0.0..=1.0).contains(&load.kv_usage) {
            return Err(self.refuse(LearnError::BadValue));
        }
        self.entry(key)?.engine = Some((now, load));
        self.stats.engine_loads += 1;
        Ok(())
    }

    /// Forgets every key of `worker`.
    pub(crate) fn remove_worker(&mut self, worker: WorkerId) {
        self.keys.retain(|k, _| k.worker != worker);
        self.update_best();
    }

    /// Linear in keys; runs once per observation, not per candidate.
    fn update_best(&mut self) {
        let cfg = &self.cfg;
        let fastest = |f: fn(&Entry) -> &Fit| self.keys.values().filter_map(|e| f(e).own(cfg)).reduce(f64::min);
        let prefill = fastest(|e| &e.prefill);
        self.timed = prefill.is_some();
        self.best = (prefill.unwrap_or(1.0), fastest(|e| &e.decode).unwrap_or(1.0));
    }

    /// How `key`'s learned scales enter its cost in `phase` at `now` (all 1 when
    /// [`LearnConfig::costs`] is off or the key is unknown): one lookup and one
    /// evaluation of each scale, for the router's per-candidate path.
    pub(crate) fn cost_scales(&self, now: Instant, key: WorkerKey, phase: Phase) -> CostScales {
        let (true, Some(e)) = (self.cfg.costs, self.keys.get(&key)) else { return CostScales::NONE };
        let p = e.prefill.scale(now, self.best.0, &self.cfg);
        let d = e.decode.scale(now, self.best.1, &self.cfg);
        CostScales {
            factor: if phase == Phase::Decode { d } else { p },
            prefill_scale: p,
            // Scale bounds as wide as `f64` allows would overflow the ratio.
            decode_weight: if phase == Phase::Aggregated {
                (d / p).clamp(1.0 / WEIGHT_LIMIT, WEIGHT_LIMIT)
            } else {
                1.0
            },
        }
    }

    /// [`CostScales::factor`] of [`Self::cost_scales`].
    #[cfg(test)]
    pub(crate) fn cost_scale(&self, now: Instant, key: WorkerKey, phase: Phase) -> f64 {
        self.cost_scales(now, key, phase).factor
    }

    /// [`CostScales::decode_weight`] of [`Self::cost_scales`].
    #[cfg(test)]
    pub(crate) fn decode_weight(&self, now: Instant, key: WorkerKey, phase: Phase) -> f64 {
        self.cost_scales(now, key, phase).decode_weight
    }

    /// What a candidate's cold wait (wall time) is multiplied by to put it in the
    /// cost's model time. With doubt off (`doubt_scale_min` 0) the timing is trusted:
    /// 1, or 1 over the key's own prefill scale with `costs` on (`scales` from
    /// [`Self::cost_scales`]). With it on, 0 until some key has `samples_min` first
    /// tokens, then 1 over the slowdown: the key's own scale with `costs` on, else the
    /// fleet's fastest once that is past the bar (else 1).
    pub(crate) fn cold_weight(&self, scales: &CostScales) -> f64 {
        let m = self.cfg.doubt_scale_min;
        let doubting = m > 0.0 && m.is_finite();
        if doubting && !self.timed {
            return 0.0;
        }
        if self.cfg.costs {
            return 1.0 / scales.prefill_scale;
        }
        if doubting && self.best.0 >= m.max(1.0) {
            1.0 / self.best.0
        } else {
            1.0
        }
    }

    /// `own` (the router's count) with `key`'s fresh engine report folded in, when
    /// [`LearnConfig::engine_load`] is on; else `own`. `own_prefill_requests` are the
    /// router's requests there still in prefill (the engine's waiting ones include
    /// them), `kv_blocks` the key's capacity.
    pub(crate) fn fold_load(
        &self,
        now: Instant,
        key: WorkerKey,
        own: WorkerLoad,
        own_prefill_requests: u32,
        kv_blocks: u32,
    ) -> WorkerLoad {
        let Some(e) = self.keys.get(&key).filter(|_| self.cfg.engine_load) else { return own };
        let fresh = |(at, _): &(Instant, EngineLoad)| now.micros_since(*at) / 1000 <= self.cfg.engine_load_age_max_ms;
        let Some((_, r)) = e.engine.filter(fresh) else { return own };
        let blocks = mathf::ceil(r.kv_usage * f64::from(kv_blocks)) as u64;
        let foreign = u64::from(r.waiting.saturating_sub(own_prefill_requests));
        WorkerLoad {
            active_prefill_tokens: own
                .active_prefill_tokens
                .saturating_add(foreign.saturating_mul(self.mean_uncached(e))),
            active_decode_blocks: own.active_decode_blocks.max(blocks),
            active_requests: own.active_requests.max(r.waiting.saturating_add(r.running)),
        }
    }

    /// What the learner knows about `key` as of `now`, with coefficients read from `m`.
    pub(crate) fn learned(&self, now: Instant, key: WorkerKey, m: &TtftModel) -> Option<Learned> {
        let e = self.keys.get(&key)?;
        let (p, d) = (e.prefill.scale(now, self.best.0, &self.cfg), e.decode.scale(now, self.best.1, &self.cfg));
        Some(Learned {
            prefill_scale: p,
            decode_scale: d,
            prefill_ms_per_token: p * m.prefill_ms_per_token,
            decode_ms_per_token: d * m.decode_step_ms(0.0),
            prefill_samples: e.prefill.samples,
            decode_samples: e.decode.samples,
            engine: e.engine.map(|(at, l)| (l, now.micros_since(at) / 1000)),
        })
    }

    fn mean_uncached(&self, e: &Entry) -> u64 {
        let (sum, n) = e.uncached;
        if n > 0.0 && (sum / n).is_finite() {
            mathf::round(sum / n) as u64
        } else {
            u64::from(self.cfg.waiting_tokens_default)
        }
    }

    fn entry(&mut self, key: WorkerKey) -> Result<&mut Entry, LearnError> {
        if !self.keys.contains_key(&key) && self.keys.len() >= self.cfg.keys_max {
            return Err(self.refuse(LearnError::TableFull { keys_max: self.cfg.keys_max }));
        }
        Ok(self.keys.entry(key).or_default())
    }

    pub(crate) fn refuse(&mut self, e: LearnError) -> LearnError {
        self.stats.dropped += 1;
        e
    }
}
