//! Why the picker did not start, as a chain: each error's `source()` is the one it
//! wraps, and each message prints the one beneath it, since the binary quotes it whole.

use std::error::Error;

use kvroute_epp::EppError;
use kvroute_frontend::{StartError, Tokenizers};
use serde_json::json;

use crate::{config, MODEL};

/// The chain from `e` down, one message per level.
fn chain(e: &(dyn Error + 'static)) -> Vec<String> {
    std::iter::successors(Some(e), |&e| e.source()).map(ToString::to_string).collect()
}

/// `e`'s chain is `depth` levels deep, each message printing the next, and the last
/// passes `cause`.
#[track_caller]
fn check(e: &(dyn Error + 'static), depth: usize, cause: fn(&(dyn Error + 'static)) -> bool) {
    let levels = chain(e);
    assert_eq!(levels.len(), depth, "{e:?}: {levels:?}");
    for w in levels.windows(2) {
        assert!(w[0].contains(&w[1]), "{:?} does not print its source {:?}", w[0], w[1]);
    }
    let mut last = e;
    while let Some(s) = last.source() {
        last = s;
    }
    assert!(cause(last), "{e:?}: the last cause is {last:?}");
}

async fn serve_err(cfg: kvroute_epp::EppConfig) -> EppError {
    match kvroute_epp::serve(cfg, Tokenizers::new()).await {
        Err(e) => e,
        Ok(_) => panic!("the picker started"),
    }
}

#[tokio::test]
async fn a_taken_port_is_the_os_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut cfg = config(&[]);
    cfg.listen = taken.local_addr().unwrap();
    let e = serve_err(cfg).await;
    assert!(matches!(e, EppError::Bind(_)), "{e:?}");
    check(&e, 2, |s| s.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::AddrInUse));
}

#[tokio::test]
async fn a_worker_the_router_refuses_chains_down_to_the_core() {
    let mut cfg = config(&[]);
    let w = json!({"id": 3, "url": "http://127.0.0.1:1", "model": MODEL, "dp_ranks": 4_000_000_000u32});
    cfg.proxy.workers = vec![serde_json::from_value(w).unwrap()];
    let e = serve_err(cfg).await;
    assert!(matches!(e, EppError::Start(StartError::Worker { id: 3, .. })), "{e:?}");
    // EppError, StartError, FleetError, DriveError, InputError, WorkerError.
    check(&e, 6, |s| s.is::<router_core::WorkerError>());
}

#[tokio::test]
async fn tenants_are_refused_since_the_picker_authenticates_no_one() {
    let mut cfg = config(&[]);
    let t = json!([{"name": "a", "api_key_sha256": "ab".repeat(32)}]);
    cfg.proxy.tenants = serde_json::from_value(t).unwrap();
    let e = serve_err(cfg).await;
    assert!(matches!(e, EppError::TenantsUnsupported), "{e:?}");
    assert!(e.to_string().contains("does not authenticate"), "{e}");
    check(&e, 1, |_| true);
}
