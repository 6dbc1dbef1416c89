//! Integration tests for kvroute-sim, one module per feature.

mod common;
mod engine_behaviour;
mod replay_loop;
mod scenarios;
mod seeded;
mod worker_speeds;
