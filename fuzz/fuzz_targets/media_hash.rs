//! libFuzzer entry for `media_hash`; the body is `kvroute_tests::fuzz_harness::media_hash`, which
//! `tests/it/fuzz_corpus.rs` also replays on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_tests::fuzz_harness::media_hash(data));
