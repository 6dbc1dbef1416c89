//! Fault injection, overload (issue #8, scenario 5): offered twice what the fleet can
//! serve, the proxy sheds the excess quickly with 429 or 503, lets every admitted stream
//! finish, keeps its goodput near capacity, and does not grow.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::fault_common::{assert_openai_error, heavy, rss_bytes, sse_ok};
use crate::*;

/// What a closed-loop run saw.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    /// Whole, clean streams.
    ok: u64,
    /// Requests shed (429 or 503).
    shed: u64,
    /// From the first request to the last answer.
    took: Duration,
}

impl Tally {
    fn add(self, o: Tally) -> Tally {
        Tally { ok: self.ok + o.ok, shed: self.shed + o.shed, took: self.took + o.took }
    }

    /// Clean streams per second.
    fn goodput(&self) -> f64 {
        self.ok as f64 / self.took.as_secs_f64()
    }
}

/// `clients` clients share `work` requests to get served, each sending its next request
/// as soon as the last one ends, or `shed_pause_ms` after a shed one. Fixed work, not a
/// fixed window: the count of a window would jump by whole service times. Every answer
/// must be a clean stream or a shed in the OpenAI error shape.
async fn closed_loop(addr: SocketAddr, clients: usize, work: u64, shed_pause_ms: u64) -> Tally {
    let left = Arc::new(AtomicU64::new(work));
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        let left = left.clone();
        tasks.spawn(async move {
            let mut t = Tally::default();
            let mut i = 0;
            while left.load(Ordering::Relaxed) > 0 {
                i += 1;
                let a = post(addr, "/v1/chat/completions", &[], &chat(&format!("c{c} q{i}"))).await;
                match a.status.as_u16() {
                    200 => {
                        assert!(sse_ok(&a.text()), "an admitted stream finishes whole: {}", a.text());
                        let _ = left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
                        t.ok += 1;
                    }
                    429 | 503 => {
                        assert_openai_error(&a);
                        assert!(a.headers.contains_key("retry-after"), "a shed answer says when to retry");
                        t.shed += 1;
                        tokio::time::sleep(Duration::from_millis(shed_pause_ms)).await;
                    }
                    s => panic!("overload is answered 429 or 503, not {s}: {}", a.text()),
                }
            }
            t
        });
    }
    let all = within(60_000, tasks.join_all()).await;
    let t = all.into_iter().fold(Tally::default(), Tally::add);
    Tally { took: t0.elapsed(), ..t }
}

/// Scenario 5 for one way of bounding the fleet: `capacity` requests in service at once.
/// Capacity runs (`capacity` clients) and overload runs (twice the clients) alternate,
/// so a machine that gets busier or quieter meanwhile weighs on both alike. Pass
/// criteria:
/// * at 2x some requests are shed, each with `shed_code` (429 or 503) and `Retry-After`;
/// * every admitted stream finishes whole;
/// * goodput at 2x stays >= 90% of the capacity runs' goodput;
/// * the process's resident memory grows by less than 32 MiB over the overload runs.
async fn check_overload(what: &str, cfg: ProxyConfig, capacity: usize, shed_code: u16) {
    let _alone = heavy().await;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let work = 8 * capacity as u64;
    closed_loop(addr, 2 * capacity, work, 25).await; // warm up every buffer and table
    let rss_before = rss_bytes();
    let (mut full, mut over) = (Tally::default(), Tally::default());
    for _ in 0..2 {
        full = full.add(closed_loop(addr, capacity, work, 25).await);
        over = over.add(closed_loop(addr, 2 * capacity, work, 25).await);
    }
    let grown = rss_bytes().saturating_sub(rss_before);
    eprintln!("{what}: capacity {full:?}, 2x {over:?}, rss grew {} KiB", grown >> 10);
    assert!(over.shed > 0, "{what}: twice the capacity sheds some requests: {over:?}");
    assert!(
        over.goodput() >= 0.9 * full.goodput(),
        "{what}: goodput at 2x ({:.1}/s) fell below 90% of capacity ({:.1}/s)",
        over.goodput(),
        full.goodput()
    );
    assert!(grown < 32 << 20, "{what}: resident memory grew by {} KiB under overload", grown >> 10);
    let m = get(addr, "/metrics").await.text();
    let shed_status = format!("status=\"{shed_code}\"");
    assert!(total(&m, "kvroute_requests_total", &shed_status) > 0.0, "{what}: sheds are counted as {shed_code}");
    eventually(5_000, "released", || released(addr)).await;
}

#[tokio::test]
async fn f5_at_twice_capacity_excess_is_shed_admitted_streams_finish_and_goodput_holds() {
    let service = Behavior::Delayed { ms: 100, chunks: sse_chunks(2) };
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    for f in &fakes {
        f.set(service.clone());
    }
    // The proxy's own cap: 6 requests in progress, the rest 503 at once.
    let mut cfg = config(&[(1, fakes[0].addr), (2, fakes[1].addr)]);
    cfg.limits.concurrent_requests_max = 6;
    check_overload("concurrent_requests_max", cfg, 6, 503).await;

    // The router's admission queue: each of 4 workers busy with one prompt in prefill,
    // 2 more may wait, the rest 429.
    let fakes = [
        Fake::start(&[MODEL]).await,
        Fake::start(&[MODEL]).await,
        Fake::start(&[MODEL]).await,
        Fake::start(&[MODEL]).await,
    ];
    for f in &fakes {
        f.set(service.clone());
    }
    let mut cfg = config(&[(1, fakes[0].addr), (2, fakes[1].addr), (3, fakes[2].addr), (4, fakes[3].addr)]);
    cfg.router.prefill_tokens_max = 1;
    cfg.router.queued_max = 2;
    check_overload("admission queue", cfg, 4, 429).await;
}
