//! Losing NATS or a replica mid-run: serving goes on, and nothing the lost part
//! reported stays counted.

use super::*;

const REQUESTS: usize = 160;
const COMPRESS: f64 = 16.0;

/// Peers' load each replica still counts, summed.
fn remote_requests(rs: &[ServeHandle]) -> usize {
    rs.iter().map(|r| r.driver(MODEL).expect("driver").snapshot().remote_requests).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_nats_keeps_serving_on_local_load() {
    let mut nats = Nats::start().await;
    let fleet = Fleet::start(4, COMPRESS / 2.0).await;
    let rs = replicas(&fleet, 3, Some(&nats)).await;
    for r in &rs {
        let (status, body) = get(r.local_addr(), "/ready").await;
        assert_eq!(status, http::StatusCode::OK);
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["nats"], "connected", "{body}");
        assert_eq!(metric(r, "kvroute_replica_nats_connected"), Some(1.0));
    }
    let mut lb = Lb::new(&rs, 3);
    let outcomes = replay(&trace_slice(REQUESTS), COMPRESS, &mut lb, |_| nats.kill()).await;
    let failed: Vec<_> = outcomes.iter().filter(|o| !o.ok).collect();
    assert!(failed.is_empty(), "{} of {} failed after NATS died: {:?}", failed.len(), outcomes.len(), failed.first());
    for (i, r) in rs.iter().enumerate() {
        let (status, body) = get(r.local_addr(), "/ready").await;
        assert_eq!(status, http::StatusCode::OK, "replica {i} stays ready: {body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["nats"], "disconnected", "{body}");
        assert_eq!(metric(r, "kvroute_replica_nats_connected"), Some(0.0), "replica {i}");
        assert_eq!(r.nats_connected(), Some(false));
    }
    // Peers' reports were forgotten with the link: every replica routes on its own load.
    eventually(10_000, "no replica counts a peer's load", || async { remote_requests(&rs) == 0 }).await;
    for r in &rs {
        r.driver(MODEL).expect("driver").check_invariants().expect("router invariants");
    }
    for r in rs {
        let _ = r.shutdown().await;
    }
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_replica_loses_only_its_in_flight_requests() {
    let nats = Nats::start().await;
    // Slower engines, so the killed replica has requests in flight.
    let fleet = Fleet::start(4, COMPRESS / 4.0).await;
    let mut rs = replicas(&fleet, 3, Some(&nats)).await;
    let victim = rs.pop().expect("three replicas");
    let mut lb = Lb::new(&rs, 5);
    let mut all = rs.iter().map(|r| Some(r.local_addr())).collect::<Vec<_>>();
    all.push(Some(victim.local_addr()));
    lb.set_addrs(all);
    let (killed_tx, killed_rx) = tokio::sync::oneshot::channel();
    let kill = move |lb: &mut Lb| {
        lb.remove(2);
        // A crash: connections cut, no goodbye to the peers.
        victim.abort();
        let _ = killed_tx.send(tokio::time::Instant::now());
        async {}
    };
    let started = tokio::time::Instant::now();
    let outcomes = replay(&trace_slice(REQUESTS), COMPRESS, &mut lb, kill).await;
    let killed_s = (killed_rx.await.expect("the replica was killed") - started).as_secs_f64();
    let failed: Vec<_> = outcomes.iter().filter(|o| !o.ok).collect();
    for f in &failed {
        assert_eq!(f.replica, 2, "only the killed replica's requests may fail: {f:?}");
        assert!(f.sent_s <= killed_s + 0.05, "and only those it had before it died: {f:?} (killed at {killed_s:.3} s)");
    }
    let on_victim = outcomes.iter().filter(|o| o.replica == 2).count();
    println!("killed replica: {} of its {on_victim} requests lost, {} requests in all", failed.len(), outcomes.len());
    // The survivors stop counting the dead replica's load once it has been silent.
    eventually(10_000, "the dead replica's load expires", || async { remote_requests(&rs) == 0 }).await;
    for r in &rs {
        let d = r.driver(MODEL).expect("driver");
        d.check_invariants().expect("router invariants");
        assert_eq!(d.snapshot().remote_replicas, 1, "only the other survivor is still heard");
    }
    for r in rs {
        let _ = r.shutdown().await;
    }
    fleet.shutdown().await;
}
