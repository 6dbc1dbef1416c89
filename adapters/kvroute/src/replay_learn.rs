//! `kvroute replay`'s cost-learning flags: a fleet of workers whose speeds the router is
//! not told, and the learned cost model and engine-reported load to route it with.

use clap::Args;
use router_core::LearnConfig;

/// Flags for heterogeneous fleets and cost learning. Learned costs and engine load are
/// off by default; the timing's doubt is on, as in `kvroute serve`, and moves nothing
/// unless the engines run at least twice as slow as the router predicts and the timing
/// has a cold term (`--engine-timing vllm-cpu`).
#[derive(Args, Debug, Clone, Default)]
pub struct LearnArgs {
    /// Per-worker speed factors the router is not told, e.g. 1,1,0.5,0.25 (0.5 runs
    /// at half speed); missing workers run at 1.
    #[arg(long, value_delimiter = ',', value_name = "X,...")]
    pub worker_speeds: Vec<f64>,
    /// Learn each worker's prefill and decode speed from observed TTFT and decode times,
    /// and scale its predicted costs by them.
    #[arg(long)]
    pub learn_costs: bool,
    /// Fold the workers' own load reports (waiting, running, KV usage) into the cost.
    #[arg(long)]
    pub engine_load: bool,
    /// Cost learning: samples a worker needs before its learned speed is used.
    #[arg(long, value_name = "N")]
    pub learn_samples_min: Option<u32>,
    /// Cost learning: age at which a sample weighs half, ms.
    #[arg(long, value_name = "MS")]
    pub learn_half_life_ms: Option<u64>,
    /// Cost learning: pull, in samples, of the fastest worker's speed on each worker's.
    #[arg(long, value_name = "N")]
    pub learn_prior_samples: Option<f64>,
    /// Doubt the timing once every worker is learned at least this many times slower
    /// than it predicts: an idle worker's cold wait then weighs that much less, and
    /// nothing before a worker has its samples (`[learn] doubt_scale_min`; default 2, 0
    /// turns it off and trusts the timing throughout).
    #[arg(long, value_name = "X", value_parser = doubt_scale_min)]
    pub learn_doubt_scale_min: Option<f64>,
}

fn doubt_scale_min(v: &str) -> Result<f64, String> {
    let x: f64 = v.parse().map_err(|e| format!("{e}"))?;
    if LearnConfig::doubt_scale_min_ok(x) {
        Ok(x)
    } else {
        Err("must be 0 (off) or a number of at least 1".into())
    }
}

impl LearnArgs {
    /// Whether the dispatcher has to report observations at all.
    pub fn observing(&self) -> bool {
        self.learn_costs || self.engine_load || self.config().doubt_scale_min != 0.0
    }

    /// The learner's configuration.
    pub fn config(&self) -> LearnConfig {
        let d = LearnConfig::default();
        LearnConfig {
            costs: self.learn_costs,
            engine_load: self.engine_load,
            samples_min: self.learn_samples_min.unwrap_or(d.samples_min),
            half_life_ms: self.learn_half_life_ms.unwrap_or(d.half_life_ms),
            prior_samples: self.learn_prior_samples.unwrap_or(d.prior_samples),
            doubt_scale_min: self.learn_doubt_scale_min.unwrap_or(d.doubt_scale_min),
            ..d
        }
    }

    /// The speeds, checked: each a positive finite number.
    pub fn speeds(&self) -> Result<Vec<f64>, String> {
        match self.worker_speeds.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            Some(bad) => Err(format!("--worker-speeds: {bad} is not a positive number")),
            None => Ok(self.worker_speeds.clone()),
        }
    }
}
