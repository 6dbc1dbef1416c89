//! The cold charge: a worker that has been idle answers its next request slower.
//!
//! On a CPU engine the first pass after a pause runs on caches, and a host core, gone
//! cold: measured on vLLM's CPU build, a fresh prompt's first token came 100 ms later
//! after 5 s idle and 250 ms later after 20 s, against 80 ms back to back. A router
//! that spreads light traffic over every worker keeps them all cold. The charge is each
//! candidate's `cold_ms` (the router works it out from the timing model's
//! [`TtftModel::cold_ms`](super::TtftModel::cold_ms)), added after scoring as the
//! excess charge is (and likewise left out of [`kv_cost`](super::kv_cost)). A GPU's
//! timing has none. The wait is wall time, which an engine slower than its timing does
//! not stretch: the router divides it by the learned slowdown (see [`crate::learn`],
//! "Doubt"), so a queue the timing underrates is not preferred to it, and counts none
//! before first tokens have shown the timing.

use super::{Candidate, CandidateScore, KvCostModel, SelectRequest};
use crate::types::Phase;

/// Adds `cost_factor × cold_ms` to each candidate's score (one per candidate, in
/// order) and says whether any changed: nothing under the blocks model or for the
/// decode phase (which computes no prompt).
pub(super) fn charge(req: &SelectRequest, cands: &[Candidate], scores: &mut [CandidateScore]) -> bool {
    if req.cost.model != KvCostModel::Ttft || req.phase == Phase::Decode {
        return false;
    }
    let mut changed = false;
    for (s, c) in scores.iter_mut().zip(cands) {
        // NaN and negative waits charge nothing.
        if c.cold_ms > 0.0 {
            s.cost += c.cost_factor * c.cold_ms;
            changed = true;
        }
    }
    changed
}
