//! Two drivers as replicas, their sinks wired to each other by hand, on paused time.

use std::time::Duration;

use kvroute_driver::{Driver, KeySnapshot, ReplicaId, ReplicaUpdate};
use router_core::{Instant, WorkerKey};
use tokio::sync::mpsc;

use crate::{driver, req};

const SILENCE_MS: u64 = 1_000;

/// A replica over two workers, with its sink.
fn replica(id: u64, sink_capacity: usize) -> (Driver, mpsc::Receiver<ReplicaUpdate>) {
    replica_over(2, id, sink_capacity)
}

fn replica_over(workers: u64, id: u64, sink_capacity: usize) -> (Driver, mpsc::Receiver<ReplicaUpdate>) {
    let d = driver(workers, |c| {
        c.replica.id = Some(ReplicaId(id));
        c.replica.remote.replica_silence_max_ms = SILENCE_MS;
    });
    let (tx, rx) = mpsc::channel(sink_capacity);
    d.set_replica_sink(tx);
    (d, rx)
}

/// Feeds everything `rx` holds to `to`, as replica `from`'s updates; returns how many.
fn forward(rx: &mut mpsc::Receiver<ReplicaUpdate>, from: u64, to: &Driver) -> usize {
    let mut n = 0;
    while let Ok(u) = rx.try_recv() {
        to.apply_replica_update(ReplicaId(from), u).unwrap();
        n += 1;
    }
    n
}

fn key_snapshot(d: &Driver, key: WorkerKey) -> Option<KeySnapshot> {
    d.snapshot().workers.iter().flat_map(|w| &w.keys).find(|k| k.key == key).cloned()
}

fn remote_requests(d: &Driver, key: WorkerKey) -> u32 {
    key_snapshot(d, key).map_or(0, |k| k.remote_load.active_requests)
}

#[tokio::test(start_paused = true)]
async fn bookings_reach_the_other_replica_and_leave_it() {
    let (a, mut from_a) = replica(1, 64);
    let (b, _) = replica(2, 64);
    let mut booking = a.route(req(&a, 2, None), a.draw()).await.unwrap();
    booking.dispatched().unwrap();
    let key = booking.target();
    assert_eq!(forward(&mut from_a, 1, &b), 1, "one update: added");
    assert_eq!(remote_requests(&b, key), 1);
    assert_eq!(b.snapshot().load_total.active_requests, 0, "b books nothing itself");
    booking.finish().unwrap();
    assert_eq!(forward(&mut from_a, 1, &b), 1, "one update: finished");
    assert_eq!(remote_requests(&b, key), 0);
    b.check_invariants().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_silent_replica_load_expires_on_the_timer() {
    let (a, mut from_a) = replica(1, 64);
    let (b, _) = replica(2, 64);
    let mut booking = a.route(req(&a, 2, None), a.draw()).await.unwrap();
    booking.dispatched().unwrap();
    forward(&mut from_a, 1, &b);
    assert_eq!(b.snapshot().remote_requests, 1);
    tokio::time::sleep(Duration::from_millis(SILENCE_MS / 2)).await;
    b.replica_heartbeat(ReplicaId(1)).unwrap();
    tokio::time::sleep(Duration::from_millis(SILENCE_MS)).await;
    assert_eq!(b.snapshot().remote_requests, 1, "the heartbeat kept it alive");
    tokio::time::sleep(Duration::from_millis(SILENCE_MS)).await;
    let s = b.snapshot();
    assert_eq!((s.remote_requests, s.remote_replicas, s.remote.silent_replicas), (0, 0, 1));
    drop(booking);
}

#[tokio::test(start_paused = true)]
async fn a_full_sink_drops_and_counts_without_blocking() {
    let (a, mut from_a) = replica(1, 1);
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(a.route(req(&a, 1, None), a.draw()).await.unwrap());
    }
    assert_eq!(a.snapshot().driver.replica_updates_dropped, 2);
    assert!(from_a.try_recv().is_ok());
    drop(from_a);
    held.clear();
    assert_eq!(a.snapshot().driver.replica_updates_dropped, 5, "a closed sink drops too");
}

#[tokio::test(start_paused = true)]
async fn sessions_bound_on_one_replica_hold_on_the_other() {
    let (a, mut from_a) = replica(1, 64);
    let (b, mut from_b) = replica(2, 64);
    let mut first = a.route(req(&a, 1, Some("chat")), a.draw()).await.unwrap();
    first.dispatched().unwrap();
    let home = first.target();
    first.finish().unwrap();
    forward(&mut from_a, 1, &b);
    for _ in 0..3 {
        let mut next = b.route(req(&b, 1, Some("chat")), b.draw()).await.unwrap();
        next.dispatched().unwrap();
        assert_eq!(next.target(), home);
        next.finish().unwrap();
    }
    forward(&mut from_b, 2, &a);
    a.check_invariants().unwrap();
    b.check_invariants().unwrap();
}

#[tokio::test(start_paused = true)]
async fn wall_time_maps_both_ways() {
    let (a, _) = replica(1, 1);
    let t = Instant::from_millis(1234);
    assert_eq!(a.instant_at_unix_us(a.unix_us(t)), t);
    assert_eq!(a.instant_at_unix_us(0), Instant::ZERO, "before the start: the epoch");
    assert_eq!(
        a.apply_replica_update(
            ReplicaId(1),
            ReplicaUpdate::Finished { id: router_core::RequestId(1), phase: router_core::Phase::Aggregated }
        )
        .unwrap_err()
        .to_string(),
        "update from this replica itself"
    );
}

#[tokio::test(start_paused = true)]
async fn a_prompt_both_replicas_booked_counts_once_in_the_fleet_load() {
    let (a, mut from_a) = replica_over(1, 1, 64);
    let (b, _) = replica_over(1, 2, 64);
    let mut on_a = a.route(req(&a, 4, None), a.draw()).await.unwrap();
    on_a.dispatched().unwrap();
    forward(&mut from_a, 1, &b);
    let mut on_b = b.route(req(&b, 4, None), b.draw()).await.unwrap();
    on_b.dispatched().unwrap();
    let k = key_snapshot(&b, on_b.target()).expect("the key is listed");
    assert_eq!(k.load.active_decode_blocks, k.remote_load.active_decode_blocks, "both sides hold the prompt");
    assert!(k.load.active_decode_blocks >= 4);
    assert_eq!(k.fleet_load.active_decode_blocks, k.load.active_decode_blocks, "its blocks count once");
    assert_eq!(k.fleet_load.active_requests, 2);
    on_a.finish().unwrap();
    forward(&mut from_a, 1, &b);
    let k = key_snapshot(&b, on_b.target()).expect("the key is listed");
    assert_eq!((k.fleet_load, k.remote_load.active_requests), (k.load, 0));
    b.check_invariants().unwrap();
    drop(on_b);
}
