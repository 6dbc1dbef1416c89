//! Integration tests for kvroute-sim, one module per feature.

mod common;
mod engine_behaviour;
mod follow_ups;
mod replay_loop;
mod scenarios;
mod seeded;
mod ttft_bound;
mod worker_speeds;
