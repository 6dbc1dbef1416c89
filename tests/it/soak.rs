//! The whole-system soak (`kvroute_tests::soak`): router, simulated engines and the
//! KV-event path on virtual time, invariants checked after every step.
//!
//! CI runs [`soak_short`]: a few seeds of a few hundred steps. `SIM_SEED=<n>` replays
//! one seed (the failure message names it), `SOAK_STEPS=<n>` sets the steps per seed,
//! `SOAK_SEEDS=<n>` the number of seeds from `SOAK_SEED_BASE`. [`soak_long`] is the
//! same with 50 seeds of 20,000 steps by default (`cargo test --release -p
//! kvroute-tests soak_long -- --ignored --nocapture`).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::Instant;

use kvroute_tests::soak::{run, Tally};

const SEED_BASE: u64 = 0x736f_616b_0000_0000;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Runs one seed; a failure or panic names the seed that replays it.
fn run_reporting(seed: u64, steps: u64) -> Tally {
    match catch_unwind(AssertUnwindSafe(|| run(seed, steps))) {
        Ok(Ok(t)) => t,
        Ok(Err(f)) => panic!("SIM_SEED={seed} SOAK_STEPS={steps}: {f}"),
        Err(p) => {
            eprintln!("SIM_SEED={seed} SOAK_STEPS={steps}: panicked");
            resume_unwind(p)
        }
    }
}

/// Runs the seeds the environment asks for, or `seeds` seeds of `steps` steps.
fn soak(seeds: u64, steps: u64) -> Tally {
    let steps = env_u64("SOAK_STEPS").unwrap_or(steps);
    if let Some(seed) = env_u64("SIM_SEED") {
        return run_reporting(seed, steps);
    }
    let base = env_u64("SOAK_SEED_BASE").unwrap_or(SEED_BASE);
    let mut total = Tally::default();
    let started = Instant::now();
    for i in 0..env_u64("SOAK_SEEDS").unwrap_or(seeds) {
        total.add(&run_reporting(base.wrapping_add(i), steps));
    }
    eprintln!("soak: {:.1}s, {total:?}", started.elapsed().as_secs_f64());
    total
}

#[test]
fn soak_short() {
    let t = soak(4, 400);
    if env_u64("SIM_SEED").is_some() {
        return;
    }
    // A soak that never reaches a path proves nothing about it.
    let reached = [
        ("routed", t.routed),
        ("queued", t.queued),
        ("finished", t.finished),
        ("cancelled", t.cancelled),
        ("batches lost", t.batches_lost),
        ("replays served", t.replays_served),
        ("in-step index checks", t.equal_checks),
    ];
    for (what, n) in reached {
        assert!(n > 0, "the short soak never reached '{what}': {t:?}");
    }
}

#[test]
#[ignore = "long: run with --release and --ignored"]
fn soak_long() {
    let t = soak(50, 20_000);
    eprintln!("{t:?}");
}
