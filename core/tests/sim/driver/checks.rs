//! The checks run after every step: the router against the model, and the index
//! against its model.

use super::*;

impl Driver {
    // ---- checks ----

    pub(super) fn check(&mut self) -> Check {
        let r = &self.router;
        let counts = r.counts();
        r.check_invariants().map_err(|v| format!("check_invariants: {}", v.0))?;
        if r.requests_in_flight() != self.reqs.len() {
            return Err(format!(
                "router tracks {} requests, the model {}: {:?}",
                r.requests_in_flight(),
                self.reqs.len(),
                self.states()
            ));
        }
        let mut per_key: BTreeMap<WorkerKey, u32> = BTreeMap::new();
        let mut loads: BTreeMap<WorkerKey, (u64, std::collections::BTreeSet<SeqHash>, u64)> = BTreeMap::new();
        let (mut seen_queued, mut pending, mut sessions) = (0, 0, 0);
        let (queue_ms, age_ms) = (self.cfg.queue.queue_timeout_ms, self.cfg.load.request_age_max_ms);
        for (&(id, phase), m) in &self.reqs {
            let overdue = match m.state {
                MState::Pending { seen_queued: true } => m.since.add_ms(queue_ms) <= self.now,
                MState::Booked(_) | MState::Dispatched(_) => m.since.add_ms(age_ms) <= self.now,
                MState::Orphaned => !avoid(Bug::OrphanExpiry) && m.since.add_ms(age_ms) <= self.now,
                _ => false,
            };
            if overdue {
                return Err(format!("{id:?} {phase} is {:?} since {:?}, past its deadline", m.state, m.since));
            }
            let want = match m.state {
                MState::Booked(k) | MState::Dispatched(k) => {
                    *per_key.entry(k).or_default() += 1;
                    let l = loads.entry(k).or_default();
                    l.0 += u64::from(m.prefill_left);
                    if phase != Phase::Prefill {
                        l.1.extend(m.blocks.iter().copied());
                        l.2 += u64::from(m.expected_out_blocks.max(m.generated_blocks));
                    }
                    Some(k)
                }
                MState::Pending { seen_queued: s } => {
                    pending += 1;
                    seen_queued += usize::from(s);
                    None
                }
                MState::Orphaned => None,
            };
            sessions += usize::from(m.session.is_some());
            if r.booking(id, phase) != want {
                return Err(format!("{id:?} {phase} is {:?} but its booking is {:?}", m.state, r.booking(id, phase)));
            }
        }
        let booked: u32 = per_key.values().sum();
        for (&k, &n) in &per_key {
            let got = r.local_load(k);
            let (prefill, blocks, out) = &loads[&k];
            let want = WorkerLoad {
                active_prefill_tokens: *prefill,
                active_decode_blocks: blocks.len() as u64 + out,
                active_requests: n,
            };
            if got != want {
                return Err(format!("{k} carries {got:?}, the model books {want:?}"));
            }
        }
        if counts.bookings != booked as usize || counts.load_total.active_requests != booked {
            return Err(format!("load tracks {} bookings, the model {booked}", counts.bookings));
        }
        if booked == 0 && counts.load_total != WorkerLoad::default() {
            return Err(format!("no bookings but load {:?}", counts.load_total));
        }
        if counts.affinity_sessions > self.cfg.affinity.sessions_max {
            return Err(format!("{} sessions, limit {}", counts.affinity_sessions, self.cfg.affinity.sessions_max));
        }
        if !(seen_queued..=pending).contains(&counts.queue_depth) {
            return Err(format!(
                "queue holds {}, the model {seen_queued} queued of {pending} pending",
                counts.queue_depth
            ));
        }
        let leases = counts.affinity_live_leases;
        if leases > sessions {
            return Err(format!("{leases} live leases but only {sessions} requests with a session in flight"));
        }
        let stats = counts.index;
        if stats.entries != self.index.total_entries() || stats.workers as usize != self.index.keys().count() {
            return Err(format!(
                "index holds {} entries over {} keys, the model {} over {}",
                stats.entries,
                stats.workers,
                self.index.total_entries(),
                self.index.keys().count()
            ));
        }
        Ok(())
    }

    /// Compares the index with the model: per-key sizes, and the answer to `query`, both
    /// exact and with early exit (where one key may stop short).
    pub(super) fn check_index(&mut self, query: &[router_core::SeqHash]) -> Check {
        for k in self.index.keys() {
            let (got, want) = (self.router.index_entries(k), self.index.entries(k));
            if got != want {
                return Err(format!("index: {k} holds {got} blocks, the model {want}"));
            }
        }
        let want = self.index.find_matches(query);
        self.router.find_matches(query, false, &mut self.scores);
        let got: Vec<_> = self.scores.iter().collect();
        if got != want {
            return Err(format!("index query of {} blocks answered {got:?}, the model {want:?}", query.len()));
        }
        self.router.find_matches(query, true, &mut self.scores);
        let early: Vec<_> = self.scores.iter().collect();
        let short: Vec<_> = want
            .iter()
            .filter(|(k, o)| self.scores.get(*k) != *o)
            .map(|(k, o)| (*k, o.raw(), self.scores.get(*k).raw()))
            .collect();
        let extra = early.iter().any(|(k, _)| !want.iter().any(|(w, _)| w == k));
        if extra || short.len() > 1 || short.iter().any(|&(_, full, got)| got > full || got == 0) {
            return Err(format!("early-exit query answered {early:?}, the full answer is {want:?}"));
        }
        Ok(())
    }

    /// With nothing due, a spurious `handle_timeout` must change nothing: every input
    /// that freed capacity has already re-tried the queue, and every timer that was due
    /// has run.
    pub(super) fn check_settled(&mut self) -> Check {
        if self.router.poll_timeout().is_some_and(|t| t <= self.now) {
            return Err(format!("a deadline is due after the timers ran: {:?}", self.router.poll_timeout()));
        }
        let before = fingerprint(&self.router);
        self.router.handle_timeout(self.now);
        if let Some(out) = self.router.poll_output() {
            return Err(format!("a spurious handle_timeout produced {out:?}: an input left work undone"));
        }
        let after = fingerprint(&self.router);
        if after != before {
            return Err(format!("a spurious handle_timeout changed {before:?} into {after:?}"));
        }
        Ok(())
    }
}
