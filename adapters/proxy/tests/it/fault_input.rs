//! Fault injection, hostile input (issue #8, scenarios 7 and 10): bad session ids and
//! header tricks, sent as raw bytes where a well-behaved client library would refuse to.
//! Nothing hostile reaches a worker, and no internal header ever does.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::fault_common::metric;
use crate::*;

/// Writes `request` on a fresh connection and reads until the proxy closes it (or 5 s
/// pass); returns everything read.
async fn raw(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A chat POST with `extra` header lines (each ending in CRLF), framed by content-length,
/// asking the proxy to close the connection after answering.
fn chat_request(extra: &[u8]) -> Vec<u8> {
    let body = chat("hi").to_string();
    let mut r =
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
            .to_vec();
    r.extend_from_slice(extra);
    r.extend_from_slice(format!("content-length: {}\r\n\r\n{body}", body.len()).as_bytes());
    r
}

/// The status of the first answer in `text`, and its body parsed as JSON when it is JSON.
fn status_and_json(text: &str) -> (u16, Value) {
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// Scenario 7: a session id that is empty, blank, non-UTF-8, repeated or longer than
/// `limits.session_id_bytes_max` (256 by default) gets a 400 in the OpenAI error shape and
/// never reaches a worker; one of exactly 256 bytes is served.
#[tokio::test]
async fn f7_bad_session_ids_get_a_400_in_the_openai_shape_and_reach_no_worker() {
    let w = Fake::start(&[MODEL]).await;
    let p = start(config(&[(1, w.addr)])).await;
    let addr = p.local_addr();
    let long = |n: usize| format!("x-session-id: {}\r\n", "s".repeat(n)).into_bytes();
    let cases: [(&str, Vec<u8>, u16); 7] = [
        ("empty", b"x-session-id: \r\n".to_vec(), 400),
        ("blank", b"x-session-id:    \r\n".to_vec(), 400),
        ("not UTF-8", b"x-session-id: \xff\xfe\xc3\r\n".to_vec(), 400),
        ("repeated", b"x-session-id: a\r\nx-session-id: b\r\n".to_vec(), 400),
        ("257 bytes", long(257), 400),
        ("30 kB, still under the head limit", long(30_000), 400),
        ("256 bytes", long(256), 200),
    ];
    for (what, header, want) in cases {
        let (status, json) = status_and_json(&raw(addr, &chat_request(&header)).await);
        assert_eq!(status, want, "{what}: {json}");
        if want == 400 {
            let e = &json["error"];
            assert_eq!(
                (e["code"].as_str(), e["type"].as_str()),
                (Some("invalid_request"), Some("invalid_request_error"))
            );
            assert!(e["message"].as_str().unwrap().contains("session id"), "{what}: {json}");
        }
    }
    assert_eq!(w.seen().len(), 1, "only the good session id reached the worker");
    eventually(10_000, "released", || released(addr)).await;
}

/// Headers that must never reach a worker: hop-by-hop ones, the ones `Connection`
/// names, the proxy's own routing and trust headers, and anything `x-kvroute-*`.
const NEVER_UPSTREAM: [&str; 17] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
    "transfer-encoding",
    "x-hop-named",
    "x-worker-id",
    "x-dp-rank",
    "x-prefill-worker-id",
    "x-decode-worker-id",
    "x-kvroute-token",
    "x-kvroute-preview",
    "x-kvroute-anything",
    "x-data-parallel-rank",
];

/// Scenario 10, hop-by-hop and internal headers: from an untrusted client (whose routing
/// headers are also counted as stripped) and from a trusted one (whose pin is honoured),
/// the worker's capture shows none of [`NEVER_UPSTREAM`], while end-to-end headers pass.
#[tokio::test]
async fn f10_no_hop_by_hop_or_internal_header_reaches_a_worker() {
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    let mut cfg = config(&[(1, fakes[0].addr), (2, fakes[1].addr)]);
    cfg.trust.cidrs.clear();
    cfg.trust.token = Some("s3cret".into());
    let p = start(cfg).await;
    let addr = p.local_addr();
    let hostile: &[u8] = b"connection: keep-alive, x-hop-named\r\nx-hop-named: 1\r\nkeep-alive: timeout=5\r\n\
proxy-connection: keep-alive\r\nproxy-authorization: Basic Zm9vOmJhcg==\r\nte: trailers\r\ntrailer: x-t\r\n\
upgrade: websocket\r\nx-kvroute-anything: 1\r\nx-data-parallel-rank: 3\r\n\
authorization: Bearer client-key\r\nx-request-id: r-1\r\nx-session-id: s-1\r\n";
    let untrusted: &[u8] = b"x-worker-id: 2\r\nx-dp-rank: 0\r\nx-prefill-worker-id: 1\r\nx-decode-worker-id: 2\r\n\
x-kvroute-preview: 1\r\nx-kvroute-token: wrong\r\n";
    let trusted: &[u8] = b"x-worker-id: 2\r\nx-kvroute-token: s3cret\r\n";
    for (who, extra) in [("untrusted", untrusted), ("trusted", trusted)] {
        let text = raw(addr, &chat_request(&[hostile, extra].concat())).await;
        let (status, _) = status_and_json(&text);
        assert_eq!(status, 200, "{who}: {text}");
        assert!(text.contains("data: [DONE]"), "{who}: served, not previewed: {text}");
    }
    let seen: Vec<_> = fakes.iter().flat_map(|f| f.seen()).collect();
    assert_eq!(seen.len(), 2);
    assert!(!fakes[1].seen().is_empty(), "the trusted pin held");
    for s in &seen {
        for h in NEVER_UPSTREAM {
            assert!(!s.headers.contains_key(h), "{h} reached the worker: {:?}", s.headers);
        }
        for (h, v) in [("authorization", "Bearer client-key"), ("x-request-id", "r-1"), ("x-session-id", "s-1")] {
            assert_eq!(s.headers.get(h).map(|v| v.to_str().unwrap()), Some(v), "{h} is end-to-end");
        }
    }
    let m = get_trusted(addr).await;
    for field in ["x-worker-id", "x-dp-rank", "x-prefill-worker-id", "x-decode-worker-id", "x-kvroute-preview"] {
        let n = metric(&m, "kvroute_untrusted_fields_stripped_total", &[&format!("field=\"{field}\"")]);
        assert_eq!(n, 1.0, "the untrusted {field} was counted once");
    }
}

async fn get_trusted(addr: SocketAddr) -> String {
    call(addr, http::Method::GET, "/metrics", &[], None).await.text()
}

/// Scenario 10, framing and injection: each request is refused with a 400 (or, for
/// Content-Length with Transfer-Encoding, framed by Transfer-Encoding alone as RFC 9112
/// §6.1 allows, with the connection closed after the one answer so that nothing
/// smuggled behind it is ever read), and no worker sees any of it.
#[tokio::test]
async fn f10_crlf_injection_and_ambiguous_framing_are_refused() {
    let w = Fake::start(&[MODEL]).await;
    let p = start(config(&[(1, w.addr)])).await;
    let addr = p.local_addr();
    let body = chat("hi").to_string();
    let post = |headers: &str, body: &str| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{headers}\r\n{body}"
        )
        .into_bytes()
    };
    let n = body.len();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("a bare CR inside a value", post(&format!("x-a: b\rx-injected: 1\r\ncontent-length: {n}\r\n"), &body)),
        ("a NUL inside a value", post(&format!("x-a: b\0c\r\ncontent-length: {n}\r\n"), &body)),
        ("an obsolete folded line", post(&format!("x-a: b\r\n x-injected: 1\r\ncontent-length: {n}\r\n"), &body)),
        ("a space before the colon", post(&format!("x-injected : 1\r\ncontent-length: {n}\r\n"), &body)),
        ("two different lengths", post(&format!("content-length: {n}\r\ncontent-length: {}\r\n", n + 1), &body)),
        ("a list of lengths", post(&format!("content-length: {n}, {}\r\n", n + 1), &body)),
        ("a signed length", post(&format!("content-length: +{n}\r\n"), &body)),
        ("a final encoding other than chunked", post("transfer-encoding: chunked, gzip\r\n", "0\r\n\r\n")),
        ("an unknown encoding", post("transfer-encoding: identity\r\n", &body)),
    ];
    for (what, req) in cases {
        let text = raw(addr, &req).await;
        let (status, _) = status_and_json(&text);
        assert_eq!(status, 400, "{what}: {text:?}");
        assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "{what}: one answer, then the connection closes");
    }
    let http10 = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n{n:x}\r\n{body}\r\n0\r\n\r\n"
    );
    let text = raw(addr, http10.as_bytes()).await;
    assert_eq!(status_and_json(&text).0, 400, "HTTP/1.0 has no chunked framing: {text:?}");
    assert!(w.seen().is_empty(), "nothing malformed reached the worker: {:?}", w.seen());

    // Content-Length and Transfer-Encoding both: the chunked body is the request, the
    // length is ignored, and the smuggled request behind it is never read.
    let smuggled = "GET /workers HTTP/1.1\r\nhost: x\r\n\r\n";
    let req =
        post("content-length: 4\r\ntransfer-encoding: chunked\r\n", &format!("{n:x}\r\n{body}\r\n0\r\n\r\n{smuggled}"));
    let text = raw(addr, &req).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "the smuggled request was never answered: {text}");
    assert!(!text.contains("\"pools\""), "{text}");
    let seen = w.seen();
    assert_eq!(seen.len(), 1);
    // A stream that may migrate also asks the worker for token ids (`return_token_ids`).
    let mut got = seen[0].body.clone();
    got.as_object_mut().unwrap().remove("return_token_ids");
    assert_eq!(got, chat("hi"), "the worker got the chunked body, whole");

    // An encoded CR LF in the target stays encoded: it is no header anywhere.
    let encoded = format!(
        "POST /v1/chat/completions?x=%0d%0ax-injected:%201 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
content-length: {n}\r\n\r\n{body}"
    );
    let text = raw(addr, encoded.as_bytes()).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let last = w.seen().pop().unwrap();
    assert!(last.headers.get("x-injected").is_none(), "{:?}", last.headers);
}
