//! Replays every committed fuzz input on stable, as ordinary tests: each file of
//! `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/` goes through the same body
//! the libFuzzer target runs (`kvroute_tests::fuzz_harness`). A regression file is a
//! crash a fuzzer once found; it must stay fixed.

use std::fs;
use std::panic::{catch_unwind, resume_unwind};
use std::path::{Path, PathBuf};

use kvroute_tests::fuzz_harness::TARGETS;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The files of `fuzz/<kind>/<target>/`, sorted; none when the folder is absent.
fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let Ok(dir) = fs::read_dir(fuzz_dir().join(kind).join(target)) else {
        return Vec::new();
    };
    let mut files: Vec<_> = dir.map(|e| e.expect("readable entry").path()).filter(|p| p.is_file()).collect();
    files.sort();
    files
}

/// Runs `target` on its corpus (at least `corpus_min` files) and its regressions.
#[track_caller]
fn check(target: &str, corpus_min: usize) {
    let body = TARGETS.iter().find(|(name, _)| *name == target).expect("a known target").1;
    let corpus = inputs("corpus", target);
    assert!(corpus.len() >= corpus_min, "{target}: corpus has {} files, want {corpus_min}", corpus.len());
    for path in corpus.iter().chain(&inputs("regressions", target)) {
        let data = fs::read(path).expect("readable input");
        if let Err(panic) = catch_unwind(|| body(&data)) {
            eprintln!("{target}: {} fails", path.display());
            resume_unwind(panic);
        }
    }
}

#[test]
fn kv_event_decode_corpus_replays() {
    check("kv_event_decode", 20);
}

#[test]
fn router_ops_corpus_replays() {
    check("router_ops", 10);
}

#[test]
fn trace_parse_corpus_replays() {
    check("trace_parse", 10);
}

#[test]
fn proxy_request_corpus_replays() {
    check("proxy_request", 20);
}

#[test]
fn config_parse_corpus_replays() {
    check("config_parse", 20);
}

#[test]
fn media_hash_corpus_replays() {
    check("media_hash", 10);
}

#[test]
fn tenant_auth_corpus_replays() {
    check("tenant_auth", 10);
}

/// The `router_ops` seeds between them run every kind of operation, so a replay on
/// stable reaches each (a kind added later decodes from none of the older seeds).
#[test]
fn router_ops_seeds_run_every_kind_of_operation() {
    use kvroute_tests::fuzz_harness::{router_ops_every_kind, router_ops_kinds};
    let every = router_ops_every_kind();
    assert!(every.len() > 20 && every.iter().any(|k| k == "Tokens"), "{every:?}");
    let mut seen = std::collections::BTreeSet::new();
    for path in inputs("corpus", "router_ops") {
        seen.extend(router_ops_kinds(&fs::read(path).expect("readable input")));
    }
    let missing: Vec<&String> = every.iter().filter(|k| !seen.contains(*k)).collect();
    assert!(missing.is_empty(), "no router_ops seed runs {missing:?}");
}

/// Every target has a corpus folder, and every corpus folder a target.
#[test]
fn every_target_has_a_corpus() {
    let mut folders: Vec<String> = fs::read_dir(fuzz_dir().join("corpus"))
        .expect("fuzz/corpus")
        .map(|e| e.expect("readable entry").file_name().to_string_lossy().into_owned())
        .collect();
    folders.sort();
    let mut names: Vec<&str> = TARGETS.iter().map(|(n, _)| *n).collect();
    names.sort();
    assert_eq!(folders, names);
}

/// Runs one regression file of `target` alone (it also runs with the whole folder).
#[track_caller]
fn regression(target: &str, name: &str) {
    let body = TARGETS.iter().find(|(n, _)| *n == target).expect("a known target").1;
    let data = fs::read(fuzz_dir().join("regressions").join(target).join(name)).expect("a committed regression");
    body(&data);
}

/// `router_ops`' first libFuzzer crash (a session's binding made before the clock stepped
/// back 997 hours; the driver's settle jumped only 48 hours and took it for a leak). Since
/// the target's operations gained the tokenizer verdict these bytes decode to other
/// operations, still replayed here; the scenario itself is the simulation's
/// `the_settle_waits_out_a_binding_made_before_the_clock_stepped_back`.
#[test]
fn router_ops_settle_after_the_clock_stepped_back() {
    regression("router_ops", "settle_after_clock_stepped_back");
}

/// `proxy_request`'s first libFuzzer crash (reduced by hand): a client's `Connection`
/// header naming `content-length`. The proxy was right: it drops the client's length
/// (hop-by-hop, as named) and sets its own for the rewritten body. The harness took
/// that header for a hop-by-hop one leaking through; it now exempts the proxy's own.
#[test]
fn proxy_request_connection_naming_content_length() {
    regression("proxy_request", "connection_names_content_length");
}

/// `tenant_auth`'s first libFuzzer crash: a `[[tenants]]` entry with no key at all
/// (no hash, no file, no variable). The file check let it pass and only loading the
/// keys at start refused it; the check now refuses it too, naming the tenant.
#[test]
fn tenant_auth_tenant_without_a_key() {
    regression("tenant_auth", "tenant_without_a_key");
}

/// Triage, not a check: `FUZZ_INPUT=<file> cargo test -p kvroute-tests reduce_router_ops
/// -- --ignored --nocapture` prints a reduced operation list for a `router_ops` crash.
#[test]
#[ignore = "a tool: needs FUZZ_INPUT"]
fn reduce_router_ops() {
    let path = std::env::var("FUZZ_INPUT").expect("FUZZ_INPUT names a router_ops input");
    let data = fs::read(&path).expect("readable input");
    match kvroute_tests::fuzz_harness::router_ops_reduce(&data) {
        Some(report) => println!("{report}"),
        None => println!("{path} passes"),
    }
}
