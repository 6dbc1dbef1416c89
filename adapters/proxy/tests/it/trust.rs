//! Trust: pins, preview and priorities only from trusted clients; admin behind trust.

use http::Method;
use serde_json::json;

use crate::*;

#[tokio::test]
async fn untrusted_pins_are_stripped_and_counted() {
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    let mut cfg = config(&[(1, fakes[0].addr), (2, fakes[1].addr)]);
    cfg.trust.cidrs.clear();
    cfg.trust.token = Some("s3cret".into());
    let p = start(cfg).await;
    let addr = p.local_addr();
    let mut body = chat("x");
    body["kvroute"] = json!({"priority": 5, "policy_class": "vip"});
    let mut served = Vec::new();
    for _ in 0..4 {
        let a = post(addr, "/v1/chat/completions", &[("x-worker-id", "2"), ("x-dp-rank", "0")], &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        served.push(a.worker().unwrap());
    }
    assert!(served.contains(&1), "an untrusted pin is ignored: {served:?}");
    let m = get(addr, "/metrics").await.text();
    for field in ["x-worker-id", "x-dp-rank", "priority", "policy_class"] {
        assert_eq!(
            sample(&m, "kvroute_untrusted_fields_stripped_total", &[&format!("field=\"{field}\"")]),
            Some(4.0),
            "{field}"
        );
    }
    let auth = [("x-worker-id", "2"), ("x-kvroute-token", "s3cret")];
    for _ in 0..3 {
        assert_eq!(post(addr, "/v1/chat/completions", &auth, &body).await.worker(), Some(2), "a trusted pin holds");
    }
    for seen in fakes.iter().flat_map(|f| f.seen()) {
        for h in ["x-worker-id", "x-dp-rank", "x-kvroute-token"] {
            assert!(seen.headers.get(h).is_none(), "{h} leaked upstream");
        }
        assert!(seen.body.get("kvroute").is_none());
    }
}

#[tokio::test]
async fn admin_endpoints_need_trust() {
    let w = Fake::start(&[MODEL]).await;
    let mut cfg = config(&[(1, w.addr)]);
    cfg.trust.cidrs.clear();
    cfg.trust.token = Some("t0k".into());
    let p = start(cfg).await;
    let addr = p.local_addr();
    let cases = [
        (Method::GET, "/workers"),
        (Method::POST, "/workers"),
        (Method::DELETE, "/workers/1"),
        (Method::POST, "/route/preview"),
    ];
    for (m, path) in cases {
        let a = call(addr, m.clone(), path, &[], Some(&chat("x"))).await;
        assert_eq!(a.status, 403, "{m} {path}");
    }
    assert_eq!(call(addr, Method::GET, "/workers", &[("x-kvroute-token", "t0k")], None).await.status, 200);
    let preview = post(addr, "/v1/chat/completions", &[("x-kvroute-preview", "1")], &chat("x")).await;
    assert_eq!((preview.status.as_u16(), preview.worker()), (200, Some(1)), "an untrusted preview flag is ignored");
    assert_eq!(preview.body, sse_chunks(3).concat());
}
