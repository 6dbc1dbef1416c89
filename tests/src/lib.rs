//! Integration tests for kvroute live in `it/` (one binary, one module per scenario).
//! This library holds only what a second crate must share with them: the bodies of the
//! fuzz targets ([`fuzz_harness`]), which `fuzz/` runs under libFuzzer and
//! `it/fuzz_corpus.rs` replays on stable.

pub mod fuzz_harness;
