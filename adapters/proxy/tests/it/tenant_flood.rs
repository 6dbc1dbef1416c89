//! Weighted fair share under a flood, black-box: a real proxy in front of one
//! sim-worker that takes one prompt at a time (`prefill_tokens_max = 1`), so every
//! other request waits in the router's admission queue. Two tenants send closed loops
//! of completions; one floods with many more clients than the other.
//!
//! Nothing here reads a clock. The sim-worker numbers its responses in the order the
//! requests reached it (`cmpl-<created>-<n>`), which with one request at a time is the
//! order the queue let them go. From that order alone the test measures each tenant's
//! share of the dispatches and, for a tenant with one client, its queue wait counted in
//! the other tenant's requests served while it waited. The wait metric,
//! `kvroute_tenant_queue_wait_seconds`, is compared between the tenants as a ratio.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kvroute_sim_server::{EngineConfig, SimServerConfig};
use serde_json::json;

use crate::fault_common::heavy;
use crate::tenants::sha256_hex;
use crate::*;

/// Dispatches per run: enough for the shares to settle, few enough for 2 loaded cores.
const DISPATCHES: u64 = 100;

/// A flood: the tenants' weights and how many clients each runs (tenant 0 is `a`,
/// tenant 1 is `b`).
#[derive(Clone, Copy, Debug)]
struct Flood {
    weights: [u32; 2],
    clients: [usize; 2],
}

/// What one run saw: per dispatch (in the worker's order) the tenant served, and per
/// request of a one-client tenant the other tenant's dispatches while it waited.
#[derive(Debug, Default)]
struct Seen {
    order: Vec<usize>,
    waits: [Vec<u64>; 2],
    queue_wait_mean_s: [f64; 2],
}

/// Runs `flood` and checks it:
/// * while both tenants keep requests queued (two clients or more each), the
///   dispatches split by weight: tenant 0's share within 0.07 of `w0 / (w0 + w1)`,
///   and the counts within SFQ's bound `|n0·w1 − n1·w0| ≤ w0 + w1`, doubled for the
///   edges of the window;
/// * a tenant with one client waits, per request, for at most `⌊w_other/w_own⌋ + 1` of
///   the other's requests, plus the one in service when it arrived;
/// * such a tenant's mean queue wait (the metric) is under a third of the flooder's.
#[track_caller]
fn check(flood: Flood, seen: &Seen) {
    let [w0, w1] = flood.weights;
    // The window where both are backlogged: past the first few dispatches (clients
    // still connecting), before the requests left queued when the clients stopped.
    let tail = flood.clients.iter().sum::<usize>();
    let window = &seen.order[4.min(seen.order.len())..seen.order.len().saturating_sub(tail)];
    let n0 = window.iter().filter(|&&t| t == 0).count() as i64;
    let n1 = window.len() as i64 - n0;
    eprintln!(
        "tenant_flood {flood:?}: window {} dispatches, a {n0} b {n1}; waits {:?}; mean queue wait {:.3?} s",
        window.len(),
        seen.waits,
        seen.queue_wait_mean_s
    );
    if flood.clients.iter().all(|&c| c >= 2) {
        let share = n0 as f64 / window.len().max(1) as f64;
        let want = f64::from(w0) / f64::from(w0 + w1);
        assert!((share - want).abs() <= 0.07, "{flood:?}: a's share {share:.3}, want {want:.3}: {:?}", seen.order);
        let skew = (n0 * i64::from(w1) - n1 * i64::from(w0)).abs();
        assert!(skew <= 2 * i64::from(w0 + w1), "{flood:?}: skew {skew}: {:?}", seen.order);
    }
    for t in 0..2 {
        if flood.clients[t] != 1 {
            continue;
        }
        let (own, other) = (flood.weights[t], flood.weights[1 - t]);
        let entitled = u64::from(other / own) + 1 + 1;
        let worst = seen.waits[t].iter().copied().max().unwrap_or(0);
        assert!(seen.waits[t].len() >= 5, "{flood:?}: tenant {t} was served {} times", seen.waits[t].len());
        assert!(worst <= entitled, "{flood:?}: tenant {t} waited for {worst} > {entitled}: {:?}", seen.waits[t]);
        let [mine, theirs] = [seen.queue_wait_mean_s[t], seen.queue_wait_mean_s[1 - t]];
        assert!(mine < theirs / 3.0, "{flood:?}: mean queue wait {mine:.3} s against the flooder's {theirs:.3} s");
    }
}

const KEYS: [&str; 2] = ["sk-flood-a-0123456789", "sk-flood-b-0123456789"];

/// One sim-worker slow enough that a client's turnaround is short next to a request.
async fn slow_worker() -> kvroute_sim_server::SimServerHandle {
    let cfg = SimServerConfig {
        model: MODEL.into(),
        engine: EngineConfig { speedup: 1.0, block_size: 16, ..EngineConfig::default() },
        shutdown_grace_ms: 100,
        ..SimServerConfig::default()
    };
    kvroute_sim_server::spawn(cfg).await.expect("sim worker starts")
}

async fn run(flood: Flood) -> Seen {
    let w = slow_worker().await;
    let mut cfg = config(&[(1, w.http_addr())]);
    cfg.trust.cidrs.clear();
    cfg.router.prefill_tokens_max = 1;
    cfg.router.queue_timeout_ms = 60_000;
    cfg.limits.request_timeout_ms = 60_000;
    cfg.tenants = serde_json::from_value(json!([
        {"name": "a", "api_key_sha256": sha256_hex(KEYS[0]), "weight": flood.weights[0]},
        {"name": "b", "api_key_sha256": sha256_hex(KEYS[1]), "weight": flood.weights[1]},
    ]))
    .unwrap();
    let p = start(cfg).await;
    let addr = p.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (t, &n) in flood.clients.iter().enumerate() {
        for c in 0..n {
            let (stop, log) = (stop.clone(), log.clone());
            tasks.push(tokio::spawn(async move { client(addr, t, c, &stop, &log).await }));
        }
    }
    for task in tasks {
        within(120_000, task).await.expect("a client runs to the end");
    }
    let m = get(addr, "/metrics").await.text();
    let mean = |t: &str| {
        let l = format!("tenant=\"{t}\"");
        let sum = sample(&m, "kvroute_tenant_queue_wait_seconds_sum", &[&l]).unwrap_or(0.0);
        sum / sample(&m, "kvroute_tenant_queue_wait_seconds_count", &[&l]).unwrap_or(1.0).max(1.0)
    };
    let seen = seen(&log.lock().unwrap(), [mean("a"), mean("b")]);
    p.shutdown().await;
    w.shutdown().await;
    seen
}

/// One dispatch: its number at the worker, the tenant, and the number of the same
/// client's previous request (for a client's first, `None`).
type Dispatch = (u64, usize, Option<u64>);

/// Sends completions as tenant `t` until [`DISPATCHES`] have been served, each after
/// the last one's answer.
async fn client(addr: SocketAddr, t: usize, c: usize, stop: &AtomicBool, log: &Mutex<Vec<Dispatch>>) {
    let auth = format!("Bearer {}", KEYS[t]);
    let mut prev = None;
    for i in 0.. {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let body = json!({"model": MODEL, "prompt": format!("tenant {t} client {c} request {i}"), "max_tokens": 8});
        let a = post(addr, "/v1/completions", &[("authorization", &auth)], &body).await;
        assert_eq!(a.status, 200, "tenant {t}: {}", a.text());
        let id = a.json()["id"].as_str().map(String::from).expect("an id");
        let n: u64 = id.rsplit('-').next().and_then(|n| n.parse().ok()).expect("cmpl-<created>-<n>");
        log.lock().unwrap().push((n, t, prev));
        prev = Some(n);
        if n + 1 >= DISPATCHES {
            stop.store(true, Ordering::Relaxed);
        }
    }
}

/// The order and the one-client waits from the clients' log.
fn seen(log: &[Dispatch], queue_wait_mean_s: [f64; 2]) -> Seen {
    let mut by_n = log.to_vec();
    by_n.sort_unstable();
    let tenant_of = |n: u64| by_n.binary_search_by_key(&n, |d| d.0).ok().map(|i| by_n[i].1);
    let mut s = Seen { order: by_n.iter().map(|d| d.1).collect(), queue_wait_mean_s, ..Seen::default() };
    for &(n, t, prev) in &by_n {
        let Some(prev) = prev else { continue };
        // Every dispatch between the client's previous request and this one: the other
        // tenant's (a one-client tenant has no other request of its own).
        s.waits[t].push((prev + 1..n).filter(|&k| tenant_of(k).is_some_and(|o| o != t)).count() as u64);
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_gets_its_weight_and_never_more() {
    let _heavy = heavy().await;
    for flood in [
        Flood { weights: [3, 1], clients: [4, 16] },
        Flood { weights: [1, 1], clients: [3, 16] },
        Flood { weights: [1, 3], clients: [1, 16] },
        Flood { weights: [3, 1], clients: [1, 16] },
    ] {
        let seen = run(flood).await;
        check(flood, &seen);
    }
}
