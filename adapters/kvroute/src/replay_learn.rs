//! `kvroute replay`'s cost-learning flags: a fleet of workers whose speeds the router is
//! not told, and the learned cost model and engine-reported load to route it with.

use clap::Args;
use router_core::LearnConfig;

/// Flags for heterogeneous fleets and cost learning. All off by default, so a replay
/// without them is the fixed-coefficient replay, byte for byte.
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
}

impl LearnArgs {
    /// Whether the dispatcher has to report observations at all.
    pub fn observing(&self) -> bool {
        self.learn_costs || self.engine_load
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
