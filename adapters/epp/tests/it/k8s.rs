//! The Kubernetes watch against recorded API responses: a loopback HTTP server answers
//! lists from `tests/fixtures/*-list.json` and streams watch events from
//! `tests/fixtures/*-watch.jsonl` one at a time, when the test says so; the picker's
//! workers must follow the pods' readiness, addresses and deletion, and the pool's port.

use std::collections::BTreeSet;

use kvroute_epp::k8s::{self, PoolRef, WorkerTemplate};
use kvroute_k8s::testing::FakeApi;
use router_core::Health;
use serde_json::{json, Value};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use super::*;

const POOLS: &str = "/apis/inference.networking.k8s.io/v1/namespaces/inference/inferencepools";
const PODS: &str = "/api/v1/namespaces/inference/pods";

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))).expect("fixture")
}

/// The recorded API: the pool and pod lists from the fixtures.
async fn fake_api() -> FakeApi {
    let list = |name: &str| serde_json::from_str::<Value>(&fixture(name)).unwrap();
    let lists = vec![(POOLS.to_string(), list("inferencepools-list.json")), (PODS.to_string(), list("pods-list.json"))];
    FakeApi::start(lists).await.expect("the fake API starts")
}

/// The picker's workers that take new requests, as `ip:port` (a terminating pod's
/// worker is draining until its pod is gone).
fn endpoints(epp: &EppHandle) -> BTreeSet<String> {
    let healthy: BTreeSet<u64> = epp.driver(MODEL).map_or_else(BTreeSet::new, |d| {
        d.snapshot().workers.iter().filter(|w| w.health == Health::Healthy).map(|w| w.spec.id.0).collect()
    });
    epp.workers().list().iter().filter(|w| healthy.contains(&w.id)).map(|w| w.url.authority().to_string()).collect()
}

/// The picker's draining workers, as `ip:port`.
fn draining(epp: &EppHandle) -> BTreeSet<String> {
    let draining: BTreeSet<u64> = epp.driver(MODEL).map_or_else(BTreeSet::new, |d| {
        d.snapshot().workers.iter().filter(|w| w.health == Health::Draining).map(|w| w.spec.id.0).collect()
    });
    epp.workers().list().iter().filter(|w| draining.contains(&w.id)).map(|w| w.url.authority().to_string()).collect()
}

async fn readiness(epp: &EppHandle) -> i32 {
    let mut health = HealthClient::new(Gateway::channel(epp.local_addr()));
    let r = within(10_000, health.check(HealthCheckRequest { service: "readiness".into() })).await.expect("answers");
    r.into_inner().status
}

/// Waits up to 10 s for readiness to report `status` (1 SERVING, 2 NOT_SERVING).
async fn ready_becomes(epp: &EppHandle, status: i32, what: &str) {
    for _ in 0..1000 {
        if readiness(epp).await == status {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("never happened: {what}");
}

fn set(addrs: &[&str]) -> BTreeSet<String> {
    addrs.iter().map(|a| a.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_follow_the_pools_ready_pods() {
    let api = fake_api().await;
    let epp = start(config(&[])).await;
    let client = api.client();
    let template = WorkerTemplate {
        worker: serde_json::from_value(json!({"id": 0, "url": "http://0.0.0.0:1", "model": MODEL, "kv_blocks": 2048}))
            .unwrap(),
        kv_events_port: None,
    };
    let pool = PoolRef { namespace: "inference".into(), name: "llama".into() };
    let watch = tokio::spawn(k8s::watch(client, pool, template, epp.workers()));

    // The listing: a and b are ready; c is not; the other app's pod is not selected.
    let want = set(&["10.244.1.11:8000", "10.244.1.12:8000"]);
    eventually(10_000, "the listed pods are workers", || endpoints(&epp) == want).await;
    ready_becomes(&epp, 1, "SERVING once the pods are listed").await;
    let w = &epp.workers().list()[0];
    assert_eq!((w.kv_blocks, w.labels.get("node").map(String::as_str)), (2048, Some("gpu-node-1")));

    // Each recorded pod event, and the workers after it.
    let steps: [&[&str]; 6] = [
        // c turns ready
        &["10.244.1.11:8000", "10.244.1.12:8000", "10.244.2.13:8000"],
        // a is being deleted: drained, no new requests
        &["10.244.1.12:8000", "10.244.2.13:8000"],
        // b is deleted
        &["10.244.2.13:8000"],
        // d is created, pending, without an address
        &["10.244.2.13:8000"],
        // d runs and is ready
        &["10.244.2.13:8000", "10.244.2.14:8000"],
        // c fails its readiness probe
        &["10.244.2.14:8000"],
    ];
    for (line, want) in fixture("pods-watch.jsonl").lines().zip(steps) {
        api.event(PODS, line);
        let want = set(want);
        eventually(10_000, &format!("after {}", &line[..60]), || endpoints(&epp) == want).await;
    }
    let driver = epp.driver(MODEL).unwrap();
    assert_eq!(draining(&epp), set(&["10.244.1.11:8000"]), "a terminating pod drains until it is gone");
    assert_eq!(driver.snapshot().workers.len(), 2, "the router agrees with the registry");

    // The pool moves to port 8001: its pods are listed again at the new port.
    let mut pool_events =
        fixture("inferencepools-watch.jsonl").lines().map(String::from).collect::<Vec<_>>().into_iter();
    api.event(POOLS, &pool_events.next().unwrap());
    let want = set(&["10.244.1.11:8001", "10.244.1.12:8001"]);
    eventually(10_000, "the pool's new port", || endpoints(&epp) == want).await;

    // The pool is deleted: no workers, not ready.
    api.event(POOLS, &pool_events.next().unwrap());
    eventually(10_000, "no pool, no workers", || endpoints(&epp).is_empty()).await;
    ready_becomes(&epp, 2, "NOT_SERVING without a pool").await;
    assert!(driver.snapshot().workers.is_empty());
    watch.abort();
    epp.shutdown().await;
}
