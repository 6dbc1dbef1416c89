//! Shared helpers: trace text → requests, and trivial dispatchers.

pub use kvroute_sim::replay::RoundRobin;
use kvroute_sim::replay::{replay, ReplayConfig, ReplayReport, SimRequest};
use kvroute_sim::trace::{parse_str, to_requests, LoadOptions, TraceLimits};

/// Parses Mooncake lines and hashes them at block size 64.
pub fn requests(lines: &str) -> Vec<SimRequest> {
    let recs = parse_str(lines, &TraceLimits::default()).expect("valid trace");
    to_requests(&recs, &LoadOptions::default()).expect("valid requests")
}

/// Replays on `workers` default engines with round robin.
pub fn replay_rr(reqs: &[SimRequest], workers: u32) -> ReplayReport {
    let cfg = ReplayConfig { workers, ..ReplayConfig::default() };
    replay(&cfg, reqs, &mut RoundRobin::new(workers)).expect("valid config")
}

use kvroute_sim::engine::{Engine, EngineConfig, EngineOutput, EngineRequest, EventLedger};

/// Drives one engine directly: submits arrivals in time order (before a pass boundary
/// at the same time), advances to each wakeup, and after every step checks the pool
/// invariants and that the announced KV events equal the resident blocks.
pub struct Drive {
    pub engine: Engine,
    pub ledger: EventLedger,
    /// Every output, in order.
    pub outs: Vec<EngineOutput>,
    pub rejected: Vec<u64>,
    pub steps: u64,
}

impl Drive {
    pub fn new(cfg: EngineConfig) -> Self {
        Drive {
            engine: Engine::new(cfg, 0).expect("valid config"),
            ledger: EventLedger::new(),
            outs: Vec::new(),
            rejected: Vec::new(),
            steps: 0,
        }
    }

    /// Runs until idle; `arrivals` must be sorted by time. Gives up after `steps_max`.
    pub fn run(&mut self, arrivals: Vec<(f64, EngineRequest)>, steps_max: u64) -> Result<(), String> {
        let mut arrivals = arrivals.into_iter().peekable();
        let mut batch = Vec::new();
        loop {
            self.steps += 1;
            if self.steps > steps_max {
                return Err(format!("no quiescence after {steps_max} steps"));
            }
            let wake = self.engine.next_wakeup();
            let arrival = arrivals.peek().map(|a| a.0);
            match (arrival, wake) {
                (None, None) => return Ok(()),
                (Some(a), w) if w.is_none_or(|w| a <= w) => {
                    let (t, req) = arrivals.next().expect("peeked");
                    let id = req.id;
                    if self.engine.submit(t, req).is_err() {
                        self.rejected.push(id);
                    }
                }
                (_, Some(w)) => {
                    batch.clear();
                    self.engine.advance(w, &mut batch);
                    for o in &batch {
                        if let EngineOutput::Kv { event_id, event, .. } = o {
                            self.ledger.apply(*event_id, event).map_err(|e| e.to_string())?;
                        }
                    }
                    self.outs.append(&mut batch);
                    self.engine.check_invariants().map_err(|e| e.to_string())?;
                    self.ledger.check(&self.engine).map_err(|e| e.to_string())?;
                }
                (Some(_), None) => unreachable!("covered above"),
            }
        }
    }
}
