//! A deterministic driver for the `Router` façade: operations as plain data, a plain
//! model of what the router must hold, and the checks run after every step.
//!
//! Two callers share it: the seeded simulation (`core/tests/simulation.rs`, operations
//! drawn from SplitMix64) and the `router_ops` fuzz target (operations drawn from
//! libFuzzer bytes, through the `kvroute-tests` crate). A failed check is a `Failure`
//! naming the step; the caller decides how to report it (print the seed, or panic).
//!
//! What it leaves to others: choosing operations ([`gen`] for the simulation, the fuzz
//! harness for libFuzzer) and judging routing quality (the scenario tests).
#![allow(dead_code)] // Each caller uses a different part.

pub mod driver;
pub mod gen;
pub mod index_model;
pub mod ops;
pub mod reduce;
pub mod rng;
