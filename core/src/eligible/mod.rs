//! Eligibility: for one phase of one request, a verdict on every `(worker, rank)` in the
//! table — eligible with a cost factor, or excluded with a reason.
//!
//! Every exclusion carries an [`ExclusionReason`], so a façade can explain a decision and
//! count exclusions by reason. The filter applies constraints only; scoring, queueing and
//! the final choice are left to the selector and the façade. [`all_overloaded`] tells the
//! façade to queue rather than fail, and [`check_pinned`] turns an excluded
//! pinned worker into an error.
//!
//! A key gets the first reason that applies, in this order:
//!
//! 1. [`WrongRole`](ExclusionReason::WrongRole): the worker's role does not serve the phase.
//! 2. [`NotPinned`](ExclusionReason::NotPinned): the pin resolution does not admit the key.
//! 3. [`NotAllowed`](ExclusionReason::NotAllowed): not in the request's allow-list.
//! 4. [`TopologyMismatch`](ExclusionReason::TopologyMismatch): `same_label_as` differs.
//! 5. [`Ejected`](ExclusionReason::Ejected), [`Draining`](ExclusionReason::Draining): health.
//! 6. [`Tainted`](ExclusionReason::Tainted): a `NoSchedule` taint the request does not tolerate.
//! 7. [`FailedBefore`](ExclusionReason::FailedBefore): the worker already failed this
//!    request, unless the request's explicit pin names it.
//! 8. [`Overloaded`](ExclusionReason::Overloaded): load above a threshold, unless
//!    `ignore_overload` (affinity validation ignores transient overload).
//!
//! Overload comes last so that an `Overloaded` key is one that only its load keeps out.
//! An eligible key's cost factor is 1, times `prefer_no_schedule_factor` for each
//! `PreferNoSchedule` taint the request does not tolerate.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

pub use crate::exclusion::ExclusionReason;
use crate::pin::{explicit_pin, PinError, PinResolution, RoutingHints};
use crate::types::{DpRank, Phase, WorkerId, WorkerKey, WorkerLoad};
use crate::worker::{Health, TaintEffect, Toleration, WorkerSpec, WorkerTable};

/// Thresholds of the eligibility filter.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct EligibilityConfig {
    /// A key with more active prefill tokens than this is overloaded (default `None`: no
    /// absolute bound).
    pub prefill_tokens_max: Option<u64>,
    /// A key with more active prefill tokens than this many times the worker's
    /// `max_batched_tokens` is overloaded (default `Some(4.0)`: four full batches queued).
    pub prefill_tokens_frac_of_batch: Option<f64>,
    /// A key holding more active decode blocks than this fraction of the worker's
    /// `kv_blocks` is overloaded (default `Some(0.95)`).
    pub decode_blocks_frac_of_kv: Option<f64>,
    /// Cost multiplier per untolerated `PreferNoSchedule` taint (default 2.0). Values below
    /// 1, and NaN, count as 1, so a taint never makes a worker cheaper.
    pub prefer_no_schedule_factor: f64,
    /// Most tolerations one request may carry (default 32).
    pub tolerations_max: usize,
}

impl Default for EligibilityConfig {
    fn default() -> Self {
        EligibilityConfig {
            prefill_tokens_max: None,
            prefill_tokens_frac_of_batch: Some(4.0),
            decode_blocks_frac_of_kv: Some(0.95),
            prefer_no_schedule_factor: 2.0,
            tolerations_max: 32,
        }
    }
}

/// The verdict on one key.
#[derive(Clone, PartialEq, Debug)]
pub(crate) enum Verdict {
    /// The key may take the request; the selector multiplies its cost by `cost_factor` (≥ 1).
    Eligible {
        /// Cost multiplier from soft constraints.
        cost_factor: f64,
    },
    /// The key may not take the request.
    Excluded(ExclusionReason),
}

/// One key and its verdict.
#[derive(Clone, PartialEq, Debug)]
pub(crate) struct Eligibility {
    /// The key judged.
    pub key: WorkerKey,
    /// The verdict.
    pub verdict: Verdict,
}

/// What the filter judges: one phase of one request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EligibilityQuery<'a> {
    /// The phase being routed.
    pub phase: Phase,
    /// The request's hints (allow-list, tolerations, explicit pin).
    pub hints: &'a RoutingHints,
    /// The resolved pin for this phase.
    pub pin: &'a PinResolution,
    /// Workers that already failed this request.
    pub failed: &'a [WorkerId],
    /// Skip the overload check (affinity validation ignores transient overload).
    pub ignore_overload: bool,
    /// Keep only workers whose label `.0` has value `.1` (disaggregated decode picks).
    pub same_label_as: Option<(&'a str, &'a str)>,
}

/// Why the filter produced no usable answer. `out` still holds every verdict.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum EligibilityError {
    /// Every key not excluded otherwise has already failed this request.
    MigrationExhausted {
        /// How many workers failed it.
        failed: usize,
    },
    /// No worker in the table serves the phase.
    NoWorkers {
        /// The phase being routed.
        phase: Phase,
    },
    /// The request carries more tolerations than `tolerations_max`; nothing was judged.
    TooManyTolerations {
        /// Tolerations carried.
        tolerations: usize,
        /// The bound.
        tolerations_max: usize,
    },
}

impl fmt::Display for EligibilityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            EligibilityError::MigrationExhausted { failed } => {
                write!(f, "every worker able to serve the request has already failed it ({failed} failed)")
            }
            EligibilityError::NoWorkers { phase } => write!(f, "no worker serves {phase} requests"),
            EligibilityError::TooManyTolerations { tolerations, tolerations_max } => {
                write!(f, "request carries {tolerations} tolerations, above the limit {tolerations_max}")
            }
        }
    }
}

impl core::error::Error for EligibilityError {}

/// Judges every key of `workers` for the query, clearing `out` and filling it in key order.
///
/// `load` is asked only for keys that reach the overload check. Work: per key, one pass
/// over the worker's taints times the request's tolerations (both bounded by their
/// configs), its labels, and `failed`; plus sorting the allow-list once.
pub(crate) fn filter(
    q: &EligibilityQuery<'_>,
    workers: &WorkerTable,
    load: &dyn Fn(WorkerKey) -> WorkerLoad,
    cfg: &EligibilityConfig,
    out: &mut Vec<Eligibility>,
) -> Result<(), EligibilityError> {
    out.clear();
    let tolerations = q.hints.tolerations.len();
    if tolerations > cfg.tolerations_max {
        return Err(EligibilityError::TooManyTolerations { tolerations, tolerations_max: cfg.tolerations_max });
    }
    let allowed = q.hints.allowed_worker_ids.as_ref().map(|ids| {
        let mut ids = ids.clone();
        ids.sort_unstable();
        ids
    });
    let explicit = explicit_pin(q.phase, q.hints).map(|p| p.worker);
    let ctx = Ctx { q, cfg, allowed: allowed.as_deref(), explicit };
    for (spec, health) in workers.iter() {
        ctx.judge_worker(spec, health, load, out);
    }
    summarize(q, out)
}

/// True when no key is eligible and at least one is only overloaded: the façade should
/// queue the request rather than fail it.
pub(crate) fn all_overloaded(out: &[Eligibility]) -> bool {
    let mut overloaded = false;
    for e in out {
        match e.verdict {
            Verdict::Eligible { .. } => return false,
            Verdict::Excluded(ExclusionReason::Overloaded { .. }) => overloaded = true,
            Verdict::Excluded(_) => {}
        }
    }
    overloaded
}

/// Turns an ineligible pinned worker into an error naming the reason.
///
/// `verdicts` is [`filter`]'s output for the same request. A worker pin
/// passes if any of its ranks is eligible; otherwise the error names its lowest rank's
/// reason. A façade that queues overloaded requests should test
/// [`all_overloaded`] first, since an overloaded pin is an error here.
pub(crate) fn check_pinned(pin: &PinResolution, verdicts: &[Eligibility]) -> Result<(), PinError> {
    let Some(worker) = pin.worker() else {
        return Ok(());
    };
    let mut first_excluded = None;
    for e in verdicts.iter().filter(|e| pin.admits(e.key)) {
        match &e.verdict {
            Verdict::Eligible { .. } => return Ok(()),
            Verdict::Excluded(reason) => {
                first_excluded.get_or_insert((e.key, reason));
            }
        }
    }
    match first_excluded {
        Some((key, reason)) => Err(PinError::Ineligible { worker: key, reason: reason.clone() }),
        None => Err(PinError::UnknownWorker { worker }),
    }
}

struct Ctx<'q, 'a> {
    q: &'q EligibilityQuery<'a>,
    cfg: &'q EligibilityConfig,
    allowed: Option<&'q [WorkerId]>,
    explicit: Option<WorkerId>,
}

impl Ctx<'_, '_> {
    fn judge_worker(
        &self,
        spec: &WorkerSpec,
        health: Health,
        load: &dyn Fn(WorkerKey) -> WorkerLoad,
        out: &mut Vec<Eligibility>,
    ) {
        let serves = spec.role.serves(self.q.phase);
        let pinned = self.q.pin.worker().is_none_or(|w| w == spec.id);
        // Worker-wide checks run once, and only when some rank could be a candidate.
        let shared = if serves && pinned { self.worker_checks(spec, health) } else { Ok(1.0) };
        for rank in ranks_to_judge(spec, self.q.pin) {
            let key = WorkerKey { worker: spec.id, rank };
            let verdict = if !serves {
                Verdict::Excluded(ExclusionReason::WrongRole)
            } else if !self.q.pin.admits(key) {
                Verdict::Excluded(ExclusionReason::NotPinned)
            } else {
                match &shared {
                    Err(reason) => Verdict::Excluded(reason.clone()),
                    Ok(cost_factor) => self.load_check(spec, key, load, *cost_factor),
                }
            };
            out.push(Eligibility { key, verdict });
        }
    }

    /// Checks 3–7 of the module order; the cost factor when they all pass.
    fn worker_checks(&self, spec: &WorkerSpec, health: Health) -> Result<f64, ExclusionReason> {
        if self.allowed.is_some_and(|ids| ids.binary_search(&spec.id).is_err()) {
            return Err(ExclusionReason::NotAllowed);
        }
        if let Some((label, value)) = self.q.same_label_as {
            if spec.label(label) != Some(value) {
                return Err(ExclusionReason::TopologyMismatch { label: String::from(label) });
            }
        }
        match health {
            Health::Healthy => {}
            Health::Ejected => return Err(ExclusionReason::Ejected),
            Health::Draining => return Err(ExclusionReason::Draining),
        }
        let cost_factor = self.taint_cost(spec)?;
        if self.q.failed.contains(&spec.id) && self.explicit != Some(spec.id) {
            return Err(ExclusionReason::FailedBefore);
        }
        Ok(cost_factor)
    }

    fn taint_cost(&self, spec: &WorkerSpec) -> Result<f64, ExclusionReason> {
        let tolerations: &[Toleration] = &self.q.hints.tolerations;
        let mut cost_factor = 1.0;
        for taint in &spec.taints {
            if tolerations.iter().any(|t| t.tolerates(taint)) {
                continue;
            }
            match taint.effect {
                TaintEffect::NoSchedule => return Err(ExclusionReason::Tainted { key: taint.key.clone() }),
                TaintEffect::PreferNoSchedule => cost_factor *= self.cfg.prefer_no_schedule_factor.max(1.0),
            }
        }
        Ok(cost_factor)
    }

    fn load_check(
        &self,
        spec: &WorkerSpec,
        key: WorkerKey,
        load: &dyn Fn(WorkerKey) -> WorkerLoad,
        cost_factor: f64,
    ) -> Verdict {
        if self.q.ignore_overload {
            return Verdict::Eligible { cost_factor };
        }
        let l = load(key);
        if overloaded(spec, l, self.cfg) {
            return Verdict::Excluded(ExclusionReason::Overloaded {
                prefill_tokens: l.active_prefill_tokens,
                decode_blocks: l.active_decode_blocks,
            });
        }
        Verdict::Eligible { cost_factor }
    }
}

/// Above any configured threshold, strictly. A NaN fraction never triggers.
fn overloaded(spec: &WorkerSpec, l: WorkerLoad, cfg: &EligibilityConfig) -> bool {
    let prefill = l.active_prefill_tokens;
    let blocks = l.active_decode_blocks as f64;
    cfg.prefill_tokens_max.is_some_and(|max| prefill > max)
        || cfg.prefill_tokens_frac_of_batch.is_some_and(|f| prefill as f64 > f * f64::from(spec.max_batched_tokens))
        || cfg.decode_blocks_frac_of_kv.is_some_and(|f| blocks > f * f64::from(spec.kv_blocks))
}

/// The ranks listed for a worker: all routable ones, except that a worker with unknown
/// ranks pinned to an exact rank is listed at that rank (it has no other known rank).
fn ranks_to_judge(spec: &WorkerSpec, pin: &PinResolution) -> impl Iterator<Item = DpRank> {
    let (start, end) = match (spec.dp_ranks, pin) {
        (None, PinResolution::Exact(k)) if k.worker == spec.id => (k.rank.0, k.rank.0.saturating_add(1)),
        _ => (0, spec.routable_ranks()),
    };
    (start..end).map(DpRank)
}

fn summarize(q: &EligibilityQuery<'_>, out: &[Eligibility]) -> Result<(), EligibilityError> {
    let (mut serving, mut usable, mut failed_before) = (false, false, false);
    for e in out {
        match &e.verdict {
            Verdict::Excluded(ExclusionReason::WrongRole) => {}
            Verdict::Eligible { .. } | Verdict::Excluded(ExclusionReason::Overloaded { .. }) => {
                serving = true;
                usable = true;
            }
            Verdict::Excluded(ExclusionReason::FailedBefore) => {
                serving = true;
                failed_before = true;
            }
            Verdict::Excluded(_) => serving = true,
        }
    }
    if !serving {
        return Err(EligibilityError::NoWorkers { phase: q.phase });
    }
    if failed_before && !usable {
        return Err(EligibilityError::MigrationExhausted { failed: q.failed.len() });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
