//! A clairvoyant reference, never a policy kvroute serves with: each request goes to the
//! worker where it would finish soonest, found by running a copy of every worker's engine
//! forward with the request added.
//!
//! It sees what no router can: every engine's exact cache, queue and batch, and the
//! request's true output length. It does not see later arrivals, and it is greedy: it
//! minimises each request's own time and ignores what that costs the requests after it.
//! So it is not a bound on every rule. It answers a narrower question with numbers: how
//! far could a rule go that always knew the best worker for the request in hand? A
//! router whose figures sit near it has little left to gain from a better per-request
//! estimate.

use std::cmp::Ordering;

use crate::engine::{Engine, EngineOutput, EngineRequest, EngineRole};
use crate::replay::{Dispatch, Dispatcher, SimRequest};

/// What the lookahead minimises for each request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Goal {
    /// Its first token (TTFT).
    FirstToken,
    /// Its last token (end-to-end time).
    LastToken,
}

/// The clairvoyant greedy [`Dispatcher`] (see the module docs). Aggregated workers only.
#[derive(Debug)]
pub struct Lookahead {
    goal: Goal,
    passes_max: u32,
    /// Arrivals whose every copy stopped at `passes_max` without reaching the goal.
    pub unresolved: u64,
}

impl Lookahead {
    /// A lookahead for `goal`, running each copy at most `passes_max` passes.
    pub fn new(goal: Goal, passes_max: u32) -> Self {
        Lookahead { goal, passes_max, unresolved: 0 }
    }

    /// When `req`, submitted at `now_ms` to a copy of `engine`, reaches the goal; `None`
    /// if the engine refuses it or the copy runs out of passes first.
    pub fn time_on(&self, engine: &Engine, now_ms: f64, req: &SimRequest) -> Option<f64> {
        let mut e = engine.clone();
        let r =
            EngineRequest { id: req.id, prompt: req.prompt.clone(), output_len: req.output_len, generated_before: 0 };
        e.submit(now_ms, r).ok()?;
        let mut outs = Vec::new();
        for _ in 0..self.passes_max {
            let t = e.next_wakeup()?;
            e.advance(t, &mut outs);
            for o in outs.drain(..) {
                match (self.goal, o) {
                    (Goal::FirstToken, EngineOutput::FirstToken { id, at_ms }) if id == req.id => return Some(at_ms),
                    (Goal::LastToken, EngineOutput::Finished { id, at_ms, .. }) if id == req.id => return Some(at_ms),
                    _ => {}
                }
            }
        }
        None
    }
}

impl Dispatcher for Lookahead {
    /// Without the engines it cannot look ahead; the replay always calls
    /// [`Dispatcher::on_arrival_seeing`] instead.
    fn on_arrival(&mut self, _now_ms: f64, _req: &SimRequest) -> Dispatch {
        Dispatch::Reject
    }

    fn on_arrival_seeing(&mut self, now_ms: f64, req: &SimRequest, engines: &[Engine]) -> Dispatch {
        // Ties (idle workers, nothing cached) go to the lightest decode load, then the
        // lowest index, so the choice is deterministic.
        let best = engines
            .iter()
            .enumerate()
            .filter(|(_, e)| e.config().role == EngineRole::Aggregated)
            .filter_map(|(w, e)| Some((self.time_on(e, now_ms, req)?, e.active_blocks(), w)))
            .min_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(Ordering::Equal).then((a.1, a.2).cmp(&(b.1, b.2))));
        match best {
            Some((_, _, w)) => Dispatch::To(w as u32),
            None => {
                self.unresolved += 1;
                Dispatch::To(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use crate::replay::{replay, ReplayConfig};
    use crate::test_requests::request;

    /// Request `id` at `at_ms`: 512 tokens per hash id in 64-token blocks, `output` tokens.
    fn req(id: u64, at_ms: f64, hash_ids: &[u32], output: u32) -> SimRequest {
        let len = 512 * hash_ids.len() as u32;
        SimRequest { arrival_ms: at_ms, output_len: output, ..request(id, hash_ids, len, 64) }
    }

    /// Replays `reqs` on `workers` small workers with the lookahead for `goal`, and
    /// checks the worker each request went to.
    fn check(goal: Goal, workers: u32, reqs: &[SimRequest], want: &[u32]) {
        let engine = EngineConfig { blocks_per_worker: 64, ..EngineConfig::default() };
        let cfg = ReplayConfig { workers, engine, ..ReplayConfig::default() };
        let mut d = Lookahead::new(goal, 10_000);
        let rep = replay(&cfg, reqs, &mut d).expect("config");
        let got: Vec<u32> = rep.records.iter().map(|r| r.worker.expect("placed")).collect();
        assert_eq!(got, want, "{goal:?}");
        assert_eq!(d.unresolved, 0);
    }

    #[test]
    fn a_cached_prefix_wins_on_an_idle_holder() {
        // The second request repeats the first's prompt after it finished: its holder is
        // idle and has the prefix, so it is the fastest worker for either goal.
        let reqs = [req(1, 0.0, &[1, 2, 3, 4], 4), req(2, 5_000.0, &[1, 2, 3, 4], 4)];
        check(Goal::FirstToken, 3, &reqs, &[0, 0]);
        let shifted = [req(1, 0.0, &[9, 9], 4), req(2, 1.0, &[1, 2, 3, 4], 4), req(3, 5_000.0, &[1, 2, 3, 4], 4)];
        check(Goal::LastToken, 3, &shifted, &[0, 1, 1]);
    }

    #[test]
    fn a_long_decode_on_the_holder_sends_a_short_prompt_elsewhere() {
        // Worker 0 holds the prefix but decodes a long answer; recomputing one short
        // prompt on an idle worker costs less than a pass beside that decode, so the
        // lookahead leaves the cache behind.
        let reqs = [req(1, 0.0, &[1], 2_000), req(2, 100.0, &[1], 4)];
        check(Goal::FirstToken, 2, &reqs, &[0, 1]);
    }
}
