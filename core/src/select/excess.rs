//! The excess charge: a cost only a worker far busier than the fleet pays.
//!
//! The kv cost scores each candidate on its own, so a worker holding a hot prefix (a
//! document every question opens with) stays the cheapest while it runs several times
//! the fleet's mean of requests: each one more looks cheap next to recomputing the
//! prefix elsewhere. This charge, added after scoring, counts the requests a candidate
//! runs beyond `excess_over_mean` times the candidates' mean, so it moves nothing on a
//! fleet whose load is even, and makes a second copy of a hot prefix pay sooner.

use super::{Candidate, CandidateScore, KvCostModel, SelectRequest};

/// Adds the excess charge of [`TtftWeights`](super::TtftWeights) to `scores` (one per
/// candidate, in order) and says whether any score changed. The charge is
/// `cost_factor × excess_ms_per_request × max(0, active_requests − excess_over_mean ×
/// mean active_requests)`; nothing under the blocks model, or with a weight of 0.
pub(super) fn charge(req: &SelectRequest, cands: &[Candidate], scores: &mut [CandidateScore]) -> bool {
    let w = &req.cost.ttft;
    // NaN and negative weights charge nothing, as 0 does.
    let on = w.excess_ms_per_request > 0.0;
    if req.cost.model != KvCostModel::Ttft || !on || cands.is_empty() {
        return false;
    }
    let total: f64 = cands.iter().map(|c| f64::from(c.load.active_requests)).sum();
    let bar = w.excess_over_mean * total / cands.len() as f64;
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
