//! A session keeps its worker whichever replica its requests reach, and two replicas
//! racing to bind one new session agree on one worker.

use router_core::Phase;

use super::*;

/// Where each replica has `session` bound, if anywhere.
fn bindings(rs: &[ServeHandle], session: &str) -> Vec<Option<u64>> {
    rs.iter()
        .map(|r| {
            let d = r.driver(MODEL).expect("driver");
            d.with_router(|router| router.session_binding(session.as_bytes(), Phase::Aggregated).map(|b| b.worker.0))
        })
        .collect()
}

/// A prompt no other request shares, so the cache pulls nowhere.
fn prompt(session: usize, turn: usize) -> Value {
    let tokens: Vec<u32> = (0..256).map(|i| (session * 1_000_000 + turn * 10_000 + i) as u32).collect();
    json!({ "model": MODEL, "prompt": tokens, "max_tokens": 4, "stream": true })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_keeps_its_worker_across_replicas() {
    let nats = Nats::start().await;
    let fleet = Fleet::start(4, 100.0).await;
    let rs = replicas(&fleet, 3, Some(&nats)).await;
    let mut lb = Lb::new(&rs, 7);
    let client = client();
    for s in 0..6 {
        let session = format!("chat-{s}");
        let headers = [("x-session-id", session.as_str())];
        let mut home = None;
        let mut seen = Vec::new();
        for turn in 0..6 {
            let (replica, addr) = lb.pick();
            let (ok, worker) = complete(&client, addr, &prompt(s, turn), &headers).await;
            assert!(ok, "session {s} turn {turn} on replica {replica}: {worker}");
            seen.push(replica);
            match home {
                None => {
                    home = Some(worker.clone());
                    // The binding reaches every replica before the client's next turn.
                    let want = worker.parse().ok();
                    eventually(5_000, "every replica learns the binding", || async {
                        bindings(&rs, &session).iter().all(|b| *b == want)
                    })
                    .await;
                }
                Some(ref h) => assert_eq!(&worker, h, "session {s} turn {turn} via replica {replica}"),
            }
        }
        seen.sort_unstable();
        seen.dedup();
        assert!(seen.len() > 1 || s > 0, "the balancer spread session {s} over replicas {seen:?}");
    }
    for r in rs {
        let _ = r.shutdown().await;
    }
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_racing_for_a_new_session_agree() {
    let nats = Nats::start().await;
    let fleet = Fleet::start(4, 100.0).await;
    let rs = replicas(&fleet, 3, Some(&nats)).await;
    let client = client();
    for s in 0..4 {
        let session = format!("race-{s}");
        let headers = [("x-session-id", session.as_str())];
        // The session's first two requests reach two replicas at once.
        let (a, b) = (rs[0].local_addr(), rs[1].local_addr());
        let (pa, pb) = (prompt(100 + s, 0), prompt(100 + s, 1));
        let (ra, rb) = tokio::join!(complete(&client, a, &pa, &headers), complete(&client, b, &pb, &headers));
        assert!(ra.0 && rb.0, "both first requests are served: {ra:?} {rb:?}");
        eventually(5_000, "the replicas converge on one binding", || async {
            let b = bindings(&rs, &session);
            b[0].is_some() && b.iter().all(|x| *x == b[0])
        })
        .await;
        let winner = bindings(&rs, &session)[0].map(|w| w.to_string());
        // From here on every replica sends the session to the winner.
        for (i, r) in rs.iter().enumerate() {
            let (ok, worker) = complete(&client, r.local_addr(), &prompt(100 + s, 2 + i), &headers).await;
            assert!(ok, "{worker}");
            assert_eq!(Some(worker), winner, "session {s} via replica {i}");
        }
    }
    for r in rs {
        let _ = r.shutdown().await;
    }
    fleet.shutdown().await;
}
