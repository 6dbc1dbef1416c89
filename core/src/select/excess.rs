//! The excess charge: a cost only a worker far busier than the fleet pays.
//!
//! The kv cost scores each candidate on its own, so a worker holding a hot prefix (a
//! document every question opens with) stays the cheapest while it runs several times
//! the fleet's mean of requests: each one more looks cheap next to recomputing the
//! prefix elsewhere. This charge, added after scoring, counts the requests a candidate
//! runs beyond `excess_over_mean` times the candidates' mean, so it moves nothing on a
//! fleet whose load is even, and makes a second copy of a hot prefix pay sooner. The bar
//! never falls below a floor: on a fleet that has just started, three times a mean of
//! 0.2 is under one request, and the charge would move requests off their caches for no
//! pile at all. The floor (`excess_requests_min`) falls once the whole fleet runs more
//! than `excess_floor_mean_requests` each, where a hot prefix's requests arrive faster
//! and a second copy pays sooner.

use super::{Candidate, CandidateScore, KvCostModel, SelectRequest};

/// Adds the excess charge of [`TtftWeights`](super::TtftWeights) to `scores` (one per
/// candidate, in order) and says whether any score changed. The charge is
/// `cost_factor × excess_ms_per_request × max(0, active_requests − bar)`, where the bar
/// is `excess_over_mean × mean active_requests`, and at least the floor; nothing under
/// the blocks model, or with a weight of 0.
pub(super) fn charge(req: &SelectRequest, cands: &[Candidate], scores: &mut [CandidateScore]) -> bool {
    let w = &req.cost.ttft;
    // NaN and negative weights charge nothing, as 0 does; so does an unreadable multiple,
    // which the floor would otherwise replace.
    let on = w.excess_ms_per_request > 0.0 && !w.excess_over_mean.is_nan();
    if req.cost.model != KvCostModel::Ttft || !on || cands.is_empty() {
        return false;
    }
    let total: f64 = cands.iter().map(|c| f64::from(c.load.active_requests)).sum();
    let mean = total / cands.len() as f64;
    let bar = (w.excess_over_mean * mean).max(floor(w, mean));
    let mut changed = false;
    for (s, c) in scores.iter_mut().zip(cands) {
        let over = f64::from(c.load.active_requests) - bar;
        if over > 0.0 {
            s.cost += c.cost_factor * w.excess_ms_per_request * over;
            changed = true;
        }
    }
    changed
}

/// `excess_requests_min`, or, once the mean passes `excess_floor_mean_requests`, that
/// times the square of their ratio (a NaN or non-positive reference keeps it fixed).
fn floor(w: &super::TtftWeights, mean: f64) -> f64 {
    let fixed = f64::from(w.excess_requests_min);
    let reference = w.excess_floor_mean_requests;
    if reference > 0.0 && mean > reference {
        let r = reference / mean;
        fixed * r * r
    } else {
        fixed
    }
}
