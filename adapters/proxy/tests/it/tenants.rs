//! Tenants: with `[[tenants]]`, `/v1/*` needs a tenant's key and the admin endpoints an
//! admin tenant's (or trust); the key never reaches a worker. Without, nothing changes.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderValue, Method};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use crate::*;

const KEY_A: &str = "sk-team-a-0123456789";
const KEY_OPS: &str = "sk-ops-9876543210";

fn sha256_hex(key: &str) -> String {
    ring::digest::digest(&ring::digest::SHA256, key.as_bytes()).as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// A proxy of one fake worker, with tenant `a` and admin tenant `ops` (when `closed`),
/// no trusted networks.
async fn gateway(closed: bool) -> (Fake, ServeHandle) {
    let w = Fake::start(&[MODEL]).await;
    let mut cfg = config(&[(1, w.addr)]);
    cfg.trust.cidrs.clear();
    if closed {
        cfg.tenants = serde_json::from_value(json!([
            {"name": "a", "api_key_sha256": sha256_hex(KEY_A)},
            {"name": "ops", "api_key_sha256": sha256_hex(KEY_OPS), "admin": true},
        ]))
        .unwrap();
    }
    (w, start(cfg).await)
}

/// Sends `method path` with `authorization` (raw bytes, any) and the body of a chat.
async fn send_auth(addr: SocketAddr, method: Method, path: &str, authorization: Option<&[u8]>) -> Answer {
    let body = Bytes::from(chat("hello").to_string());
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    if let Some(v) = authorization {
        req.headers_mut().insert("authorization", HeaderValue::from_bytes(v).unwrap());
    }
    let resp = within(10_000, client().request(req)).await.expect("the proxy answers");
    let (parts, body) = resp.into_parts();
    let body = within(10_000, body.collect()).await.unwrap().to_bytes();
    Answer { status: parts.status, headers: parts.headers, body }
}

/// `method path` with `authorization` answers `status`; a refusal is an OpenAI error
/// with `code`, and never echoes the header.
#[track_caller]
fn check(a: &Answer, what: &str, status: u16, code: Option<&str>) {
    assert_eq!(a.status.as_u16(), status, "{what}: {}", a.text());
    let text = a.text();
    for key in [KEY_A, KEY_OPS, "garbage-key"] {
        assert!(!text.contains(key), "{what}: the key leaked into {text}");
    }
    if let Some(code) = code {
        let v: Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(v["error"]["code"], code, "{what}: {text}");
    }
}

#[tokio::test]
async fn a_closed_gateway_needs_a_tenants_key() {
    let (w, p) = gateway(true).await;
    let addr = p.local_addr();
    let bearer = |k: &str| format!("Bearer {k}").into_bytes();
    let huge = [b"Bearer ".as_slice(), &[b'x'; 8000]].concat();
    let chat_path = "/v1/chat/completions";
    let cases: Vec<(Method, &str, Option<Vec<u8>>, u16, Option<&str>)> = vec![
        (Method::POST, chat_path, None, 401, Some("invalid_api_key")),
        (Method::POST, chat_path, Some(bearer("garbage-key")), 401, Some("invalid_api_key")),
        (Method::POST, chat_path, Some(b"Bearer \xff\xfe".to_vec()), 401, Some("invalid_api_key")),
        (Method::POST, chat_path, Some(format!("Basic {KEY_A}").into_bytes()), 401, Some("invalid_api_key")),
        (Method::POST, chat_path, Some(huge), 401, Some("invalid_api_key")),
        (Method::POST, "/v1/completions", None, 401, Some("invalid_api_key")),
        (Method::GET, "/v1/models", None, 401, Some("invalid_api_key")),
        (Method::GET, "/v1/nothing-here", None, 401, Some("invalid_api_key")),
        (Method::POST, chat_path, Some(bearer(KEY_A)), 200, None),
        (Method::POST, chat_path, Some(bearer(KEY_OPS)), 200, None),
        (Method::GET, "/v1/models", Some(bearer(KEY_A)), 200, None),
        (Method::GET, "/workers", None, 401, Some("invalid_api_key")),
        (Method::GET, "/workers", Some(bearer("garbage-key")), 401, Some("invalid_api_key")),
        (Method::GET, "/workers", Some(bearer(KEY_A)), 403, Some("forbidden")),
        (Method::POST, "/route/preview", Some(bearer(KEY_A)), 403, Some("forbidden")),
        (Method::DELETE, "/workers/1", Some(bearer(KEY_A)), 403, Some("forbidden")),
        (Method::POST, "/workers/1/drain", Some(bearer(KEY_A)), 403, Some("forbidden")),
        (Method::GET, "/workers", Some(bearer(KEY_OPS)), 200, None),
        (Method::POST, "/route/preview", Some(bearer(KEY_OPS)), 200, None),
        (Method::GET, "/health", None, 200, None),
        (Method::GET, "/metrics", None, 200, None),
    ];
    for (method, path, auth, status, code) in cases {
        let what = format!("{method} {path} with {:?}", auth.as_ref().map(|a| a.len()));
        check(&send_auth(addr, method, path, auth.as_deref()).await, &what, status, code);
    }
    let seen = w.seen();
    assert_eq!(seen.len(), 2, "only the two keyed chats reach the worker");
    for s in seen {
        assert!(s.headers.get("authorization").is_none(), "a tenant's key was forwarded");
    }
    let m = get(addr, "/metrics").await.text();
    assert!(!m.contains(KEY_A) && !m.contains(&sha256_hex(KEY_A)), "a key in the metrics");
}

#[tokio::test]
async fn an_admin_key_is_trusted_for_pins() {
    let w2 = Fake::start(&[MODEL]).await;
    let (_w, p) = gateway(true).await;
    p.add_worker(worker(2, w2.addr)).unwrap();
    let addr = p.local_addr();
    for (key, pinned) in [(KEY_OPS, true), (KEY_A, false)] {
        let auth = format!("Bearer {key}");
        let mut served = Vec::new();
        for _ in 0..4 {
            let a =
                post(addr, "/v1/chat/completions", &[("authorization", &auth), ("x-worker-id", "2")], &chat("x")).await;
            assert_eq!(a.status, 200, "{}", a.text());
            served.push(a.worker().unwrap());
        }
        assert_eq!(served.iter().all(|&w| w == 2), pinned, "{key}: {served:?}");
    }
}

#[tokio::test]
async fn an_open_gateway_is_unchanged_and_forwards_the_workers_key() {
    let (w, p) = gateway(false).await;
    let addr = p.local_addr();
    check(&send_auth(addr, Method::POST, "/v1/chat/completions", None).await, "no key", 200, None);
    check(&send_auth(addr, Method::POST, "/v1/chat/completions", Some(b"Bearer vllm-key")).await, "key", 200, None);
    check(&send_auth(addr, Method::GET, "/workers", Some(b"Bearer vllm-key")).await, "admin", 403, Some("forbidden"));
    let seen = w.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen[0].headers.get("authorization").is_none());
    assert_eq!(seen[1].headers.get("authorization").unwrap(), "Bearer vllm-key", "the worker's own key passes");
}
