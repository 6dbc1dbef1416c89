//! Integration tests of kvroute-events: one binary, one module per scenario family.

mod corpus;
mod golden;
mod loopback;
mod model;
mod runner;
mod support;
mod vllm_media;
