//! The soak's moving parts between operations: engines running to the current time,
//! event delivery and replays, timers, workers leaving and restarting, and the run
//! itself with its final settle.

use std::fmt;
use std::mem;

use kvroute_events::encode::{encode_batch, WireEvent, WireForm};
use kvroute_sim::EngineOutput;
use router_core::{WorkerId, WorkerKey, WorkerUpdate};

use super::events::{self, ReplayMode, Sink};
use super::fleet::{Message, SimWorker};
use super::requests::St;
use super::{Soak, Tally};

/// Most `handle_timeout` calls one instant may need before nothing is due; more is a
/// livelock.
const TIMEOUT_CALLS_MAX: usize = 10_000;

/// A failed check: the step it broke at and what broke.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The step (0-based; `steps` for the final settle).
    pub step: u64,
    /// What broke.
    pub message: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {}: {}", self.step, self.message)
    }
}

/// Runs `steps` operations from `seed`, then settles. Deterministic in `seed`.
pub fn run(seed: u64, steps: u64) -> Result<Tally, Failure> {
    let mut soak = Soak::new(seed);
    for step in 0..steps {
        soak.step().map_err(|message| Failure { step, message: format!("{message}\nknobs: {:?}", soak.knobs) })?;
    }
    soak.settle().map_err(|message| Failure { step: steps, message: format!("{message}\nknobs: {:?}", soak.knobs) })?;
    Ok(soak.tally)
}

impl Soak {
    /// Runs one engine to the current time, publishes its events, reports its ends.
    pub(super) fn advance_worker(&mut self, id: WorkerId) -> Result<(), String> {
        let clock = self.clock_ms;
        let Some(m) = self.fleet.get_mut(&id) else { return Ok(()) };
        let mut outputs = mem::take(&mut m.sim.outputs);
        outputs.clear();
        m.sim.engine.advance(clock as f64, &mut outputs);
        m.sim.outputs = outputs;
        if let Some(payload) = m.sim.encode_events(clock as f64 / 1000.0) {
            let msg = m.sim.publisher.publish(payload);
            self.deliver(id, &msg, false);
        }
        let outputs = mem::take(&mut self.fleet.get_mut(&id).expect("present").sim.outputs);
        for out in &outputs {
            match *out {
                EngineOutput::FirstToken { id: rid, .. } => self.first_token(id, rid)?,
                EngineOutput::Finished { id: rid, .. } => {
                    self.fleet.get_mut(&id).expect("present").sim.release(rid);
                    self.finished(id, rid)?;
                }
                _ => {}
            }
        }
        self.fleet.get_mut(&id).expect("present").sim.outputs = outputs;
        Ok(())
    }

    /// Sends a live message over a wire that may lose or repeat it (`reliable` spares it).
    fn deliver(&mut self, id: WorkerId, msg: &Message, reliable: bool) {
        self.tally.batches += 1;
        if !reliable {
            let drop = self.drop_next.get_mut(&id).filter(|k| **k > 0).map(|k| *k -= 1).is_some();
            if drop || self.pct(self.knobs.loss_pct) {
                self.tally.batches_lost += 1;
                return;
            }
        }
        let copies = if !reliable && self.pct(self.knobs.repeat_pct) { 2 } else { 1 };
        self.tally.batches_repeated += copies - 1;
        let now = self.now();
        for _ in 0..copies {
            let mut sink = Sink { router: &mut self.router, model: &mut self.model, now };
            // A batch the translator cannot use is counted in the stream's status.
            let _ = self.ingest.handle_live(now, WorkerKey::new(id.0, 0), &msg.frames, &mut sink);
        }
        events::drain_ingest(&mut self.ingest, &mut self.replays);
    }

    /// Answers replay requests as the current mode says; new requests raised meanwhile
    /// wait for the next step.
    pub(super) fn service_replays(&mut self) {
        let now = self.now();
        for r in mem::take(&mut self.replays) {
            let mode = match self.replay_mode {
                ReplayMode::Defer if self.rng.below(2) == 0 => ReplayMode::Serve,
                m => m,
            };
            let mut sink = Sink { router: &mut self.router, model: &mut self.model, now };
            match mode {
                ReplayMode::Serve => {
                    self.tally.replays_served += 1;
                    let Some(m) = self.fleet.get(&WorkerId(r.key.worker.0)) else { continue };
                    for frames in m.sim.publisher.replay(r.from) {
                        let _ = self.ingest.handle_replay(now, r.key, r.id, &frames, &mut sink);
                    }
                }
                ReplayMode::Fail => {
                    self.tally.replays_failed += 1;
                    let _ = self.ingest.handle_replay_failed(now, r.key, r.id, &mut sink);
                }
                ReplayMode::Defer => {
                    self.tally.replays_deferred += 1;
                    self.replays.push(r);
                    continue;
                }
            }
            let mut fresh = Vec::new();
            events::drain_ingest(&mut self.ingest, &mut fresh);
            self.replays.extend(fresh);
        }
    }

    /// Fires every timer due, router and ingestion, until nothing is due; sometimes a
    /// spurious call first, which must be harmless.
    pub(super) fn fire_timers(&mut self) -> Result<(), String> {
        let now = self.now();
        if self.rng.below(20) == 0 {
            self.router.handle_timeout(now);
            self.drain_router_checked()?;
        }
        let mut calls = 0;
        while self.router.poll_timeout().is_some_and(|t| t <= now) {
            calls += 1;
            if calls > TIMEOUT_CALLS_MAX {
                return Err(format!("router timers still due at {now:?} after {TIMEOUT_CALLS_MAX} calls"));
            }
            self.router.handle_timeout(now);
            self.drain_router_checked()?;
        }
        if self.ingest.poll_timeout().is_some_and(|t| t <= now) {
            let mut sink = Sink { router: &mut self.router, model: &mut self.model, now };
            self.ingest.handle_timeout(now, &mut sink);
            events::drain_ingest(&mut self.ingest, &mut self.replays);
        }
        Ok(())
    }

    /// A random worker leaves: router and ingestion forget it; its streams break, and
    /// the end of some is never reported (the router must expire them).
    pub(super) fn leave(&mut self) -> Result<(), String> {
        let Some(id) = self.pick_worker() else { return Ok(()) };
        self.tally.leaves += 1;
        let now = self.now();
        self.router.handle_worker_update(now, WorkerUpdate::Removed(id)).map_err(|e| format!("remove {id:?}: {e}"))?;
        self.drain_router_checked()?;
        let key = WorkerKey::new(id.0, 0);
        self.tally.seq_resets += self.ingest.status(key).map_or(0, |s| s.seq.resets);
        let mut sink = Sink { router: &mut self.router, model: &mut self.model, now };
        self.ingest.remove_stream(key, &mut sink).map_err(|e| format!("remove stream {key}: {e}"))?;
        self.model.remove_worker(id);
        self.fleet.remove(&id);
        self.drop_next.remove(&id);
        self.replays.retain(|r| r.key != key);
        let on_it: Vec<u64> = self.reqs.iter().filter(|(_, r)| r.booked_on() == Some(id)).map(|(&i, _)| i).collect();
        for rid in on_it {
            let lost = self.reqs[&rid].st == St::Lost(id);
            if lost || self.rng.below(10) < 3 {
                self.tally.orphaned += 1;
                self.reqs.get_mut(&rid).expect("present").st = St::Orphan;
            } else {
                self.end_stream(rid)?;
            }
        }
        Ok(())
    }

    /// A random worker's process restarts: a fresh engine and publisher under the same
    /// id, numbering batches from 0 again. Its streams break.
    pub(super) fn restart(&mut self) -> Result<(), String> {
        let Some(id) = self.pick_worker() else { return Ok(()) };
        self.tally.restarts += 1;
        self.clock_ms += 1; // the new publisher's timestamps are newer
        let running: Vec<u64> = self.reqs.iter().filter(|(_, r)| r.st == St::Running(id)).map(|(&i, _)| i).collect();
        for rid in running {
            if self.rng.below(10) == 0 {
                self.tally.reports_lost += 1;
                self.reqs.get_mut(&rid).expect("present").st = St::Lost(id);
            } else {
                self.end_stream(rid)?;
            }
        }
        let status = self.ingest.status(WorkerKey::new(id.0, 0)).unwrap_or_default();
        let m = self.fleet.get_mut(&id).expect("picked from the fleet");
        m.sim = SimWorker::new(self.knobs.engine_config(), id.0 as u32, self.knobs.replay_buffer);
        m.resets_base = status.seq.resets;
        m.dropped_base = status.events_dropped;
        // A fresh engine announces an empty cache; the first batch always arrives, so
        // the sequencer sees the restart.
        let payload = encode_batch(self.clock_ms as f64 / 1000.0, &[WireEvent::Cleared], None, WireForm::Map);
        let msg = m.sim.publisher.publish(payload);
        self.deliver(id, &msg, true);
        Ok(())
    }

    /// Ends the run: no more faults, every stream runs out, every deadline passes. The
    /// router must then hold no request, load, lease, queue slot or binding, and every
    /// worker's index entries must equal what its engine announced.
    pub(super) fn settle(&mut self) -> Result<(), String> {
        self.knobs.loss_pct = 0;
        self.knobs.repeat_pct = 0;
        self.knobs.lost_report_pct = 0;
        self.knobs.connect_fail_pct = 0;
        self.drop_next.clear();
        self.replay_mode = ReplayMode::Serve;
        self.skew_ms = 0;
        for _ in 0..100_000 {
            let active = self.reqs.values().any(|r| !matches!(r.st, St::Lost(_) | St::Orphan));
            let busy = self.fleet.values().any(|m| m.sim.engine.next_wakeup().is_some());
            if !active && !busy && self.replays.is_empty() {
                break;
            }
            self.clock_ms += 100;
            self.run_to_now()?;
            self.check()?;
        }
        // An empty batch from every publisher reveals a lost last batch; its replay
        // then brings the stream up to date.
        let ids: Vec<WorkerId> = self.fleet.keys().copied().collect();
        for id in ids {
            let m = self.fleet.get_mut(&id).expect("present");
            let msg = m.sim.publisher.publish(encode_batch(self.clock_ms as f64 / 1000.0, &[], None, WireForm::Map));
            self.deliver(id, &msg, true);
        }
        self.service_replays();
        // Then every deadline: lost reports and orphans expire, which idles their
        // bindings, which expire a lease TTL later.
        for _ in 0..1_000 {
            let next = [self.router.poll_timeout(), self.ingest.poll_timeout()].into_iter().flatten().min();
            let Some(t) = next else { break };
            self.clock_ms = self.clock_ms.max(t.as_millis() + 1);
            self.run_to_now()?;
            self.service_replays();
            self.check()?;
        }
        for id in self.fleet.keys() {
            self.tally.seq_resets += self.ingest.status(WorkerKey::new(id.0, 0)).map_or(0, |s| s.seq.resets);
        }
        self.check_empty()
    }
}
