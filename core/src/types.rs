//! Identifiers and small value types shared by every module.

use core::fmt;

/// A worker (one inference server, possibly with several data-parallel ranks).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WorkerId(pub u64);

/// A data-parallel rank within a worker. Rank 0 is a real rank, not "unset".
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DpRank(pub u32);

/// One routable target: a worker and one of its dp ranks.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WorkerKey {
    /// The worker.
    pub worker: WorkerId,
    /// Its data-parallel rank.
    pub rank: DpRank,
}

impl WorkerKey {
    /// Rank `rank` of worker `worker`.
    pub const fn new(worker: u64, rank: u32) -> Self {
        WorkerKey { worker: WorkerId(worker), rank: DpRank(rank) }
    }
}

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker.0, self.rank.0)
    }
}

/// A request, named by the adapter. Unique among the requests the core tracks.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RequestId(pub u64);

/// Which step of serving a routing decision is for.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Phase {
    /// One worker does prefill and decode.
    Aggregated,
    /// The prefill step of disaggregated serving.
    Prefill,
    /// The decode step of disaggregated serving.
    Decode,
}

impl Phase {
    /// Every phase, in a fixed order (used to index per-phase tables).
    pub const ALL: [Phase; 3] = [Phase::Aggregated, Phase::Prefill, Phase::Decode];

    /// A dense index 0..3.
    pub const fn index(self) -> usize {
        match self {
            Phase::Aggregated => 0,
            Phase::Prefill => 1,
            Phase::Decode => 2,
        }
    }

    /// The lower-case name used in errors and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Phase::Aggregated => "aggregated",
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A random draw supplied by the caller.
///
/// The core needs several independent values per decision (a tie-break, two distinct
/// power-of-two candidates, a temperature sample); it expands the caller's one draw with
/// SplitMix64, so a decision stays a pure function of its inputs and the draw.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Draw(pub u64);

impl Draw {
    /// The next 64 pseudo-random bits derived from this draw.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value uniform in `0..n` (`n > 0`; returns 0 when `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        // Multiply-shift avoids modulo bias that matters for small n.
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// A value uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Where a cached block lives on a worker. Lower tiers are slower to reuse.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Tier {
    /// GPU memory: a hit costs nothing to reuse.
    Device,
    /// Host (CPU) memory: reusable after a copy.
    Host,
    /// Local disk or remote storage: reusable after a slower load.
    Disk,
}

/// A worker's prefix match for one request: the leading run of the request's blocks the
/// worker holds in any tier, with each block counted under the best tier holding it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Overlap {
    /// Blocks of the run resident on the device.
    pub device: u32,
    /// Blocks of the run held only in host memory.
    pub host: u32,
    /// Blocks of the run held only on disk.
    pub disk: u32,
}

impl Overlap {
    /// Length of the leading run, every tier counted fully.
    pub const fn raw(self) -> u32 {
        self.device.saturating_add(self.host).saturating_add(self.disk)
    }
}

/// In-flight load on one worker (and dp rank), as the load tracker sees it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct WorkerLoad {
    /// Prompt tokens routed here whose prefill has not finished (uncached tokens only).
    pub active_prefill_tokens: u64,
    /// KV blocks held by running requests; a shared prefix block counts once.
    pub active_decode_blocks: u64,
    /// Requests routed here and not yet finished.
    pub active_requests: u32,
}
