//! The excess charge: only a worker past `excess_over_mean` times the candidates' mean
//! of requests pays it, by the requests beyond that bar.

use super::super::*;
use alloc::vec::Vec;

/// Workers 1.. running `requests`, worker 1 holding all 20 blocks of the prompt.
fn fleet(requests: &[u32]) -> Vec<Candidate> {
    let load = |r| WorkerLoad { active_prefill_tokens: 0, active_decode_blocks: 0, active_requests: r };
    let cand = |(i, &r): (usize, &u32)| {
        let c = Candidate::new(WorkerKey::new(i as u64 + 1, 0), load(r));
        let device = if i == 0 { 20 } else { 0 };
        Candidate { overlap: Overlap { device, host: 0, disk: 0 }, ..c }
    };
    requests.iter().enumerate().map(cand).collect()
}

fn request(excess_ms_per_request: f64, excess_over_mean: f64) -> SelectRequest {
    let ttft = TtftWeights { excess_ms_per_request, excess_over_mean, ..TtftWeights::default() };
    let cost = KvCostConfig { ttft, ..KvCostConfig::default() };
    SelectRequest { isl_tokens: 20 * 64, cost, ..SelectRequest::default() }
}

/// With no charge the cache holder, worker 1, is picked. With 10 ms per request beyond
/// `over_mean` × the mean, each worker's cost rises by `want_ms` and the pick is
/// `want_worker`.
#[track_caller]
fn check(requests: &[u32], over_mean: f64, want_ms: &[f64], want_worker: u64) {
    let cands = fleet(requests);
    let pick = |r: &SelectRequest| Selector::new().select(r, &cands, &mut Draw(0), false).unwrap();
    let (plain, charged) = (pick(&request(0.0, over_mean)), pick(&request(10.0, over_mean)));
    assert_eq!(plain.chosen.worker.0, 1, "requests {requests:?}: the holder, uncharged");
    let got: Vec<f64> = plain.scores.iter().zip(&charged.scores).map(|(a, b)| b.cost - a.cost).collect();
    assert_eq!(got, want_ms, "requests {requests:?}, bar {over_mean} × mean");
    let costs: Vec<f64> = charged.scores.iter().map(|s| s.cost).collect();
    assert_eq!(charged.chosen.worker.0, want_worker, "requests {requests:?}, bar {over_mean} × mean: costs {costs:?}");
}

#[test]
fn only_a_worker_past_the_bar_pays_for_the_requests_beyond_it() {
    // Mean 5, bar 15: worker 1 runs 3 past it, and 30 ms sends the request elsewhere.
    check(&[18, 0, 1, 1], 3.0, &[30.0, 0.0, 0.0, 0.0], 2);
    // The same worker under a bar of 4 × the mean (16) pays nothing and keeps its cache.
    check(&[16, 0, 0, 0], 4.0, &[0.0; 4], 1);
    // Even load: no one is past 3 × the mean.
    check(&[5, 5, 5, 5], 3.0, &[0.0; 4], 1);
    // Past a bar of 1 × the mean, the two busy workers pay by their excess.
    check(&[6, 6, 2, 2], 1.0, &[20.0, 20.0, 0.0, 0.0], 1);
}

#[test]
fn no_charge_when_off_or_unreadable() {
    let cands = fleet(&[16, 0, 0, 0]);
    for (ms, over) in [(0.0, 3.0), (f64::NAN, 3.0), (-5.0, 3.0), (10.0, f64::NAN)] {
        let r = request(ms, over);
        let got = Selector::new().select(&r, &cands, &mut Draw(0), false).unwrap();
        let plain = Selector::new().select(&request(0.0, 3.0), &cands, &mut Draw(0), false).unwrap();
        assert_eq!(got.scores, plain.scores, "{ms} ms beyond {over} × the mean");
    }
}
