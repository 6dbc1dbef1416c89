//! The time-to-first-token cost: how long a request would wait for its first token on
//! each worker, from an engine timing model.
//!
//! A worker runs forward passes of at most `max_batched_tokens` prompt tokens (prompts
//! are chunked across passes, first come first served). A pass over `T` prompt tokens
//! takes `f_p(T)`; while any request on the worker is decoding, every pass also takes one
//! decode step `f_d(p)`, `p` being the share of the worker's KV blocks in use. A new
//! request's first token comes at the end of the pass that finishes its prompt, after
//! the prompt tokens already queued there. So the prediction is the time to push the
//! queued prompt tokens plus this request's uncached ones through that pass structure.
//!
//! What it leaves to others: the coefficients describe one engine and model; adapters
//! that know their engine set [`TtftModel`] (the defaults are the fitted vLLM model of
//! the reference simulator). The queued tokens come from the load tracker, which only
//! knows what the router routed.

use super::{Candidate, SelectRequest};
use crate::mathf;

/// Timing model of one engine, in milliseconds.
///
/// Prefill pass over `T` tokens: `f_p(T) = prefill_ms_per_token_squared·T² +
/// prefill_ms_per_token·T + prefill_ms_per_pass` (0 for `T = 0`). Decode step at KV
/// usage `p` (0..=1): `f_d(p) = max(decode_ms_min, decode_ms_per_usage_squared·p² +
/// decode_ms_per_usage·p + decode_ms_per_step)`.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct TtftModel {
    /// Quadratic prefill coefficient, ms per token². Default 4.209989e-7.
    pub prefill_ms_per_token_squared: f64,
    /// Linear prefill coefficient, ms per token. Default 1.518344e-2.
    pub prefill_ms_per_token: f64,
    /// Fixed cost of a pass that computes prompt tokens, ms. Default 16.50142.
    pub prefill_ms_per_pass: f64,
    /// Decode step at empty KV, ms. Default 5.74.
    pub decode_ms_per_step: f64,
    /// Linear decode coefficient, ms per unit of KV usage. Default 54.01.
    pub decode_ms_per_usage: f64,
    /// Quadratic decode coefficient, ms per unit of KV usage squared. Default −25.74.
    pub decode_ms_per_usage_squared: f64,
    /// Floor of one decode step, ms. Default 1.0.
    pub decode_ms_min: f64,
    /// Pass token budget of a worker that reports none (0). Default 8192.
    pub max_batched_tokens_default: u32,
    /// KV capacity in blocks of a worker that reports none (0). Default 16384.
    pub kv_blocks_default: u32,
    /// Share of the prefill a busy worker is predicted to have computed since its backlog
    /// began (see [`Candidate::prefill_busy_ms`]) that is taken off its queued tokens.
    /// 0 trusts only finished prefills; 1 trusts the timing model fully.
    pub progress_credit: f64,
    /// Weight of the delay this request's tokens add to the requests already queued on
    /// the worker whose prompts end in the pass it joins (0 ignores it, 1 minimises
    /// total first-token time).
    pub others_delay_weight: f64,
    /// Weight of the compute this request adds to the worker (its own prefill time),
    /// charged on top of its wait: the delay that work passes on to later requests.
    pub work_weight: f64,
    /// Wait charged per KV block the worker would be short of to hold this request next
    /// to the ones it runs (an engine admits nothing it has no room for), ms.
    pub memory_ms_per_block: f64,
}

impl Default for TtftModel {
    fn default() -> Self {
        TtftModel {
            prefill_ms_per_token_squared: 4.209989e-7,
            prefill_ms_per_token: 1.518344e-2,
            prefill_ms_per_pass: 16.50142,
            decode_ms_per_step: 5.74,
            decode_ms_per_usage: 54.01,
            decode_ms_per_usage_squared: -25.74,
            decode_ms_min: 1.0,
            max_batched_tokens_default: 8192,
            kv_blocks_default: 16384,
            progress_credit: 1.0,
            others_delay_weight: 1.0,
            work_weight: 1.0,
            memory_ms_per_block: 10.0,
        }
    }
}

impl TtftModel {
    /// `f_p(tokens)`: one pass computing `tokens` prompt tokens.
    pub fn prefill_pass_ms(&self, tokens: f64) -> f64 {
        if tokens <= 0.0 {
            return 0.0;
        }
        (self.prefill_ms_per_token_squared * tokens + self.prefill_ms_per_token) * tokens + self.prefill_ms_per_pass
    }

    /// `f_d(usage)`: one decode step with `usage` (clamped to 0..=1) of the KV blocks held.
    pub fn decode_step_ms(&self, usage: f64) -> f64 {
        let p = usage.clamp(0.0, 1.0);
        let t = (self.decode_ms_per_usage_squared * p + self.decode_ms_per_usage) * p + self.decode_ms_per_step;
        t.max(self.decode_ms_min)
    }

    /// Time to compute `tokens` prompt tokens in passes of at most `batch` tokens:
    /// `(n − 1)·f_p(batch) + f_p(rest)`, and the number of passes `n`.
    pub fn chunked_prefill_ms(&self, tokens: f64, batch: u32) -> (f64, f64) {
        if tokens.is_nan() || tokens <= 0.0 {
            return (0.0, 0.0);
        }
        let batch = f64::from(batch.max(1));
        // Bounded so the float-to-integer steps in `floor` stay exact.
        let tokens = tokens.min(1e15);
        let full = mathf::floor(tokens / batch);
        let rest = tokens - full * batch;
        let passes = if rest > 0.0 { full + 1.0 } else { full };
        (full * self.prefill_pass_ms(batch) + self.prefill_pass_ms(rest), passes)
    }
}

/// The predicted wait for the first token of `req` on `c`, in ms, with its parts.
pub(super) struct TtftParts {
    /// Prompt tokens ahead of and including this request's uncached ones.
    pub tokens: f64,
    /// Time to compute them.
    pub prefill_ms: f64,
    /// Decode steps those passes carry.
    pub decode_ms: f64,
    /// What joining the last queued pass adds to the wait of the requests ending there.
    pub others_ms: f64,
    /// The compute this request adds: prefill time with it less without it.
    pub work_ms: f64,
    /// The wait for KV room, when the worker would be short of blocks.
    pub memory_ms: f64,
}

/// Predicts the first-token wait of `req` on `c` given `cached_tokens` of its prompt
/// cached there. `decoding` says whether passes on this worker carry a decode step.
///
/// ```text
/// tokens     = active_prefill_tokens + max(1, isl − cached)   (an engine always computes one)
/// prefill_ms = chunked f_p over passes of max_batched_tokens
/// decode_ms  = passes × f_d(active_decode_blocks / kv_blocks)  when decoding, else 0
/// ```
pub(super) fn predict(m: &TtftModel, req: &SelectRequest, c: &Candidate, cached_tokens: f64, decoding: bool) -> TtftParts {
    let isl = f64::from(req.isl_tokens);
    let own = if isl > 0.0 { (isl - cached_tokens).max(1.0) } else { 0.0 };
    let batch = if c.max_batched_tokens == 0 { m.max_batched_tokens_default } else { c.max_batched_tokens };
    let kv = if c.kv_blocks == 0 { m.kv_blocks_default } else { c.kv_blocks };
    let step_ms = if decoding { m.decode_step_ms(c.load.active_decode_blocks as f64 / f64::from(kv.max(1))) } else { 0.0 };
    let queued = queued_tokens(m, c, batch, step_ms);
    let tokens = queued + own;
    let (prefill_ms, passes) = m.chunked_prefill_ms(tokens, batch);
    let decode_ms = passes.max(1.0) * step_ms;
    let others_ms = others_delay(m, c, queued, own, batch);
    let work_ms = prefill_ms - m.chunked_prefill_ms(queued, batch).0;
    let needed = c.load.active_decode_blocks as f64
        + f64::from(c.new_decode_blocks)
        + f64::from(req.expected_output_blocks);
    let memory_ms = m.memory_ms_per_block * (needed - f64::from(kv)).max(0.0);
    TtftParts { tokens, prefill_ms, decode_ms, others_ms, work_ms, memory_ms }
}

/// The requests queued on `c` whose prompts end in the backlog's last, partly filled
/// pass wait for `own` more tokens there: all of them when the backlog fits one pass,
/// else (at least) the last one.
fn others_delay(m: &TtftModel, c: &Candidate, queued: f64, own: f64, batch: u32) -> f64 {
    if !(queued > 0.0) || c.prefill_requests == 0 {
        return 0.0;
    }
    let batch = f64::from(batch.max(1));
    let rest = queued - mathf::floor(queued.min(1e15) / batch) * batch;
    if rest <= 0.0 {
        return 0.0;
    }
    let delay = m.prefill_pass_ms((rest + own).min(batch)) - m.prefill_pass_ms(rest);
    let waiting = if queued <= batch { f64::from(c.prefill_requests) } else { 1.0 };
    waiting * delay
}

/// Prompt tokens still queued on `c`: its booked ones less what it has computed since its
/// backlog began, beyond the prefills known finished. Full passes bound that progress.
fn queued_tokens(m: &TtftModel, c: &Candidate, batch: u32, step_ms: f64) -> f64 {
    let queued = c.load.active_prefill_tokens as f64;
    if c.prefill_busy_ms == 0 || !(m.progress_credit > 0.0) {
        return queued;
    }
    let pass_ms = m.prefill_pass_ms(f64::from(batch)) + step_ms;
    if !(pass_ms > 0.0) {
        return queued;
    }
    let computed = m.progress_credit * c.prefill_busy_ms as f64 * f64::from(batch) / pass_ms;
    let left = c.prefill_done_tokens as f64 + queued - computed;
    left.clamp(0.0, queued)
}
