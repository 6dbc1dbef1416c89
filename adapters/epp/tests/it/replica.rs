//! `[replica]` in the picker: it joins the peer replicas over NATS through the same
//! start-up as `kvroute serve`, instead of accepting the section and routing alone.
//!
//! The peer test needs `nats-server` on PATH, as the replica crate's tests do (CI
//! installs the Debian package); it fails with a clear message when it is not.

use std::process::Stdio;

use serde_json::json;

use super::*;

/// A `nats-server` on a free loopback port, killed when dropped.
struct Nats {
    _child: tokio::process::Child,
    port: u16,
}

impl Nats {
    async fn start() -> Nats {
        let port = free_port();
        let child = tokio::process::Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run nats-server ({e}): install the Debian package `nats-server`"));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            assert!(tokio::time::Instant::now() < deadline, "nats-server never accepted connections");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Nats { _child: child, port }
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address").port()
}

/// A picker without workers that is replica `id` of the cluster at `nats_port`.
async fn picker(id: &str, nats_port: u16) -> EppHandle {
    let mut cfg = config(&[]);
    let replica =
        json!({"id": id, "nats_url": format!("nats://127.0.0.1:{nats_port}"), "cluster": "epp", "heartbeat_ms": 50});
    cfg.proxy.replica = Some(serde_json::from_value(replica).expect("a replica section"));
    start(cfg).await
}

/// The value of an unlabelled sample in a Prometheus exposition.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test]
async fn a_picker_alone_has_no_replica_link() {
    let epp = start(config(&[])).await;
    assert_eq!(epp.nats_connected(), None);
    assert_eq!(sample(&epp.metrics_text(), "kvroute_replica_nats_connected"), None);
    epp.shutdown().await;
}

#[tokio::test]
async fn a_picker_with_replica_starts_even_while_nats_is_down() {
    // Nothing listens on the port: the link retries in the background, routing goes on.
    let epp = picker("lonely", free_port()).await;
    assert_eq!(epp.nats_connected(), Some(false));
    assert_eq!(sample(&epp.metrics_text(), "kvroute_replica_nats_connected"), Some(0.0));
    epp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pickers_of_one_cluster_hear_each_other() {
    let nats = Nats::start().await;
    let (a, b) = (picker("a", nats.port).await, picker("b", nats.port).await);
    for epp in [&a, &b] {
        eventually(10_000, "the NATS link is up", || epp.nats_connected() == Some(true)).await;
        eventually(10_000, "the peer's heartbeats arrive", || {
            sample(&epp.metrics_text(), "kvroute_replica_peers") == Some(1.0)
        })
        .await;
    }
    a.shutdown().await;
    b.shutdown().await;
}
