//! Replicas as data: a few routers wired together by a lossless in-memory "transport"
//! (drain one's updates, feed them to the others), checking every router's invariants
//! after every step.

use alloc::vec;
use alloc::vec::Vec;

use super::*;
use crate::eligible::EligibilityConfig;
use crate::hash::SeqHash;
use crate::router::{Decision, DispatchFailure, Output, Request, RouterConfig, WorkerUpdate};
use crate::select::RouterMode;
use crate::worker::{WorkerRole, WorkerSpec};
use crate::Draw;

const SILENCE_MS: u64 = 1000;

fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn replica(id: u64, workers: u64, mode: RouterMode) -> Router {
    replica_with(id, workers, RouterConfig { mode, ..RouterConfig::default() })
}

fn replica_with(id: u64, workers: u64, mut cfg: RouterConfig) -> Router {
    cfg.replica.id = Some(ReplicaId(id));
    cfg.replica.remote.replica_silence_max_ms = SILENCE_MS;
    cfg.eligibility = EligibilityConfig { prefill_tokens_max: Some(1000), ..EligibilityConfig::default() };
    let mut r = Router::new(cfg);
    for w in 0..workers {
        r.handle_worker_update(at(0), WorkerUpdate::Upsert(WorkerSpec::new(WorkerId(w), WorkerRole::Aggregated)))
            .unwrap();
    }
    r
}

fn req(id: u64, session: Option<&[u8]>) -> Request {
    Request {
        id: RequestId(id),
        blocks: vec![SeqHash(id)],
        isl_tokens: 64,
        session: session.map(<[u8]>::to_vec),
        ..Request::default()
    }
}

/// Routes and dispatches a request; returns its worker.
#[track_caller]
fn route(r: &mut Router, now: Instant, q: Request) -> WorkerId {
    let id = q.id;
    let d = match r.handle_request(now, q, Draw(id.0)) {
        Ok(Decision::Routed(d)) => d,
        other => panic!("expected a routed decision, got {other:?}"),
    };
    r.handle_dispatched(now, d.id, d.phase).unwrap();
    invariants(r);
    d.target.worker
}

#[track_caller]
fn invariants(r: &Router) {
    if let Err(v) = r.check_invariants() {
        panic!("invariant violated: {}", v.0);
    }
}

/// Delivers every queued update of `routers[from]` to every other router.
fn pump(routers: &mut [Router], from: usize, now: Instant) -> Vec<ReplicaUpdate> {
    let sender = routers[from].config().replica.id.unwrap();
    let mut sent = Vec::new();
    while let Some(u) = routers[from].poll_replica_update() {
        sent.push(u);
    }
    for (i, r) in routers.iter_mut().enumerate() {
        if i != from {
            for u in &sent {
                let _ = r.handle_replica_update(now, sender, u.clone());
            }
            invariants(r);
        }
    }
    sent
}

/// Delivers every router's updates until none are left (bounded, so a storm fails).
fn settle(routers: &mut [Router], now: Instant) {
    for _ in 0..10 {
        let mut any = false;
        for from in 0..routers.len() {
            any |= !pump(routers, from, now).is_empty();
        }
        if !any {
            return;
        }
    }
    panic!("replica updates did not settle within 10 rounds");
}

#[test]
fn selection_sees_other_replicas_load() {
    let mut rs = [replica(1, 2, RouterMode::LeastLoaded), replica(2, 2, RouterMode::LeastLoaded)];
    // Each replica alone would pick the least loaded of two idle workers by draw; with
    // the other's load in view, four requests alternate between the workers.
    let mut on = [0u32; 2];
    for i in 0..4u64 {
        let r = (i % 2) as usize;
        on[route(&mut rs[r], at(i), req(10 + i, None)).0 as usize] += 1;
        settle(&mut rs, at(i));
    }
    assert_eq!(on, [2, 2], "load is shared");
    for r in &rs {
        let total: u32 = (0..2).map(|w| r.combined_load(WorkerKey::new(w, 0)).active_requests).sum();
        assert_eq!(total, 4, "every replica sees all four requests");
        assert_eq!(r.load.local().len(), 2, "and books only its own");
    }
}

/// How a booking ends on replica 1.
#[derive(Clone, Copy, Debug)]
enum End {
    Finished,
    Cancelled,
    DispatchFailed,
    WorkerRemoved,
    Expired,
}

#[track_caller]
fn check_end(end: End) {
    let mut short = RouterConfig::default();
    short.load.request_age_max_ms = 500;
    let mut rs = [replica_with(1, 1, short), replica(2, 1, RouterMode::Kv)];
    let d = match rs[0].handle_request(at(0), req(7, None), Draw(0)) {
        Ok(Decision::Routed(d)) => d,
        other => panic!("{other:?}"),
    };
    settle(&mut rs, at(0));
    assert_eq!(rs[1].load.remote().load(d.target).active_requests, 1, "{end:?}: the booking is announced");
    match end {
        End::Finished => rs[0].handle_finished(at(1), d.id, d.phase).unwrap(),
        End::Cancelled => rs[0].handle_cancel(at(1), d.id, d.phase).unwrap(),
        End::DispatchFailed => rs[0].handle_dispatch_failed(at(1), d.id, d.phase, DispatchFailure::Worker).unwrap(),
        End::WorkerRemoved => rs[0].handle_worker_update(at(1), WorkerUpdate::Removed(WorkerId(0))).unwrap(),
        End::Expired => {
            rs[0].handle_timeout(at(600));
            while rs[0].poll_output().is_some() {}
        }
    }
    invariants(&rs[0]);
    let sent = pump(&mut rs, 0, at(1));
    assert_eq!(sent, [ReplicaUpdate::Finished { id: d.id, phase: d.phase }], "{end:?}");
    assert_eq!(rs[1].load.remote().len(), 0, "{end:?}: the other replica forgets it");
}

#[test]
fn every_end_of_a_booking_is_announced_once() {
    for end in [End::Finished, End::Cancelled, End::DispatchFailed, End::WorkerRemoved, End::Expired] {
        check_end(end);
    }
}

#[test]
fn prefill_done_is_announced_once() {
    let mut rs = [replica(1, 1, RouterMode::Kv), replica(2, 1, RouterMode::Kv)];
    let mut q = req(3, None);
    q.isl_tokens = 500;
    route(&mut rs[0], at(0), q);
    settle(&mut rs, at(0));
    let key = WorkerKey::new(0, 0);
    assert_eq!(rs[1].load.remote().load(key).active_prefill_tokens, 500);
    rs[0].handle_decode_progress(at(1), RequestId(3), Phase::Aggregated, 4).unwrap();
    rs[0].handle_prefill_done(at(1), RequestId(3), Phase::Aggregated).unwrap();
    rs[0].handle_decode_progress(at(1), RequestId(3), Phase::Aggregated, 8).unwrap();
    let sent = pump(&mut rs, 0, at(1));
    assert_eq!(sent, [ReplicaUpdate::PrefillDone { id: RequestId(3), phase: Phase::Aggregated }]);
    assert_eq!(rs[1].load.remote().load(key).active_prefill_tokens, 0);
    assert_eq!(rs[1].load.remote().load(key).active_requests, 1);
}

#[test]
fn a_silent_replica_load_expires_and_frees_queued_requests() {
    let mut rs = [replica(1, 1, RouterMode::Kv), replica(2, 1, RouterMode::Kv)];
    // Replica 1's prompt overloads the only worker (prefill_tokens_max is 1000).
    let mut big = req(1, None);
    big.isl_tokens = 5000;
    route(&mut rs[0], at(0), big);
    settle(&mut rs, at(0));
    assert_eq!(rs[1].handle_request(at(10), req(2, None), Draw(0)), Ok(Decision::Queued));
    // Replica 1 goes quiet; replica 2 sleeps until its next deadline and wakes there.
    let due = rs[1].poll_timeout().unwrap();
    assert!(due <= at(SILENCE_MS), "the silence deadline is armed: {due:?}");
    rs[1].handle_timeout(at(SILENCE_MS));
    invariants(&rs[1]);
    assert!(matches!(rs[1].poll_output(), Some(Output::Routed(r)) if r.id == RequestId(2)));
    assert_eq!(rs[1].load.remote().len(), 0);
    assert_eq!(rs[1].load.remote().stats().silent_replicas, 1);
}

#[test]
fn a_heartbeat_keeps_a_replica_alive_and_a_goodbye_drops_it() {
    let mut rs = [replica(1, 1, RouterMode::Kv), replica(2, 1, RouterMode::Kv)];
    route(&mut rs[0], at(0), req(1, None));
    settle(&mut rs, at(0));
    rs[1].handle_replica_heartbeat(at(900), ReplicaId(1)).unwrap();
    rs[1].handle_timeout(at(1500));
    assert_eq!(rs[1].load.remote().len(), 1, "heard from at 900 ms: alive until 1900 ms");
    assert_eq!(rs[1].handle_replica_gone(at(1500), ReplicaId(1)), Ok(1));
    assert_eq!(rs[1].load.remote().len(), 0);
    invariants(&rs[1]);
}

#[test]
fn a_lone_router_shares_nothing() {
    let mut r = Router::new(RouterConfig::default());
    r.handle_worker_update(at(0), WorkerUpdate::Upsert(WorkerSpec::new(WorkerId(0), WorkerRole::Aggregated))).unwrap();
    route(&mut r, at(0), req(1, Some(b"s")));
    assert_eq!(r.poll_replica_update(), None);
    let u = ReplicaUpdate::Finished { id: RequestId(1), phase: Phase::Aggregated };
    assert_eq!(r.handle_replica_update(at(0), ReplicaId(2), u.clone()), Err(ReplicaError::Disabled));
    let mut me = replica(1, 1, RouterMode::Kv);
    assert_eq!(me.handle_replica_update(at(0), ReplicaId(1), u), Err(ReplicaError::OwnReplica));
    assert_eq!(me.replica_stats().remote_refused, 1);
}

#[test]
fn a_session_keeps_its_worker_across_replicas() {
    let mut rs = [replica(1, 4, RouterMode::RoundRobin), replica(2, 4, RouterMode::RoundRobin)];
    let home = route(&mut rs[0], at(0), req(1, Some(b"chat")));
    settle(&mut rs, at(0));
    for i in 2..6u64 {
        let r = (i % 2) as usize;
        assert_eq!(route(&mut rs[r], at(i), req(i, Some(b"chat"))), home, "request {i} on replica {r}");
        settle(&mut rs, at(i));
    }
}

#[test]
fn concurrent_first_bindings_converge_on_the_earliest() {
    let mut rs = [replica(1, 4, RouterMode::RoundRobin), replica(2, 4, RouterMode::RoundRobin)];
    // Round-robin sends each replica's first request to a different worker unless the
    // second replica's cursor is moved on first.
    route(&mut rs[1], at(0), req(100, None));
    let first = route(&mut rs[1], at(20), req(2, Some(b"s"))); // committed at 20 ms
    let winner = route(&mut rs[0], at(10), req(1, Some(b"s"))); // committed at 10 ms
    assert_ne!(first, winner, "the race is real");
    settle(&mut rs, at(30));
    for (i, r) in rs.iter_mut().enumerate() {
        let b = r.affinity.peek(b"s", Phase::Aggregated).map(|b| b.worker);
        assert_eq!(b, Some(winner), "replica {i} holds the earlier binding");
        assert_eq!(route(r, at(40), req(200 + i as u64, Some(b"s"))), winner, "the loser re-binds");
    }
}

#[test]
fn an_invalidated_binding_is_dropped_everywhere() {
    let mut rs = [replica(1, 2, RouterMode::RoundRobin), replica(2, 2, RouterMode::RoundRobin)];
    let q = req(1, Some(b"s"));
    route(&mut rs[0], at(0), q.clone());
    settle(&mut rs, at(0));
    assert!(rs[1].affinity.peek(b"s", Phase::Aggregated).is_some());
    // The worker fails a later request of the session on replica 1.
    let again = Request { id: RequestId(2), ..q };
    let d = match rs[0].handle_request(at(1), again, Draw(0)) {
        Ok(Decision::Routed(d)) => d,
        other => panic!("{other:?}"),
    };
    rs[0].handle_dispatch_failed(at(1), d.id, d.phase, DispatchFailure::Worker).unwrap();
    settle(&mut rs, at(1));
    assert_eq!(rs[1].affinity.peek(b"s", Phase::Aggregated), None);
    assert_eq!(rs[1].affinity.stats().remote_unbound, 1);
}

#[test]
fn a_peers_in_flight_prompt_draws_its_continuation() {
    let mut rs = [replica(1, 4, RouterMode::Kv), replica(2, 4, RouterMode::Kv)];
    let prompt = |id: u64, blocks: u64| Request {
        id: RequestId(id),
        blocks: (1..=blocks).map(SeqHash).collect(),
        isl_tokens: blocks as u32 * 64,
        ..Request::default()
    };
    // Replica 1 sends a long prompt somewhere; no worker has announced any cache yet.
    let home = route(&mut rs[0], at(0), prompt(1, 60));
    settle(&mut rs, at(0));
    let key = WorkerKey::new(home.0, 0);
    assert_eq!(rs[1].load.remote().held_prefix(key, &prompt(2, 61).blocks), 60);
    // Its prefill is done, but the worker has not announced the blocks yet when the
    // continuation reaches replica 2: the prefix is in `home`'s cache, so it goes there.
    rs[0].handle_prefill_done(at(1), RequestId(1), Phase::Aggregated).unwrap();
    settle(&mut rs, at(1));
    assert_eq!(route(&mut rs[1], at(1), prompt(2, 61)), home);
    // Peers' prompt blocks count as decode blocks, but a block held both by a booking
    // here and by a peer's counts once: the 60 shared ones plus the continuation's last.
    assert_eq!(rs[1].load.remote().load(key).active_decode_blocks, 60);
    assert_eq!(rs[1].load.remote().shared_blocks(key), 60);
    assert_eq!(rs[1].combined_load(key).active_decode_blocks, 61);
    // The peer's request finishing leaves only the local booking's 61 blocks.
    rs[0].handle_finished(at(2), RequestId(1), Phase::Aggregated).unwrap();
    settle(&mut rs, at(2));
    assert_eq!(rs[1].load.remote().shared_blocks(key), 0);
    assert_eq!(rs[1].combined_load(key).active_decode_blocks, 61);
}

/// A peer books a prompt of `remote` blocks and this replica one of `local`, both
/// prefixes of one chain, on the only worker. A prompt of `len` blocks of that chain
/// then adds `new` decode blocks (held by neither side) and finds `held` leading blocks
/// on their way into the cache; booking it grows the combined decode load by `new`.
#[track_caller]
fn check_inflight(remote: u64, local: u64, len: u64, new: u32, held: u32) {
    let mut rs = [replica(1, 1, RouterMode::Kv), replica(2, 1, RouterMode::Kv)];
    // Few tokens, so that prefill backlog never makes the worker ineligible.
    let prompt = |id: u64, n: u64| Request {
        id: RequestId(id),
        blocks: (1..=n).map(SeqHash).collect(),
        isl_tokens: 8,
        ..Request::default()
    };
    if remote > 0 {
        route(&mut rs[0], at(0), prompt(1, remote));
        settle(&mut rs, at(0));
    }
    if local > 0 {
        route(&mut rs[1], at(0), prompt(2, local));
        settle(&mut rs, at(0));
    }
    let key = WorkerKey::new(0, 0);
    let q = prompt(3, len);
    assert_eq!(rs[1].inflight_blocks(key, &q.blocks), (new, held), "(new decode blocks, held prefix)");
    let before = rs[1].combined_load(key).active_decode_blocks;
    route(&mut rs[1], at(0), q);
    assert_eq!(rs[1].combined_load(key).active_decode_blocks - before, u64::from(new), "decode load added");
}

#[test]
fn a_prefix_held_on_both_sides_is_new_and_counted_once() {
    // (remote, local, len) → (new, held)
    check_inflight(0, 0, 5, 5, 0);
    check_inflight(3, 0, 5, 2, 3);
    check_inflight(0, 3, 5, 2, 3);
    check_inflight(3, 3, 5, 2, 3);
    check_inflight(4, 2, 5, 1, 4);
    check_inflight(2, 4, 5, 1, 4);
    check_inflight(6, 2, 5, 0, 5);
    check_inflight(2, 7, 5, 0, 5);
}
