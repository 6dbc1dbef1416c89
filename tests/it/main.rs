//! Integration tests for kvroute; see `it/`.
//! One integration-test binary, one module per scenario.

mod core_smoke;
mod fuzz_corpus;
mod soak;
mod tls;
