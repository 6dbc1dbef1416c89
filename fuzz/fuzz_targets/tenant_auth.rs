//! libFuzzer entry for `tenant_auth`; the body is `kvroute_tests::fuzz_harness::tenant_auth`, which
//! `tests/it/fuzz_corpus.rs` also replays on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_tests::fuzz_harness::tenant_auth(data));
