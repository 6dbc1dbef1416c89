//! The router's side of cost learning: observations and engine reports in, checked
//! against the fleet, with the timing model's prediction for the same work worked out
//! here (see [`crate::learn`]).

use super::{Routed, Router};
use crate::hash::BlockSize;
use crate::learn::{EngineLoad, LearnError, Learned, Observation};
use crate::mathf;
use crate::{Instant, WorkerKey};

impl Observation {
    /// The first-token observation of a routed request: `ttft_ms` against the work its
    /// decision counted on the target, the prompt's uncached tokens (as booked: the
    /// device overlap is cached) and the prompt tokens queued ahead of them (the rest of
    /// the target's `prefill_blocks`). A target missing from the explanation counts no
    /// queue.
    pub fn first_token(ttft_ms: f64, routed: &Routed, isl_tokens: u32, block_size: BlockSize) -> Observation {
        let bs = block_size.tokens();
        let uncached_tokens = isl_tokens - routed.overlap.device.saturating_mul(bs).min(isl_tokens);
        let row = routed.explanation.iter().find(|r| r.key == routed.target);
        let counted = row.and_then(|r| r.score).map_or(0.0, |s| s.prefill_blocks * f64::from(bs));
        // The cost model charges at least one token for a non-empty prompt.
        let own = uncached_tokens.max(u32::from(isl_tokens > 0));
        let queued = counted - f64::from(own);
        // Float to integer saturates; NaN becomes 0.
        let queued_tokens = if queued > 0.0 { mathf::round(queued) as u64 } else { 0 };
        Observation::FirstToken { ttft_ms, uncached_tokens, queued_tokens }
    }
}

impl Router {
    /// What the cost learner knows about `key` as of `now`, as plain data: its learned
    /// scales and the times they give, its samples and its last engine report. `None`
    /// before anything about `key` was fed in. O(log keys).
    pub fn learned(&self, now: Instant, key: WorkerKey) -> Option<Learned> {
        self.learn.learned(now, key, &self.cfg.cost.timing)
    }

    /// Feeds one measurement of a request served by `key` to the cost learner. The
    /// timing model's prediction for the same work (at the key's pass budget, and for
    /// decode at its current KV usage) is what the measurement is compared with.
    /// Refused (and counted) for an unregistered worker or a non-finite or negative
    /// value; a refused observation changes nothing.
    pub fn handle_observation(&mut self, now: Instant, key: WorkerKey, obs: Observation) -> Result<(), LearnError> {
        let Some(spec) = self.workers.get(key.worker) else {
            return self.learn_refused(key);
        };
        let m = &self.cfg.cost.timing;
        let predicted_ms = match obs {
            Observation::FirstToken { uncached_tokens, queued_tokens, .. } => {
                let batch =
                    if spec.max_batched_tokens == 0 { m.max_batched_tokens_default } else { spec.max_batched_tokens };
                let tokens = queued_tokens as f64 + f64::from(uncached_tokens.max(1));
                m.chunked_prefill_ms(tokens, batch).0
            }
            Observation::Decode { tokens, .. } => {
                let kv = if spec.kv_blocks == 0 { m.kv_blocks_default } else { spec.kv_blocks }.max(1);
                let usage = self.load.local().load(key).active_decode_blocks as f64 / f64::from(kv);
                f64::from(tokens) * m.decode_step_ms(usage)
            }
        };
        self.learn.observe(now, key, &obs, predicted_ms)
    }

    /// Stores the load `key`'s engine reports about itself (scraped from its metrics).
    /// With `learn.engine_load` on, candidates are scored with it while it is fresh.
    pub fn handle_engine_load(&mut self, now: Instant, key: WorkerKey, load: EngineLoad) -> Result<(), LearnError> {
        if self.workers.get(key.worker).is_none() {
            return self.learn_refused(key);
        }
        self.learn.engine_load(now, key, load)
    }

    fn learn_refused(&mut self, key: WorkerKey) -> Result<(), LearnError> {
        Err(self.learn.refuse(LearnError::UnknownWorker { worker: key.worker }))
    }
}

#[cfg(test)]
mod tests;
