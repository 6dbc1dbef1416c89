//! The time-to-first-token cost: how long a request would wait for its first token on
//! each worker, predicted from an engine timing model, plus what placing it there costs
//! the requests around it.
//!
//! A worker runs forward passes of at most `max_batched_tokens` prompt tokens, taking
//! prompts first come first served and chunking long ones across passes. A pass over `T`
//! prompt tokens takes `f_p(T)`; while any request there is decoding, every pass also
//! takes one decode step `f_d(p)`, `p` being the share of the worker's KV blocks in use.
//! A request's first token comes at the end of the pass that finishes its prompt, after
//! the prompt tokens already queued there. `ttft_cost` predicts that wait and adds the
//! delay the request passes on to others (see its formula).
//!
//! What it leaves to others: the coefficients describe one engine and model; adapters
//! that know their engine set [`TtftModel`] (the defaults are the fitted vLLM model of
//! the reference simulator). Queued tokens, in-flight prefixes and prefill progress come
//! from the load tracker through the [`Candidate`], so they only cover what the router
//! itself routed.

use super::cost::{blocks_cost, overlap_effective, score};
use super::{Candidate, CandidateScore, SelectRequest};
use crate::mathf;
use crate::types::Phase;

/// Timing model of one engine, in milliseconds.
///
/// Prefill pass over `T` tokens: `f_p(T) = prefill_ms_per_token_squared·T² +
/// prefill_ms_per_token·T + prefill_ms_per_pass` (0 for `T = 0`). Decode step at KV
/// usage `p` (clamped to 0..=1): `f_d(p) = max(decode_ms_min, decode_ms_per_usage_squared·p²
/// + decode_ms_per_usage·p + decode_ms_per_step)`.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct TtftModel {
    /// Quadratic prefill coefficient, ms per token². Default 4.209989e-7.
    pub prefill_ms_per_token_squared: f64,
    /// Linear prefill coefficient, ms per token. Default 1.518344e-2.
    pub prefill_ms_per_token: f64,
    /// Fixed cost of a pass that computes prompt tokens, ms. Default 16.50142.
    pub prefill_ms_per_pass: f64,
    /// Decode step with an empty KV cache, ms. Default 5.74.
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
    /// Extra time to the first token on a worker that has run nothing for a while, ms
    /// per second it has been idle: a CPU engine's caches and its host's core go cold
    /// between requests. Default 0 (a GPU's is too small to count).
    pub cold_ms_per_idle_s: f64,
    /// Most that extra time, ms. Default 0.
    pub cold_ms_max: f64,
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
            cold_ms_per_idle_s: 0.0,
            cold_ms_max: 0.0,
        }
    }
}

impl TtftModel {
    /// vLLM's CPU build, one core per server: the `vllm-cpu` engine timing of the
    /// simulator (kvroute-sim's `EngineTiming::VLLM_CPU`, where the measurements are),
    /// less its per-running-request decode term. Prefill is nearly linear in tokens
    /// (0.15 ms each, 42 ms a pass), unlike a GPU's, whose fixed cost per pass makes
    /// batching prompts together nearly free; a router that predicts with the GPU's
    /// coefficients piles prompts onto a CPU worker that computes them one by one.
    /// A server idle for a while answers slower: 20 ms more per second idle, at most
    /// 250 (measured there too).
    pub fn vllm_cpu() -> Self {
        TtftModel {
            prefill_ms_per_token_squared: 8.494e-05,
            prefill_ms_per_token: 0.1537,
            prefill_ms_per_pass: 42.1,
            decode_ms_per_step: 31.3,
            decode_ms_per_usage: 0.0,
            decode_ms_per_usage_squared: 0.0,
            decode_ms_min: 1.0,
            cold_ms_per_idle_s: 20.0,
            cold_ms_max: 250.0,
            ..TtftModel::default()
        }
    }

    /// The extra time to the first token on a worker idle for `idle_ms`:
    /// `min(cold_ms_max, cold_ms_per_idle_s × idle_ms / 1000)`, 0 unless both are above 0.
    pub fn cold_ms(&self, idle_ms: u64) -> f64 {
        if !(self.cold_ms_per_idle_s > 0.0 && self.cold_ms_max > 0.0) {
            return 0.0;
        }
        (self.cold_ms_per_idle_s * idle_ms as f64 / 1000.0).min(self.cold_ms_max)
    }

    /// `f_p(tokens)`: one pass computing `tokens` prompt tokens.
    pub fn prefill_pass_ms(&self, tokens: f64) -> f64 {
        if tokens.is_nan() || tokens <= 0.0 {
            return 0.0;
        }
        (self.prefill_ms_per_token_squared * tokens + self.prefill_ms_per_token) * tokens + self.prefill_ms_per_pass
    }

    /// `f_d(usage)`: one decode step with `usage` of the KV blocks held.
    pub fn decode_step_ms(&self, usage: f64) -> f64 {
        let p = if usage.is_nan() { 1.0 } else { usage.clamp(0.0, 1.0) };
        let t = (self.decode_ms_per_usage_squared * p + self.decode_ms_per_usage) * p + self.decode_ms_per_step;
        t.max(self.decode_ms_min)
    }

    /// Time to compute `tokens` prompt tokens in passes of at most `batch` tokens,
    /// `(n − 1)·f_p(batch) + f_p(rest)`, and the number of passes `n`.
    pub fn chunked_prefill_ms(&self, tokens: f64, batch: u32) -> (f64, f64) {
        if tokens.is_nan() || tokens <= 0.0 {
            return (0.0, 0.0);
        }
        let batch = f64::from(batch.max(1));
        let (full, rest) = split_passes(tokens, batch);
        let passes = if rest > 0.0 { full + 1.0 } else { full };
        (full * self.prefill_pass_ms(batch) + self.prefill_pass_ms(rest), passes)
    }
}

/// Weights of the terms `ttft_cost` adds to the predicted wait. The defaults minimise
/// the total wait of the fleet, not just this request's.
#[derive(Clone, Copy, PartialEq, Debug)]
#[non_exhaustive]
pub struct TtftWeights {
    /// Share of the prefill a busy worker is predicted to have computed since its backlog
    /// began (see [`Candidate::prefill_busy_ms`]) that is taken off its queued tokens:
    /// 0 trusts only finished prefills, 1 the timing model. Default 1.0.
    pub progress_credit: f64,
    /// Share of the pass under way that stays credited once the worker is late: the
    /// model says it computed more than `overdue_grace_passes` passes past the first one
    /// beyond what was seen finish. The credit rises with the model's progress up to one
    /// pass, then falls back towards this share over the next pass as the first tokens
    /// stay away, since an engine that slow is not where the model thinks it is. 1
    /// keeps the pass credited (the model trusted).
    /// Default 0.5 (a pass that has run twice its predicted time is, as likely as not,
    /// half done): on the real vLLM fleet, whose engines ran 50–145 times slower than
    /// the CPU timing, it took the conversation workload's TTFT mean from 14.0 s (1)
    /// to 9.4 s (with no grace), against sglang-router's 11.7. In replay a multimodal
    /// trace on engines 4–5 times slower than the CPU timing got a 5–7% higher TTFT.
    pub overdue_pass_share: f64,
    /// Passes past the first that the model may run ahead of the first tokens before the
    /// credit starts to fall (see `overdue_pass_share`): a timing a few times off is
    /// still trusted. Default 3: in replay of the sim fleet's conversation on 32
    /// workers, run 4–8 times slower than the GPU timing (10 seeds), 0 kept 0.7% fewer
    /// hits than trusting the timing and 3 none, while on engines 20–50 times slower than
    /// the CPU timing 3 kept the TTFT within 6% of 0's.
    pub overdue_grace_passes: f64,
    /// Weight of the delay this request's tokens add to the requests queued before it
    /// whose prompts end in the pass it joins. Default 1.0.
    pub others_delay_weight: f64,
    /// Weight of the compute this request adds to the worker (its share of the prefill
    /// time): the wait that work passes on to later requests, which is what keeps a busy
    /// fleet on its cached prefixes. Default 1.0.
    pub work_weight: f64,
    /// Wait charged per KV block the worker would hold beyond `memory_kv_share` of its
    /// capacity with this request next to the ones it runs (an engine admits nothing it
    /// has no room for), ms. Default 5: in replay of the fleet benchmark's conversation
    /// workload on 8 workers, saturated (10 seeds), 10 moved turns off holders that
    /// still had room and cost 2.3% of the hits (0.1948 against 0.1993), 1% of the TTFT
    /// mean and 2% of the end-to-end mean; no other workload, load or fleet size
    /// charges it.
    pub memory_ms_per_block: f64,
    /// Share of a worker's KV blocks above which the memory term charges. Default 0.9:
    /// below the share at which eligibility passes a worker over (`kvroute serve`'s
    /// `decode_blocks_frac_of_kv`, 0.95), so the cost turns work away before the worker
    /// is excluded and the next turns of the conversations it holds must move. At 1.0 a
    /// saturated conversation replay lost 4% of its hits that way (0.185 against 0.193).
    pub memory_kv_share: f64,
    /// Weight of the decode time placing the request there costs (see `ttft_cost`'s
    /// `decode`): its own output's steps at the worker's KV usage with it, what its
    /// blocks add to the steps of every request there, and the pass time its prompt adds,
    /// which every request there waits out. This is what spreads decode work and keeps
    /// end-to-end latency even. Default 0.1.
    pub decode_time_weight: f64,
    /// Most the decode time term charges beyond the least any candidate has for the
    /// request ([`SelectRequest::decode_time_floor_ms`]), ms: it may move a request off
    /// its cache, but not by more than this, so a cheap-looking worker cannot pull in
    /// every request and a long context is not moved for decode time alone. Default 600.
    pub decode_time_ms_max: f64,
    /// Output tokens expected of a request that names none, for the decode time term.
    /// Default 128.
    pub output_tokens_default: u32,
    /// Charge per cached block that storing the request's uncached blocks would evict
    /// there, ms: a later request may have needed it. It fills empty caches before
    /// evicting from full ones, and keeps one copy of a prefix where it is unless load
    /// pays for another. Default 1.0.
    pub store_ms_per_block: f64,
    /// Charge per leading prompt block that the best holder has and this worker lacks,
    /// ms: moving a conversation off its cache costs its later turns their hits and
    /// stores a second copy, which its TTFT alone does not count. A holder keeps the
    /// request unless its wait exceeds another's by more. Default 20.
    pub keep_ms_per_block: f64,
    /// Most the keep term charges one placement, ms: a long context left behind is
    /// worth no more than this, so a busy holder of long agent contexts still sheds
    /// work. Default 200.
    pub keep_ms_max: f64,
    /// Share of a request's blocks below which its best holders' prefix may be read as
    /// shared text (a system prompt, a document's header): when more than
    /// `keep_holders_max` workers hold it, or (with `keep_needs_prompt_end`) no earlier
    /// prompt ended inside it. The keep term is then dropped, since that prefix is not
    /// this conversation's context, and charging every other worker for lacking it
    /// piles new conversations onto the holders. A conversation's own context has one
    /// holder and its last prompt ended there, so it keeps the term, however long its
    /// new turn. 0 keeps the term always. Default 0.5: in replay of the fleet
    /// benchmark's multimodal workload (four shared system prompts) on 32 workers it
    /// took end-to-end time from 1,484 to 1,167 ms at the busy load, and moved
    /// conversation, shared-document and agentic by under 1.5%.
    pub keep_share_min: f64,
    /// Most workers that may hold a short best prefix (see `keep_share_min`) with the
    /// keep term still charged. Default 1.
    pub keep_holders_max: u32,
    /// Read a short best prefix on `keep_holders_max` or fewer workers as shared text
    /// too unless an earlier prompt ended inside it (the router remembers where, see
    /// [`RouterConfig::prompt_ends_max`](crate::RouterConfig::prompt_ends_max)): a
    /// system prompt's first holder is its only holder until another worker copies it,
    /// and the keep term gathered every new conversation that opens with it there.
    /// Default true: in replay of the multimodal workload on 32 workers it took
    /// end-to-end time from 1,167 to 1,118 ms and TTFT p99 from 61.4 to 57.0 ms at the
    /// busy load (1,247 to 1,218 and 76.6 to 64.6 saturated); conversation, agentic and
    /// shared-document came out the same.
    pub keep_needs_prompt_end: bool,
    /// `decode_time_weight` for a placement that starts a session (see
    /// [`TtftWeights::session_start`]): the session's later requests decode where this
    /// one goes, so its decode time counts in full, not as one request's share. Default
    /// 1.0: in replay of the fleet benchmark's agentic workload on 32 workers, 0.3 left
    /// the busiest worker at 2.2× the mean and end-to-end time 11% above 1.0's (742 ms
    /// against 665); on 8 workers 1.0 costs under 2%.
    pub session_decode_time_weight: f64,
    /// How recently a session's last request must have ended for a placement that starts
    /// a session to count it as a request on its worker, ms: a session between calls (an
    /// agent program waiting on a tool) will send its next one there, and a start that
    /// sees only the requests in flight piles new sessions onto workers whose sessions
    /// happen to be between calls. 0 counts none. Default 10,000.
    pub session_return_ms: u64,
    /// Count those sessions by the share of the fleet's session time spent in
    /// requests, `running / (running + between calls)` (the candidates' running
    /// requests, every worker's sessions between calls), rounded down,
    /// rather than each as a request: at low load a session between calls is rarely
    /// back while another runs, and counting it in full spread new sessions away from
    /// their shared prompt's holder for decode contention that never came. Default
    /// true: in replay of the agentic workload at the real vLLM fleet's scale (3
    /// workers, 100 requests, 7 workload seeds) it took kv's hits from 0.935 to 0.990
    /// of the text-tree rule's under the GPU timing and 0.962 to 0.996 under the CPU
    /// build's; the sim fleet's agentic cells (10 seeds) moved by at most 1.2% (e2e at
    /// 8 workers, busy).
    pub session_return_scaled: bool,
    /// Charge per request a worker runs beyond `excess_over_mean` times the candidates'
    /// mean, ms. [`Selector::select`](super::Selector::select) adds it after scoring
    /// (see the `excess` module; [`kv_cost`](super::kv_cost), which sees one candidate,
    /// leaves it out). Default 20: in replay of the fleet benchmark's document Q&A on
    /// 32 workers, saturated (20 workload seeds, 2 router seeds), it took the end-to-end
    /// mean down 4.3% and its p99 19%, for 0.07% of the hits, where one worker held a
    /// hot document and ran five times the fleet's mean; with `excess_requests_min` no
    /// other workload, load or fleet size routes otherwise.
    pub excess_ms_per_request: f64,
    /// Multiple of the candidates' mean of running requests past which
    /// `excess_ms_per_request` charges. Default 3.0.
    pub excess_over_mean: f64,
    /// Running requests below which `excess_ms_per_request` never charges, however low
    /// the mean. Default 36: a second copy of a document costs its hits once, which pays
    /// only when the pile is large. In replay (40 runs), document Q&A on 32 workers,
    /// busy, keeps one copy of each document from 36 up (34–38 gave the same figures)
    /// and the saturated load still spreads; a floor of 4 spread the busy load too, for
    /// 0.1% of its hits, and 3× the mean alone fired while the fleet filled.
    pub excess_requests_min: u32,
    /// Candidates' mean of running requests past which `excess_requests_min` falls, with
    /// the square of this over the mean: the busier the whole fleet, the faster a hot
    /// prefix's requests arrive, so the more requests share what its second copy costs
    /// and the sooner a pile pays for one. 0 keeps the floor fixed. Default 4.5: in
    /// replay of document Q&A on 32 workers (20 workload seeds, 2 router seeds) the busy
    /// load, whose mean stays under it, routes as with a fixed floor, and the saturated
    /// load's end-to-end mean fell 1.35% (988.5 against 1,002), its hits and TTFT mean
    /// equal; of every other workload, load and fleet size only conversation on 32
    /// workers, busy, moved (hits 0.2645 against 0.2642, the rest equal).
    pub excess_floor_mean_requests: f64,
}

impl Default for TtftWeights {
    fn default() -> Self {
        TtftWeights {
            progress_credit: 1.0,
            overdue_pass_share: OVERDUE_PASS_SHARE,
            overdue_grace_passes: OVERDUE_GRACE_PASSES,
            others_delay_weight: 1.0,
            work_weight: 1.0,
            memory_ms_per_block: MEMORY_MS,
            memory_kv_share: MEMORY_KV_SHARE,
            decode_time_weight: DECODE_TIME_WEIGHT,
            decode_time_ms_max: DECODE_TIME_MS_MAX,
            output_tokens_default: 128,
            store_ms_per_block: STORE_MS,
            keep_ms_per_block: KEEP_MS,
            keep_ms_max: KEEP_MS_MAX,
            keep_share_min: KEEP_SHARE_MIN,
            keep_holders_max: KEEP_HOLDERS_MAX,
            keep_needs_prompt_end: true,
            session_decode_time_weight: SESSION_DECODE_TIME_WEIGHT,
            session_return_ms: SESSION_RETURN_MS,
            session_return_scaled: true,
            excess_ms_per_request: EXCESS_MS,
            excess_over_mean: 3.0,
            excess_requests_min: EXCESS_REQUESTS_MIN,
            excess_floor_mean_requests: EXCESS_FLOOR_MEAN_REQUESTS,
        }
    }
}

const OVERDUE_PASS_SHARE: f64 = 0.5;
const OVERDUE_GRACE_PASSES: f64 = 3.0;
const MEMORY_MS: f64 = 5.0;
const MEMORY_KV_SHARE: f64 = 0.9;
const DECODE_TIME_WEIGHT: f64 = 0.1;
const DECODE_TIME_MS_MAX: f64 = 600.0;
const STORE_MS: f64 = 1.0;
const KEEP_MS: f64 = 20.0;
const KEEP_MS_MAX: f64 = 200.0;
const KEEP_SHARE_MIN: f64 = 0.5;
const KEEP_HOLDERS_MAX: u32 = 1;
const SESSION_DECODE_TIME_WEIGHT: f64 = 1.0;
const SESSION_RETURN_MS: u64 = 10_000;
const EXCESS_MS: f64 = 20.0;
const EXCESS_REQUESTS_MIN: u32 = 36;
const EXCESS_FLOOR_MEAN_REQUESTS: f64 = 4.5;

impl TtftWeights {
    /// The weights for a placement that binds a new session, whose later requests
    /// follow the binding: no keep term, since what the best holder has is shared
    /// (a system prompt, a tool list), not this session's context, and the session's
    /// context is stored wherever it goes; and `session_decode_time_weight` for the
    /// decode time term. Charging the keep term there piled every new agent program
    /// onto the few workers holding its type's prompt (the busiest at 1.96× the mean in
    /// the fleet benchmark, and three of eight workers idle).
    pub fn session_start(self) -> Self {
        TtftWeights { keep_ms_max: 0.0, decode_time_weight: self.session_decode_time_weight, ..self }
    }

    /// The weights for a request of `blocks` blocks whose best prefix, `best_blocks`
    /// long, is held by `holders` workers: without the keep term when that prefix is
    /// short and shared text (see `keep_share_min`). `continued` says whether an earlier
    /// prompt ended within the prefix; it is asked only when the answer matters.
    pub fn for_holding(
        self,
        best_blocks: u32,
        holders: usize,
        blocks: usize,
        continued: impl FnOnce() -> bool,
    ) -> Self {
        let short = f64::from(best_blocks) < self.keep_share_min * blocks as f64;
        let shared = || holders > self.keep_holders_max as usize || (self.keep_needs_prompt_end && !continued());
        if short && shared() {
            TtftWeights { keep_ms_max: 0.0, ..self }
        } else {
            self
        }
    }

    /// The decode time term (see [`ttft_cost`]'s `decode`) from its parts: the uncapped
    /// term, then its cap. Shared by `ttft_cost` and the batch evaluator, which must
    /// agree bit for bit.
    #[inline(always)]
    pub(super) fn decode_time_ms(&self, out_tokens: f64, d: DecodeParts, floor_ms: f64) -> f64 {
        self.capped_decode_time_ms(self.decode_time_uncapped_ms(out_tokens, d), floor_ms)
    }

    #[inline(always)]
    pub(super) fn decode_time_uncapped_ms(&self, out_tokens: f64, d: DecodeParts) -> f64 {
        let slowed = d.requests * d.span_ms * d.added_share;
        let steps = out_tokens * (d.step_ms + slowed) * d.decode_weight;
        self.decode_time_weight * (steps + d.requests * d.work_ms)
    }

    /// `ms`, at most `floor_ms + decode_time_ms_max` (NaN stays NaN).
    #[inline(always)]
    pub(super) fn capped_decode_time_ms(&self, ms: f64, floor_ms: f64) -> f64 {
        let max = floor_ms + self.decode_time_ms_max;
        if ms > max {
            max
        } else {
            ms
        }
    }

    /// Whether selection works out a floor for the decode time term's cap: in the
    /// aggregated phase, with the term on and a finite cap.
    #[inline(always)]
    pub(super) fn decode_time_floored(&self, phase: Phase) -> bool {
        phase == Phase::Aggregated && self.decode_time_weight != 0.0 && self.decode_time_ms_max.is_finite()
    }

    /// The keep term: `keep_ms_per_block × left_blocks`, at most `keep_ms_max` (a NaN
    /// product stays NaN, so `score` sees it). Shared as `decode_time_ms` is.
    #[inline(always)]
    pub(super) fn keep_ms(&self, left_blocks: f64) -> f64 {
        let ms = self.keep_ms_per_block * left_blocks;
        if ms > self.keep_ms_max {
            self.keep_ms_max
        } else {
            ms
        }
    }
}

/// The TTFT cost of sending `req` to `c`, in milliseconds, with its parts.
///
/// ```text
/// cached   = min(isl, overlap_credit × max(overlap_effective, inflight_prefix_blocks) × block_size)
/// own      = max(1, isl − cached)          (an engine computes at least the last token)
/// queued   = active_prefill_tokens less what the worker computed since its backlog began
///            beyond the prefills known done: the model's M = progress_credit ×
///            prefill_busy_ms × batch / ((f_p(batch) + step) × prefill_scale), up to one
///            pass q = min(batch, active_prefill_tokens) past prefill_done_tokens; once
///            M passes that by overdue_grace_passes more passes (g) the worker is late, and
///            of that pass only q × max(overdue_pass_share, 2 + g − (M −
///            prefill_done_tokens) / q) counts; clamped to 0..=active_prefill_tokens
/// P(T)     = time of T tokens in passes of batch = max_batched_tokens (n passes)
/// step     = f_d(active_decode_blocks / kv_blocks) if a request there is past its prefill
/// wait     = P(queued + own) + n × step
/// others   = k × (f_p(min(batch, r + own)) − f_p(r)),  r = queued mod batch: the requests
///            whose prompts end in the backlog's last pass (k = prefill_requests when the
///            backlog fits one pass, else 1) wait for this one's tokens there
/// work     = P(queued + own) − P(queued)
/// memory   = memory_ms_per_block × max(0, active_decode_blocks + new_decode_blocks
///                                        + expected_output_blocks − memory_kv_share × kv_blocks)
/// out      = expected_output_blocks × block_size, or output_tokens_default if 0
/// added    = new_decode_blocks + out / block_size: the blocks it would hold there
/// m        = active_requests: every request there, queued ones too (they decode soon)
/// decode   = min(decode_time_weight × (decode_weight × out × (f_d(u₁) + m × (f_d(1) − f_d(0))
///                 × added / kv_blocks) + m × work),
///                decode_time_floor_ms + decode_time_ms_max)
///            u₁ = (active_decode_blocks + added) / kv_blocks: its own steps; what its blocks
///            add to the m others' steps, at the fit's mean slope (the local slope of the
///            concave fit flattens near a full cache, where adding blocks then looked
///            free); and the prefill passes it adds, which the m others wait out
/// store    = store_ms_per_block × min(own / block_size, max(0, cached_blocks + own /
///            block_size − kv_blocks)): the cached blocks its new ones would evict
/// keep     = min(keep_ms_max, keep_ms_per_block × max(0, prefix_best_blocks −
///            max(overlap_effective, inflight_prefix_blocks))): the prefix the best
///            holder has and this one lacks
/// cost     = cost_factor × (prefill_load_scale × P(queued + own) + decode_weight × n × step
///                           + others_delay_weight × others + work_weight × work + memory
///                           + decode + store + keep
///                           + active_request_weight × active_requests)
/// ```
///
/// The router weighs a request that starts a session with [`TtftWeights::session_start`].
/// `batch` and `kv_blocks` come from the candidate, or the model's defaults when it
/// reports 0. [`Phase::Prefill`] has no decode step and no memory or decode term (a
/// prefill worker holds blocks only while computing). [`Phase::Decode`] computes no prompt, so it has no
/// first-token wait to predict: it is scored by [`blocks_cost`]. The score reports
/// `prefill_blocks` as `(queued + own) / block_size` and `decode_blocks` as the blocks
/// formula does.
pub(crate) fn ttft_cost(req: &SelectRequest, c: &Candidate) -> CandidateScore {
    if req.phase == Phase::Decode {
        return blocks_cost(req, c);
    }
    let (cfg, p) = (&req.cost, ttft_parts(req, c));
    let w = &cfg.ttft;
    let requests = f64::from(c.load.active_requests);
    let cost = c.cost_factor
        * (cfg.prefill_load_scale * p.prefill_ms
            + p.steps_ms
            + w.others_delay_weight * p.others_ms
            + w.work_weight * p.work_ms
            + p.memory_ms
            + p.decode_time_ms
            + p.store_ms
            + p.keep_ms
            + cfg.active_request_weight * requests);
    let bs = f64::from(req.block_size.tokens());
    score(c, p.overlap, (p.queued + p.own) / bs, p.decode_blocks, cost)
}

/// [`ttft_cost`]'s terms before they are weighed and summed (not for [`Phase::Decode`]).
struct Parts {
    overlap: f64,
    queued: f64,
    own: f64,
    prefill_ms: f64,
    steps_ms: f64,
    others_ms: f64,
    work_ms: f64,
    memory_ms: f64,
    decode_time_ms: f64,
    store_ms: f64,
    keep_ms: f64,
    /// Reported decode blocks: 0 for a prefill worker.
    decode_blocks: f64,
}

fn ttft_parts(req: &SelectRequest, c: &Candidate) -> Parts {
    let cfg = &req.cost;
    let (m, w) = (&cfg.timing, &cfg.ttft);
    let bs = f64::from(req.block_size.tokens());
    let overlap = overlap_effective(&req.cost, c);
    let cached_blocks = overlap.max(f64::from(c.inflight_prefix_blocks));
    let cached = (cfg.overlap_credit * cached_blocks * bs).min(f64::from(req.isl_tokens));
    let isl = f64::from(req.isl_tokens);
    let own = if isl > 0.0 { (isl - cached).max(1.0) } else { 0.0 };
    let aggregated = req.phase == Phase::Aggregated;
    let batch = if c.max_batched_tokens == 0 { m.max_batched_tokens_default } else { c.max_batched_tokens };
    let kv = kv_blocks(m, c);
    let active = c.load.active_decode_blocks as f64;
    let decoding = aggregated && c.load.active_requests > c.prefill_requests;
    let step_ms = if decoding { m.decode_step_ms(active / kv) } else { 0.0 };

    let queued = queued_tokens(m, w, c, batch, step_ms);
    let (prefill_ms, passes) = m.chunked_prefill_ms(queued + own, batch);
    let steps_ms = passes.max(1.0) * step_ms * c.decode_weight;
    let others_ms = others_delay(m, c, queued, own, batch);
    let work_ms = prefill_ms - m.chunked_prefill_ms(queued, batch).0;
    let decode_blocks = active + f64::from(c.new_decode_blocks) + f64::from(req.expected_output_blocks);
    let memory_ms =
        if aggregated { w.memory_ms_per_block * (decode_blocks - w.memory_kv_share * kv).max(0.0) } else { 0.0 };
    let decode_time_ms = if aggregated {
        w.decode_time_ms(output_tokens(req, w), decode_parts(m, req, c, kv, work_ms), req.decode_time_floor_ms)
    } else {
        0.0
    };
    Parts {
        overlap,
        queued,
        own,
        prefill_ms,
        steps_ms,
        others_ms,
        work_ms,
        memory_ms,
        decode_time_ms,
        store_ms: w.store_ms_per_block * evicted_blocks(own / bs, f64::from(c.cached_blocks), kv),
        keep_ms: w.keep_ms(left_behind(f64::from(c.prefix_best_blocks), cached_blocks)),
        decode_blocks: if aggregated { decode_blocks } else { 0.0 },
    }
}

/// The least decode time term any of `cands` has for `req` before its cap, ms (see
/// [`SelectRequest::decode_time_floor_ms`]); 0 when the term is off or has no finite cap,
/// or no candidate has a number. The batch evaluator works out the same floor on its
/// own; this is the reference it is checked against. Linear in the candidates.
#[cfg(test)]
pub(crate) fn decode_time_floor_ms(req: &SelectRequest, cands: &[Candidate]) -> f64 {
    if !req.cost.ttft.decode_time_floored(req.phase) {
        return 0.0;
    }
    let mut floor = f64::INFINITY;
    for c in cands {
        let ms = decode_time_uncapped_ms(req, c);
        if ms < floor {
            floor = ms;
        }
    }
    finite_floor(floor)
}

/// The least of the candidates' uncapped decode time terms as the cap's floor: `+ 0.0`
/// makes a −0.0 minimum +0.0 (whatever the candidates' order), and none finite is 0.
#[inline(always)]
pub(super) fn finite_floor(least_ms: f64) -> f64 {
    if least_ms.is_finite() {
        least_ms + 0.0
    } else {
        0.0
    }
}

/// `c`'s decode time term for `req` before its cap (aggregated phase only).
pub(super) fn decode_time_uncapped_ms(req: &SelectRequest, c: &Candidate) -> f64 {
    let (m, w) = (&req.cost.timing, &req.cost.ttft);
    let work_ms = ttft_parts(req, c).work_ms;
    w.decode_time_uncapped_ms(output_tokens(req, w), decode_parts(m, req, c, kv_blocks(m, c), work_ms))
}

/// What the decode time term weighs on one candidate (see [`ttft_cost`]'s `decode`).
#[derive(Clone, Copy)]
pub(super) struct DecodeParts {
    /// `m`: requests on the worker, decoding or queued.
    pub(super) requests: f64,
    /// `f_d(u₁)`, ms.
    pub(super) step_ms: f64,
    /// `f_d(1) − f_d(0)`, ms.
    pub(super) span_ms: f64,
    /// `added / kv_blocks`.
    pub(super) added_share: f64,
    /// The candidate's decode weight.
    pub(super) decode_weight: f64,
    /// `work`, ms.
    pub(super) work_ms: f64,
}

/// [`DecodeParts`] of `c` for `req`, its KV capacity `kv` resolved.
fn decode_parts(m: &TtftModel, req: &SelectRequest, c: &Candidate, kv: f64, work_ms: f64) -> DecodeParts {
    let bs = f64::from(req.block_size.tokens());
    let added = f64::from(c.new_decode_blocks) + output_tokens(req, &req.cost.ttft) / bs;
    let active = c.load.active_decode_blocks as f64;
    DecodeParts {
        requests: f64::from(c.load.active_requests),
        step_ms: m.decode_step_ms((active + added) / kv),
        span_ms: m.decode_step_ms(1.0) - m.decode_step_ms(0.0),
        added_share: added / kv,
        decode_weight: c.decode_weight,
        work_ms,
    }
}

/// `c`'s KV capacity in blocks: its own, or the model's default when it reports 0.
fn kv_blocks(m: &TtftModel, c: &Candidate) -> f64 {
    f64::from(if c.kv_blocks == 0 { m.kv_blocks_default } else { c.kv_blocks }.max(1))
}

/// Cached blocks that storing `new` more would evict from a cache of `kv` blocks
/// holding `cached`: the overflow, at most `new`.
#[inline(always)]
pub(super) fn evicted_blocks(new: f64, cached: f64, kv: f64) -> f64 {
    let over = cached + new - kv;
    if over <= 0.0 {
        0.0
    } else if over < new {
        over
    } else {
        new
    }
}

/// Leading blocks the best holder has beyond `cached` (0 when this one is the best).
#[inline(always)]
pub(super) fn left_behind(best: f64, cached: f64) -> f64 {
    let left = best - cached;
    if left > 0.0 {
        left
    } else {
        0.0
    }
}

/// The output `req` is expected to produce, in tokens: its own expectation, else the
/// weights' default.
pub(super) fn output_tokens(req: &SelectRequest, w: &TtftWeights) -> f64 {
    match req.expected_output_blocks {
        0 => f64::from(w.output_tokens_default),
        b => f64::from(b) * f64::from(req.block_size.tokens()),
    }
}

/// Prompt tokens still queued on `c`: its booked ones less what it has computed since its
/// backlog began, beyond the prefills known finished. Full passes bound that progress.
fn queued_tokens(m: &TtftModel, w: &TtftWeights, c: &Candidate, batch: u32, step_ms: f64) -> f64 {
    let batch = f64::from(batch.max(1));
    // A worker the learner found slower than the model gets through its backlog slower.
    let pass_ms = (m.prefill_pass_ms(batch) + step_ms) * c.prefill_scale;
    still_queued(w, c, pass_ms, batch)
}

/// `c`'s booked prompt tokens not [`credited`] as computed, when a pass of `batch`
/// tokens takes `pass_ms` there. The hoisted path calls it too, so the two agree.
pub(super) fn still_queued(w: &TtftWeights, c: &Candidate, pass_ms: f64, batch: f64) -> f64 {
    let queued = c.load.active_prefill_tokens as f64;
    if c.prefill_busy_ms == 0
        || w.progress_credit.is_nan()
        || w.progress_credit <= 0.0
        || pass_ms.is_nan()
        || pass_ms <= 0.0
    {
        return queued;
    }
    let done = c.prefill_done_tokens as f64;
    let model = w.progress_credit * c.prefill_busy_ms as f64 * batch / pass_ms;
    (done + queued - credited(model, done, queued, batch, w)).clamp(0.0, queued)
}

/// Prompt tokens taken as computed, of a backlog of `queued` tokens past the `done` ones
/// seen finish, when the model says `model`: the model's figure up to one pass past
/// `done` (a worker slower than the model has not computed what the model credits it
/// with), then, once the model is `overdue_grace_passes` further ahead, less as the
/// worker falls late, down to `overdue_pass_share` of that pass a pass later.
pub(super) fn credited(model: f64, done: f64, queued: f64, batch: f64, w: &TtftWeights) -> f64 {
    let pass = batch.min(queued);
    if pass.is_nan() || pass <= 0.0 || model <= done + pass {
        return model.min(done + batch);
    }
    let grace = if w.overdue_grace_passes > 0.0 { w.overdue_grace_passes } else { 0.0 };
    let late = (model - done) / pass - 1.0 - grace;
    if late <= 0.0 {
        return done + pass;
    }
    let floor = if w.overdue_pass_share.is_nan() { 1.0 } else { w.overdue_pass_share.clamp(0.0, 1.0) };
    done + pass * (1.0 - late).max(floor)
}

/// What `own` more tokens add to the wait of the requests queued on `c` whose prompts end
/// in the backlog's last, partly filled pass: all of them when the backlog fits one pass,
/// else (at least) the last one.
fn others_delay(m: &TtftModel, c: &Candidate, queued: f64, own: f64, batch: u32) -> f64 {
    if queued.is_nan() || queued <= 0.0 || c.prefill_requests == 0 {
        return 0.0;
    }
    let batch = f64::from(batch.max(1));
    let (_, rest) = split_passes(queued, batch);
    if rest <= 0.0 {
        return 0.0; // The backlog ends with a full pass: this request starts a new one.
    }
    let delay = m.prefill_pass_ms((rest + own).min(batch)) - m.prefill_pass_ms(rest);
    let waiting = if queued <= batch { f64::from(c.prefill_requests) } else { 1.0 };
    waiting * delay
}

/// `tokens` as full passes of `batch` and the rest.
fn split_passes(tokens: f64, batch: f64) -> (f64, f64) {
    // Bounded so `floor`'s float-to-integer step stays exact.
    let tokens = tokens.min(1e15);
    let full = mathf::floor(tokens / batch);
    (full, tokens - full * batch)
}
