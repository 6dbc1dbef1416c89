//! Session affinity through the proxy.

use http::Method;

use crate::*;

async fn worker_of(addr: std::net::SocketAddr, session: &str) -> u64 {
    let a = post(addr, "/v1/chat/completions", &[("x-session-id", session)], &chat("hi")).await;
    assert_eq!(a.status, 200, "{}", a.text());
    a.worker().expect("x-kvroute-worker")
}

#[tokio::test]
async fn sessions_stick_and_rebind_when_the_worker_is_removed() {
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    let p = start(config(&[(1, fakes[0].addr), (2, fakes[1].addr), (3, fakes[2].addr)])).await;
    let addr = p.local_addr();
    let first = worker_of(addr, "alice").await;
    for _ in 0..4 {
        assert_eq!(worker_of(addr, "alice").await, first, "a session sticks to its worker");
    }
    let others: Vec<u64> = [worker_of(addr, "bob").await, worker_of(addr, "carol").await].into();
    assert!(others.iter().any(|&w| w != first), "round-robin spreads new sessions: {others:?}");

    let del = call(addr, Method::DELETE, &format!("/workers/{first}"), &[], None).await;
    assert_eq!(del.status, 204);
    let moved = worker_of(addr, "alice").await;
    assert_ne!(moved, first, "the session re-binds once its worker is gone");
    for _ in 0..3 {
        assert_eq!(worker_of(addr, "alice").await, moved, "and sticks to the new one");
    }
    assert_eq!(call(addr, Method::DELETE, &format!("/workers/{first}"), &[], None).await.status, 404);
}
