//! The driver's vocabulary: configuration knobs and operations, all small integers so a
//! seeded generator and a fuzzer can both produce them. Every value is valid: the
//! driver maps out-of-range numbers onto the range (modulo), never rejects them.

use router_core::AffinityMode;
use router_core::RouterConfig;
use router_core::RouterMode;
use router_core::TtftModel;
use router_core::UnknownParentPolicy;
use router_core::{BlockHash, LocalHash, SeqHash};
use router_core::{ClassLimits, QueueOrder};

/// Distinct prompt chains; chains share leading blocks with chain 0 (see [`block`]).
pub const CHAINS: u8 = 8;
/// Longest chain, in blocks.
pub const CHAIN_BLOCKS: u32 = 32;
/// Worker ids the operations name (one more than this is never registered).
pub const WORKERS: u8 = 6;
/// Session ids in the pool.
pub const SESSIONS: u8 = 10;

/// The bugs `core/tests/sim_regressions.rs` pins with ignored tests, by the name
/// `SIM_AVOID_BUGS` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// `refused_session_commit_wakes_waiters`.
    LeakedInit,
    /// `pinned_request_to_a_busy_worker_queues`.
    BusyPin,
    /// `soft_binding_to_a_tainted_worker_is_dropped`.
    SoftBinding,
    /// `decode_progress_retries_the_queue`.
    DecodeProgress,
    /// `late_worker_failure_keeps_a_newer_binding`.
    LateFailure,
    /// `orphaned_request_expires`.
    OrphanExpiry,
}

impl Bug {
    fn name(self) -> &'static str {
        match self {
            Bug::LeakedInit => "leaked_init",
            Bug::BusyPin => "busy_pin",
            Bug::SoftBinding => "soft_binding",
            Bug::DecodeProgress => "decode_progress",
            Bug::LateFailure => "late_failure",
            Bug::OrphanExpiry => "orphan_expiry",
        }
    }
}

/// Whether to steer clear of `bug` (avoid its trigger, skip the check that catches it)
/// so runs keep finding new ones while a known bug is open. All of the bugs listed are
/// fixed, so every run faces them; `SIM_AVOID_BUGS` (comma-separated names) steers
/// around some again, for triage.
pub fn avoid(bug: Bug) -> bool {
    let Ok(list) = std::env::var("SIM_AVOID_BUGS") else { return false };
    list.split(',').any(|b| b.trim() == "all" || b.trim() == bug.name())
}

/// Router configuration, as knobs. Each knob picks from a few values chosen to reach the
/// edges: tiny tables that fill, timeouts of zero, limits of one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Knobs {
    pub mode: u8,
    pub approximate: bool,
    pub soft_affinity: bool,
    pub sessions_max: u8,
    pub leases_max: u8,
    pub lease_ttl: u8,
    pub waiters_max: u8,
    pub queued_max: u8,
    pub queue_timeout: u8,
    pub wspt: bool,
    pub class_limit: u8,
    pub request_age: u8,
    pub load_requests_max: u8,
    pub requests_max: u8,
    pub prefill_tokens_max: u8,
    pub blocks_cap: u8,
    pub reject_unknown_parent: bool,
    pub keys_max: u8,
    pub workers_max: u8,
    /// The CPU build's timing, whose cold term tracks each worker's warmth.
    pub cpu_timing: bool,
}

fn pick<T: Copy>(knob: u8, values: &[T]) -> T {
    values[knob as usize % values.len()]
}

impl Knobs {
    /// The router configuration these knobs describe.
    pub fn config(&self) -> RouterConfig {
        let mut c = RouterConfig { mode: pick(self.mode, &RouterMode::ALL), ..RouterConfig::default() };
        c.approximate = self.approximate;
        c.affinity.mode = if self.soft_affinity { AffinityMode::Soft } else { AffinityMode::Hard };
        c.affinity.sessions_max = pick(self.sessions_max, &[65_536, 1, 2, 4, 16]);
        c.affinity.leases_max = pick(self.leases_max, &[1 << 20, 1 << 20, 1 << 20, 2, 8]);
        if avoid(Bug::LeakedInit) {
            // A refused session commit leaks its init token (see
            // `sim_regressions::refused_session_commit_wakes_waiters`).
            c.affinity.leases_max = 1 << 20;
        }
        c.affinity.lease_ttl_ms = pick(self.lease_ttl, &[300_000, 0, 50, 1_000, 60_000]);
        c.affinity.waiters_max_per_session = pick(self.waiters_max, &[1024, 1, 4]);
        c.queue.queued_max = pick(self.queued_max, &[4096, 1, 4, 64]);
        c.queue.queue_timeout_ms = pick(self.queue_timeout, &[30_000, 0, 10, 500]);
        c.queue.order = if self.wspt { QueueOrder::Wspt } else { QueueOrder::Fcfs };
        let limit = pick(self.class_limit, &[None, Some(1), Some(3)]);
        c.queue.classes = vec![ClassLimits {
            queued_requests_max: limit,
            queued_prompt_tokens_max: limit.map(|n| u64::from(n) * 1024),
            ..ClassLimits::unlimited("a")
        }];
        c.load.request_age_max_ms = pick(self.request_age, &[600_000, 600_000, 0, 100, 5_000]);
        c.load.requests_max = pick(self.load_requests_max, &[1 << 20, 1 << 20, 3]);
        c.requests_max = pick(self.requests_max, &[65_536, 65_536, 2, 8]);
        // Small absolute prefill bounds make fleets busy, so requests queue.
        c.eligibility.prefill_tokens_max = pick(self.prefill_tokens_max, &[None, Some(0), Some(300), Some(2_000)]);
        c.index.blocks_max_per_worker = pick(self.blocks_cap, &[None, Some(1), Some(8)]);
        c.index.unknown_parent =
            if self.reject_unknown_parent { UnknownParentPolicy::Reject } else { UnknownParentPolicy::AcceptAsRoot };
        c.index.keys_max = pick(self.keys_max, &[4096, 1, 3]);
        c.workers.workers_max = pick(self.workers_max, &[4096, 2, 4]);
        c.workers.dp_ranks_max = 4;
        if self.cpu_timing {
            c.cost.timing = TtftModel::vllm_cpu();
        }
        c
    }
}

/// One request, as knobs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReqOp {
    /// Prompt: `len` blocks of chain `chain`, then `tail` blocks of a private chain.
    pub chain: u8,
    pub len: u8,
    pub tail: u8,
    /// 0–1 aggregated, 2 prefill, 3 decode.
    pub phase: u8,
    /// 0 none, 1 empty (refused), 2 too long (refused), else a session of the pool.
    pub session: u8,
    /// 0 none, else `backend_instance_id` = `pin - 1` (may name no worker).
    pub pin: u8,
    /// 0 none, else `dp_rank` = `pin_rank - 1`.
    pub pin_rank: u8,
    /// 0 none, else an allow-list of the workers whose bit is set.
    pub allow: u8,
    /// Tolerates every taint.
    pub tolerate: bool,
    /// 0 none, else `same_label_as` = ("zone", zone `label % 2`).
    pub label: u8,
    /// 0 none, else `planned` = worker `(planned - 1) % WORKERS`, rank 0.
    pub planned: u8,
    pub strict: i8,
    pub jump_ms: i16,
    /// 0 default class, 1 class "a", 2 an unlisted class.
    pub class: u8,
    pub preview: bool,
    /// 0 unknown, else that many tokens.
    pub expected_out: u16,
    /// Reuse the id of a request in flight (must be refused as a duplicate).
    pub duplicate: bool,
    pub draw: u64,
}

/// One input to the router. `pick` numbers choose among the requests the model holds
/// (modulo their count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Register or reconfigure a worker. `ranks`: 0 unknown, 1–4, 5 zero (refused), 6 too
    /// many (refused). `weight` 0 is refused.
    Upsert {
        worker: u8,
        role: u8,
        ranks: u8,
        weight: u8,
        small_kv: bool,
        zone: u8,
        taint: u8,
    },
    Remove {
        worker: u8,
    },
    /// 0 healthy, 1 ejected, 2 draining.
    Health {
        worker: u8,
        health: u8,
    },
    /// 0 none, 1 a `NoSchedule` taint, 2 a `PreferNoSchedule` taint, 3 both.
    Taints {
        worker: u8,
        taints: u8,
    },
    /// A KV `Stored` event: blocks `start..start+len` of `chain`, after its parent when
    /// `parent`. `tier` 0 device, 1 host, 2 disk.
    Stored {
        worker: u8,
        rank: u8,
        chain: u8,
        start: u8,
        len: u8,
        parent: bool,
        tier: u8,
    },
    Removed {
        worker: u8,
        rank: u8,
        chain: u8,
        start: u8,
        len: u8,
        tier: u8,
    },
    Cleared {
        worker: u8,
        rank: u8,
    },
    KvClear {
        worker: u8,
        rank: u8,
    },
    Trust {
        worker: u8,
        rank: u8,
        trusted: bool,
    },
    /// Whether the worker's engine tokenizes as the caller does.
    Tokens {
        worker: u8,
        agrees: bool,
    },
    /// A first token `slowdown`/4 ms per prompt token after dispatch (0: a NaN, refused):
    /// under either timing mostly far slower than predicted, so the cost learner's
    /// fleet scale passes 2 and the timing's doubt is often on.
    Observe {
        worker: u8,
        rank: u8,
        slowdown: u8,
        tokens: u16,
    },
    Request(ReqOp),
    Dispatched {
        pick: u16,
    },
    DispatchFailed {
        pick: u16,
        /// 0: the client went away; 1: the worker failed; 2: it refused (modulo 3).
        failure: u8,
    },
    PrefillDone {
        pick: u16,
    },
    Progress {
        pick: u16,
        tokens: u16,
    },
    Finished {
        pick: u16,
    },
    Cancel {
        pick: u16,
    },
    /// A lifecycle input for a request that already ended or never existed.
    Late {
        pick: u16,
        kind: u8,
    },
    Advance {
        ms: u32,
    },
    Back {
        ms: u32,
    },
    Jump {
        hours: u16,
    },
    /// A spurious `handle_timeout` at the current time.
    Timeout,
    /// Compare the index with the model on one query.
    Query {
        chain: u8,
        len: u8,
        twist: u8,
    },
}

/// Block `i` of chain `chain`. Chain `c` shares its first `SHARED[c]` blocks with chain 0,
/// so prompts form a tree, as conversations with a common system prompt do.
pub fn block(chain: u8, i: u32) -> SeqHash {
    const SHARED: [u32; CHAINS as usize] = [0, 2, 4, 6, 8, 3, 5, 1];
    let c = chain % CHAINS;
    let owner = if i < SHARED[c as usize] { 0 } else { u64::from(c) };
    SeqHash(mix((owner << 32) | u64::from(i)))
}

/// Block `i` of a private chain no stored event names.
pub fn private_block(tag: u64, i: u32) -> SeqHash {
    SeqHash(mix((1 << 48) | (tag << 16) | u64::from(i)))
}

/// `len` blocks of `chain` from `start`, clamped to the chain.
pub fn chain_blocks(chain: u8, start: u32, len: u32) -> Vec<SeqHash> {
    let end = (start + len).min(CHAIN_BLOCKS);
    (start.min(end)..end).map(|i| block(chain, i)).collect()
}

pub fn with_local(seqs: &[SeqHash]) -> Vec<BlockHash> {
    seqs.iter().map(|&s| BlockHash { seq: s, local: LocalHash(s.0 ^ 0x5555) }).collect()
}

fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
