//! [`TtftPlan`]: [`ttft_cost`] for one request over many candidates, with the request's
//! constants worked out once and the arithmetic cut to what the answer needs.
//!
//! Every candidate's score is bit for bit the one [`ttft_cost`] returns: the plan runs
//! the same floating-point operations in the same order on the same values, and only
//! drops work whose result it knows exactly. The savings:
//!
//! * the request's parts (prompt length, block size, weights), the time of a full pass
//!   `f_p(batch)` and the candidates' usual pass budget and KV capacity are read or
//!   computed once per decision, not per candidate;
//! * dividing by a power of two (block sizes always are; the default pass budget and KV
//!   capacity are too) is multiplying by its reciprocal, exactly: both round the same
//!   real number. The evaluator is compiled once for power-of-two budgets and once for
//!   others;
//! * splitting tokens into passes needs `floor(tokens / batch)`. Below the batch (below
//!   `batch · (1 − 2⁻⁴⁰)` unless it is a power of two) the rounded quotient is below 1,
//!   so the split is `(0, tokens)`: most prompts and backlogs fit one pass. Above, every
//!   split here is of a positive count, whose floor is found by adding and subtracting
//!   2⁵² instead of a float-integer round trip;
//! * NaN and sign checks are dropped where the operand cannot be NaN or negative (counts
//!   converted from integers), `f64::max`/`min` are plain comparisons where one side
//!   cannot be NaN, and the backlog's split, which the reference computes twice, is
//!   computed once.
//!
//! The decode time term's cap counts from the least uncapped term of any candidate
//! ([`SelectRequest::decode_time_floor_ms`]), which the plan works out itself: it keeps
//! every candidate's terms, takes that least, then caps and sums in the reference's
//! order (about a third more time per decision than without the cap, against two and a
//! half times when the floor came from the reference formula).
//!
//! What it leaves to [`ttft_cost`]: the decode phase (the blocks formula scores it) and
//! any candidate reporting its own pass budget or KV capacity different from the
//! model's defaults, which are rare and scored one by one.

use super::cost::{overlap_effective, score};
use super::ttft::{
    decode_time_uncapped_ms, evicted_blocks, finite_floor, left_behind, output_tokens, ttft_cost, DecodeParts,
    TtftModel,
};
use super::KvCostConfig;
use super::{tally, Candidate, CandidateScore, Cheapest, SelectRequest};
use crate::types::Phase;
use alloc::vec::Vec;

/// A fraction of a full pass below which a token count surely fits one pass (see the
/// module docs): `1 − 2⁻⁴⁰`.
const ONE_PASS_SHARE: f64 = 1.0 - 1.0 / (1u64 << 40) as f64;

/// Scores every candidate for `req` as [`ttft_cost`] does, in candidate order, finds
/// the cheapest and tells whether the candidates are in key order.
pub(super) fn ttft_scores(req: &SelectRequest, cands: &[Candidate]) -> (Vec<CandidateScore>, Cheapest, bool) {
    match TtftPlan::new(req) {
        Some(plan) if plan.pow2 => plan.score_all::<true>(cands),
        Some(plan) => plan.score_all::<false>(cands),
        None => {
            let scores: Vec<_> = cands.iter().map(|c| ttft_cost(req, c)).collect();
            let (min, in_order, _) = tally(&scores, cands, |_| false);
            (scores, min, in_order)
        }
    }
}

/// Scores `c` with the reference formula, out of the hot loop's way.
#[cold]
#[inline(never)]
fn reference(req: &SelectRequest, c: &Candidate) -> CandidateScore {
    ttft_cost(req, c)
}

/// The request's side of [`ttft_cost`], for scoring many candidates.
struct TtftPlan<'a> {
    req: &'a SelectRequest,
    /// The default pass budget, resolved as the reference does (at least 1).
    batch_tokens: u32,
    batch: f64,
    batch_recip: f64,
    full_pass_ms: f64,
    one_pass_below: f64,
    /// The default KV capacity, resolved as the reference does (at least 1).
    kv_blocks: u32,
    kv: f64,
    kv_recip: f64,
    /// Both `batch` and `kv` are powers of two (their reciprocals are exact).
    pow2: bool,
    bs: f64,
    bs_recip: f64,
    isl: f64,
    aggregated: bool,
    expected_blocks: f64,
    /// The request's expected output in tokens and blocks, for the decode time term.
    out_tokens: f64,
    out_blocks: f64,
    /// `f_d(1) − f_d(0)`, for the decode time term.
    span_ms: f64,
    /// The request's weights, copied so the loop reads them without going through `req`.
    cfg: KvCostConfig,
}

/// Stage 1's results for one candidate.
#[derive(Clone, Copy, Default)]
struct Inputs {
    overlap: f64,
    cached_blocks: f64,
    own: f64,
    active: f64,
    step_ms: f64,
    queued: f64,
}

/// Stage 2's results for one candidate.
#[derive(Clone, Copy, Default)]
struct Times {
    prefill_ms: f64,
    passes: f64,
    others_ms: f64,
    queued_ms: f64,
}

/// Stage 3's results for one candidate: its cost but for the decode time term's cap.
#[derive(Clone, Copy)]
struct Partial {
    /// The terms before the decode time term, summed in the reference's order.
    head_ms: f64,
    /// The decode time term before its cap.
    decode_ms: f64,
    store_ms: f64,
    keep_ms: f64,
    requests_ms: f64,
    overlap: f64,
    prefill_blocks: f64,
    decode_blocks: f64,
}

/// `2^-k` for `d = 2^k`, else 0.
fn pow2_recip(d: u32) -> f64 {
    if d.is_power_of_two() {
        // k < 32: a normal float.
        f64::from_bits(u64::from(1023 - d.trailing_zeros()) << 52)
    } else {
        0.0
    }
}

impl<'a> TtftPlan<'a> {
    /// The plan for `req`, or `None` in the decode phase.
    fn new(req: &'a SelectRequest) -> Option<TtftPlan<'a>> {
        if req.phase == Phase::Decode {
            return None;
        }
        let m = &req.cost.timing;
        let batch_tokens = m.max_batched_tokens_default.max(1);
        let kv_blocks = m.kv_blocks_default.max(1);
        let batch = f64::from(batch_tokens);
        let bs = req.block_size.tokens();
        let out_tokens = output_tokens(req, &req.cost.ttft);
        Some(TtftPlan {
            req,
            batch_tokens,
            batch,
            batch_recip: pow2_recip(batch_tokens),
            full_pass_ms: m.prefill_pass_ms(batch),
            // A power of two divides exactly: below it the quotient is below 1.
            one_pass_below: if batch_tokens.is_power_of_two() { batch } else { batch * ONE_PASS_SHARE },
            kv_blocks,
            kv: f64::from(kv_blocks),
            kv_recip: pow2_recip(kv_blocks),
            pow2: batch_tokens.is_power_of_two() && kv_blocks.is_power_of_two(),
            bs: f64::from(bs),
            bs_recip: pow2_recip(bs),
            isl: f64::from(req.isl_tokens),
            aggregated: req.phase == Phase::Aggregated,
            expected_blocks: f64::from(req.expected_output_blocks),
            out_tokens,
            out_blocks: out_tokens / f64::from(bs),
            span_ms: m.decode_step_ms(1.0) - m.decode_step_ms(0.0),
            cfg: req.cost,
        })
    }

    /// `ttft_cost(req, c)` of every candidate, in order, with the cheapest and whether
    /// the candidates are in key order. `POW2` must equal `self.pow2`.
    ///
    /// Every candidate goes through the fast path first, whose answer for one with its
    /// own pass budget or KV capacity is then replaced by the reference's. The scoring
    /// loop keeps no state of its own in memory (no running minimum, key order or flag
    /// updated through a pointer): the only stores it makes are the scores. Running
    /// state kept on the stack made every iteration store to fixed stack addresses, and
    /// in some stack layouts (likely where those stores 4K-alias the candidates' loads)
    /// decisions ran a third to half slower, depending only on where the stack started.
    fn score_all<const POW2: bool>(&self, cands: &[Candidate]) -> (Vec<CandidateScore>, Cheapest, bool) {
        if self.cfg.ttft.decode_time_floored(self.req.phase) {
            return self.score_all_floored::<POW2>(cands);
        }
        let floor_ms = 0.0;
        let mut out: Vec<_> = cands
            .iter()
            .map(|c| {
                let p = self.inputs::<POW2>(c);
                let t = self.times::<POW2>(c, &p);
                self.complete(c, &self.partial::<POW2>(c, &p, &t), floor_ms)
            })
            .collect();
        let (min, in_order, odd) = tally(&out, cands, |c| !self.is_default::<POW2>(c));
        if !odd {
            return (out, min, in_order);
        }
        let req = SelectRequest { decode_time_floor_ms: floor_ms, ..*self.req };
        for (s, c) in out.iter_mut().zip(cands) {
            if !self.is_default::<POW2>(c) {
                *s = reference(&req, c);
            }
        }
        let min = Cheapest::of(&out);
        (out, min, in_order)
    }

    /// [`TtftPlan::score_all`] when the decode time term's cap counts from the least
    /// term any candidate has: every candidate's uncapped cost first, then that least
    /// (the reference's for a candidate with its own budget or capacity), then the caps.
    fn score_all_floored<const POW2: bool>(&self, cands: &[Candidate]) -> (Vec<CandidateScore>, Cheapest, bool) {
        let parts: Vec<Partial> = cands
            .iter()
            .map(|c| {
                let p = self.inputs::<POW2>(c);
                let t = self.times::<POW2>(c, &p);
                self.partial::<POW2>(c, &p, &t)
            })
            .collect();
        let mut least = f64::INFINITY;
        for (q, c) in parts.iter().zip(cands) {
            let ms = if self.is_default::<POW2>(c) { q.decode_ms } else { decode_time_uncapped_ms(self.req, c) };
            if ms < least {
                least = ms;
            }
        }
        let floor_ms = finite_floor(least);
        let req = SelectRequest { decode_time_floor_ms: floor_ms, ..*self.req };
        let out: Vec<_> = parts
            .iter()
            .zip(cands)
            .map(|(q, c)| if self.is_default::<POW2>(c) { self.complete(c, q, floor_ms) } else { reference(&req, c) })
            .collect();
        let (min, in_order, _) = tally(&out, cands, |_| false);
        (out, min, in_order)
    }

    /// Whether `c` uses the default pass budget and KV capacity: a reported 0 resolves
    /// to the default, any other value to itself.
    #[inline(always)]
    fn is_default<const POW2: bool>(&self, c: &Candidate) -> bool {
        if POW2 {
            // The only submasks of a power of two are 0 and itself.
            return (c.max_batched_tokens & !self.batch_tokens) | (c.kv_blocks & !self.kv_blocks) == 0;
        }
        let batch = (c.max_batched_tokens == 0) | (c.max_batched_tokens == self.batch_tokens);
        batch & ((c.kv_blocks == 0) | (c.kv_blocks == self.kv_blocks))
    }

    /// Stage 1: the prompt tokens to compute, the backlog and the decode step.
    #[inline(always)]
    fn inputs<const POW2: bool>(&self, c: &Candidate) -> Inputs {
        let cfg = &self.cfg;
        let overlap = overlap_effective(cfg, c);
        // `f64::max` and `min` with one side never NaN: a NaN other side gives that one,
        // as a plain comparison does (and neither is −0.0, so zeros' signs can't differ).
        let inflight = f64::from(c.inflight_prefix_blocks);
        let cached_blocks = if overlap > inflight { overlap } else { inflight };
        let credited = cfg.overlap_credit * cached_blocks * self.bs;
        let cached = if credited < self.isl { credited } else { self.isl };
        let isl = self.isl;
        let left = isl - cached;
        let own = if isl <= 0.0 {
            0.0
        } else if left > 1.0 {
            left
        } else {
            1.0
        };
        let active = c.load.active_decode_blocks as f64;
        let decoding = self.aggregated && c.load.active_requests > c.prefill_requests;
        let step_ms = if decoding {
            let usage = if POW2 { active * self.kv_recip } else { active / self.kv };
            decode_step_ms(&cfg.timing, usage)
        } else {
            0.0
        };
        let queued = self.queued_tokens::<POW2>(c, step_ms);
        Inputs { overlap, cached_blocks, own, active, step_ms, queued }
    }

    /// Stage 2: the pass times.
    #[inline(always)]
    fn times<const POW2: bool>(&self, c: &Candidate, p: &Inputs) -> Times {
        let m = &self.cfg.timing;
        let (queued, own) = (p.queued, p.own);
        let (prefill_ms, passes) = self.chunked::<POW2>(queued + own);
        // The backlog's split, shared by the delay to others and the work term.
        let (others_ms, queued_ms) = if queued > 0.0 {
            let (full, rest) = self.split::<POW2>(queued);
            let others = if c.prefill_requests != 0 && rest > 0.0 {
                // Neither side is NaN: a plain comparison is `f64::min`.
                let joined = if rest + own < self.batch { rest + own } else { self.batch };
                let delay = prefill_pass_ms(m, joined) - prefill_pass_ms(m, rest);
                let waiting = if queued <= self.batch { f64::from(c.prefill_requests) } else { 1.0 };
                waiting * delay
            } else {
                0.0
            };
            (others, full * self.full_pass_ms + prefill_pass_ms(m, rest))
        } else {
            (0.0, 0.0)
        };
        Times { prefill_ms, passes, others_ms, queued_ms }
    }

    /// Stage 3: the cost's terms, the decode time term not yet capped.
    #[inline(always)]
    fn partial<const POW2: bool>(&self, c: &Candidate, p: &Inputs, t: &Times) -> Partial {
        let cfg = &self.cfg;
        let w = &cfg.ttft;
        let decode_ms = if t.passes > 1.0 { t.passes } else { 1.0 } * p.step_ms * c.decode_weight;
        let work_ms = t.prefill_ms - t.queued_ms;
        let decode_blocks = p.active + f64::from(c.new_decode_blocks) + self.expected_blocks;
        let memory_ms = if self.aggregated {
            let short = decode_blocks - w.memory_kv_share * self.kv;
            w.memory_ms_per_block * if short > 0.0 { short } else { 0.0 }
        } else {
            0.0
        };
        let out_time_ms = if self.aggregated {
            let m = &cfg.timing;
            let added = f64::from(c.new_decode_blocks) + self.out_blocks;
            let used = p.active + added;
            let d = DecodeParts {
                requests: f64::from(c.load.active_requests),
                step_ms: decode_step_ms(m, if POW2 { used * self.kv_recip } else { used / self.kv }),
                span_ms: self.span_ms,
                added_share: if POW2 { added * self.kv_recip } else { added / self.kv },
                decode_weight: c.decode_weight,
                work_ms,
            };
            w.decode_time_uncapped_ms(self.out_tokens, d)
        } else {
            0.0
        };
        let own_blocks = if POW2 { p.own * self.bs_recip } else { p.own / self.bs };
        let store_ms = w.store_ms_per_block * evicted_blocks(own_blocks, f64::from(c.cached_blocks), self.kv);
        let keep_ms = w.keep_ms(left_behind(f64::from(c.prefix_best_blocks), p.cached_blocks));
        let requests = f64::from(c.load.active_requests);
        Partial {
            head_ms: cfg.prefill_load_scale * t.prefill_ms
                + decode_ms
                + w.others_delay_weight * t.others_ms
                + w.work_weight * work_ms
                + memory_ms,
            decode_ms: out_time_ms,
            store_ms,
            keep_ms,
            requests_ms: cfg.active_request_weight * requests,
            overlap: p.overlap,
            prefill_blocks: (p.queued + p.own) * self.bs_recip,
            decode_blocks: if self.aggregated { decode_blocks } else { 0.0 },
        }
    }

    /// Stage 4: the decode time term capped at `floor_ms` plus its most, the cost and the
    /// score. The sum runs in the reference's order.
    #[inline(always)]
    fn complete(&self, c: &Candidate, q: &Partial, floor_ms: f64) -> CandidateScore {
        // Only the aggregated phase has the term, and so its cap.
        let decode_ms = if self.aggregated { self.cfg.ttft.capped_decode_time_ms(q.decode_ms, floor_ms) } else { 0.0 };
        let cost = c.cost_factor * (q.head_ms + decode_ms + q.store_ms + q.keep_ms + q.requests_ms);
        score(c, q.overlap, q.prefill_blocks, q.decode_blocks, cost)
    }

    /// The reference's `queued_tokens`: booked prompt tokens less the progress credit.
    fn queued_tokens<const POW2: bool>(&self, c: &Candidate, step_ms: f64) -> f64 {
        if c.prefill_busy_ms == 0 {
            return c.load.active_prefill_tokens as f64; // Skips the pass time below.
        }
        let pass_ms = (self.full_pass_ms + step_ms) * c.prefill_scale;
        super::ttft::still_queued(&self.cfg.ttft, c, pass_ms, self.batch)
    }

    /// The reference's `chunked_prefill_ms`: the time of `tokens` in passes, and how
    /// many passes.
    fn chunked<const POW2: bool>(&self, tokens: f64) -> (f64, f64) {
        // Not above 0 covers NaN too, as the reference's two tests do.
        if tokens > 0.0 {
            let (full, rest) = self.split::<POW2>(tokens);
            let passes = if rest > 0.0 { full + 1.0 } else { full };
            (full * self.full_pass_ms + prefill_pass_ms(&self.cfg.timing, rest), passes)
        } else {
            (0.0, 0.0)
        }
    }

    /// The reference's `split_passes` of a positive `tokens`: full passes and the rest.
    fn split<const POW2: bool>(&self, tokens: f64) -> (f64, f64) {
        if tokens < self.one_pass_below {
            // The reference's floor of a quotient in [0, 1) is +0.0 and its rest
            // `tokens − 0·batch`, which is `tokens` (the batch is finite).
            return (0.0, tokens);
        }
        let tokens = if tokens > 1e15 { 1e15 } else { tokens };
        let quotient = if POW2 { tokens * self.batch_recip } else { tokens / self.batch };
        let full = floor_small(quotient);
        (full, tokens - full * self.batch)
    }
}

/// `mathf::floor(x)` for `0 <= x < 2^52`, without a float-integer round trip: adding
/// 2^52 rounds `x` to the nearest integer (the sum's spacing is 1), and the floor is
/// that or one less.
fn floor_small(x: f64) -> f64 {
    const TWO_52: f64 = (1u64 << 52) as f64;
    let nearest = (x + TWO_52) - TWO_52;
    if nearest > x {
        nearest - 1.0
    } else {
        nearest
    }
}

/// [`TtftModel::prefill_pass_ms`], its NaN and sign tests in one comparison.
fn prefill_pass_ms(m: &TtftModel, tokens: f64) -> f64 {
    if tokens > 0.0 {
        (m.prefill_ms_per_token_squared * tokens + m.prefill_ms_per_token) * tokens + m.prefill_ms_per_pass
    } else {
        0.0
    }
}

/// [`TtftModel::decode_step_ms`] for a usage that is neither NaN nor negative.
fn decode_step_ms(m: &TtftModel, usage: f64) -> f64 {
    let p = if usage > 1.0 { 1.0 } else { usage };
    let t = (m.decode_ms_per_usage_squared * p + m.decode_ms_per_usage) * p + m.decode_ms_per_step;
    t.max(m.decode_ms_min)
}
