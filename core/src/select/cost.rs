//! The kv routing cost: what sending a request to a worker would cost, in blocks.
//!
//! The cost adds the prefill the worker would have to compute (its queued prompt tokens
//! plus this prompt, minus the prefix it already caches) to the KV blocks it would hold
//! while decoding and, optionally, a charge per running request. Lower is better.

use super::{Candidate, CandidateScore, SelectRequest};
use crate::types::Phase;

/// Weights of the kv cost. Every field can be overridden per request with
/// [`KvCostOverrides`].
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct KvCostConfig {
    /// Multiplies the prefill term. Default 1.0.
    pub prefill_load_scale: f64,
    /// Blocks of prefill credited per block of effective prefix overlap. 0 ignores the
    /// cache (pure load balancing). Default 1.0.
    pub overlap_credit: f64,
    /// Cost per running request on the worker. Default 0.0 (decode uses at least 1.0).
    pub active_request_weight: f64,
    /// Sampling temperature; 0 picks the cheapest worker. Default 0.0.
    pub temperature: f64,
    /// Overlap credit of a block held only in host memory, relative to a device block.
    /// Default 0.75.
    pub host_tier_weight: f64,
    /// Overlap credit of a block held only on disk, relative to a device block.
    /// Default 0.25.
    pub disk_tier_weight: f64,
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

/// The kv cost of sending `req` to `c`, with its parts.
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
/// least 1. `overlap_effective` is reported in every phase. A NaN cost (from NaN weights)
/// is reported as infinite, so such a candidate is never preferred.
pub fn kv_cost(req: &SelectRequest, c: &Candidate) -> CandidateScore {
    CostTerms::new(req).score(c)
}

/// The parts of the kv cost that depend only on the request, worked out once per
/// decision so the per-candidate loop is a handful of multiply-adds.
#[derive(Clone, Copy, Debug)]
pub(super) struct CostTerms {
    /// `1 / block_size`, exact since block sizes are powers of two.
    blocks_per_token: f64,
    isl_tokens: f64,
    host_tier_weight: f64,
    disk_tier_weight: f64,
    /// `None` when the phase has no prefill term, else the overlap credit.
    prefill_credit: Option<f64>,
    prefill_load_scale: f64,
    decode: DecodeTerm,
    request_weight: f64,
}

#[derive(Clone, Copy, Debug)]
enum DecodeTerm {
    /// Prefill workers hold no decode blocks.
    None,
    /// Active blocks plus the candidate's new blocks plus this many (expected output).
    NewBlocksPlus(f64),
    /// Active blocks plus this many (every prompt block plus expected output).
    Plus(f64),
}

impl CostTerms {
    pub(super) fn new(req: &SelectRequest) -> Self {
        let cfg = &req.cost;
        let expected = f64::from(req.expected_output_blocks);
        let (prefill_credit, decode, request_weight) = match req.phase {
            Phase::Aggregated => {
                (Some(cfg.overlap_credit), DecodeTerm::NewBlocksPlus(expected), cfg.active_request_weight)
            }
            Phase::Prefill => (Some(cfg.overlap_credit), DecodeTerm::None, cfg.active_request_weight),
            Phase::Decode => {
                let prompt_blocks = f64::from(req.isl_tokens / req.block_size.tokens());
                (None, DecodeTerm::Plus(prompt_blocks + expected), cfg.active_request_weight.max(1.0))
            }
        };
        CostTerms {
            blocks_per_token: 1.0 / f64::from(req.block_size.tokens()),
            isl_tokens: f64::from(req.isl_tokens),
            host_tier_weight: cfg.host_tier_weight,
            disk_tier_weight: cfg.disk_tier_weight,
            prefill_credit,
            prefill_load_scale: cfg.prefill_load_scale,
            decode,
            request_weight,
        }
    }

    #[inline]
    pub(super) fn score(&self, c: &Candidate) -> CandidateScore {
        let overlap_effective = f64::from(c.overlap.device)
            + self.host_tier_weight * f64::from(c.overlap.host)
            + self.disk_tier_weight * f64::from(c.overlap.disk);
        let prefill_blocks = match self.prefill_credit {
            None => 0.0,
            Some(credit) => {
                let queued = (c.load.active_prefill_tokens as f64 + self.isl_tokens) * self.blocks_per_token;
                (queued - credit * overlap_effective).max(0.0)
            }
        };
        let active = c.load.active_decode_blocks as f64;
        let decode_blocks = match self.decode {
            DecodeTerm::None => 0.0,
            DecodeTerm::NewBlocksPlus(extra) => active + f64::from(c.new_decode_blocks) + extra,
            DecodeTerm::Plus(extra) => active + extra,
        };
        let requests = f64::from(c.load.active_requests);
        let cost =
            c.cost_factor * (self.prefill_load_scale * prefill_blocks + decode_blocks + self.request_weight * requests);
        CandidateScore {
            key: c.key,
            // Not `Overlap::raw`, whose plain sum could overflow on hostile input.
            overlap_raw: c.overlap.device.saturating_add(c.overlap.host).saturating_add(c.overlap.disk),
            overlap_effective,
            prefill_blocks,
            decode_blocks,
            cost: if cost.is_nan() { f64::INFINITY } else { cost },
        }
    }
}
