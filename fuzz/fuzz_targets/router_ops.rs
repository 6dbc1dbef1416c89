//! libFuzzer entry for `router_ops`; the body is `kvroute_tests::fuzz_harness::router_ops`, which
//! `tests/it/fuzz_corpus.rs` also replays on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_tests::fuzz_harness::router_ops(data));
