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
        let learned = r.learned(T0, HOT).unwrap();
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
    assert_eq!(r.counts().learned_keys, 1);
    r.handle_worker_update(T0, WorkerUpdate::Removed(WorkerId(0))).unwrap();
    assert_eq!(r.counts().learned_keys, 0);
    assert_eq!(r.counts().learn.dropped, 2);
}
