//! Invariant checkers for tests and simulations: the pool's bookkeeping against the
//! requests' block tables, and the KV event stream against actual residency.
//!
//! Both are linear in the pool size; they are meant to run after every pass in tests,
//! not in a timed replay.

use std::collections::BTreeSet;
use std::fmt;

use router_core::SeqHash;

use super::{Engine, KvEvent};

/// A broken invariant, described for a test failure message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvariantViolation(pub String);

impl fmt::Display for InvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvariantViolation {}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(InvariantViolation(format!($($fmt)+)));
        }
    };
}

/// Pool and request invariants: capacity, reference counts equal to the running
/// requests' block references, LRU membership, block tables matching hashes.
pub(super) fn engine(e: &Engine) -> Result<(), InvariantViolation> {
    let pool = &e.pool;
    let bs = e.bs;
    ensure!(pool.used() <= pool.capacity(), "used {} > capacity {}", pool.used(), pool.capacity());
    let mut refs: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    let mut private = 0;
    for r in &e.running {
        ensure!(r.computed <= r.seq_len(), "req {} computed {} > len {}", r.id, r.computed, r.seq_len());
        ensure!(
            r.held.len() == (r.computed / bs) as usize,
            "req {} holds {} full blocks for {} computed tokens",
            r.id,
            r.held.len(),
            r.computed
        );
        ensure!(r.has_private == (r.computed % bs != 0), "req {} private flag wrong", r.id);
        private += u32::from(r.has_private);
        for (i, &s) in r.held.iter().enumerate() {
            ensure!(pool.slot(s).hash == r.block_hash(i).seq, "req {} block {i} is slot {s} with another hash", r.id);
            ensure!(pool.lookup(r.block_hash(i).seq) == Some(s), "req {} block {i} not in the table", r.id);
            *refs.entry(s).or_default() += 1;
        }
    }
    for r in &e.waiting {
        ensure!(r.held.is_empty() && !r.has_private, "waiting req {} holds blocks", r.id);
    }
    ensure!(private == pool.private(), "private count {} != {}", pool.private(), private);
    let mut active = 0;
    let mut inactive = 0;
    for (s, slot) in pool.live_slots() {
        let want = refs.get(&s).copied().unwrap_or(0);
        ensure!(slot.refs == want, "slot {s} refcount {} but {want} running references", slot.refs);
        if slot.refs == 0 {
            inactive += 1;
        } else {
            active += 1;
        }
    }
    ensure!(active == pool.active(), "active {} != counted {active}", pool.active());
    ensure!(inactive == pool.inactive(), "inactive {} != counted {inactive}", pool.inactive());
    let lru = pool.lru_order();
    ensure!(lru.len() as u32 == inactive, "LRU has {} entries, {inactive} inactive blocks", lru.len());
    for s in lru {
        ensure!(pool.slot(s).refs == 0, "LRU holds active slot {s}");
    }
    Ok(())
}

/// Replays an engine's KV events into the set of blocks a router would believe
/// resident, and compares it with the engine's real residency.
#[derive(Clone, Debug, Default)]
pub struct EventLedger {
    resident: BTreeSet<SeqHash>,
    next_event_id: u64,
}

impl EventLedger {
    /// An empty ledger expecting event id 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event: ids must be consecutive, stored blocks new, a stored chain's
    /// parent resident, removed blocks known.
    pub fn apply(&mut self, event_id: u64, event: &KvEvent) -> Result<(), InvariantViolation> {
        ensure!(event_id == self.next_event_id, "event id {event_id}, expected {}", self.next_event_id);
        self.next_event_id += 1;
        match event {
            KvEvent::Stored { parent, blocks } => {
                ensure!(!blocks.is_empty(), "empty Stored event {event_id}");
                if let Some(p) = parent {
                    ensure!(self.resident.contains(p), "Stored {event_id} has unknown parent {p:?}");
                }
                for b in blocks {
                    ensure!(self.resident.insert(b.seq), "Stored {event_id} repeats resident {:?}", b.seq);
                }
            }
            KvEvent::Removed { blocks } => {
                ensure!(!blocks.is_empty(), "empty Removed event {event_id}");
                for h in blocks {
                    ensure!(self.resident.remove(h), "Removed {event_id} of unknown {h:?}");
                }
            }
        }
        Ok(())
    }

    /// The announced set equals the engine's resident full blocks.
    pub fn check(&self, engine: &Engine) -> Result<(), InvariantViolation> {
        let real = engine.resident_hashes();
        ensure!(
            real.len() == self.resident.len() && real.iter().eq(self.resident.iter()),
            "events announce {} blocks, engine holds {}",
            self.resident.len(),
            real.len()
        );
        Ok(())
    }

    /// Blocks currently announced.
    pub fn len(&self) -> usize {
        self.resident.len()
    }

    /// Whether nothing is announced.
    pub fn is_empty(&self) -> bool {
        self.resident.is_empty()
    }
}
