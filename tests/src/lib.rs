//! Integration tests for kvroute live in `it/` (one binary, one module per scenario).
//! This library holds what a second crate must share with them, or what is large
//! enough to want its own modules: the bodies of the fuzz targets ([`fuzz_harness`]),
//! which `fuzz/` runs under libFuzzer and `it/fuzz_corpus.rs` replays on stable, and the
//! whole-system soak ([`soak`]), which `it/soak.rs` runs.

pub mod fuzz_harness;
pub mod soak;
