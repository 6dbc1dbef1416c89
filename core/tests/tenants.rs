//! Tenants at the `Router` façade: requests carry a `TenantId`, and a saturated worker
//! takes the queued ones in proportion to the tenants' weights, whatever order they
//! arrived in.

use router_core::{
    Decision, Draw, Instant, Output, Phase, QueueConfig, Request, RequestId, Router, RouterConfig, SeqHash, TenantId,
    WorkerId, WorkerRole, WorkerSpec, WorkerUpdate,
};

const T0: Instant = Instant::ZERO;
const AGG: Phase = Phase::Aggregated;

/// One worker that is busy while any request is in prefill, and tenants weighing
/// `weights` (tenant `i` weighs `weights[i]`).
fn router(weights: &[u32]) -> Router {
    let mut cfg = RouterConfig {
        queue: QueueConfig { tenant_weights: weights.to_vec(), ..QueueConfig::default() },
        ..RouterConfig::default()
    };
    cfg.eligibility.prefill_tokens_max = Some(100);
    cfg.eligibility.prefill_tokens_frac_of_batch = None;
    let mut r = Router::new(cfg);
    let spec = WorkerSpec::new(WorkerId(0), WorkerRole::Aggregated);
    r.handle_worker_update(T0, WorkerUpdate::Upsert(spec)).expect("fits");
    r
}

fn req(id: u64, tenant: u16) -> Request {
    Request {
        id: RequestId(id),
        blocks: vec![SeqHash(id), SeqHash(1000 + id)],
        isl_tokens: 128,
        tenant: TenantId(tenant),
        ..Request::default()
    }
}

/// Occupies the worker with request 0, queues `(id, tenant)` in that order, then ends
/// each running prefill in turn and returns the ids in the order they were routed.
#[track_caller]
fn check(weights: &[u32], queued: &[(u64, u16)], want: &[u64]) {
    let mut r = router(weights);
    assert!(matches!(r.handle_request(T0, req(0, 0), Draw(0)), Ok(Decision::Routed(_))));
    r.handle_dispatched(T0, RequestId(0), AGG).expect("booked");
    for &(id, tenant) in queued {
        assert_eq!(r.handle_request(T0, req(id, tenant), Draw(id)), Ok(Decision::Queued), "request {id}");
    }
    let mut running = RequestId(0);
    let mut order = Vec::new();
    for _ in 0..queued.len() {
        r.handle_prefill_done(T0, running, AGG).expect("running");
        r.handle_finished(T0, running, AGG).expect("running");
        let routed: Vec<RequestId> = std::iter::from_fn(|| r.poll_output())
            .filter_map(|o| match o {
                Output::Routed(d) => Some(d.id),
                _ => None,
            })
            .collect();
        assert_eq!(routed.len(), 1, "one leaves the queue per prefill done: {routed:?}");
        running = routed[0];
        r.handle_dispatched(T0, running, AGG).expect("booked");
        order.push(running.0);
        if let Err(v) = r.check_invariants() {
            panic!("invariant violated: {}", v.0);
        }
    }
    assert_eq!(order, want);
}

#[test]
fn a_flood_by_one_tenant_shares_the_worker_by_weight() {
    // Tenant 1 floods first; tenant 2, weighing a third as much, arrives last.
    let flood: Vec<(u64, u16)> = (10..16).map(|id| (id, 1)).chain((20..23).map(|id| (id, 2))).collect();
    check(&[1, 3, 1], &flood, &[10, 20, 11, 12, 13, 21, 14, 15, 22]);
    // Equal weights: turns.
    check(&[], &flood, &[10, 20, 11, 21, 12, 22, 13, 14, 15]);
}

#[test]
fn one_tenant_keeps_arrival_order() {
    let one: Vec<(u64, u16)> = (10..15).map(|id| (id, 0)).collect();
    check(&[], &one, &[10, 11, 12, 13, 14]);
}
