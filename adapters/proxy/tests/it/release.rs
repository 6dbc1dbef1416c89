//! A client that goes away frees its load, lease and queue slot.

use std::sync::Arc;

use http::Method;
use http_body_util::BodyExt;
use tokio::sync::Semaphore;

use crate::*;

#[tokio::test]
async fn a_cancelled_stream_frees_its_load_and_lease() {
    let w = Fake::start(&[MODEL]).await;
    let gate = Arc::new(Semaphore::new(1));
    w.set(Behavior::Gated { chunks: sse_chunks(5), gate: gate.clone() });
    let p = start(config(&[(1, w.addr)])).await;
    let addr = p.local_addr();
    let resp = send(addr, Method::POST, "/v1/chat/completions", &[("x-session-id", "s")], Some(&chat("x"))).await;
    let mut body = resp.into_body();
    within(10_000, body.frame()).await.unwrap().unwrap();
    let before = pool(addr).await;
    assert_eq!((before["active_requests"].as_u64(), before["affinity_live_leases"].as_u64()), (Some(1), Some(1)));
    drop(body);
    eventually(10_000, "the cancelled stream releases everything", || released(addr)).await;
    let text = get(addr, "/metrics").await.text();
    assert_eq!(sample(&text, "kvroute_requests_total", &["outcome=\"cancelled\""]), Some(1.0));
}

#[tokio::test]
async fn a_cancelled_queued_request_frees_its_slot() {
    let w = Fake::start(&[MODEL]).await;
    // No chunk flows until the test says so: the first chunk would end the prefill and
    // free the worker.
    let gate = Arc::new(Semaphore::new(0));
    w.set(Behavior::Gated { chunks: sse_chunks(2), gate: gate.clone() });
    let mut cfg = config(&[(1, w.addr)]);
    cfg.router.prefill_tokens_max = 1; // one request in prefill makes the worker busy
    let p = start(cfg).await;
    let addr = p.local_addr();
    let long = chat(&"a long prompt ".repeat(20));
    let holder = hold(addr, &long).await;
    let queued = tokio::spawn(async move { post(addr, "/v1/chat/completions", &[], &chat("queued")).await });
    eventually(10_000, "the second request is queued", || async { pool(addr).await["queue_depth"] == 1 }).await;
    queued.abort();
    let _ = queued.await;
    eventually(10_000, "the aborted request leaves the queue", || async {
        let p = pool(addr).await;
        p["queue_depth"] == 0 && p["requests_in_flight"] == 1
    })
    .await;
    gate.add_permits(10);
    within(10_000, holder.await.unwrap().into_body().collect()).await.unwrap();
    eventually(10_000, "everything released", || released(addr)).await;
    assert_eq!(w.seen().len(), 1, "the cancelled request never reached the worker");
}
