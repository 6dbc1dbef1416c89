//! Graceful shutdown: stop accepting, let in-flight streams finish, cut them after the grace.

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use http_body_util::BodyExt;
use tokio::sync::Semaphore;

use crate::*;

#[tokio::test]
async fn shutdown_drains_in_flight_streams() {
    let w = Fake::start(&[MODEL]).await;
    let gate = Arc::new(Semaphore::new(1));
    let chunks = sse_chunks(3);
    w.set(Behavior::Gated { chunks: chunks.clone(), gate: gate.clone() });
    let p = start(config(&[(1, w.addr)])).await;
    let addr = p.local_addr();
    let resp = send(addr, Method::POST, "/v1/chat/completions", &[], Some(&chat("x"))).await;
    let mut body = resp.into_body();
    let first = within(10_000, body.frame()).await.unwrap().unwrap().into_data().unwrap();
    let stopping = tokio::spawn(p.shutdown());
    eventually(10_000, "the listener closes", || async { tokio::net::TcpStream::connect(addr).await.is_err() }).await;
    assert!(!stopping.is_finished(), "shutdown waits for the stream");
    gate.add_permits(chunks.len());
    let rest = within(10_000, body.collect()).await.unwrap().to_bytes();
    assert_eq!([first, rest].concat(), chunks.concat(), "the in-flight stream finishes whole");
    let report = within(10_000, stopping).await.unwrap();
    assert!(report.drained, "{report:?}");
}

#[tokio::test]
async fn shutdown_cuts_streams_after_the_grace() {
    let w = Fake::start(&[MODEL]).await;
    let gate = Arc::new(Semaphore::new(1));
    w.set(Behavior::Gated { chunks: sse_chunks(3), gate });
    let mut cfg = config(&[(1, w.addr)]);
    cfg.limits.shutdown_grace_s = 1;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let resp = send(addr, Method::POST, "/v1/chat/completions", &[], Some(&chat("x"))).await;
    let mut body = resp.into_body();
    within(10_000, body.frame()).await.unwrap().unwrap();
    let t0 = tokio::time::Instant::now();
    let report = within(10_000, p.shutdown()).await;
    assert_eq!((report.drained, report.connections_aborted), (false, 1));
    assert!(t0.elapsed() >= Duration::from_millis(900));
    assert!(within(10_000, body.collect()).await.is_err(), "the cut stream ends in an error, not cleanly");
}
