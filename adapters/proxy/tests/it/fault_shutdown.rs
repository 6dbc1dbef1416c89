//! Fault injection, shutdown under load (issue #8, scenario 12): a hundred requests in
//! flight, some streaming and some still waiting for their worker's first byte, and
//! clients still sending, when `ServeHandle::shutdown` (what SIGTERM runs) is called.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::fault_common::{heavy, sse_ok};
use crate::*;

/// Scenario 12. Pass criteria:
/// * every one of the 100 requests in flight when shutdown begins (50 mid-stream, 50
///   not yet answered by their worker) finishes with a whole, clean stream;
/// * clients that keep sending get either a clean stream or a 503 `shutting_down`,
///   never a broken stream, and new connections are refused once the listener closes;
/// * the shutdown reports a full drain within `shutdown_grace_s`, no connection cut;
/// * the router holds nothing afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f12_shutdown_under_load_fails_no_request_that_finishes_within_the_grace() {
    let _heavy = heavy().await;
    let (streaming, waiting) = (Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await);
    streaming.set(Behavior::Stream { chunks: sse_chunks(8), gap_ms: 60 });
    waiting.set(Behavior::Delayed { ms: 400, chunks: sse_chunks(3) });
    let mut cfg = config(&[(1, streaming.addr), (2, waiting.addr)]);
    cfg.limits.shutdown_grace_s = 10;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let driver = p.driver(MODEL).unwrap();

    let in_flight = 100;
    let mut requests = tokio::task::JoinSet::new();
    for i in 0..in_flight {
        requests.spawn(async move { post(addr, "/v1/chat/completions", &[], &chat(&format!("r{i}"))).await });
    }
    eventually(10_000, "every request reached its worker", || async {
        streaming.seen().len() + waiting.seen().len() == in_flight
    })
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let mut latecomers = tokio::task::JoinSet::new();
    for c in 0..8 {
        let stop = stop.clone();
        latecomers.spawn(async move {
            let (mut clean, mut refused) = (0, 0);
            while !stop.load(Ordering::Relaxed) {
                let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(bytes::Bytes::from(chat(&format!("late {c}")).to_string())))
                    .unwrap();
                let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(10), client().request(req)).await else {
                    refused += 1; // no connection, or closed before an answer: never served
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let status = resp.status();
                let body = http_body_util::BodyExt::collect(resp.into_body()).await;
                let text = body.map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned());
                match (status.as_u16(), text) {
                    (200, Ok(t)) if sse_ok(&t) => clean += 1,
                    (503, Ok(t)) if t.contains("shutting_down") => refused += 1,
                    (s, t) => panic!("a late request failed: {s} {t:?}"),
                }
            }
            (clean, refused)
        });
    }

    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    let stopping = tokio::spawn(p.shutdown());
    eventually(10_000, "the listener closes", || async { tokio::net::TcpStream::connect(addr).await.is_err() }).await;
    let answers = within(15_000, requests.join_all()).await;
    for a in &answers {
        assert_eq!(a.status, 200, "{}", a.text());
        assert!(sse_ok(&a.text()), "in flight at shutdown, finished whole: {}", a.text());
    }
    let report = within(15_000, stopping).await.unwrap();
    assert!(report.drained && report.connections_aborted == 0, "{report:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "drained within the grace: {:?}", t0.elapsed());
    stop.store(true, Ordering::Relaxed);
    let late = within(15_000, latecomers.join_all()).await;
    assert!(late.iter().map(|(_, refused)| refused).sum::<u32>() > 0, "late clients met the shutdown: {late:?}");
    let s = driver.snapshot();
    assert_eq!((s.requests_in_flight, s.queue_depth, s.load_total.active_requests), (0, 0, 0), "nothing held");
}
