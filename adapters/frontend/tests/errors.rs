//! The front end's errors chain: each one's `source()` is the error it wraps, down to
//! the cause from the OS, the router or another crate. Since messages are quoted whole
//! in HTTP bodies and on the command line, each of ours also prints its source.

use std::error::Error;
use std::path::Path;

use kvroute_frontend::config::TracingConfig;
use kvroute_frontend::otel::{Tracing, TracingError};
use kvroute_frontend::scrape::ScrapeError;
use kvroute_frontend::{start, ConfigError, ProxyConfig, StartError};
use kvroute_replica::ReplicaStartError;

/// The chain from `e` down, one message per level.
fn chain(e: &(dyn Error + 'static)) -> Vec<String> {
    std::iter::successors(Some(e), |&e| e.source()).map(ToString::to_string).collect()
}

/// `e`'s chain is at least `ours + 1` deep, its first `ours` levels print the level
/// beneath them, and the level under ours passes `cause`.
#[track_caller]
fn check(e: &(dyn Error + 'static), ours: usize, cause: fn(&(dyn Error + 'static)) -> bool) {
    let levels = chain(e);
    assert!(levels.len() > ours, "{e:?}: chain {levels:?} is shorter than {}", ours + 1);
    for w in levels[..=ours].windows(2) {
        assert!(w[0].contains(&w[1]), "{:?} does not print its source {:?}", w[0], w[1]);
    }
    let mut level = e;
    for _ in 0..ours {
        level = level.source().expect("checked above");
    }
    assert!(cause(level), "{e:?}: level {ours} is {level:?}");
}

async fn start_err(toml: &str) -> StartError {
    let cfg = ProxyConfig::from_toml_str(toml).expect("a valid configuration");
    match start(&cfg).await {
        Err(e) => e,
        Ok(_) => panic!("started with {toml}"),
    }
}

#[test]
fn an_unreadable_file_keeps_the_os_error() {
    let e = ProxyConfig::from_file(Path::new("no/such/kvroute.toml")).expect_err("no such file");
    assert!(matches!(e, ConfigError::Read { .. }), "{e:?}");
    assert!(e.to_string().starts_with("cannot read no/such/kvroute.toml: "), "{e}");
    check(&e, 1, |s| s.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::NotFound));
}

#[tokio::test]
async fn start_errors_chain_to_their_cause() {
    let replica = "[replica]\nid = \"a\"\nnats_url = \"nats://127.0.0.1:notaport\"\n";
    let e = start_err(replica).await;
    assert!(matches!(e, StartError::Replica(_)), "{e:?}");
    // The NATS client's own error beneath it is checked in kvroute-replica.
    check(&e, 1, |s| s.is::<ReplicaStartError>() && s.source().is_some());

    // The router refuses a worker the file's checks let through: StartError, then
    // FleetError, DriveError, the core's InputError and WorkerError.
    let worker = "[[models]]\nname = \"m\"\n[[workers]]\nid = 7\nurl = \"http://127.0.0.1:1\"\nmodel = \"m\"\n\
                  dp_ranks = 4000000000\n";
    let e = start_err(worker).await;
    assert!(matches!(e, StartError::Worker { id: 7, .. }), "{e:?}");
    check(&e, 4, |s| s.is::<router_core::WorkerError>());
}

#[tokio::test]
async fn a_bad_collector_endpoint_keeps_the_uri_error() {
    let e = Tracing::start(&TracingConfig::new("http://[bad")).expect_err("not a URI");
    assert!(matches!(e, TracingError::Endpoint(_)), "{e:?}");
    check(&e, 1, |s| s.is::<http::uri::InvalidUri>());
}

#[test]
fn scrape_errors_are_errors() {
    let e: Box<dyn Error> = Box::new(ScrapeError::Status(503));
    assert_eq!(e.to_string(), "metrics answered status 503");
    assert!(e.source().is_none());
}

#[test]
fn a_tokenizer_failure_keeps_the_tokenizers_error() {
    let cause = std::io::Error::new(std::io::ErrorKind::InvalidData, "no such merge");
    let e = kvroute_frontend::TokenizeError::new(cause);
    check(&e, 1, |s| s.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::InvalidData));
}
