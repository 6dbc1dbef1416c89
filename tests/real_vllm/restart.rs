//! A vLLM server killed (SIGKILL, as a crash) and restarted: no request fails while it
//! is down, and kvroute drops what it knew of that worker's cache and rebuilds it from
//! the new process's events.

use std::time::{Duration, Instant};

use crate::engine::MODEL;
use crate::fleet::{fleet, token_prompt, tokens};

/// Needs retries on a reset before the first byte: the first request after the kill
/// goes out on a pooled connection to the dead server and is reset (502 without them).
#[test]
fn a_killed_and_restarted_server_loses_its_index_and_no_request_fails() {
    let Some(mut f) = fleet() else { return };
    let dead = 1;
    let kept = token_prompt(MODEL, &tokens(80, 330));
    let stale = token_prompt(MODEL, &tokens(81, 330));
    for body in [&kept, &stale] {
        f.send("/v1/completions", body, Some(dead));
        f.wait_overlap(body, dead, 5);
    }
    f.engine_mut(dead).kill();
    // The kv policy prefers the dead worker for `kept`; every request must still
    // succeed, retried on the live one, until health checks take the dead one out.
    // Failures are asserted last, so the index checks below run either way.
    let mut failed = Vec::new();
    for i in 0..6 {
        let body = token_prompt(MODEL, &tokens(80, 330 + i));
        match f.router.try_post("/v1/completions", &[], &body) {
            Ok(r) if r.status == 200 => {
                assert_eq!(r.header("x-kvroute-worker"), Some("2"), "request {i} served by the live worker");
            }
            Ok(r) => failed.push(format!("request {i}: {} {}", r.status, r.text())),
            Err(e) => failed.push(format!("request {i}: {e}")),
        }
    }
    let t0 = Instant::now();
    f.engine_mut(dead).restart();
    let waited = f.engine_mut(dead).wait_ready();
    eprintln!("real_vllm: vLLM server {dead} restarted in {waited:?}");
    f.router
        .wait(Duration::from_secs(30), "kvroute readmits the restarted worker", |_| f.preview(&kept).eligible(dead));
    // kvroute subscribes again on its own backoff (capped at 5 s); what the new process
    // publishes before that is not seen.
    f.router.wait(Duration::from_secs(60), "kvroute's event streams reconnect", |r| r.streams_connected());
    // The new process's first events (numbered from 0 again, with a newer timestamp)
    // make kvroute drop the worker's old entries, then index the new blocks.
    let fresh = token_prompt(MODEL, &tokens(82, 330));
    let served = f.send("/v1/completions", &fresh, Some(dead));
    assert_eq!(served.cached_tokens(), 0, "a restarted engine starts cold");
    f.wait_overlap(&fresh, dead, 5);
    f.wait_overlap(&stale, dead, 0);
    let again = f.send("/v1/completions", &stale, Some(dead));
    assert_eq!(again.cached_tokens(), 0, "vLLM no longer holds what the index dropped");
    eprintln!("real_vllm: restart to rebuilt index in {:?}", t0.elapsed());
    assert!(failed.is_empty(), "requests failed while worker {dead} was down:\n{}", failed.join("\n"));
}
