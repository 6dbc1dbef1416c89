//! A deterministic model of one vLLM-v1-style GPU worker, as NVIDIA Dynamo's mocker
//! (generation 3) models it: a KV block pool with prefix caching and LRU eviction, a
//! chunked-prefill scheduler with LIFO preemption, and a polynomial timing model.
//!
//! The engine does no I/O and reads no clock: the caller passes `now_ms` (virtual
//! milliseconds). Calling order, for a discrete-event loop:
//!
//! 1. [`Engine::submit`] a request when it arrives (it waits for the next pass start).
//! 2. Sleep until [`Engine::next_wakeup`], then [`Engine::advance`] to that time; it
//!    finishes every pass due by then, starts the next one, and appends
//!    [`EngineOutput`]s (KV events stamped at pass start, tokens at pass end).
//!
//! A spurious `advance` is harmless; time going backwards is treated as "no time passed".
//! What it leaves to others: routing, event delivery lag, and statistics.

mod check;
pub(crate) mod pool;
mod seq;
mod timing;

use std::collections::VecDeque;
use std::fmt;

use router_core::{BlockHash, BlockSize, SeqHash};
use serde::{Deserialize, Serialize};

pub use check::{EventLedger, InvariantViolation};
pub use timing::{decode_ms, prefill_ms, EngineTiming, TimingError};

use crate::prompt::Prompt;
use pool::Pool;
use seq::{Events, Req};

/// What part of serving an engine does.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub enum EngineRole {
    /// Prefill and decode on the same worker.
    #[default]
    Aggregated,
    /// Prefill only: a request finishes with its first token, then its KV is shipped.
    Prefill,
    /// Decode only: the prompt's KV arrives computed; prefill costs no time here.
    Decode,
}

/// KV transfer cost between a prefill and a decode worker.
#[derive(Clone, Copy, PartialEq, Debug, Serialize, Deserialize)]
pub struct KvTransfer {
    /// KV bytes per token (layers × 2 × kv heads × head dim × dtype bytes).
    pub kv_bytes_per_token: u64,
    /// Link bandwidth, bytes per second.
    pub bandwidth_bytes_per_s: f64,
}

impl Default for KvTransfer {
    fn default() -> Self {
        KvTransfer { kv_bytes_per_token: 160 * 1024, bandwidth_bytes_per_s: 64e9 }
    }
}

/// One engine's parameters (the mocker's defaults).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// KV capacity in blocks; 16,384.
    pub blocks_per_worker: u32,
    /// Tokens per KV block (a power of two up to 1024); 64.
    pub block_size: u32,
    /// Token budget of one forward pass; 8,192.
    pub max_batched_tokens: u32,
    /// Most requests running at once; 256.
    pub max_num_seqs: u32,
    /// Every modelled duration is divided by this; 1.0.
    pub speedup: f64,
    /// Aggregated, prefill-only or decode-only; aggregated.
    pub role: EngineRole,
    /// Prefill→decode KV handoff cost; 160 KiB per token over 64 GB/s.
    pub kv_transfer: KvTransfer,
    /// Seed of the block table's hasher.
    pub table_seed: u64,
    /// How long passes take; the mocker's GPU polynomial.
    #[serde(default)]
    pub timing: EngineTiming,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            blocks_per_worker: 16_384,
            block_size: 64,
            max_batched_tokens: 8_192,
            max_num_seqs: 256,
            speedup: 1.0,
            role: EngineRole::Aggregated,
            kv_transfer: KvTransfer::default(),
            table_seed: 0x6b76_726f_7574_6521,
            timing: EngineTiming::MOCKER,
        }
    }
}

/// Why an engine configuration was refused.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum ConfigError {
    /// The block size is not a power of two in `1..=1024`.
    BlockSize(u32),
    /// A capacity or budget is zero.
    Zero(&'static str),
    /// The speedup is not a positive finite number.
    Speedup(f64),
    /// A timing coefficient is out of range.
    Timing(TimingError),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::BlockSize(b) => {
                write!(f, "block size {b} is not a power of two in 1..=1024")
            }
            ConfigError::Zero(name) => write!(f, "{name} must be positive"),
            ConfigError::Speedup(s) => write!(f, "speedup {s} must be positive and finite"),
            ConfigError::Timing(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Timing(e) => Some(e),
            _ => None,
        }
    }
}

/// A request handed to an engine.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    /// Caller's id, echoed in outputs.
    pub id: u64,
    /// The hashed prompt, at the engine's block size.
    pub prompt: Prompt,
    /// Tokens to generate in total (0 is treated as 1).
    pub output_len: u32,
    /// Tokens already generated elsewhere (1 when a decode worker takes over from a
    /// prefill worker); they count towards `output_len`.
    pub generated_before: u32,
}

/// Why an engine refused a request at submission.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum RejectReason {
    /// The prompt was hashed at another block size.
    BlockSizeMismatch {
        /// The prompt's block size, in tokens.
        prompt: u32,
        /// The engine's block size, in tokens.
        engine: u32,
    },
    /// Prompt plus output need more blocks than the whole pool.
    TooLong {
        /// Blocks the request would need.
        blocks: u64,
        /// The pool's capacity, in blocks.
        capacity: u32,
    },
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::BlockSizeMismatch { prompt, engine } => {
                write!(f, "prompt hashed at block size {prompt}, engine uses {engine}")
            }
            RejectReason::TooLong { blocks, capacity } => {
                write!(f, "request needs {blocks} blocks, the pool holds {capacity}")
            }
        }
    }
}

impl std::error::Error for RejectReason {}

/// A KV cache event, as a router's index consumes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks newly resident, a chain continuing after `parent`.
    Stored {
        /// Sequence hash of the block before the first one, if any.
        parent: Option<SeqHash>,
        /// The blocks, in chain order.
        blocks: Vec<BlockHash>,
    },
    /// Full blocks evicted.
    Removed {
        /// Their sequence hashes.
        blocks: Vec<SeqHash>,
    },
}

/// Something an engine did, in the order it happened.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineOutput {
    /// A KV event, stamped at the start of the pass that caused it.
    Kv {
        /// When the blocks changed.
        at_ms: f64,
        /// Counts up from 0 per engine.
        event_id: u64,
        /// The event.
        event: KvEvent,
    },
    /// A request joined the running batch, with its prefix hit.
    Admitted {
        /// Request id.
        id: u64,
        /// Pass start.
        at_ms: f64,
        /// Tokens served from cache at this admission.
        cached_tokens: u32,
        /// It was admitted before and preempted since (it recomputes).
        readmission: bool,
    },
    /// The prompt is computed and the first token sampled (not emitted by decode
    /// engines, whose first token came from the prefill worker).
    FirstToken {
        /// Request id.
        id: u64,
        /// Pass end.
        at_ms: f64,
    },
    /// A running request lost its blocks and went back to the queue to recompute.
    Preempted {
        /// Request id.
        id: u64,
        /// Pass start.
        at_ms: f64,
    },
    /// The request produced its last token here and released its blocks.
    Finished {
        /// Request id.
        id: u64,
        /// Time of the last token.
        at_ms: f64,
        /// Time of the first token this engine produced.
        first_token_ms: f64,
        /// Tokens this engine produced.
        tokens: u32,
        /// Times the request was preempted here.
        preemptions: u32,
        /// KV handoff time to a decode worker (prefill engines; 0 otherwise).
        kv_transfer_ms: f64,
    },
}

/// Counters over an engine's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Forward passes run.
    pub passes: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Blocks announced as stored.
    pub stored_blocks: u64,
    /// Blocks evicted.
    pub evicted_blocks: u64,
    /// Virtual time spent in passes, ms.
    pub busy_ms: f64,
    /// Pass starts that could schedule nothing (should stay 0).
    pub stalls: u64,
}

/// One simulated worker. See the module docs for the calling order. A clone runs on
/// independently (what-if studies such as [`crate::lookahead`]).
#[derive(Clone)]
pub struct Engine {
    cfg: EngineConfig,
    worker_index: u32,
    bs: u32,
    pool: Pool,
    waiting: VecDeque<Req>,
    running: Vec<Req>,
    clock_ms: f64,
    pass_end_ms: Option<f64>,
    /// When the last pass ended: a pass that starts later than that pays the timing's
    /// cold term. `None` before the first (a fresh engine is cold).
    last_pass_end_ms: Option<f64>,
    wake_ms: Option<f64>,
    next_out_token: u32,
    next_event_id: u64,
    scratch: Vec<u32>,
    stats: EngineStats,
}

mod sched;

impl Engine {
    /// A fresh, empty engine. `worker_index` only salts the block table's hasher.
    pub fn new(cfg: EngineConfig, worker_index: u32) -> Result<Self, ConfigError> {
        BlockSize::new(cfg.block_size).map_err(|_| ConfigError::BlockSize(cfg.block_size))?;
        for (v, name) in [
            (cfg.blocks_per_worker, "blocks_per_worker"),
            (cfg.max_batched_tokens, "max_batched_tokens"),
            (cfg.max_num_seqs, "max_num_seqs"),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if !(cfg.speedup.is_finite() && cfg.speedup > 0.0) {
            return Err(ConfigError::Speedup(cfg.speedup));
        }
        cfg.timing.check().map_err(ConfigError::Timing)?;
        let seed = cfg.table_seed ^ u64::from(worker_index).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Ok(Engine {
            bs: cfg.block_size,
            pool: Pool::new(cfg.blocks_per_worker, seed),
            cfg,
            worker_index,
            waiting: VecDeque::new(),
            running: Vec::new(),
            clock_ms: 0.0,
            pass_end_ms: None,
            last_pass_end_ms: None,
            wake_ms: None,
            next_out_token: 0,
            next_event_id: 0,
            scratch: Vec::new(),
            stats: EngineStats::default(),
        })
    }

    /// Queues a request that arrived at `now_ms`; it is admitted at the next pass start.
    pub fn submit(&mut self, now_ms: f64, req: EngineRequest) -> Result<(), RejectReason> {
        let engine_bs = self.bs;
        if req.prompt.block_size().tokens() != engine_bs {
            return Err(RejectReason::BlockSizeMismatch {
                prompt: req.prompt.block_size().tokens(),
                engine: engine_bs,
            });
        }
        let prompt_len = req.prompt.len_tokens();
        let target = match self.cfg.role {
            EngineRole::Prefill => 1,
            _ => req.output_len.max(1),
        };
        // The last sampled token is never computed, so this is the most KV ever held.
        let max_tokens = u64::from(prompt_len) + u64::from(target) - 1;
        let blocks = max_tokens.div_ceil(u64::from(engine_bs));
        if blocks > u64::from(self.cfg.blocks_per_worker) {
            return Err(RejectReason::TooLong { blocks, capacity: self.cfg.blocks_per_worker });
        }
        let now = self.sane_now(now_ms);
        let out_base = self.next_out_token;
        self.next_out_token = self.next_out_token.wrapping_add(target);
        self.waiting.push_back(Req {
            id: req.id,
            prompt: req.prompt,
            prompt_len,
            target_tokens: target,
            generated: req.generated_before.min(target - 1),
            kv_arrived: self.cfg.role == EngineRole::Decode && req.generated_before > 0,
            computed: 0,
            held: Vec::new(),
            has_private: false,
            gen_hashes: Vec::new(),
            out_base,
            admitted: false,
            first_token_ms: f64::NAN,
            emitted: 0,
            preemptions: 0,
            scheduled: false,
        });
        if self.pass_end_ms.is_none() {
            self.wake_ms = Some(self.wake_ms.map_or(now, |w| w.min(now)));
        }
        Ok(())
    }

    /// When the engine next needs [`Engine::advance`]: the end of the pass in flight,
    /// or the start of the next one; `None` when idle with nothing queued.
    #[must_use]
    pub fn next_wakeup(&self) -> Option<f64> {
        self.pass_end_ms.or(self.wake_ms)
    }

    /// Runs every pass boundary due at or before `now_ms`, appending outputs.
    ///
    /// Work per call is bounded by the passes due; each pass is linear in the running
    /// requests plus the blocks it allocates.
    pub fn advance(&mut self, now_ms: f64, out: &mut Vec<EngineOutput>) {
        loop {
            if let Some(end) = self.pass_end_ms {
                if end > now_ms {
                    return;
                }
                self.pass_end_ms = None;
                self.finish_pass(end, out);
                if !self.running.is_empty() || !self.waiting.is_empty() {
                    self.wake_ms = Some(end);
                }
            }
            match self.wake_ms {
                Some(w) if w <= now_ms => {
                    self.wake_ms = None;
                    self.start_pass(w, out);
                }
                _ => return,
            }
        }
    }

    /// Blocks held by running requests (the load metric a worker publishes).
    pub fn active_blocks(&self) -> u32 {
        self.pool.active() + self.pool.private()
    }

    /// Cached blocks no request holds.
    pub fn inactive_blocks(&self) -> u32 {
        self.pool.inactive()
    }

    /// Requests in the running batch.
    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for admission.
    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// Life counters.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The index given at construction.
    pub fn worker_index(&self) -> u32 {
        self.worker_index
    }

    /// Sequence hashes of every resident full block, sorted (linear in the pool).
    pub fn resident_hashes(&self) -> Vec<SeqHash> {
        self.pool.resident_sorted()
    }

    /// Checks the pool and request invariants (see [`check`](EventLedger)); linear in
    /// the pool and the running requests, meant for tests.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        check::engine(self)
    }

    fn sane_now(&self, now_ms: f64) -> f64 {
        if now_ms.is_finite() && now_ms > self.clock_ms {
            now_ms
        } else {
            self.clock_ms
        }
    }

    fn events<'a>(
        out: &'a mut Vec<EngineOutput>,
        next_id: &'a mut u64,
        stats: &'a mut EngineStats,
        at_ms: f64,
    ) -> Events<'a> {
        Events {
            out,
            next_id,
            at_ms,
            stored_blocks: &mut stats.stored_blocks,
            evicted_blocks: &mut stats.evicted_blocks,
        }
    }
}
