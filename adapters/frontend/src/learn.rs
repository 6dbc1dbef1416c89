//! The `[learn]` section: the cost model that learns each worker's speed from the
//! requests it serves, and the engine load scraped from the workers' own metrics.

use std::time::Duration;

use kvroute_driver::Driver;
use router_core::Routed;
use router_core::{LearnConfig, Learned};
use serde::Deserialize;
use serde_json::{json, Value};

/// Cost learning and engine-load scraping (`[learn]`). Observations are fitted even when
/// `costs` is off, so `/workers` shows what would be learned before it is used.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LearnSection {
    /// Scale each worker's predicted times by its learned speed (default false).
    pub costs: bool,
    /// Fold the load the engines report into the cost (default false). Needs
    /// `scrape_interval_ms` above 0.
    pub engine_load: bool,
    /// Age at which a sample weighs half as much as a new one, in ms (default 20,000).
    pub half_life_ms: u64,
    /// Weight, in samples, of the fleet's fastest learned speed in each worker's; a
    /// worker judged slow drifts back towards it as its samples age, and is tried again
    /// (default 4; 0 turns it off).
    pub prior_samples: f64,
    /// Samples a worker needs before its learned speed replaces the fixed one (default 8).
    pub samples_min: u32,
    /// Furthest one sample may pull from the current estimate, as a factor (default 3.0).
    pub outlier_ratio_max: f64,
    /// How often each worker's metrics are scraped, in ms (default 0: not scraped;
    /// 1,000 is a good period).
    pub scrape_interval_ms: u64,
    /// Time one scrape may take, in ms (default 500).
    pub scrape_timeout_ms: u64,
    /// Path of the workers' Prometheus metrics (default `/metrics`).
    pub metrics_path: String,
    /// Largest metrics page read, in bytes (default 4 MiB); a larger one is a dropped scrape.
    pub metrics_bytes_max: usize,
    /// An engine report older than this is ignored, in ms (default 10,000).
    pub engine_load_age_max_ms: u64,
    /// How often each worker of a model with a `tokenizer` (one that publishes KV events,
    /// or whose model has `forward_token_ids`) is asked to tokenize a probe text, to
    /// compare with the router's ids (see [`crate::agree`]), in ms (default
    /// 30,000; 0: never, and no prompt is sent as token ids). Each check may take
    /// `scrape_timeout_ms`.
    pub tokenizer_check_interval_ms: u64,
    /// Path of the workers' tokenize endpoint, in vLLM's shape (default `/tokenize`).
    pub tokenize_path: String,
    /// When every worker with enough samples prefills at least this many times slower
    /// than the timing (`[router] engine_timing`) predicts, the timing is doubted: an idle
    /// worker's cold wait, which such a slowdown does not stretch, weighs that much less
    /// against the predicted queues (default 2; 0 turns it off). Applies with `costs` off.
    /// While on, the cold wait counts nothing until some worker has `samples_min` first
    /// tokens: nothing has shown the timing holds before.
    pub doubt_scale_min: f64,
}

impl Default for LearnSection {
    fn default() -> Self {
        let core = LearnConfig::default();
        LearnSection {
            costs: core.costs,
            engine_load: core.engine_load,
            half_life_ms: core.half_life_ms,
            prior_samples: core.prior_samples,
            samples_min: core.samples_min,
            outlier_ratio_max: core.outlier_ratio_max,
            scrape_interval_ms: 0,
            scrape_timeout_ms: 500,
            metrics_path: "/metrics".into(),
            metrics_bytes_max: 4 << 20,
            engine_load_age_max_ms: core.engine_load_age_max_ms,
            tokenizer_check_interval_ms: 30_000,
            tokenize_path: "/tokenize".into(),
            doubt_scale_min: core.doubt_scale_min,
        }
    }
}

impl LearnSection {
    /// The core's learner configuration.
    pub fn core(&self) -> LearnConfig {
        LearnConfig {
            costs: self.costs,
            engine_load: self.engine_load,
            half_life_ms: self.half_life_ms,
            prior_samples: self.prior_samples,
            samples_min: self.samples_min,
            outlier_ratio_max: self.outlier_ratio_max,
            engine_load_age_max_ms: self.engine_load_age_max_ms,
            doubt_scale_min: self.doubt_scale_min,
            ..LearnConfig::default()
        }
    }

    /// The scrape period, or `None` when scraping is off.
    pub fn scrape_interval(&self) -> Option<Duration> {
        (self.scrape_interval_ms > 0).then(|| Duration::from_millis(self.scrape_interval_ms))
    }

    /// The tokenizer check period, or `None` when checks are off.
    pub fn tokenizer_check_interval(&self) -> Option<Duration> {
        (self.tokenizer_check_interval_ms > 0).then(|| Duration::from_millis(self.tokenizer_check_interval_ms))
    }

    /// The first field that is out of range, with why.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(self.outlier_ratio_max.is_finite() && self.outlier_ratio_max >= 1.0) {
            return Err(("learn.outlier_ratio_max", "must be a number of at least 1".into()));
        }
        if !(self.prior_samples.is_finite() && self.prior_samples >= 0.0) {
            return Err(("learn.prior_samples", "must be a number of at least 0".into()));
        }
        if !LearnConfig::doubt_scale_min_ok(self.doubt_scale_min) {
            return Err(("learn.doubt_scale_min", "must be 0 (off) or a number of at least 1".into()));
        }
        if !self.metrics_path.starts_with('/') {
            return Err(("learn.metrics_path", "must start with /".into()));
        }
        if self.engine_load && self.scrape_interval_ms == 0 {
            return Err(("learn.engine_load", "needs learn.scrape_interval_ms above 0".into()));
        }
        if !self.tokenize_path.starts_with('/') {
            return Err(("learn.tokenize_path", "must start with /".into()));
        }
        let asks = self.scrape_interval_ms > 0 || self.tokenizer_check_interval_ms > 0;
        if asks && self.scrape_timeout_ms == 0 {
            return Err(("learn.scrape_timeout_ms", "must be above 0 while scraping or checking tokenizers".into()));
        }
        Ok(())
    }
}

/// What the cost learner knows about one worker key, as `/workers` and
/// `/route/preview` show it: learned coefficients, sample counts, and the engine's last
/// report with its age (`null` before any).
pub fn learned_json(learned: Option<Learned>) -> Value {
    let Some(l) = learned else {
        return json!({"prefill_samples": 0, "decode_samples": 0, "engine": null});
    };
    json!({
        "prefill_ms_per_token": l.prefill_ms_per_token,
        "decode_ms_per_token": l.decode_ms_per_token,
        "prefill_scale": l.prefill_scale,
        "decode_scale": l.decode_scale,
        "prefill_samples": l.prefill_samples,
        "decode_samples": l.decode_samples,
        "engine": l.engine.map(|(e, age_ms)| json!({
            "waiting": e.waiting,
            "running": e.running,
            "kv_usage": e.kv_usage,
            "age_ms": age_ms,
        })),
    })
}

/// Adds the learner's view to a preview's JSON: whether learned costs and engine load
/// are in use, and per explanation row what the decision read.
pub fn annotate_preview(out: &mut Value, driver: &Driver, routed: &Routed, cfg: &LearnSection) {
    if let Some(rows) = out.get_mut("explanation").and_then(Value::as_array_mut) {
        for (row, r) in rows.iter_mut().zip(&routed.explanation) {
            row["learned"] = learned_json(driver.learned(r.key));
        }
    }
    out["learn"] = json!({"costs": cfg.costs, "engine_load": cfg.engine_load});
}
