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

use crate::engine::{Engine, EngineOutput, EngineRequest, EngineRole, KvEvent};
use crate::replay::{Dispatch, Dispatcher, SimRequest, WorkerLoadSample};

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

    /// When `req`, submitted at `now_ms` to a copy of `engine`, reaches the goal, and the
    /// prompt tokens the copy served from its cache; `None` if the engine refuses it or
    /// the copy runs out of passes first.
    pub fn outcome_on(&self, engine: &Engine, now_ms: f64, req: &SimRequest) -> Option<Outcome> {
        let mut e = engine.clone();
        let r =
            EngineRequest { id: req.id, prompt: req.prompt.clone(), output_len: req.output_len, generated_before: 0 };
        e.submit(now_ms, r).ok()?;
        let (mut outs, mut cached) = (Vec::new(), 0);
        for _ in 0..self.passes_max {
            let t = e.next_wakeup()?;
            e.advance(t, &mut outs);
            for o in outs.drain(..) {
                let at_ms = match (self.goal, o) {
                    (_, EngineOutput::Admitted { id, cached_tokens, .. }) if id == req.id => {
                        cached = cached_tokens;
                        continue;
                    }
                    (Goal::FirstToken, EngineOutput::FirstToken { id, at_ms }) if id == req.id => at_ms,
                    (Goal::LastToken, EngineOutput::Finished { id, at_ms, .. }) if id == req.id => at_ms,
                    _ => continue,
                };
                return Some(Outcome { at_ms, cached_tokens: cached });
            }
        }
        None
    }

    /// Every worker's [`Lookahead::outcome_on`] for `req` at `now_ms` (`None` for a worker
    /// that is not aggregated), and the best worker: the soonest, ties (idle workers,
    /// nothing cached) to the lightest decode load, then the lowest index, so the choice
    /// is deterministic.
    pub fn outcomes(
        &self,
        engines: &[Engine],
        now_ms: f64,
        req: &SimRequest,
    ) -> (Vec<Option<Outcome>>, Option<(usize, Outcome)>) {
        let outs: Vec<Option<Outcome>> = engines
            .iter()
            .map(|e| (e.config().role == EngineRole::Aggregated).then(|| self.outcome_on(e, now_ms, req)).flatten())
            .collect();
        let best = outs
            .iter()
            .zip(engines)
            .enumerate()
            .filter_map(|(w, (o, e))| Some(((*o)?, e.active_blocks(), w)))
            .min_by(|a, b| a.0.at_ms.total_cmp(&b.0.at_ms).then((a.1, a.2).cmp(&(b.1, b.2))))
            .map(|(o, _, w)| (w, o));
        (outs, best)
    }
}

/// Where a lookahead copy got to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outcome {
    /// When the goal was reached, ms.
    pub at_ms: f64,
    /// Prompt tokens served from cache at the request's (last) admission.
    pub cached_tokens: u32,
}

impl Dispatcher for Lookahead {
    /// Without the engines it cannot look ahead; the replay always calls
    /// [`Dispatcher::on_arrival_seeing`] instead.
    fn on_arrival(&mut self, _now_ms: f64, _req: &SimRequest) -> Dispatch {
        Dispatch::Reject
    }

    fn on_arrival_seeing(&mut self, now_ms: f64, req: &SimRequest, engines: &[Engine]) -> Dispatch {
        match self.outcomes(engines, now_ms, req).1 {
            Some((w, _)) => Dispatch::To(w as u32),
            None => {
                self.unresolved += 1;
                Dispatch::To(0)
            }
        }
    }
}

/// One request's choice against the lookahead's, at the moment it was made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// Request id.
    pub id: u64,
    /// The worker the wrapped dispatcher chose (`None`: it queued or refused).
    pub chosen: Option<u32>,
    /// The goal's time on the chosen worker, from arrival, ms (`None` if unknown).
    pub chosen_ms: Option<f64>,
    /// The lookahead's best worker.
    pub best: u32,
    /// The goal's time there, from arrival, ms.
    pub best_ms: f64,
    /// Prompt tokens the chosen worker would serve from cache (0 if unknown).
    pub chosen_cached: u32,
    /// ...and the best worker.
    pub best_cached: u32,
}

/// Wraps a [`Dispatcher`] and, at each arrival, records how its choice compares with
/// the best worker in hindsight of the fleet's state then (the per-request regret). It
/// routes exactly as the wrapped dispatcher does.
#[derive(Debug)]
pub struct Regret<D> {
    /// The dispatcher that routes.
    pub inner: D,
    look: Lookahead,
    /// One entry per arrival, in arrival order.
    pub choices: Vec<Choice>,
}

impl<D: Dispatcher> Regret<D> {
    /// Records `inner`'s choices against a lookahead for `goal`.
    pub fn new(inner: D, goal: Goal, passes_max: u32) -> Self {
        Regret { inner, look: Lookahead::new(goal, passes_max), choices: Vec::new() }
    }
}

impl<D: Dispatcher> Dispatcher for Regret<D> {
    fn on_arrival(&mut self, now_ms: f64, req: &SimRequest) -> Dispatch {
        self.inner.on_arrival(now_ms, req)
    }

    fn on_arrival_seeing(&mut self, now_ms: f64, req: &SimRequest, engines: &[Engine]) -> Dispatch {
        let d = self.inner.on_arrival_seeing(now_ms, req, engines);
        let (outs, best) = self.look.outcomes(engines, now_ms, req);
        if let Some((best, b)) = best {
            let chosen = match d {
                Dispatch::To(w) => Some(w),
                _ => None,
            };
            let at = chosen.and_then(|w| *outs.get(w as usize)?);
            self.choices.push(Choice {
                id: req.id,
                chosen,
                chosen_ms: at.map(|o| o.at_ms - now_ms),
                best: best as u32,
                best_ms: b.at_ms - now_ms,
                chosen_cached: at.map_or(0, |o| o.cached_tokens),
                best_cached: b.cached_tokens,
            });
        }
        d
    }

    fn on_kv_event(&mut self, now_ms: f64, worker: u32, event_id: u64, event: &KvEvent) {
        self.inner.on_kv_event(now_ms, worker, event_id, event);
    }

    fn on_prefill_done(&mut self, now_ms: f64, worker: u32, req_id: u64) {
        self.inner.on_prefill_done(now_ms, worker, req_id);
    }

    fn on_finished(&mut self, now_ms: f64, worker: u32, req_id: u64) {
        self.inner.on_finished(now_ms, worker, req_id);
    }

    fn on_worker_load(&mut self, now_ms: f64, worker: u32, load: WorkerLoadSample) {
        self.inner.on_worker_load(now_ms, worker, load);
    }

    fn poll_dispatch(&mut self, now_ms: f64) -> Option<(u64, Dispatch)> {
        self.inner.poll_dispatch(now_ms)
    }

    fn next_timeout(&self) -> Option<f64> {
        self.inner.next_timeout()
    }

    fn on_timeout(&mut self, now_ms: f64) {
        self.inner.on_timeout(now_ms);
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

    /// Sends everything to one worker.
    struct Always(u32);

    impl Dispatcher for Always {
        fn on_arrival(&mut self, _now_ms: f64, _req: &SimRequest) -> Dispatch {
            Dispatch::To(self.0)
        }
    }

    /// Replays `reqs` on 2 small workers through `inner` wrapped in [`Regret`], and
    /// checks per request: (chosen, best, whether the choice was slower than the best).
    fn check_regret<D: Dispatcher>(inner: D, reqs: &[SimRequest], want: &[(u32, u32, bool)]) {
        let engine = EngineConfig { blocks_per_worker: 64, ..EngineConfig::default() };
        let cfg = ReplayConfig { workers: 2, engine, ..ReplayConfig::default() };
        let mut d = Regret::new(inner, Goal::FirstToken, 10_000);
        let rep = replay(&cfg, reqs, &mut d).expect("config");
        let got: Vec<(u32, u32, bool)> = d
            .choices
            .iter()
            .map(|c| (c.chosen.expect("placed"), c.best, c.chosen_ms.expect("timed") > c.best_ms))
            .collect();
        assert_eq!(got, want);
        for (c, r) in d.choices.iter().zip(&rep.records) {
            let ttft = r.first_token_ms.expect("served") - r.arrival_ms;
            assert!(
                (c.chosen_ms.expect("timed") - ttft).abs() < 1e-6,
                "the copy foretold {c:?}, the replay took {ttft}"
            );
        }
    }

    #[test]
    fn regret_is_the_gap_to_the_best_worker_then() {
        let reqs = [req(1, 0.0, &[1], 2_000), req(2, 100.0, &[1], 4)];
        check_regret(Always(0), &reqs, &[(0, 0, false), (0, 1, true)]);
        check_regret(Lookahead::new(Goal::FirstToken, 10_000), &reqs, &[(0, 0, false), (1, 1, false)]);
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
