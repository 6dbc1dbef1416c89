//! The router's side of cost learning: observations and engine reports in, checked
//! against the fleet, with the timing model's prediction for the same work worked out
//! here (see [`crate::learn`]).

use super::{Routed, Router};
use crate::hash::BlockSize;
use crate::learn::{CostLearner, EngineLoad, LearnError, Observation};
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
    /// The cost learner: learned speeds and engine reports per worker key.
    pub fn learner(&self) -> &CostLearner {
        &self.learn
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
mod tests {
    use alloc::vec::Vec;

    use super::*;
    use crate::hash::{BlockHash, LocalHash, SeqHash};
    use crate::index::IndexEvent;
    use crate::learn::LearnConfig;
    use crate::router::{Decision, Request, RouterConfig, WorkerUpdate};
    use crate::worker::{WorkerRole, WorkerSpec};
    use crate::{Draw, RequestId, Tier, WorkerId};

    const T0: Instant = Instant::ZERO;
    const HOT: WorkerKey = WorkerKey { worker: WorkerId(0), rank: crate::DpRank(0) };
    const COLD: WorkerKey = WorkerKey { worker: WorkerId(1), rank: crate::DpRank(0) };

    /// Two idle workers; `HOT` caches the 8-block prompt the previews ask about.
    fn router(learn: LearnConfig) -> Router {
        let mut r = Router::new(RouterConfig { learn, ..RouterConfig::default() });
        for w in 0..2 {
            let spec = WorkerSpec::new(WorkerId(w), WorkerRole::Aggregated);
            r.handle_worker_update(T0, WorkerUpdate::Upsert(spec)).unwrap();
        }
        let blocks: Vec<BlockHash> = (1..=8).map(|i| BlockHash { seq: SeqHash(i), local: LocalHash(i) }).collect();
        r.handle_kv_event(T0, HOT, IndexEvent::Stored { parent: None, blocks: &blocks, tier: Tier::Device }).unwrap();
        r
    }

    /// Where a preview of the cached prompt goes.
    fn target(r: &mut Router) -> WorkerKey {
        let q = Request {
            id: RequestId(7),
            blocks: (1..=8).map(SeqHash).collect(),
            isl_tokens: 512,
            preview: true,
            ..Request::default()
        };
        match r.handle_request(T0, q, Draw(0)) {
            Ok(Decision::Routed(d)) => d.target,
            other => panic!("expected a route, got {other:?}"),
        }
    }

    /// `HOT` answers ten times slower than the timing model predicts.
    fn slow_hot(r: &mut Router) {
        for i in 0..8 {
            let obs = Observation::FirstToken { ttft_ms: 2_000.0, uncached_tokens: 512, queued_tokens: 0 };
            r.handle_observation(Instant::from_millis(i), HOT, obs).unwrap();
        }
    }

    #[test]
    fn a_learned_slow_worker_loses_its_cache_advantage_only_when_costs_are_on() {
        for (costs, expected) in [(false, HOT), (true, COLD)] {
            let mut r = router(LearnConfig { costs, ..LearnConfig::default() });
            assert_eq!(target(&mut r), HOT, "before any sample, the prior holds");
            slow_hot(&mut r);
            assert_eq!(target(&mut r), expected, "costs {costs}");
            let learned = r.learner().learned(T0, HOT, &r.config().cost.timing).unwrap();
            assert_eq!(learned.prefill_samples, 8);
            assert!(learned.prefill_scale > 10.0, "{learned:?}");
        }
    }

    #[test]
    fn engine_reported_queue_moves_traffic_only_when_folded_in() {
        for (engine_load, expected) in [(false, HOT), (true, COLD)] {
            let mut r = router(LearnConfig { engine_load, ..LearnConfig::default() });
            let busy = EngineLoad { waiting: 40, running: 8, kv_usage: 0.5 };
            r.handle_engine_load(T0, HOT, busy).unwrap();
            assert_eq!(target(&mut r), expected, "engine_load {engine_load}");
        }
    }

    #[test]
    fn a_first_token_observation_carries_the_work_its_decision_counted() {
        let mut r = router(LearnConfig::default());
        let bs = r.config().block_size;
        let preview = |id, blocks: core::ops::RangeInclusive<u64>, preview| Request {
            id: RequestId(id),
            isl_tokens: blocks.clone().count() as u32 * 64,
            blocks: blocks.map(SeqHash).collect(),
            preview,
            ..Request::default()
        };
        let cached = match r.handle_request(T0, preview(1, 1..=8, true), Draw(0)) {
            Ok(Decision::Routed(d)) => d,
            other => panic!("{other:?}"),
        };
        assert_eq!(cached.target, HOT);
        let expected = Observation::FirstToken { ttft_ms: 5.0, uncached_tokens: 0, queued_tokens: 0 };
        assert_eq!(Observation::first_token(5.0, &cached, 512, bs), expected);
        // A booked, unfinished 512-token prompt on COLD is queued ahead of the next one.
        let hints = crate::pin::RoutingHints { backend_instance_id: Some(COLD.worker), ..Default::default() };
        let first = Request { hints: hints.clone(), ..preview(2, 101..=108, false) };
        assert!(matches!(r.handle_request(T0, first, Draw(0)), Ok(Decision::Routed(_))));
        let next = match r.handle_request(T0, Request { hints, ..preview(3, 201..=204, true) }, Draw(0)) {
            Ok(Decision::Routed(d)) => d,
            other => panic!("{other:?}"),
        };
        let expected = Observation::FirstToken { ttft_ms: 9.0, uncached_tokens: 256, queued_tokens: 512 };
        assert_eq!(Observation::first_token(9.0, &next, 256, bs), expected);
    }

    #[test]
    fn inputs_for_unknown_workers_are_refused_and_a_removed_worker_is_forgotten() {
        let mut r = router(LearnConfig::default());
        let ghost = WorkerKey::new(9, 0);
        let obs = Observation::FirstToken { ttft_ms: 1.0, uncached_tokens: 1, queued_tokens: 0 };
        assert_eq!(r.handle_observation(T0, ghost, obs), Err(LearnError::UnknownWorker { worker: WorkerId(9) }));
        assert_eq!(
            r.handle_engine_load(T0, ghost, EngineLoad::default()),
            Err(LearnError::UnknownWorker { worker: WorkerId(9) })
        );
        r.handle_observation(T0, HOT, obs).unwrap();
        assert_eq!(r.learner().len(), 1);
        r.handle_worker_update(T0, WorkerUpdate::Removed(WorkerId(0))).unwrap();
        assert!(r.learner().is_empty());
        assert_eq!(r.learner().stats().dropped, 2);
    }
}
