//! An offline reference, never a policy kvroute serves with: one fixed worker for every
//! request of a trace, improved by local search over whole-trace replays.
//!
//! It sees the whole trace, later arrivals included, and judges each candidate
//! assignment by replaying all of it. From a start (a router's own choices), it moves
//! one request, or a request and every later one of its group that sat on the same
//! worker (a conversation moving at that turn), to another worker: half the time to a
//! hinted worker, otherwise to a random one. For a time, the hint is the worker where the
//! request's goal would have come soonest given the fleet's state at its arrival (the
//! [`crate::lookahead`] hint, recomputed after each kept move); for hits, it is the
//! worker of the group's request before it. It keeps a move when the trace's mean for its
//! aim (TTFT or end-to-end time) falls, or its hit rate rises, while the hit rate and
//! both means stay within limits. The requests with most to gain (the slow ones, or those
//! with the most uncached tokens) are tried most.
//!
//! What it finds is a local optimum, not the optimum, but it is an assignment that
//! exists: a figure it reaches, some rule could reach. A figure it cannot reach after
//! many moves from a router's choices, with the future in hand, is evidence (not proof)
//! that no online rule reaches it either.

use std::collections::HashMap;

use crate::engine::ConfigError;
use crate::lookahead::{Goal, Regret};
use crate::replay::{replay, Dispatch, Dispatcher, ReplayConfig, ReplayReport, SimRequest};
use crate::rng::SplitMix64;
use crate::stats::Summary;

/// Sends each request to the worker an assignment gives it (worker 0 if it names none).
#[derive(Debug)]
pub struct Assigned {
    to: HashMap<u64, u32>,
}

impl Assigned {
    /// `workers[i]` is request `reqs[i]`'s worker.
    pub fn new(reqs: &[SimRequest], workers: &[u32]) -> Self {
        Assigned { to: reqs.iter().zip(workers).map(|(r, &w)| (r.id, w)).collect() }
    }
}

impl Dispatcher for Assigned {
    fn on_arrival(&mut self, _now_ms: f64, req: &SimRequest) -> Dispatch {
        Dispatch::To(self.to.get(&req.id).copied().unwrap_or(0))
    }
}

/// What [`search`] improves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Aim {
    /// Lowers the mean time to a request's first token, or to its last.
    Time(Goal),
    /// Raises the hit rate (prefix reuse ratio).
    Hits,
}

/// The limits and budget of [`search`].
#[derive(Clone, Copy, Debug)]
pub struct SearchConfig {
    /// Moves tried (one replay each).
    pub moves_max: u32,
    /// Seed of the move draws.
    pub seed: u64,
    /// What it improves.
    pub aim: Aim,
    /// Least prefix reuse ratio a kept assignment may have.
    pub hits_min: f64,
    /// Most TTFT mean a kept assignment may have, ms.
    pub ttft_mean_max_ms: f64,
    /// Most end-to-end mean a kept assignment may have, ms.
    pub e2e_mean_max_ms: f64,
}

impl SearchConfig {
    /// A search for `aim` with no limits, `moves_max` moves from seed 0.
    pub fn unlimited(aim: Aim, moves_max: u32) -> Self {
        let inf = f64::INFINITY;
        SearchConfig { moves_max, seed: 0, aim, hits_min: 0.0, ttft_mean_max_ms: inf, e2e_mean_max_ms: inf }
    }
}

/// What [`search`] found.
#[derive(Clone, Debug)]
pub struct SearchReport {
    /// The start's figures.
    pub start: Summary,
    /// The best kept assignment's figures.
    pub best: Summary,
    /// The best kept assignment, by request index.
    pub assignment: Vec<u32>,
    /// Moves tried.
    pub tried: u32,
    /// Moves kept.
    pub kept: u32,
    /// Moves that lowered the goal's mean but broke a limit (or left a request unserved).
    pub limited: u32,
}

/// Improves `start` (one worker per request of `reqs`, by index) for `s.aim` within
/// `s`'s limits (see the module docs). `reqs` is in arrival order. An assignment that
/// leaves a request unserved is never kept. `progress` hears after every move: moves
/// tried, moves kept, and the best figures so far.
pub fn search(
    cfg: &ReplayConfig,
    reqs: &[SimRequest],
    start: Vec<u32>,
    s: &SearchConfig,
    mut progress: impl FnMut(u32, u32, &Summary),
) -> Result<SearchReport, ConfigError> {
    let first = run(cfg, reqs, &start)?;
    let next = groups(reqs);
    let hinted = hints(cfg, reqs, &start, &first, &next, s.aim)?;
    let mut n = Neighbours { next, hints: hinted, workers: cfg.workers, aim: s.aim };
    let mut rng = SplitMix64::new(s.seed);
    let (mut best, mut at) = (first.clone(), start);
    let (mut tried, mut kept, mut limited) = (0, 0, 0);
    while tried < s.moves_max {
        let Some(next) = propose(&at, &best, &n, &mut rng) else { break };
        let rep = run(cfg, reqs, &next)?;
        tried += 1;
        match judge(&rep, &best, s) {
            Judged::Better => {
                n.hints = hints(cfg, reqs, &next, &rep, &n.next, s.aim)?;
                (best, at, kept) = (rep, next, kept + 1);
            }
            Judged::Limited => limited += 1,
            Judged::Worse => {}
        }
        progress(tried, kept, &best.summary);
    }
    Ok(SearchReport { start: first.summary, best: best.summary, assignment: at, tried, kept, limited })
}

fn run(cfg: &ReplayConfig, reqs: &[SimRequest], workers: &[u32]) -> Result<ReplayReport, ConfigError> {
    replay(cfg, reqs, &mut Assigned::new(reqs, workers))
}

/// A move's verdict.
enum Judged {
    /// The aim's figure improved and every limit holds: kept.
    Better,
    /// The aim's figure improved but a limit broke.
    Limited,
    /// The aim's figure did not improve.
    Worse,
}

fn judge(rep: &ReplayReport, best: &ReplayReport, s: &SearchConfig) -> Judged {
    let (n, b) = (&rep.summary, &best.summary);
    // Lower is better for every aim: hits count negated.
    let figure = |x: &Summary| match s.aim {
        Aim::Time(Goal::FirstToken) => x.ttft_ms.mean,
        Aim::Time(Goal::LastToken) => x.e2e_ms.mean,
        Aim::Hits => -x.prefix_reuse_ratio,
    };
    if figure(n) >= figure(b) {
        return Judged::Worse;
    }
    let within = n.completed == rep.records.len() as u64
        && n.prefix_reuse_ratio >= s.hits_min
        && n.ttft_ms.mean <= s.ttft_mean_max_ms
        && n.e2e_ms.mean <= s.e2e_mean_max_ms;
    if within {
        Judged::Better
    } else {
        Judged::Limited
    }
}

/// The hash of a prompt's ninth block (its last, if shorter; 0 if empty): requests that
/// share it share a document or a conversation's opening. `policy_sweep`'s partition
/// keys its groups by it too.
pub fn opening_key(r: &SimRequest) -> u64 {
    let b = r.prompt.blocks();
    b.get(8).or(b.last()).map_or(0, |h| h.seq.0)
}

/// Per request, the index of the next request of its group (`usize::MAX` for none).
/// A group is a session, or else the requests with the same [`opening_key`].
fn groups(reqs: &[SimRequest]) -> Vec<usize> {
    let mut next = vec![usize::MAX; reqs.len()];
    let mut last: HashMap<(Option<&str>, u64), usize> = HashMap::new();
    for (i, r) in reqs.iter().enumerate() {
        let key = match &r.session_id {
            Some(s) => (Some(&**s), 0),
            None => (None, opening_key(r)),
        };
        if let Some(j) = last.insert(key, i) {
            next[j] = i;
        }
    }
    next
}

/// What moves are drawn from: each request's next request of its group, and per request
/// a hinted worker with what moving there might gain (see [`hints`]).
struct Neighbours {
    next: Vec<usize>,
    hints: Vec<(u32, f64)>,
    workers: u32,
    aim: Aim,
}

/// Passes a hint's engine copy may run before it gives up on a worker.
const HINT_PASSES_MAX: u32 = 100_000;

/// Per request (by index), a worker to try under assignment `at` (replayed as `rep`) and
/// what it might gain: for a time, the lookahead's best worker and the time it would have
/// saved (0 where the choice was the best); for hits, the worker of the group's request
/// before it and the request's uncached tokens (0 where they share a worker).
fn hints(
    cfg: &ReplayConfig,
    reqs: &[SimRequest],
    at: &[u32],
    rep: &ReplayReport,
    next: &[usize],
    aim: Aim,
) -> Result<Vec<(u32, f64)>, ConfigError> {
    let goal = match aim {
        Aim::Time(goal) => goal,
        Aim::Hits => return Ok(hits_hints(at, rep, next)),
    };
    let mut r = Regret::new(Assigned::new(reqs, at), goal, HINT_PASSES_MAX);
    replay(cfg, reqs, &mut r)?;
    let index: HashMap<u64, usize> = reqs.iter().enumerate().map(|(i, q)| (q.id, i)).collect();
    let mut out: Vec<(u32, f64)> = at.iter().map(|&w| (w, 0.0)).collect();
    for c in &r.choices {
        if let (Some(&i), Some(ms)) = (index.get(&c.id), c.chosen_ms) {
            out[i] = (c.best, (ms - c.best_ms).max(0.0));
        }
    }
    Ok(out)
}

fn hits_hints(at: &[u32], rep: &ReplayReport, next: &[usize]) -> Vec<(u32, f64)> {
    let mut out: Vec<(u32, f64)> = at.iter().map(|&w| (w, 0.0)).collect();
    for (i, &j) in next.iter().enumerate() {
        if j == usize::MAX || at[i] == at[j] {
            continue;
        }
        out[j] = (at[i], uncached(&rep.records[j]));
    }
    out
}

/// A neighbour of `at`. Half the time, a request drawn by what its hint might gain moves
/// to the hinted worker; otherwise one drawn by what it has to gain in `rep` ([`weight`])
/// moves to a random other worker. Half the time again the later requests of its group on its old
/// worker follow it. `None` when there is nothing to move.
fn propose(at: &[u32], rep: &ReplayReport, n: &Neighbours, rng: &mut SplitMix64) -> Option<Vec<u32>> {
    if n.workers < 2 || at.is_empty() {
        return None;
    }
    let hinted = if rng.below(2) == 0 { draw(n.hints.iter().map(|h| h.1), rng) } else { None };
    let (i, to) = match hinted {
        Some(i) if n.hints[i].0 != at[i] => (i, n.hints[i].0),
        _ => {
            let i = draw(rep.records.iter().map(|r| weight(r, n.aim)), rng).unwrap_or(0);
            (i, (at[i] + 1 + rng.below(u64::from(n.workers) - 1) as u32) % n.workers)
        }
    };
    let from = at[i];
    let mut out = at.to_vec();
    out[i] = to;
    let mut j = i;
    while rng.below(2) == 0 && n.next[j] != usize::MAX {
        j = n.next[j];
        if out[j] == from {
            out[j] = to;
        }
    }
    Some(out)
}

/// What a request has to gain: its time from arrival to the aim's goal, ms (0 if it
/// never got there), or its uncached prompt tokens.
fn weight(r: &crate::stats::RequestRecord, aim: Aim) -> f64 {
    let ms = match aim {
        Aim::Time(Goal::FirstToken) => r.ttft_ms(),
        Aim::Time(Goal::LastToken) => r.e2e_ms(),
        Aim::Hits => return uncached(r),
    };
    ms.map_or(0.0, |t| t.max(0.0))
}

/// A request's prompt tokens not served from cache.
fn uncached(r: &crate::stats::RequestRecord) -> f64 {
    f64::from(r.prompt_tokens.saturating_sub(r.cached_tokens.unwrap_or(0)))
}

/// An index drawn with chance proportional to its weight; `None` if no weight is
/// positive and finite.
fn draw(weights: impl Iterator<Item = f64>, rng: &mut SplitMix64) -> Option<usize> {
    let w: Vec<f64> = weights.map(|x| if x.is_finite() { x.max(0.0) } else { 0.0 }).collect();
    let total: f64 = w.iter().sum();
    if total <= 0.0 {
        return None;
    }
    let mut x = rng.unit() * total;
    let last = w.iter().rposition(|&wi| wi > 0.0)?;
    for (i, wi) in w.iter().enumerate() {
        if x < *wi {
            return Some(i);
        }
        x -= wi;
    }
    Some(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use crate::test_requests::request;

    /// Request `id` at `at_ms`: 512 tokens per hash id in 64-token blocks, `output` tokens.
    fn req(id: u64, at_ms: f64, hash_ids: &[u32], output: u32) -> SimRequest {
        let len = 512 * hash_ids.len() as u32;
        SimRequest { arrival_ms: at_ms, output_len: output, ..request(id, hash_ids, len, 64) }
    }

    fn cfg(workers: u32) -> ReplayConfig {
        let engine = EngineConfig { blocks_per_worker: 64, ..EngineConfig::default() };
        ReplayConfig { workers, engine, ..ReplayConfig::default() }
    }

    /// Searches from `start` for `aim` without limits, and checks the assignment it ends
    /// on and that its figure is no worse than the start's (better when `improves`).
    fn check(aim: Aim, reqs: &[SimRequest], start: &[u32], want: &[u32], improves: bool) {
        let s = SearchConfig { seed: 7, ..SearchConfig::unlimited(aim, 200) };
        let rep = search(&cfg(2), reqs, start.to_vec(), &s, |_, _, _| {}).expect("config");
        assert_eq!(rep.assignment, want, "seed {}", s.seed);
        let gain = |x: &Summary| match aim {
            Aim::Time(Goal::FirstToken) => -x.ttft_ms.mean,
            Aim::Time(Goal::LastToken) => -x.e2e_ms.mean,
            Aim::Hits => x.prefix_reuse_ratio,
        };
        assert_eq!(gain(&rep.best) > gain(&rep.start), improves, "{rep:?}");
        assert!(gain(&rep.best) >= gain(&rep.start));
        let again = run(&cfg(2), reqs, &rep.assignment).expect("config");
        assert_eq!(gain(&again.summary), gain(&rep.best), "the report replays");
    }

    const TTFT: Aim = Aim::Time(Goal::FirstToken);

    #[test]
    fn two_prompts_piled_on_one_worker_are_spread() {
        let reqs = [req(1, 0.0, &[1, 2, 3, 4], 50), req(2, 1.0, &[5, 6, 7, 8], 50)];
        check(TTFT, &reqs, &[0, 0], &[0, 1], true);
    }

    #[test]
    fn a_repeat_stays_with_its_cached_prefix() {
        // The repeat arrives after the first finished: its holder is idle and caches the
        // prompt, so no move lowers its TTFT.
        let reqs = [req(1, 0.0, &[1, 2, 3, 4], 4), req(2, 5_000.0, &[1, 2, 3, 4], 4)];
        check(TTFT, &reqs, &[1, 1], &[1, 1], false);
    }

    #[test]
    fn a_conversations_turn_away_from_its_opening_is_brought_back_for_hits() {
        // Turn two went to the other worker and recomputed the opening; either worker
        // holding both turns gets the same hits, and the hint is the opening's worker.
        let reqs = [req(1, 0.0, &[1, 2, 3, 4], 4), req(2, 5_000.0, &[1, 2, 3, 4, 5], 4)];
        check(Aim::Hits, &reqs, &[0, 1], &[0, 0], true);
        check(Aim::Hits, &reqs, &[1, 1], &[1, 1], false);
    }

    #[test]
    fn the_hits_hint_is_the_worker_of_the_groups_request_before() {
        // Request 2 follows request 0's opening on another worker and misses it all;
        // request 1 shares nothing.
        let reqs = [req(0, 0.0, &[1, 2, 3], 4), req(1, 1.0, &[7, 8], 4), req(2, 5_000.0, &[1, 2, 3, 4], 4)];
        let at = [0, 1, 1];
        let rep = run(&cfg(2), &reqs, &at).expect("config");
        assert_eq!(hits_hints(&at, &rep, &groups(&reqs)), [(0, 0.0), (1, 0.0), (0, 2048.0)]);
        let along = [0, 1, 0];
        let rep = run(&cfg(2), &reqs, &along).expect("config");
        assert_eq!(hits_hints(&along, &rep, &groups(&reqs)), [(0, 0.0), (1, 0.0), (0, 0.0)]);
    }

    #[test]
    fn a_limit_on_hits_keeps_a_move_that_would_lose_them() {
        // Spreading the repeat would lower TTFT only by recomputing the shared prompt;
        // with hits held at the start's, it stays.
        let reqs = [req(1, 0.0, &[1, 2, 3, 4], 400), req(2, 30.0, &[1, 2, 3, 4, 5], 4)];
        let free = SearchConfig { seed: 3, ..SearchConfig::unlimited(TTFT, 100) };
        let loose = search(&cfg(2), &reqs, vec![0, 0], &free, |_, _, _| {}).expect("config");
        assert!(loose.best.ttft_ms.mean < loose.start.ttft_ms.mean, "{loose:?}");
        assert!(loose.best.prefix_reuse_ratio < loose.start.prefix_reuse_ratio, "{loose:?}");
        let held = SearchConfig { hits_min: loose.start.prefix_reuse_ratio, ..free };
        let got = search(&cfg(2), &reqs, vec![0, 0], &held, |_, _, _| {}).expect("config");
        assert_eq!(got.assignment, [0, 0], "seed {}", held.seed);
        assert_eq!(got.kept, 0);
        assert!(got.limited >= 1, "the move that lowers TTFT was found and refused: {got:?}");
    }

    #[test]
    fn groups_chain_a_session_or_a_shared_opening_in_arrival_order() {
        let mut reqs =
            vec![req(0, 0.0, &[1, 2, 3], 4), req(1, 1.0, &[9, 8], 4), req(2, 2.0, &[1, 2, 4], 4), req(3, 3.0, &[5], 4)];
        for i in [1, 3] {
            reqs[i].session_id = Some("a".into());
        }
        assert_eq!(groups(&reqs), [2, 3, usize::MAX, usize::MAX]);
    }

    #[test]
    fn draws_follow_the_weights_and_skip_the_weightless() {
        let mut rng = SplitMix64::new(1);
        for (weights, want) in [(vec![0.0, 0.0, 3.0], Some(2)), (vec![0.0, f64::NAN], None), (vec![], None)] {
            assert_eq!(draw(weights.into_iter(), &mut rng), want);
        }
        let mut seen = [0u32; 2];
        for _ in 0..1_000 {
            seen[draw([1.0, 3.0].into_iter(), &mut rng).expect("a weight")] += 1;
        }
        assert!((650..850).contains(&seen[1]), "3 in 4 draws on the heavier: {seen:?}");
    }
}
