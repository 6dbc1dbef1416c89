//! The kv routing cost: what sending a request to a worker would cost. Lower is better.
//!
//! Two models, chosen by [`KvCostConfig::model`]:
//! - [`KvCostModel::Ttft`] (the default) predicts the request's time to first token on
//!   the worker from an engine timing model, plus the delay it passes on to others (see
//!   [`ttft_cost`]).
//! - [`KvCostModel::Blocks`] adds the prefill the worker would have to compute (its
//!   queued prompt tokens plus this prompt, minus the prefix it already caches) to the KV
//!   blocks it would hold while decoding and, optionally, a charge per running request.

use super::ttft::{ttft_cost, TtftModel, TtftWeights};
use super::{Candidate, CandidateScore, SelectRequest};
use crate::types::Phase;

/// Which formula [`kv_cost`] uses.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum KvCostModel {
    /// Prefill blocks plus decode blocks (see `blocks_cost`).
    Blocks,
    /// Predicted time to first token and the delay passed on to others, in milliseconds
    /// (see `ttft_cost`).
    #[default]
    Ttft,
}

/// Weights of the kv cost. The first four fields can be overridden per request with
/// [`KvCostOverrides`]. Costs are in blocks under [`KvCostModel::Blocks`] and in
/// milliseconds under [`KvCostModel::Ttft`]; the weights apply to the matching terms.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct KvCostConfig {
    /// Multiplies the prefill term (the predicted wait, under the TTFT model). Default 1.0.
    pub prefill_load_scale: f64,
    /// Blocks of prefill credited per block of effective prefix overlap. 0 ignores the
    /// cache (pure load balancing). Default 1.0.
    pub overlap_credit: f64,
    /// Cost per running request on the worker, in the model's unit. Default 0.0 (decode
    /// uses at least 1.0).
    pub active_request_weight: f64,
    /// Sampling temperature; 0 picks the cheapest worker. Default 0.0.
    pub temperature: f64,
    /// Overlap credit of a block held only in host memory, relative to a device block.
    /// Default 0.75.
    pub host_tier_weight: f64,
    /// Overlap credit of a block held only on disk, relative to a device block.
    /// Default 0.25.
    pub disk_tier_weight: f64,
    /// The formula. Default [`KvCostModel::Ttft`].
    pub model: KvCostModel,
    /// The engine timing [`KvCostModel::Ttft`] predicts with.
    pub timing: TtftModel,
    /// The weights of [`KvCostModel::Ttft`]'s terms.
    pub ttft: TtftWeights,
}

impl Default for KvCostConfig {
    fn default() -> Self {
        KvCostConfig {
            prefill_load_scale: 1.0,
            overlap_credit: 1.0,
            active_request_weight: 0.0,
            temperature: 0.0,
            host_tier_weight: 0.75,
            disk_tier_weight: 0.25,
            model: KvCostModel::default(),
            timing: TtftModel::default(),
            ttft: TtftWeights::default(),
        }
    }
}

/// Per-request replacements for some [`KvCostConfig`] fields; `None` keeps the config's.
#[derive(Clone, Copy, PartialEq, Debug, Default)]
pub struct KvCostOverrides {
    /// Replaces [`KvCostConfig::prefill_load_scale`].
    pub prefill_load_scale: Option<f64>,
    /// Replaces [`KvCostConfig::overlap_credit`].
    pub overlap_credit: Option<f64>,
    /// Replaces [`KvCostConfig::active_request_weight`].
    pub active_request_weight: Option<f64>,
    /// Replaces [`KvCostConfig::temperature`].
    pub temperature: Option<f64>,
}

impl KvCostConfig {
    /// This config with `o`'s fields applied.
    pub fn with(&self, o: &KvCostOverrides) -> KvCostConfig {
        KvCostConfig {
            prefill_load_scale: o.prefill_load_scale.unwrap_or(self.prefill_load_scale),
            overlap_credit: o.overlap_credit.unwrap_or(self.overlap_credit),
            active_request_weight: o.active_request_weight.unwrap_or(self.active_request_weight),
            temperature: o.temperature.unwrap_or(self.temperature),
            ..*self
        }
    }
}

/// The kv cost of sending `req` to `c`, with its parts: `ttft_cost` or `blocks_cost`
/// as `req.cost.model` says. A NaN cost (from NaN weights) is reported as infinite, so
/// such a candidate is never preferred.
pub fn kv_cost(req: &SelectRequest, c: &Candidate) -> CandidateScore {
    match req.cost.model {
        KvCostModel::Ttft => ttft_cost(req, c),
        KvCostModel::Blocks => blocks_cost(req, c),
    }
}

/// The blocks cost of sending `req` to `c`, with its parts.
///
/// ```text
/// overlap_effective = device + host_tier_weight × host + disk_tier_weight × disk
/// prefill_blocks    = max(0, (active_prefill_tokens + isl) / block_size − overlap_credit × overlap_effective)
/// decode_blocks     = active_decode_blocks + new_decode_blocks + expected_output_blocks
/// cost              = cost_factor × (prefill_load_scale × prefill_blocks + decode_blocks
///                                    + active_request_weight × active_requests)
/// ```
///
/// By phase: [`Phase::Prefill`] has no decode term (prefill workers hold no decode
/// blocks). [`Phase::Decode`] has no prefill term and no prefix credit, since the cache
/// arrives by transfer: its decode term assumes no reuse (`active_decode_blocks` plus
/// every full block of the prompt plus the expected output), and its request weight is at
/// least 1. `overlap_effective` is reported in every phase.
#[inline(always)] // Into the selector's loop, which it writes each score straight into.
pub(crate) fn blocks_cost(req: &SelectRequest, c: &Candidate) -> CandidateScore {
    let cfg = &req.cost;
    let bs = f64::from(req.block_size.tokens());
    let overlap_effective = overlap_effective(&req.cost, c);
    let prefill = || {
        let queued = (c.load.active_prefill_tokens as f64 + f64::from(req.isl_tokens)) / bs;
        (queued - cfg.overlap_credit * overlap_effective).max(0.0)
    };
    let active = c.load.active_decode_blocks as f64;
    let expected = f64::from(req.expected_output_blocks);
    let (prefill_blocks, decode_blocks, request_weight) = match req.phase {
        Phase::Aggregated => (prefill(), active + f64::from(c.new_decode_blocks) + expected, cfg.active_request_weight),
        Phase::Prefill => (prefill(), 0.0, cfg.active_request_weight),
        Phase::Decode => {
            let prompt_blocks = f64::from(req.isl_tokens / req.block_size.tokens());
            (0.0, active + prompt_blocks + expected, cfg.active_request_weight.max(1.0))
        }
    };
    let requests = f64::from(c.load.active_requests);
    let cost = c.cost_factor * (cfg.prefill_load_scale * prefill_blocks + decode_blocks + request_weight * requests);
    score(c, overlap_effective, prefill_blocks, decode_blocks, cost)
}

/// The candidate's overlap with lower tiers discounted, in blocks.
pub(super) fn overlap_effective(cfg: &KvCostConfig, c: &Candidate) -> f64 {
    f64::from(c.overlap.device)
        + cfg.host_tier_weight * f64::from(c.overlap.host)
        + cfg.disk_tier_weight * f64::from(c.overlap.disk)
}

/// A score from its parts; a NaN cost becomes infinite.
pub(super) fn score(
    c: &Candidate,
    overlap_effective: f64,
    prefill_blocks: f64,
    decode_blocks: f64,
    cost: f64,
) -> CandidateScore {
    CandidateScore {
        key: c.key,
        // Not `Overlap::raw`, whose plain sum could overflow on hostile input.
        overlap_raw: c.overlap.device.saturating_add(c.overlap.host).saturating_add(c.overlap.disk),
        overlap_effective,
        prefill_blocks,
        decode_blocks,
        // NaN to infinity in one comparison (a minimum), bit for bit as `is_nan` would.
        cost: if cost < f64::INFINITY { cost } else { f64::INFINITY },
    }
}
