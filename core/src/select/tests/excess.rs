//! The excess charge: only a worker past `excess_over_mean` times the candidates' mean
//! of requests, and past the floor (`excess_requests_min`, lower on a busy fleet), pays
//! it, by the requests beyond that bar.

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

fn request(excess_ms_per_request: f64, excess_over_mean: f64, excess_requests_min: u32) -> SelectRequest {
    let ttft = TtftWeights { excess_ms_per_request, excess_over_mean, excess_requests_min, ..TtftWeights::default() };
    let cost = KvCostConfig { ttft, ..KvCostConfig::default() };
    SelectRequest { isl_tokens: 20 * 64, cost, ..SelectRequest::default() }
}

/// With no charge the cache holder, worker 1, is picked. With 10 ms per request beyond
/// the bar (`over_mean` × the mean, and at least `min` requests), each worker's cost
/// rises by `want_ms` and the pick is `want_worker`.
#[track_caller]
fn check(requests: &[u32], (over_mean, min): (f64, u32), want_ms: &[f64], want_worker: u64) {
    let cands = fleet(requests);
    let pick = |r: &SelectRequest| Selector::new().select(r, &cands, &mut Draw(0), false).unwrap();
    let (plain, charged) = (pick(&request(0.0, over_mean, min)), pick(&request(10.0, over_mean, min)));
    assert_eq!(plain.chosen.worker.0, 1, "requests {requests:?}: the holder, uncharged");
    let got: Vec<f64> = plain.scores.iter().zip(&charged.scores).map(|(a, b)| b.cost - a.cost).collect();
    assert_eq!(got, want_ms, "requests {requests:?}, bar {over_mean} × mean");
    let costs: Vec<f64> = charged.scores.iter().map(|s| s.cost).collect();
    assert_eq!(charged.chosen.worker.0, want_worker, "requests {requests:?}, bar {over_mean} × mean: costs {costs:?}");
}

#[test]
fn only_a_worker_past_the_bar_pays_for_the_requests_beyond_it() {
    // Mean 5, bar 15: worker 1 runs 3 past it, and 30 ms sends the request elsewhere.
    check(&[18, 0, 1, 1], (3.0, 4), &[30.0, 0.0, 0.0, 0.0], 2);
    // The same worker under a bar of 4 × the mean (16) pays nothing and keeps its cache.
    check(&[16, 0, 0, 0], (4.0, 4), &[0.0; 4], 1);
    // Even load: no one is past 3 × the mean.
    check(&[5, 5, 5, 5], (3.0, 4), &[0.0; 4], 1);
    // Past a bar of 1 × the mean, the two busy workers pay by their excess.
    check(&[6, 6, 2, 2], (1.0, 4), &[20.0, 20.0, 0.0, 0.0], 1);
}

#[test]
fn the_bar_never_falls_below_the_requests_min() {
    // A fleet filling up: mean 0.5, so 3 × the mean is 1.5, but the bar is 4.
    check(&[2, 0, 0, 0], (3.0, 4), &[0.0; 4], 1);
    // Without the floor the same worker pays for half a request.
    check(&[2, 0, 0, 0], (3.0, 0), &[5.0, 0.0, 0.0, 0.0], 1);
    // Mean 2.75, 3 × the mean 8.25: the floor of 10 is the bar, and 11 requests pay for
    // one, too little to leave the cache.
    check(&[11, 0, 0, 0], (3.0, 10), &[10.0, 0.0, 0.0, 0.0], 1);
    // Mean 3, 3 × the mean 9 over a floor of 4: 10 requests pay for one, not six.
    check(&[10, 0, 1, 1], (3.0, 4), &[10.0, 0.0, 0.0, 0.0], 1);
}

#[test]
fn no_charge_when_off_or_unreadable() {
    let cands = fleet(&[16, 0, 0, 0]);
    for (ms, over) in [(0.0, 3.0), (f64::NAN, 3.0), (-5.0, 3.0), (10.0, f64::NAN)] {
        let r = request(ms, over, 4);
        let got = Selector::new().select(&r, &cands, &mut Draw(0), false).unwrap();
        let plain = Selector::new().select(&request(0.0, 3.0, 4), &cands, &mut Draw(0), false).unwrap();
        assert_eq!(got.scores, plain.scores, "{ms} ms beyond {over} × the mean");
    }
}

/// What the default weights charge each worker running `requests`, over no charge.
fn default_charge(requests: &[u32]) -> Vec<f64> {
    let cands = fleet(requests);
    let off = request(0.0, 3.0, 0);
    let on = SelectRequest { isl_tokens: 20 * 64, ..SelectRequest::default() };
    let score = |r: &SelectRequest| Selector::new().select(r, &cands, &mut Draw(0), false).unwrap().scores;
    // Rounded to a µs: the charge is added to a cost, and taken off it again here.
    score(&off).iter().zip(&score(&on)).map(|(a, b)| ((b.cost - a.cost) * 1e3).round() / 1e3).collect()
}

#[test]
fn by_default_a_pile_pays_past_36_requests_or_less_on_a_busy_fleet() {
    // (running requests, charge each pays). While the mean is at most 4.5 the floor is
    // 36: a hot document's holder at 40 on a nearly idle 32-worker fleet pays 20 ms for
    // each of its 4 past it; at 36 on 8 workers (mean 4.5), nothing. Past a mean of 4.5
    // the floor falls as (4.5 / mean)^2: at 40 on 8 workers (mean 5) it is 29.16, so 40
    // pays for 10.84; at a mean of 11.5 it is 5.5, under 3 × the mean (34.5), which is
    // the bar. At 3 × a mean of 16, nothing; past 3 × a mean of 17.5, the 7.5 beyond.
    let idle_32 = [&[40][..], &[1; 31][..]].concat();
    let rows: [(&[u32], &[f64]); 6] = [
        (&idle_32, &[[80.0].as_slice(), &[0.0; 31]].concat()),
        (&[36, 0, 0, 0, 0, 0, 0, 0], &[0.0; 8]),
        (&[40, 0, 0, 0, 0, 0, 0, 0], &[216.8, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
        (&[40, 2, 2, 2], &[110.0, 0.0, 0.0, 0.0]),
        (&[48, 16, 0, 0], &[0.0; 4]),
        (&[60, 4, 3, 3], &[150.0, 0.0, 0.0, 0.0]),
    ];
    for (requests, want) in rows {
        assert_eq!(default_charge(requests), want, "requests {requests:?}");
    }
}

#[test]
fn an_unreadable_floor_reference_keeps_the_floor_fixed() {
    // Mean 5 on 8 workers: a reference of 4.5 lowers the floor to 29.16; none, or one
    // that is not a positive number, leaves it at 36, so 40 pays for 4.
    let cands = fleet(&[40, 0, 0, 0, 0, 0, 0, 0]);
    let charge = |reference: f64| {
        let mut r = request(20.0, 3.0, 36);
        r.cost.ttft.excess_floor_mean_requests = reference;
        let off = Selector::new().select(&request(0.0, 3.0, 36), &cands, &mut Draw(0), false).unwrap();
        let on = Selector::new().select(&r, &cands, &mut Draw(0), false).unwrap();
        ((on.scores[0].cost - off.scores[0].cost) * 1e3).round() / 1e3
    };
    assert_eq!(charge(4.5), 216.8);
    for reference in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(charge(reference), 80.0, "reference {reference}");
    }
}
