//! Engine load in the picker: with `[learn]` scraping on, each worker's metrics page (a
//! sim-worker exports vLLM's scheduler gauges) reaches the router, as in `kvroute serve`.

use router_core::WorkerKey;
use std::sync::atomic::Ordering;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_load_is_scraped_from_the_workers_metrics() {
    let w = sim_worker().await;
    let mut cfg = config(&[w.http_addr()]);
    cfg.proxy.learn.scrape_interval_ms = 20;
    cfg.proxy.learn.engine_load = true;
    let epp = start(cfg).await;
    let driver = epp.driver(MODEL).expect("the pool");
    let engine = || driver.learned(WorkerKey::new(0, 0)).and_then(|l| l.engine);
    eventually(5_000, "the worker's engine load is known", || engine().is_some()).await;
    let (load, age_ms) = engine().unwrap();
    assert_eq!((load.waiting, load.running), (0, 0), "an idle engine");
    assert!((0.0..=1.0).contains(&load.kv_usage) && age_ms < 5_000, "{load:?} {age_ms}");
    let stats = epp.engine_scrapes();
    assert!(stats.ok.load(Ordering::Relaxed) >= 1);
    assert_eq!(stats.dropped.load(Ordering::Relaxed), 0, "the sim-worker's page parses");
    epp.shutdown().await;
    w.shutdown().await;
}
