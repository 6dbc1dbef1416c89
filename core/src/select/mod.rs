//! Worker selection: picks one of the eligible candidates for a request.
//!
//! A [`Selector`] applies one [`RouterMode`] to a list of [`Candidate`]s, each carrying
//! its load and its cached prefix for the request, and returns the chosen key with a
//! per-candidate [`CandidateScore`] for metrics. Randomness comes only from the caller's
//! [`Draw`], so a decision is a pure function of the request, the candidates, the
//! draw and the round-robin cursor.
//!
//! What it leaves to others: deciding which workers are eligible (`eligible`), measuring
//! overlap (`index`) and load (`load`), and booking the chosen worker's new load.
//!
//! Candidates are considered in [`WorkerKey`] order. Sorted input (the usual case) is used
//! as is, checked in one pass; unsorted input is copied and sorted first, so the order the
//! caller happened to build the list in never changes a decision. Work is linear in the
//! number of candidates (plus the sort when unsorted).

mod cold;
mod cost;
mod excess;
mod ttft;
mod ttft_plan;

pub(crate) use cost::blocks_cost;
pub use cost::{kv_cost, KvCostConfig, KvCostModel, KvCostOverrides};
#[cfg(test)]
use ttft::ttft_cost;
pub use ttft::{TtftModel, TtftWeights};

use crate::hash::BlockSize;
use crate::mathf;
use crate::types::{Draw, Overlap, Phase, WorkerKey, WorkerLoad};
use alloc::borrow::Cow;
use alloc::vec::Vec;
use core::cmp::Ordering;
use core::fmt;
use core::str::FromStr;

/// How to pick a worker.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum RouterMode {
    /// Uniformly at random.
    Random,
    /// The next candidate after the last one chosen, in key order, wrapping around.
    RoundRobin,
    /// The less busy (fewer requests) of two distinct random candidates.
    PowerOfTwo,
    /// Fewest running requests, then fewest decode blocks.
    LeastLoaded,
    /// At random, in proportion to each candidate's weight.
    Weighted,
    /// The worker the request names, if it is a candidate.
    Direct,
    /// Lowest kv cost (see [`kv_cost`]), or sampled by it at a positive temperature.
    Kv,
}

impl RouterMode {
    /// Every mode, in declaration order.
    pub const ALL: [RouterMode; 7] = [
        RouterMode::Random,
        RouterMode::RoundRobin,
        RouterMode::PowerOfTwo,
        RouterMode::LeastLoaded,
        RouterMode::Weighted,
        RouterMode::Direct,
        RouterMode::Kv,
    ];

    /// The kebab-case name used in configs and flags.
    pub const fn as_str(self) -> &'static str {
        match self {
            RouterMode::Random => "random",
            RouterMode::RoundRobin => "round-robin",
            RouterMode::PowerOfTwo => "power-of-two",
            RouterMode::LeastLoaded => "least-loaded",
            RouterMode::Weighted => "weighted",
            RouterMode::Direct => "direct",
            RouterMode::Kv => "kv",
        }
    }
}

impl fmt::Display for RouterMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a router mode name was refused.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum RouterModeParseError {
    /// The name is none of the kebab-case mode names.
    Unknown,
}

impl fmt::Display for RouterModeParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("unknown router mode (expected one of")?;
        for m in RouterMode::ALL {
            write!(f, " {m}")?;
        }
        f.write_str(")")
    }
}

impl core::error::Error for RouterModeParseError {}

impl FromStr for RouterMode {
    type Err = RouterModeParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RouterMode::ALL.into_iter().find(|m| m.as_str() == s).ok_or(RouterModeParseError::Unknown)
    }
}

/// One eligible worker key and what selection needs to know about it.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct Candidate {
    /// The worker and rank.
    pub key: WorkerKey,
    /// Its current load.
    pub load: WorkerLoad,
    /// Its cached prefix of the request's blocks.
    pub overlap: Overlap,
    /// Decode blocks the request would add here (prompt blocks not already active).
    pub new_decode_blocks: u32,
    /// Leading prompt blocks that requests already routed here hold: cached by the time
    /// this one is admitted (engines take prompts in order), announced or not.
    pub inflight_prefix_blocks: u32,
    /// The most leading prompt blocks any candidate holds, cached or in flight: what
    /// placing the request elsewhere leaves behind is measured against it. 0 if unknown.
    pub prefix_best_blocks: u32,
    /// Share in [`RouterMode::Weighted`].
    pub weight: u32,
    /// Multiplies the kv cost; above 1.0 for a worker to avoid (a `PreferNoSchedule`
    /// taint), 1.0 normally.
    pub cost_factor: f64,
    /// Its KV capacity in blocks; 0 if unknown (the cost model's default is used).
    pub kv_blocks: u32,
    /// Blocks its cache holds now, by its KV events (0 if it publishes none): with
    /// `kv_blocks`, how many cached blocks storing this request's would evict.
    pub cached_blocks: u32,
    /// Prompt tokens one forward pass of it computes at most; 0 if unknown (the cost
    /// model's default is used).
    pub max_batched_tokens: u32,
    /// Requests on it whose prefill has not finished (those not yet decoding).
    pub prefill_requests: u32,
    /// How long it has been computing its current prefill backlog without a break, in
    /// ms; 0 if idle or unknown (then none of `active_prefill_tokens` counts as done).
    pub prefill_busy_ms: u64,
    /// Prefill tokens it finished within those `prefill_busy_ms`.
    pub prefill_done_tokens: u64,
    /// How much slower than the timing model it prefills (its learned prefill scale;
    /// 1.0 when not learned): the progress credited to its backlog is divided by it.
    pub prefill_scale: f64,
    /// Its decode steps' weight in the TTFT cost against its prefill time's: its learned
    /// decode scale over its prefill scale (`cost_factor` already carries the prefill
    /// scale), so each is scaled by its own; 1.0 when not learned.
    pub decode_weight: f64,
    /// The cold wait ahead of a request sent there, ms ([`TtftModel::cold_ms`] of how
    /// long it has been idle; for a worker whose backlog began idle, that backlog's
    /// first pass's, until it ends). 0 unless the timing model has a cold term; the
    /// router leaves it 0 for a holder of the request's longest cached prefix.
    pub cold_ms: f64,
}

impl Candidate {
    /// A candidate with no overlap, no new blocks, weight 1, cost factor and prefill scale
    /// 1.0 and unknown capacity.
    pub fn new(key: WorkerKey, load: WorkerLoad) -> Self {
        Candidate {
            key,
            load,
            overlap: Overlap::default(),
            new_decode_blocks: 0,
            inflight_prefix_blocks: 0,
            prefix_best_blocks: 0,
            weight: 1,
            cost_factor: 1.0,
            kv_blocks: 0,
            cached_blocks: 0,
            max_batched_tokens: 0,
            prefill_requests: 0,
            prefill_busy_ms: 0,
            prefill_done_tokens: 0,
            prefill_scale: 1.0,
            decode_weight: 1.0,
            cold_ms: 0.0,
        }
    }
}

/// What is being routed and how.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct SelectRequest {
    /// The selection rule.
    pub mode: RouterMode,
    /// Which serving step the decision is for.
    pub phase: Phase,
    /// Kv cost weights, already merged with the request's overrides.
    pub cost: KvCostConfig,
    /// Prompt length in tokens.
    pub isl_tokens: u32,
    /// Tokens per KV block.
    pub block_size: BlockSize,
    /// Predicted output length in blocks (0 if unknown).
    pub expected_output_blocks: u32,
    /// The worker named by the request; used only in [`RouterMode::Direct`].
    pub direct: Option<WorkerKey>,
    /// The least decode time term (see [`TtftWeights::decode_time_weight`]) any candidate
    /// has before its cap, ms: [`TtftWeights::decode_time_ms_max`] counts from it.
    /// [`Selector::select`] works it out from the candidates in kv mode, whatever this
    /// says; [`kv_cost`], which sees one candidate, reads it as given (0 makes the cap
    /// absolute).
    pub decode_time_floor_ms: f64,
}

impl Default for SelectRequest {
    /// Kv mode, aggregated, default costs, an empty prompt of default-size blocks.
    fn default() -> Self {
        SelectRequest {
            mode: RouterMode::Kv,
            phase: Phase::Aggregated,
            cost: KvCostConfig::default(),
            isl_tokens: 0,
            block_size: BlockSize::DEFAULT,
            expected_output_blocks: 0,
            direct: None,
            decode_time_floor_ms: 0.0,
        }
    }
}

/// How one candidate scored.
///
/// In kv mode these are [`kv_cost`]'s parts. Other modes report the overlap, the
/// candidate's current load (`prefill_blocks` = queued prefill tokens / block size,
/// `decode_blocks` = active decode blocks) and as `cost` the quantity they rank by:
/// running requests for power-of-two and least-loaded, 0 otherwise.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct CandidateScore {
    /// The candidate.
    pub key: WorkerKey,
    /// Its prefix overlap in blocks, every tier counted fully.
    pub overlap_raw: u32,
    /// Its overlap with lower tiers discounted.
    pub overlap_effective: f64,
    /// Prefill blocks it would compute (before `prefill_load_scale`).
    pub prefill_blocks: f64,
    /// Decode blocks it would hold.
    pub decode_blocks: f64,
    /// The total; lower is better.
    pub cost: f64,
}

/// A decision.
#[derive(Clone, PartialEq, Debug)]
pub struct Selection {
    /// The chosen key.
    pub chosen: WorkerKey,
    /// Every candidate's score, in key order.
    pub scores: Vec<CandidateScore>,
}

/// Why no worker was chosen.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum SelectError {
    /// The candidate list is empty.
    NoCandidates,
    /// Direct mode, but the request names no worker.
    DirectTargetRequired {
        /// The phase being routed.
        phase: Phase,
    },
    /// Direct mode, but the named worker is not among the candidates.
    DirectTargetNotEligible {
        /// The named worker.
        target: WorkerKey,
    },
}

impl fmt::Display for SelectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SelectError::NoCandidates => f.write_str("no eligible worker"),
            SelectError::DirectTargetRequired { phase } => {
                write!(f, "worker ID required for {} request in Direct routing mode", phase.as_str())
            }
            SelectError::DirectTargetNotEligible { target } => {
                write!(f, "worker {target} named for Direct routing is not eligible")
            }
        }
    }
}

impl core::error::Error for SelectError {}

/// Picks workers; holds the round-robin cursor (one per phase).
#[derive(Clone, Debug, Default)]
pub struct Selector {
    /// Last key chosen by round-robin, per [`Phase::index`].
    round_robin_last: [Option<WorkerKey>; 3],
}

impl Selector {
    /// A selector whose round-robin starts at the lowest key.
    pub fn new() -> Self {
        Selector::default()
    }

    /// Picks one candidate for `req`.
    ///
    /// `commit == false` previews: the decision is the one `commit == true` would make
    /// with the same draw, but no state (the round-robin cursor) changes. Ties are broken
    /// by `draw`. Linear in `candidates.len()`; see the module docs on ordering.
    pub fn select(
        &mut self,
        req: &SelectRequest,
        candidates: &[Candidate],
        draw: &mut Draw,
        commit: bool,
    ) -> Result<Selection, SelectError> {
        let direct = match (req.mode, req.direct) {
            (RouterMode::Direct, None) => return Err(SelectError::DirectTargetRequired { phase: req.phase }),
            (RouterMode::Direct, Some(target)) => Some(target),
            _ => None,
        };
        if req.mode == RouterMode::Kv && !candidates.is_empty() {
            // Scoring in the caller's order checks that order on the way: sorted input,
            // the usual case, is read once. Unsorted input is scored again once sorted.
            let (scores, min, in_order) = kv_scores(req, candidates);
            if in_order {
                return Ok(selection(candidates, kv_pick(&scores, min, req.cost.temperature, draw), scores));
            }
        }
        let cands = sorted(candidates);
        if let Some(target) = direct {
            let Some(i) = cands.iter().position(|c| c.key == target) else {
                return Err(SelectError::DirectTargetNotEligible { target });
            };
            return Ok(selection(&cands, i, load_scores(req, &cands, |_| 0.0)));
        }
        if cands.is_empty() {
            return Err(SelectError::NoCandidates);
        }
        let n = cands.len();
        let requests = |c: &Candidate| f64::from(c.load.active_requests);
        let (i, scores) = match req.mode {
            RouterMode::Random => (draw.below(n), load_scores(req, &cands, |_| 0.0)),
            RouterMode::RoundRobin => (self.round_robin(req.phase, &cands, commit), load_scores(req, &cands, |_| 0.0)),
            RouterMode::PowerOfTwo => (power_of_two(&cands, draw), load_scores(req, &cands, requests)),
            RouterMode::LeastLoaded => (least_loaded(&cands, draw), load_scores(req, &cands, requests)),
            RouterMode::Weighted => (weighted(&cands, draw), load_scores(req, &cands, |_| 0.0)),
            // Direct returned above; it shares the kv arm only to keep the match exhaustive.
            RouterMode::Kv | RouterMode::Direct => {
                let (scores, min, _) = kv_scores(req, &cands);
                (kv_pick(&scores, min, req.cost.temperature, draw), scores)
            }
        };
        Ok(selection(&cands, i, scores))
    }

    fn round_robin(&mut self, phase: Phase, cands: &[Candidate], commit: bool) -> usize {
        let slot = &mut self.round_robin_last[phase.index()];
        let next = match *slot {
            None => 0,
            Some(last) => cands.partition_point(|c| c.key <= last),
        };
        let i = if next == cands.len() { 0 } else { next };
        if commit {
            *slot = Some(cands[i].key);
        }
        i
    }
}

/// The candidates in key order, borrowed when already sorted.
fn sorted(candidates: &[Candidate]) -> Cow<'_, [Candidate]> {
    if candidates.windows(2).all(|w| w[0].key <= w[1].key) {
        return Cow::Borrowed(candidates);
    }
    let mut v = candidates.to_vec();
    v.sort_by_key(|c| c.key); // Stable: duplicate keys keep the caller's order.
    Cow::Owned(v)
}

fn selection(cands: &[Candidate], i: usize, scores: Vec<CandidateScore>) -> Selection {
    Selection { chosen: cands[i].key, scores }
}

/// Scores for the modes that do not compute a kv cost: overlap and current load.
fn load_scores(req: &SelectRequest, cands: &[Candidate], cost: impl Fn(&Candidate) -> f64) -> Vec<CandidateScore> {
    let bs = f64::from(req.block_size.tokens());
    cands
        .iter()
        .map(|c| CandidateScore {
            prefill_blocks: c.load.active_prefill_tokens as f64 / bs,
            decode_blocks: c.load.active_decode_blocks as f64,
            cost: cost(c),
            ..blocks_cost(req, c)
        })
        .collect()
}

/// [`kv_cost`] of every candidate, in order (the TTFT model through its batch evaluator,
/// which gives the same scores), the cheapest of them, and whether the candidates are
/// in key order.
fn kv_scores(req: &SelectRequest, cands: &[Candidate]) -> (Vec<CandidateScore>, Cheapest, bool) {
    let (mut scores, min, in_order) = kv_scores_plain(req, cands);
    // Both charges run: `|`, not `||`.
    let charged = excess::charge(req, cands, &mut scores) | cold::charge(req, cands, &mut scores);
    let min = if charged { Cheapest::of(&scores) } else { min };
    (scores, min, in_order)
}

/// [`kv_scores`] before the excess and cold charges: each candidate scored on its own.
fn kv_scores_plain(req: &SelectRequest, cands: &[Candidate]) -> (Vec<CandidateScore>, Cheapest, bool) {
    match req.cost.model {
        KvCostModel::Ttft => ttft_plan::ttft_scores(req, cands),
        KvCostModel::Blocks => {
            // No running state in the scoring loop: see `TtftPlan::score_all`.
            let scores: Vec<_> = cands.iter().map(|c| blocks_cost(req, c)).collect();
            let (min, in_order, _) = tally(&scores, cands, |_| false);
            (scores, min, in_order)
        }
    }
}

/// Whether keys seen one by one come in order (the check `sorted` makes, folded into
/// [`tally`]'s pass).
#[derive(Clone, Copy, Debug)]
struct KeyOrder {
    last: WorkerKey,
    in_order: bool,
}

impl KeyOrder {
    /// Before any key.
    const START: KeyOrder = KeyOrder { last: WorkerKey::new(0, 0), in_order: true };

    #[inline(always)]
    fn see(&mut self, key: WorkerKey) {
        // Ordered as `WorkerKey` is: by worker, then rank (without branches).
        let (last, worker) = (self.last.worker.0, key.worker.0);
        self.in_order &= (last < worker) | ((last == worker) & (self.last.rank.0 <= key.rank.0));
        self.last = key;
    }
}

/// In one read-only pass after scoring: the cheapest of `scores`, whether `cands` are in
/// key order and whether `odd` holds for any of them. The scoring loops keep no running
/// state (see `TtftPlan::score_all`), so this pass does their bookkeeping.
fn tally(scores: &[CandidateScore], cands: &[Candidate], odd: impl Fn(&Candidate) -> bool) -> (Cheapest, bool, bool) {
    let (mut min, mut order, mut any) = (Cheapest::NONE, KeyOrder::START, false);
    for (i, (s, c)) in scores.iter().zip(cands).enumerate() {
        order.see(c.key);
        min.see(i, s.cost);
        any |= odd(c);
    }
    (min, order.in_order, any)
}

/// The least cost in a list of scores, the first index holding it and how many do.
#[derive(Clone, Copy, Debug)]
struct Cheapest {
    index: usize,
    cost: f64,
    ties: usize,
}

impl Cheapest {
    /// Before any score.
    const NONE: Cheapest = Cheapest { index: 0, cost: f64::INFINITY, ties: 0 };

    /// Takes in score `i`'s cost (never NaN: see `cost::score`), the scores seen in order.
    #[inline(always)]
    fn see(&mut self, i: usize, cost: f64) {
        if cost < self.cost {
            *self = Cheapest { index: i, cost, ties: 1 };
        } else if cost == self.cost {
            self.ties += 1;
        }
    }

    fn of(scores: &[CandidateScore]) -> Cheapest {
        let mut min = Cheapest::NONE;
        for (i, s) in scores.iter().enumerate() {
            min.see(i, s.cost);
        }
        min
    }
}

/// The index of the least element under `cmp`, ties broken uniformly by `draw`.
fn pick_min(n: usize, draw: &mut Draw, cmp: impl Fn(usize, usize) -> Ordering) -> usize {
    let mut best = 0;
    let mut ties = 1;
    for i in 1..n {
        match cmp(i, best) {
            Ordering::Less => (best, ties) = (i, 1),
            Ordering::Equal => ties += 1,
            Ordering::Greater => {}
        }
    }
    let k = if ties > 1 { draw.below(ties) } else { 0 };
    (best..n).filter(|&i| cmp(i, best) == Ordering::Equal).nth(k).unwrap_or(best)
}

fn least_loaded(cands: &[Candidate], draw: &mut Draw) -> usize {
    let rank = |i: usize| (cands[i].load.active_requests, cands[i].load.active_decode_blocks);
    pick_min(cands.len(), draw, |a, b| rank(a).cmp(&rank(b)))
}

fn power_of_two(cands: &[Candidate], draw: &mut Draw) -> usize {
    let n = cands.len();
    if n == 1 {
        return 0;
    }
    let a = draw.below(n);
    let mut b = draw.below(n - 1);
    if b >= a {
        b += 1; // Skips `a`, so the two are distinct and each pair equally likely.
    }
    let (ra, rb) = (cands[a].load.active_requests, cands[b].load.active_requests);
    match ra.cmp(&rb) {
        Ordering::Less => a,
        Ordering::Greater => b,
        Ordering::Equal if draw.below(2) == 0 => a,
        Ordering::Equal => b,
    }
}

/// Proportional to weight; uniform when every weight is zero.
fn weighted(cands: &[Candidate], draw: &mut Draw) -> usize {
    let total: u64 = cands.iter().map(|c| u64::from(c.weight)).sum();
    if total == 0 {
        return draw.below(cands.len());
    }
    // Multiply-shift maps 64 random bits onto 0..total without modulo bias.
    let target = ((u128::from(draw.next_u64()) * u128::from(total)) >> 64) as u64;
    let mut acc = 0;
    for (i, c) in cands.iter().enumerate() {
        acc += u64::from(c.weight);
        if target < acc {
            return i;
        }
    }
    cands.len() - 1 // Unreachable: target < total = the final acc.
}

/// Temperature 0 (or NaN): the cheapest, ties by draw. Above 0: sampled with
/// `p ∝ exp(−(c − c_min) / ((c_max − c_min) × T))`, uniform when all costs are equal.
/// Infinite costs get no weight unless every cost is infinite.
/// `min` must be `Cheapest::of(scores)`.
fn kv_pick(scores: &[CandidateScore], min: Cheapest, temperature: f64, draw: &mut Draw) -> usize {
    if temperature > 0.0 {
        return sample(scores, temperature, draw);
    }
    cheapest(scores, min, draw)
}

/// [`pick_min`] by cost, from the cheapest found while scoring (costs are never NaN:
/// see `cost::score`); the same answer and the same draws.
fn cheapest(scores: &[CandidateScore], min: Cheapest, draw: &mut Draw) -> usize {
    if min.ties <= 1 {
        return min.index;
    }
    let k = draw.below(min.ties);
    (min.index..scores.len()).filter(|&i| scores[i].cost == min.cost).nth(k).unwrap_or(min.index)
}

fn sample(scores: &[CandidateScore], temperature: f64, draw: &mut Draw) -> usize {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for s in scores.iter().filter(|s| s.cost.is_finite()) {
        lo = lo.min(s.cost);
        hi = hi.max(s.cost);
    }
    if lo > hi {
        return draw.below(scores.len()); // No finite cost at all.
    }
    let scale = (hi - lo) * temperature;
    let weight = |c: f64| match (c.is_finite(), scale > 0.0) {
        (false, _) => 0.0,
        (true, true) => mathf::exp(-(c - lo) / scale),
        (true, false) => 1.0, // All finite costs equal (or 0 × ∞): uniform.
    };
    let weights: Vec<f64> = scores.iter().map(|s| weight(s.cost)).collect();
    let total: f64 = weights.iter().sum();
    let target = draw.unit() * total;
    let mut acc = 0.0;
    for (i, &w) in weights.iter().enumerate() {
        acc += w;
        if target < acc {
            return i;
        }
    }
    // Rounding can leave `target` a hair above the sum; take the last weighted one.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
}

#[cfg(test)]
mod tests;
