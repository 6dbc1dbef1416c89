//! The soak's global invariants, checked after every step:
//!
//! * `Router::check_invariants()`, and the router tracks exactly the requests the
//!   adapter has not seen end;
//! * loads: per worker, the router's active requests equal the adapter's bookings
//!   there, and their sum equals the requests in flight on live workers;
//! * no lease without a live stream: live leases never outnumber the session requests
//!   the adapter still streams (booked, running, or orphaned and unreported);
//! * queue slots are conserved: the queue holds no more than the requests the adapter
//!   saw queued or waiting and not yet routed, failed, timed out or cancelled, and at
//!   most `queued_max` (the router's own check ties queue, tickets and flights);
//! * the affinity table stays within `sessions_max`;
//! * the index equals the union of the events the router accepted (a model set per
//!   worker key: sizes every step, membership every [`FULL_CHECK_EVERY`] steps);
//!   when a stream is in step with its publisher, those sets are a subset of what the
//!   engine announced, and equal to it unless the sequencer had to reset;
//! * every [`ENGINE_CHECK_EVERY`] steps, each engine's own invariants, and its
//!   announced blocks equal its resident ones.

use std::collections::BTreeMap;

use router_core::{OverlapScores, WorkerId, WorkerKey};

use super::requests::St;
use super::Soak;

/// Steps between full membership checks of the index (linear in its size).
pub const FULL_CHECK_EVERY: u64 = 16;
/// Steps between engine checks (linear in the engines' pools).
pub const ENGINE_CHECK_EVERY: u64 = 64;

impl Soak {
    pub(super) fn check(&mut self) -> Result<(), String> {
        self.router.check_invariants().map_err(|e| format!("router invariants: {}", e.0))?;
        if self.router.requests_in_flight() != self.reqs.len() {
            return Err(format!(
                "router tracks {} requests, the adapter {}",
                self.router.requests_in_flight(),
                self.reqs.len()
            ));
        }
        self.check_loads()?;
        self.check_slots()?;
        self.check_index()?;
        if self.tally.steps.is_multiple_of(ENGINE_CHECK_EVERY) {
            self.check_engines()?;
        }
        Ok(())
    }

    fn check_loads(&self) -> Result<(), String> {
        let mut want: BTreeMap<WorkerId, u32> = BTreeMap::new();
        for r in self.reqs.values() {
            if let Some(w) = r.booked_on() {
                *want.entry(w).or_default() += 1;
            }
        }
        for id in self.fleet.keys() {
            let got = self.router.local_load(WorkerKey::new(id.0, 0)).active_requests;
            let w = want.get(id).copied().unwrap_or(0);
            if got != w {
                return Err(format!("{id:?} carries {got} requests, the adapter booked {w} there"));
            }
        }
        let in_flight: u32 = want.iter().filter(|(id, _)| self.fleet.contains_key(id)).map(|(_, n)| n).sum();
        let total = self.router.counts().load_total.active_requests;
        if total != in_flight || want.keys().any(|id| !self.fleet.contains_key(id)) {
            return Err(format!("loads sum to {total}, requests in flight {in_flight}: {want:?}"));
        }
        Ok(())
    }

    fn check_slots(&self) -> Result<(), String> {
        let pending = self.reqs.values().filter(|r| r.st == St::Pending).count();
        let q = self.router.counts().queue_depth;
        if q > pending || q > self.knobs.queued_max {
            return Err(format!("queue holds {q}, the adapter has {pending} pending (max {})", self.knobs.queued_max));
        }
        let streams = self.reqs.values().filter(|r| r.session && r.is_stream()).count();
        let leases = self.router.counts().affinity_live_leases;
        if leases > streams {
            return Err(format!("{leases} live leases, only {streams} session streams"));
        }
        let sessions = self.router.counts().affinity_sessions;
        if sessions > self.knobs.sessions_max {
            return Err(format!("{sessions} sessions held, sessions_max {}", self.knobs.sessions_max));
        }
        Ok(())
    }

    fn check_index(&mut self) -> Result<(), String> {
        let router = &self.router;
        for id in self.fleet.keys() {
            let key = WorkerKey::new(id.0, 0);
            let want = self.model.keys.get(&key).map_or(0, |s| s.len());
            let got = router.index_entries(key) as usize;
            if got != want {
                return Err(format!("index holds {got} blocks of {key}, the events applied leave {want}"));
            }
        }
        if self.tally.steps.is_multiple_of(FULL_CHECK_EVERY) {
            self.tally.index_full_checks += 1;
            let mut scores = OverlapScores::new();
            for (key, set) in &self.model.keys {
                for h in set {
                    router.find_matches(std::slice::from_ref(h), false, &mut scores);
                    if scores.get(*key).raw() != 1 {
                        return Err(format!("index lost block {h:?} of {key}"));
                    }
                }
            }
        }
        for (id, m) in &self.fleet {
            let key = WorkerKey::new(id.0, 0);
            let Some(status) = self.ingest.status(key) else { return Err(format!("no stream for {key}")) };
            let synced = status.last_seq == m.sim.publisher.last_seq() && status.pending_batches == 0 && status.trusted;
            if !synced {
                continue;
            }
            let held = self.model.keys.get(&key).cloned().unwrap_or_default();
            let announced = &m.sim.publisher.announced;
            if let Some(h) = held.iter().find(|h| !announced.contains(h)) {
                return Err(format!("index holds {h:?} for {key}, which its engine no longer announces"));
            }
            self.tally.subset_checks += 1;
            let clean = status.seq.resets == m.resets_base && status.events_dropped == m.dropped_base;
            if clean {
                self.tally.equal_checks += 1;
                if held.len() != announced.len() {
                    return Err(format!(
                        "{key} in step with no reset: index holds {}, engine announced {}",
                        held.len(),
                        announced.len()
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_engines(&self) -> Result<(), String> {
        for (id, m) in &self.fleet {
            m.sim.engine.check_invariants().map_err(|e| format!("engine {id:?}: {}", e.0))?;
            let resident = m.sim.engine.resident_hashes();
            if !resident.iter().eq(m.sim.publisher.announced.iter()) {
                return Err(format!(
                    "engine {id:?} holds {} blocks, announced {}",
                    resident.len(),
                    m.sim.publisher.announced.len()
                ));
            }
        }
        Ok(())
    }

    /// After the settle: nothing left anywhere.
    pub(super) fn check_empty(&self) -> Result<(), String> {
        let left = [
            ("requests", self.router.requests_in_flight()),
            ("adapter requests", self.reqs.len()),
            ("load", self.router.counts().load_total.active_requests as usize),
            ("bookings", self.router.counts().bookings),
            ("leases", self.router.counts().affinity_live_leases),
            ("queued", self.router.counts().queue_depth),
            ("sessions", self.router.counts().affinity_sessions),
        ];
        if let Some((what, n)) = left.iter().find(|(_, n)| *n != 0) {
            return Err(format!("after the settle {n} {what} remain: {left:?}"));
        }
        for (id, m) in &self.fleet {
            if m.sim.ledger_len() != 0 || m.sim.engine.running_len() + m.sim.engine.waiting_len() != 0 {
                return Err(format!("engine {id:?} still runs requests"));
            }
        }
        self.check_engines()
    }
}
