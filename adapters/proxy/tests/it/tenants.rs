//! Tenants: with `[[tenants]]`, `/v1/*` needs a tenant's key and the admin endpoints an
//! admin tenant's (or trust); the key never reaches a worker. Without, nothing changes.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::*;

const KEY_A: &str = "sk-team-a-0123456789";
const KEY_OPS: &str = "sk-ops-9876543210";

pub(crate) fn sha256_hex(key: &str) -> String {
    ring::digest::digest(&ring::digest::SHA256, key.as_bytes()).as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Tenant `a` and admin tenant `ops`.
fn two_tenants() -> Value {
    json!([
        {"name": "a", "api_key_sha256": sha256_hex(KEY_A)},
        {"name": "ops", "api_key_sha256": sha256_hex(KEY_OPS), "admin": true},
    ])
}

/// A proxy of one fake worker, with `tenants` (a JSON array of `[[tenants]]`; empty:
/// an open gateway) and no trusted networks.
async fn gateway(tenants: Value) -> (Fake, ServeHandle) {
    let w = Fake::start(&[MODEL]).await;
    let mut cfg = config(&[(1, w.addr)]);
    cfg.trust.cidrs.clear();
    cfg.tenants = serde_json::from_value(tenants).unwrap();
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
    if status == 429 {
        let s = a.headers.get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        assert!(s.is_some_and(|s| s >= 1), "{what}: Retry-After {s:?}");
    }
}

/// A chat of tenant `key` asking for `max_tokens`.
async fn chat_as(addr: SocketAddr, key: &str, max_tokens: u32) -> http::Response<hyper::body::Incoming> {
    let mut body = chat("hello");
    body["max_tokens"] = json!(max_tokens);
    send(addr, Method::POST, "/v1/chat/completions", &[("authorization", &format!("Bearer {key}"))], Some(&body)).await
}

async fn answer(r: http::Response<hyper::body::Incoming>) -> Answer {
    let (parts, body) = r.into_parts();
    let body = within(10_000, body.collect()).await.unwrap().to_bytes();
    Answer { status: parts.status, headers: parts.headers, body }
}

/// A request (method, path, raw `Authorization`) and its status and error code.
type Case<'a> = (Method, &'a str, Option<Vec<u8>>, u16, Option<&'a str>);

#[tokio::test]
async fn a_closed_gateway_needs_a_tenants_key() {
    let (w, p) = gateway(two_tenants()).await;
    let addr = p.local_addr();
    let bearer = |k: &str| format!("Bearer {k}").into_bytes();
    let huge = [b"Bearer ".as_slice(), &[b'x'; 8000]].concat();
    let chat_path = "/v1/chat/completions";
    let cases: Vec<Case<'_>> = vec![
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
    let forbidden = sample(&m, "kvroute_tenant_rejections_total", &["tenant=\"a\"", "reason=\"forbidden\""]);
    assert_eq!(forbidden, Some(4.0), "{m}");
}

#[tokio::test]
async fn an_admin_key_is_trusted_for_pins() {
    let w2 = Fake::start(&[MODEL]).await;
    let (_w, p) = gateway(two_tenants()).await;
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
    let (w, p) = gateway(json!([])).await;
    let addr = p.local_addr();
    check(&send_auth(addr, Method::POST, "/v1/chat/completions", None).await, "no key", 200, None);
    check(&send_auth(addr, Method::POST, "/v1/chat/completions", Some(b"Bearer vllm-key")).await, "key", 200, None);
    check(&send_auth(addr, Method::GET, "/workers", Some(b"Bearer vllm-key")).await, "admin", 403, Some("forbidden"));
    let seen = w.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen[0].headers.get("authorization").is_none());
    assert_eq!(seen[1].headers.get("authorization").unwrap(), "Bearer vllm-key", "the worker's own key passes");
}

#[tokio::test]
async fn isolated_tenants_salt_their_cache_apart_and_keep_the_clients_salt() {
    let tenants = json!([
        {"name": "a", "api_key_sha256": sha256_hex("key-a")},
        {"name": "b", "api_key_sha256": sha256_hex("key-b"), "cache": "isolated"},
        {"name": "s", "api_key_sha256": sha256_hex("key-s"), "cache": "shared"},
    ]);
    let (w, p) = gateway(tenants).await;
    let addr = p.local_addr();
    let sends = [
        ("key-a", None),
        ("key-a", None),
        ("key-b", None),
        ("key-a", Some("c1")),
        ("key-s", None),
        ("key-s", Some("c2")),
    ];
    for (key, client_salt) in sends {
        let mut body = chat("the same prompt for everyone");
        if let Some(c) = client_salt {
            body["cache_salt"] = json!(c);
        }
        let a = post(addr, "/v1/chat/completions", &[("authorization", &format!("Bearer {key}"))], &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let salts: Vec<Option<String>> =
        w.seen().iter().map(|s| s.body.get("cache_salt").and_then(Value::as_str).map(String::from)).collect();
    let [a1, a2, b, a_c1, s, s_c2] = salts.try_into().unwrap();
    let a = a1.clone().expect("an isolated tenant is salted");
    assert_eq!((a.len(), a.bytes().all(|c| c.is_ascii_hexdigit())), (32, true), "{a}");
    assert_eq!(a2, a1, "one tenant keeps one salt: its cache is shared with itself");
    assert_ne!(b.clone().unwrap(), a, "two isolated tenants never share a salt");
    assert_eq!(a_c1.unwrap(), format!("{a}:c1"), "a client's salt is combined, never replaces");
    assert_eq!((s, s_c2.as_deref()), (None, Some("c2")), "a shared tenant is not salted");
}

#[tokio::test]
async fn a_tenant_over_a_limit_gets_429_and_the_others_do_not() {
    let tenants = json!([
        {"name": "rate", "api_key_sha256": sha256_hex("key-rate"), "requests_per_second": 1},
        {"name": "tokens", "api_key_sha256": sha256_hex("key-tokens"), "tokens_per_minute": 1000},
        {"name": "conc", "api_key_sha256": sha256_hex("key-conc"), "concurrent_max": 1},
        {"name": "free", "api_key_sha256": sha256_hex("key-free")},
    ]);
    let (w, p) = gateway(tenants).await;
    let addr = p.local_addr();
    let limited = |code| (429, Some(code));
    let ok = (200, None);
    for (key, max_tokens, (status, code)) in [
        ("key-rate", 1, ok),
        ("key-rate", 1, limited("rate_limit_exceeded")),
        ("key-free", 1, ok),
        ("key-free", 900, ok),
    ] {
        check(&answer(chat_as(addr, key, max_tokens).await).await, key, status, code);
    }
    // Streams held open: a charge is trued up only at its end.
    w.set(Behavior::GatedAfterFirst { chunks: sse_chunks(3), gate: Arc::new(Semaphore::new(0)) });
    let held_tokens = chat_as(addr, "key-tokens", 900).await;
    assert_eq!(held_tokens.status(), 200);
    check(&answer(chat_as(addr, "key-tokens", 900).await).await, "tokens", 429, Some("rate_limit_exceeded"));
    let held = chat_as(addr, "key-conc", 1).await;
    assert_eq!(held.status(), 200);
    check(&answer(chat_as(addr, "key-conc", 1).await).await, "a second at once", 429, Some("rate_limit_exceeded"));
    let other = chat_as(addr, "key-free", 1).await;
    assert_eq!(other.status(), 200, "another tenant is untouched");
    drop(held);
    eventually(10_000, "a dropped stream frees its tenant's slot", || async {
        chat_as(addr, "key-conc", 1).await.status() == 200
    })
    .await;
    let m = get(addr, "/metrics").await.text();
    for (tenant, reason) in
        [("rate", "requests_per_second"), ("tokens", "tokens_per_minute"), ("conc", "concurrent_max")]
    {
        let labels = [format!("tenant=\"{tenant}\""), format!("reason=\"{reason}\"")];
        let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
        assert_eq!(sample(&m, "kvroute_tenant_rejections_total", &labels), Some(1.0), "{tenant}\n{m}");
    }
    assert!(
        sample(&m, "kvroute_tenant_requests_total", &["tenant=\"free\"", "outcome=\"ok\""]).is_some_and(|n| n >= 3.0)
    );
    assert!(sample(&m, "kvroute_tenant_prompt_tokens_total", &["tenant=\"free\""]).is_some_and(|n| n > 0.0));
}

/// A stream of `tokens` chunks, then a usage chunk saying `used` completion tokens
/// (`None`: no usage chunk).
fn stream_with_usage(tokens: usize, used: Option<u64>) -> Behavior {
    let mut chunks = sse_chunks(tokens);
    if let Some(n) = used {
        let usage =
            format!("data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":10,\"completion_tokens\":{n}}}}}\n\n");
        chunks.insert(tokens, Bytes::from(usage));
    }
    Behavior::Stream { chunks, gap_ms: 0 }
}

/// `kvroute_tenant_charged_tokens_total` of tenant `t`.
async fn charged(addr: SocketAddr, t: &str) -> f64 {
    let m = get(addr, "/metrics").await.text();
    sample(&m, "kvroute_tenant_charged_tokens_total", &[&format!("tenant=\"{t}\"")]).unwrap_or(0.0)
}

/// Sends a chat of tenant `key` asking for `max_tokens`, reads it whole, and waits until
/// its charge is trued up (the body's end reaches the proxy after the client's).
async fn used_up(addr: SocketAddr, key: &str, max_tokens: u32) -> f64 {
    let before = charged(addr, "t").await;
    let a = answer(chat_as(addr, key, max_tokens).await).await;
    assert_eq!(a.status, 200, "{}", a.text());
    for _ in 0..1000 {
        let after = charged(addr, "t").await;
        if after > before {
            return after - before;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the charge was never trued up")
}

/// A tenant of 1,000 tokens a minute (refilled at about 17 a second): a request asking
/// for 900 output tokens takes 900 plus its prompt on admission, and is charged what it
/// used at its end, so the next one fits at once.
#[tokio::test]
async fn the_token_charge_is_trued_up_to_the_usage() {
    let (w, p) = gateway(json!([
        {"name": "t", "api_key_sha256": sha256_hex("key-t"), "tokens_per_minute": 1000},
    ]))
    .await;
    let addr = p.local_addr();
    // (completion tokens streamed, usage chunk, max_tokens asked, tokens charged).
    let cases: [(usize, Option<u64>, u32, f64); 3] = [
        (5, Some(5), 900, 15.0), // the engine's usage: its prompt (10) and completion
        (3, None, 900, -1.0),    // no usage: the stream's 3 events and the router's prompt
        (2, Some(2), 900, 12.0), // and again: nothing was left owing
    ];
    for (tokens, usage, max_tokens, want) in cases {
        w.set(stream_with_usage(tokens, usage));
        let got = used_up(addr, "key-t", max_tokens).await;
        if want >= 0.0 {
            assert_eq!(got, want, "{tokens} tokens, usage {usage:?}");
        } else {
            assert!(got > tokens as f64 && got < 100.0, "{tokens} tokens without usage: charged {got}");
        }
    }
    // A request that used more than it reserved leaves the tenant in debt.
    w.set(stream_with_usage(1, Some(990)));
    assert_eq!(used_up(addr, "key-t", 1).await, 1000.0, "charged at most a minute's tokens");
    let a = answer(chat_as(addr, "key-t", 1).await).await;
    check(&a, "in debt", 429, Some("rate_limit_exceeded"));
}

/// Sends a chat with the raw `authorization` on a fresh connection; the status, or
/// `None` when the proxy closed the connection instead.
async fn status_with(addr: SocketAddr, authorization: &[u8]) -> Option<u16> {
    let body = Bytes::from(chat("hello").to_string());
    let req = http::Request::builder()
        .method(Method::POST)
        .uri(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("authorization", HeaderValue::from_bytes(authorization).unwrap())
        .body(Full::new(body))
        .unwrap();
    let r = within(10_000, client().request(req)).await.ok()?;
    let status = r.status().as_u16();
    let text = within(10_000, r.into_body().collect()).await.map(|b| b.to_bytes()).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&text).contains(KEY_A), "the key is quoted");
    Some(status)
}

/// What a bad header is, its value, and the answers allowed (`None`: the connection
/// closed).
type BadHeader<'a> = (&'a str, Vec<u8>, &'a [Option<u16>]);

/// Bad `Authorization` headers, each answered without a panic, and the proxy serving a
/// good key after every one. Past the connection's buffer (64 KiB) hyper refuses the
/// head itself: 431, or a closed connection.
#[tokio::test]
async fn bad_authorization_headers_are_refused_and_the_proxy_keeps_serving() {
    let (_w, p) = gateway(two_tenants()).await;
    let addr = p.local_addr();
    let bearer = |key: &[u8]| [b"Bearer ".as_slice(), key].concat();
    let max = kvroute_proxy::auth::AUTHORIZATION_BYTES_MAX;
    let cases: Vec<BadHeader<'_>> = vec![
        ("a one-byte key", bearer(b"k"), &[Some(401)]),
        ("the key one byte short", bearer(&KEY_A.as_bytes()[1..]), &[Some(401)]),
        ("the key one byte long", bearer(format!("{KEY_A}x").as_bytes()), &[Some(401)]),
        ("the longest header read", bearer(&vec![b'k'; max - 7]), &[Some(401)]),
        ("a byte past it", bearer(&vec![b'k'; max - 6]), &[Some(401)]),
        ("not UTF-8", bearer(&[0xc3, 0x28, 0xff, 0x80]), &[Some(401)]),
        ("the key after Latin-1", bearer(&[b"\xe9".as_slice(), KEY_A.as_bytes()].concat()), &[Some(401)]),
        ("a tab in the key", bearer(b"sk-team\t-a"), &[Some(401)]),
        ("60 KiB", bearer(&vec![b'k'; 60 << 10]), &[Some(401), Some(431)]),
        ("1 MiB", bearer(&vec![b'k'; 1 << 20]), &[Some(431), None]),
    ];
    for (what, value, want) in cases {
        let got = status_with(addr, &value).await;
        assert!(want.contains(&got), "{what}: {got:?}, want one of {want:?}");
        assert_eq!(status_with(addr, &bearer(KEY_A.as_bytes())).await, Some(200), "after {what}");
    }
}

/// Sends a POST to `path` with `authorization`, declaring a `declared`-byte body but
/// sending only `body`, and returns the answer's head (status line and headers, lowercase).
async fn head_of(addr: SocketAddr, path: &str, authorization: &str, declared: usize, body: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: {authorization}\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    );
    s.write_all(&[head.as_bytes(), body].concat()).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while !out.windows(4).any(|w| w == b"\r\n\r\n") {
        match within(10_000, s.read(&mut buf)).await {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).to_ascii_lowercase()
}

/// A request (what, path, `Authorization`, declared body size, body sent), the status
/// it gets, and whether the answer says `connection: close`.
type Unread<'a> = (&'a str, &'a str, &'a str, usize, Vec<u8>, &'a str, bool);

/// An answer given before the request's body is read says `connection: close`: hyper
/// closes such a connection, and a client told nothing reuses it and sees it drop
/// (the `openai` client's "Server disconnected without sending a response"). Answers
/// after the body is read keep the connection.
#[tokio::test]
async fn a_refusal_before_the_body_is_read_tells_the_client_to_reconnect() {
    let (_w, p) = gateway(two_tenants()).await;
    let addr = p.local_addr();
    let good = format!("Bearer {KEY_A}");
    let stranger = "Bearer sk-stranger";
    let chat_body = chat("hello").to_string().into_bytes();
    let chat_path = "/v1/chat/completions";
    let cases: Vec<Unread<'_>> = vec![
        ("a stranger's chat", chat_path, stranger, 100, vec![], "401", true),
        ("a stranger's unknown path", "/v1/nothing-here", stranger, 100, vec![], "401", true),
        ("a body past the limit", chat_path, &good, 9 << 20, vec![], "413", true),
        ("a tenant's unknown path", "/v1/nothing-here", &good, 100, vec![], "404", true),
        ("a tenant at an admin endpoint", "/route/preview", &good, 100, vec![], "403", true),
        ("a body that is not JSON", chat_path, &good, 9, b"{not json".to_vec(), "400", false),
        ("a served chat", chat_path, &good, chat_body.len(), chat_body.clone(), "200", false),
    ];
    for (what, path, authorization, declared, body, status, closes) in cases {
        let head = head_of(addr, path, authorization, declared, &body).await;
        assert!(head.starts_with(&format!("http/1.1 {status}")), "{what}: {head}");
        assert_eq!(head.contains("\r\nconnection: close\r\n"), closes, "{what}: {head}");
    }
}
