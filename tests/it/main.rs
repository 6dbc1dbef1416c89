//! One integration-test binary, one module per scenario.

mod core_smoke;
