//! Conditional disaggregation: whether a request's prefill runs on the prefill pool or
//! the whole request runs aggregated on a decode worker.
//!
//! Remote prefill pays for a KV transfer. For a short uncached prompt that costs more
//! than it saves, and an overloaded prefill pool would only add queueing, so the plan
//! bypasses it. The decision is query-only; the adapter then routes `Phase::Prefill` and
//! `Phase::Decode` (or one `Phase::Aggregated`) through `handle_request` as usual.

use alloc::vec::Vec;
use core::mem;

use super::*;
use crate::eligible::{self, EligibilityQuery, Verdict};
use crate::pin::PinResolution;

/// Disaggregation settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DisaggConfig {
    /// Prompts whose uncached part is shorter than this run aggregated (default 2,048).
    pub isl_min_tokens: u32,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig { isl_min_tokens: 2_048 }
    }
}

/// Why a request skipped remote prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BypassReason {
    /// The uncached prompt is below `isl_min_tokens`.
    ShortPrompt {
        /// Prompt tokens not cached on the best prefill worker.
        effective_isl_tokens: u32,
    },
    /// Every eligible prefill worker is over its busy threshold.
    PrefillBusy,
    /// No worker can prefill this request.
    NoPrefillWorkers,
}

impl BypassReason {
    /// A short code for metrics labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            BypassReason::ShortPrompt { .. } => "short_prompt",
            BypassReason::PrefillBusy => "prefill_busy",
            BypassReason::NoPrefillWorkers => "no_prefill_workers",
        }
    }
}

/// What to do with a request in a disaggregated fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DisaggPlan {
    /// Route `Phase::Prefill`, then `Phase::Decode`.
    Split,
    /// Route one `Phase::Aggregated` request (a decode worker serves it whole).
    Bypass(BypassReason),
}

/// Bypass counters, by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DisaggStats {
    /// Requests planned as split.
    pub split: u64,
    /// Bypassed: short uncached prompt.
    pub bypass_short_prompt: u64,
    /// Bypassed: prefill pool busy.
    pub bypass_prefill_busy: u64,
    /// Bypassed: no prefill worker.
    pub bypass_no_prefill_workers: u64,
}

impl Router {
    /// Plans `req` for a disaggregated fleet and counts the outcome. Changes nothing
    /// else: the index, loads, bindings and queue are only read. Linear in the prompt's
    /// blocks plus the number of workers.
    pub fn plan_disagg(&mut self, req: &Request) -> DisaggPlan {
        let plan = self.plan_disagg_query(req);
        let s = &mut self.disagg_stats;
        match plan {
            DisaggPlan::Split => s.split += 1,
            DisaggPlan::Bypass(BypassReason::ShortPrompt { .. }) => s.bypass_short_prompt += 1,
            DisaggPlan::Bypass(BypassReason::PrefillBusy) => s.bypass_prefill_busy += 1,
            DisaggPlan::Bypass(BypassReason::NoPrefillWorkers) => s.bypass_no_prefill_workers += 1,
        }
        plan
    }

    /// The plan without counting it (for previews).
    pub fn plan_disagg_query(&mut self, req: &Request) -> DisaggPlan {
        let mut scratch = mem::take(&mut self.scratch);
        let plan = self.plan_with(req, &mut scratch);
        self.scratch = scratch;
        plan
    }

    fn plan_with(&self, req: &Request, scratch: &mut super::Scratch) -> DisaggPlan {
        let super::Scratch { verdicts, scores, .. } = scratch;
        let q = EligibilityQuery {
            phase: Phase::Prefill,
            hints: &req.hints,
            pin: &PinResolution::Any,
            failed: &[],
            ignore_overload: false,
            same_label_as: None,
        };
        let load = &self.load;
        let combined = |k| load.combined(k);
        let filtered = eligible::filter(&q, &self.workers, &combined, &self.cfg.eligibility, verdicts);
        if filtered.is_err() {
            DisaggPlan::Bypass(BypassReason::NoPrefillWorkers)
        } else if eligible::all_overloaded(verdicts) {
            DisaggPlan::Bypass(BypassReason::PrefillBusy)
        } else {
            let eligible: Vec<WorkerKey> =
                verdicts.iter().filter(|v| matches!(v.verdict, Verdict::Eligible { .. })).map(|v| v.key).collect();
            if eligible.is_empty() {
                DisaggPlan::Bypass(BypassReason::NoPrefillWorkers)
            } else {
                scores.clear();
                self.index.find_matches(&req.blocks, false, scores);
                let best = eligible
                    .iter()
                    .filter(|k| !self.untrusted.contains(k))
                    .map(|k| scores.get(*k).device)
                    .max()
                    .unwrap_or(0);
                let cached = best.saturating_mul(self.cfg.block_size.tokens()).min(req.isl_tokens);
                let effective = req.isl_tokens - cached;
                if effective < self.cfg.disagg.isl_min_tokens {
                    DisaggPlan::Bypass(BypassReason::ShortPrompt { effective_isl_tokens: effective })
                } else {
                    DisaggPlan::Split
                }
            }
        }
    }

    /// Bypass and split counters.
    pub fn disagg_stats(&self) -> DisaggStats {
        self.disagg_stats
    }
}
