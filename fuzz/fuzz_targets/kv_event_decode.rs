//! libFuzzer entry for `kv_event_decode`; the body is `kvroute_tests::fuzz_harness::kv_event_decode`, which
//! `tests/it/fuzz_corpus.rs` also replays on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_tests::fuzz_harness::kv_event_decode(data));
