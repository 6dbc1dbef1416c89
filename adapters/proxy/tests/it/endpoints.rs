//! Every endpoint vLLM serves, through a closed gateway in front of sim-workers: each
//! passes through with the tenant's key, is refused without one (401), and a model the
//! tenant may not use is one it cannot see (404). Unknown paths get a JSON 404, a wrong
//! method a 405. `/v1/models` lists what the tenant may use, from a cache refreshed
//! when the workers change. Responses route by their prefix.

use std::net::SocketAddr;

use http::Method;
use kvroute_proxy::ServeHandle;
use router_core::RouterMode;
use serde_json::{json, Value};

use crate::sims::Sims;
use crate::*;

/// A tenant that may use every model.
pub const KEY_ALL: &str = "sk-endpoints-all-0123456789";
/// A tenant that may use model `n` only.
pub const KEY_N: &str = "sk-endpoints-n-0123456789";
/// A tenant with one request in progress at most.
const KEY_ONE: &str = "sk-endpoints-one-0123456789";

fn sha256_hex(key: &str) -> String {
    ring::digest::digest(&ring::digest::SHA256, key.as_bytes()).as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Two sim-workers of model `m` (ids 1, 2), a fake worker of model `n` (id 3) that
/// answers JSON, both tenants, `m` the default model, kv routing.
pub struct Gateway {
    pub sims: Sims,
    pub n: Fake,
    pub proxy: ServeHandle,
}

impl Gateway {
    pub async fn start() -> Gateway {
        let sims = Sims::start(2).await;
        let n = Fake::start(&["n"]).await;
        n.set(Behavior::Json);
        let mut cfg = sims.config();
        cfg.router.mode = RouterMode::Kv;
        cfg.default_model = Some(MODEL.into());
        cfg.models.push(serde_json::from_value(json!({"name": "n", "block_size": 16})).unwrap());
        cfg.workers.push(serde_json::from_value(json!({"id": 3, "url": n.url(), "model": "n"})).unwrap());
        cfg.tenants = serde_json::from_value(json!([
            {"name": "all", "api_key_sha256": sha256_hex(KEY_ALL)},
            {"name": "narrow", "api_key_sha256": sha256_hex(KEY_N), "models": ["n"]},
            {"name": "one", "api_key_sha256": sha256_hex(KEY_ONE), "concurrent_max": 1},
        ]))
        .unwrap();
        let proxy = start(cfg).await;
        Gateway { sims, n, proxy }
    }

    pub fn addr(&self) -> SocketAddr {
        self.proxy.local_addr()
    }

    pub async fn stop(self) {
        let _ = self.proxy.shutdown().await;
        self.sims.stop().await;
    }
}

/// One request and what it must get: its status, and `(JSON pointer, value)` pairs
/// that hold in the answer.
struct Case {
    method: Method,
    path: &'static str,
    key: Option<&'static str>,
    body: Option<Value>,
    status: u16,
    want: Vec<(&'static str, Value)>,
}

fn case(method: Method, path: &'static str, key: Option<&'static str>, body: Option<Value>) -> Case {
    Case { method, path, key, body, status: 200, want: Vec::new() }
}

impl Case {
    fn is(mut self, status: u16, want: &[(&'static str, Value)]) -> Case {
        self.status = status;
        self.want = want.to_vec();
        self
    }
}

async fn check(addr: SocketAddr, c: &Case) -> Answer {
    let auth = c.key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let a = call(addr, c.method.clone(), c.path, &headers, c.body.as_ref()).await;
    let what = format!("{} {} key {:?} {:?}", c.method, c.path, c.key, c.body);
    assert_eq!(a.status.as_u16(), c.status, "{what}: {}", a.text());
    let v: Value = serde_json::from_slice(&a.body).unwrap_or_else(|_| panic!("{what}: not JSON: {}", a.text()));
    for (pointer, value) in &c.want {
        assert_eq!(v.pointer(pointer), Some(value), "{what} at {pointer}: {v}");
    }
    a
}

/// The bodies of every forwarded endpoint, for model `m`.
fn every_endpoint() -> Vec<(&'static str, Value, &'static str, Value)> {
    let m = MODEL;
    vec![
        ("/v1/responses", json!({"model": m, "input": "hi", "max_output_tokens": 2}), "/object", json!("response")),
        ("/v1/embeddings", json!({"model": m, "input": "hello"}), "/data/0/object", json!("embedding")),
        ("/v1/score", json!({"model": m, "queries": "q", "documents": ["a", "b"]}), "/data/1/object", json!("score")),
        ("/score", json!({"model": m, "text_1": "q", "text_2": ["a"]}), "/data/0/object", json!("score")),
        ("/v1/rerank", json!({"model": m, "query": "q", "documents": ["a", "q"]}), "/results/0/index", json!(1)),
        ("/rerank", json!({"model": m, "query": "q", "documents": ["a"]}), "/model", json!(m)),
        ("/v2/rerank", json!({"model": m, "query": "q", "documents": ["a"]}), "/model", json!(m)),
        ("/tokenize", json!({"model": m, "prompt": "hello"}), "/count", json!(2)),
        ("/detokenize", json!({"model": m, "tokens": [1819043176, 111]}), "/prompt", json!("hello")),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_vllm_endpoint_passes_with_a_key_and_is_refused_without() {
    let g = Gateway::start().await;
    let mut cases = Vec::new();
    for (path, body, pointer, value) in every_endpoint() {
        cases.push(case(Method::POST, path, Some(KEY_ALL), Some(body.clone())).is(200, &[(pointer, value)]));
        let refused = [("/error/code", json!("invalid_api_key"))];
        cases.push(case(Method::POST, path, None, Some(body.clone())).is(401, &refused));
        cases.push(case(Method::POST, path, Some("sk-wrong"), Some(body.clone())).is(401, &refused));
        let hidden = [("/error/code", json!("model_not_found"))];
        cases.push(case(Method::POST, path, Some(KEY_N), Some(body)).is(404, &hidden));
        cases.push(case(Method::GET, path, None, None).is(401, &refused));
        cases.push(
            case(Method::GET, path, Some(KEY_ALL), None).is(405, &[("/error/code", json!("method_not_allowed"))]),
        );
    }
    let not_found = [("/error/code", json!("not_found")), ("/error/type", json!("invalid_request_error"))];
    cases.extend([
        case(Method::POST, "/tokenize", Some(KEY_ALL), Some(json!({"prompt": "hello"})))
            .is(200, &[("/count", json!(2))]),
        case(Method::POST, "/tokenize", Some(KEY_N), Some(json!({"prompt": "hello"}))).is(404, &[]),
        case(Method::POST, "/v1/embeddings", Some(KEY_N), Some(json!({"model": "n", "input": "x"}))).is(200, &[]),
        case(Method::POST, "/v1/nothing", Some(KEY_ALL), Some(json!({}))).is(404, &not_found),
        case(Method::POST, "/v1/nothing", None, Some(json!({}))).is(401, &[]),
        case(Method::GET, "/nothing", None, None).is(404, &not_found),
        case(Method::GET, "/v1/responses/resp_1", Some(KEY_ALL), None).is(404, &not_found),
        case(Method::GET, "/v1/models", None, None).is(401, &[("/error/code", json!("invalid_api_key"))]),
        case(Method::GET, "/v1/models/m", Some(KEY_ALL), None).is(200, &[("/id", json!("m"))]),
        case(Method::GET, "/v1/models/m", Some(KEY_N), None).is(404, &[("/error/code", json!("model_not_found"))]),
        case(Method::GET, "/v1/models/n", Some(KEY_N), None).is(200, &[("/id", json!("n"))]),
        case(Method::POST, "/v1/responses", Some(KEY_ALL), Some(json!({"model": "m", "input": []}))).is(400, &[]),
    ]);
    for c in &cases {
        check(g.addr(), c).await;
    }
    g.stop().await;
}

/// An isolated tenant's salt goes to the endpoints whose engine requests take one, and
/// no key reaches a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salts_go_where_vllm_takes_them_and_keys_go_nowhere() {
    let g = Gateway::start().await;
    let bodies = [
        ("/v1/responses", json!({"model": "n", "input": "x"}), true),
        ("/v1/embeddings", json!({"model": "n", "input": "x"}), true),
        ("/v1/score", json!({"model": "n", "queries": "q", "documents": ["d"]}), true),
        ("/v1/rerank", json!({"model": "n", "query": "q", "documents": ["d"]}), true),
        ("/tokenize", json!({"model": "n", "prompt": "x"}), false),
        ("/detokenize", json!({"model": "n", "tokens": [1]}), false),
    ];
    for (path, body, _) in &bodies {
        check(g.addr(), &case(Method::POST, path, Some(KEY_N), Some(body.clone()))).await;
    }
    let seen = g.n.seen();
    assert_eq!(seen.len(), bodies.len());
    for (s, (path, _, salted)) in seen.iter().zip(&bodies) {
        assert_eq!(s.path, *path);
        assert_eq!(s.body["cache_salt"].is_string(), *salted, "{path}: {}", s.body);
        assert!(s.headers.get("authorization").is_none(), "{path}: the key reached the worker");
    }
    g.stop().await;
}

/// The new endpoints are under the tenant's limits like the others: while one request
/// of a `concurrent_max = 1` tenant is in progress, each gets a 429 with `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_is_under_the_tenants_limits() {
    let g = Gateway::start().await;
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    g.n.set(Behavior::Gated { chunks: crate::fake::sse_chunks(2), gate: gate.clone() });
    let addr = g.addr();
    let held = tokio::spawn(async move {
        let body = json!({"model": "n", "input": "held", "stream": true});
        let auth = format!("Bearer {KEY_ONE}");
        post(addr, "/v1/responses", &[("authorization", auth.as_str())], &body).await
    });
    eventually(10_000, "the held request reached its worker", || async { g.n.seen().len() == 1 }).await;
    let over = [("/error/code", json!("rate_limit_exceeded"))];
    for (path, mut body, _, _) in every_endpoint() {
        body["model"] = json!("n");
        let a = check(addr, &case(Method::POST, path, Some(KEY_ONE), Some(body)).is(429, &over)).await;
        assert!(a.headers.contains_key("retry-after"), "{path}: no Retry-After");
    }
    gate.add_permits(2);
    assert_eq!(within(10_000, held).await.unwrap().status, 200);
    g.stop().await;
}

fn ids(v: &Value) -> Vec<String> {
    v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect()
}

async fn models(addr: SocketAddr, key: &'static str) -> Vec<String> {
    ids(&check(addr, &case(Method::GET, "/v1/models", Some(key), None)).await.json())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_cached_until_the_workers_change_and_listed_per_tenant() {
    let g = Gateway::start().await;
    let a = g.addr();
    assert_eq!(models(a, KEY_ALL).await, ["m", "m-lora", "n"]);
    assert_eq!(models(a, KEY_N).await, ["n"]);
    // A worker that lists a model of its own: the fleet changed, so the listing is made again.
    let extra = Fake::start(&["extra"]).await;
    g.proxy.add_worker(serde_json::from_value(json!({"id": 4, "url": extra.url(), "model": MODEL})).unwrap()).unwrap();
    assert_eq!(models(a, KEY_ALL).await, ["extra", "m", "m-lora", "n"]);
    assert_eq!(models(a, KEY_N).await, ["n"], "`extra` belongs to no model the tenant may use");
    // The worker is gone but still registered: the cached listing is served, not asked again.
    extra.kill();
    for _ in 0..3 {
        assert_eq!(models(a, KEY_ALL).await, ["extra", "m", "m-lora", "n"]);
    }
    assert!(g.proxy.remove_worker(4));
    assert_eq!(models(a, KEY_ALL).await, ["m", "m-lora", "n"]);
    g.stop().await;
}

/// A long system prompt of its own for conversation `i`: several blocks.
fn instructions(i: usize) -> String {
    format!("Conversation {i}. ") + &"You answer questions about caches and routers, tersely. ".repeat(12)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_follow_their_prefix_streamed_or_not() {
    let g = Gateway::start().await;
    let auth = format!("Bearer {KEY_ALL}");
    let headers = [("authorization", auth.as_str())];
    for i in 0..4 {
        let first = json!({"model": MODEL, "instructions": instructions(i), "input": "What is a prefix cache?", "max_output_tokens": 2});
        let a = post(g.addr(), "/v1/responses", &headers, &first).await;
        assert_eq!(a.status, 200, "{}", a.text());
        let mut again = first.clone();
        again["input"] = json!([
            {"role": "user", "content": "What is a prefix cache?"},
            {"role": "assistant", "content": "A cache of prompts."},
            {"role": "user", "content": "And a router?"},
        ]);
        again["stream"] = json!(true);
        let b = post(g.addr(), "/v1/responses", &headers, &again).await;
        assert_eq!(b.status, 200, "{}", b.text());
        assert_eq!(b.headers["content-type"], "text/event-stream");
        assert!(b.text().contains("event: response.completed"), "{}", b.text());
        assert_eq!(a.worker(), b.worker(), "conversation {i}: the follow-up goes where its prefix is cached");
    }
    g.stop().await;
}

/// A stored conversation (`previous_response_id`) lives on the engine that answered
/// it: requests carrying one session id stay on one worker whatever their prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_keeps_a_responses_conversation_on_its_worker() {
    let g = Gateway::start().await;
    let auth = format!("Bearer {KEY_ALL}");
    let mut workers = Vec::new();
    for i in 0..6 {
        let headers = [("authorization", auth.as_str()), ("x-session-id", "conversation-1")];
        let body =
            json!({"model": MODEL, "instructions": instructions(100 + i), "input": "next", "max_output_tokens": 1});
        let a = post(g.addr(), "/v1/responses", &headers, &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        workers.push(a.worker().expect("x-kvroute-worker"));
    }
    assert!(workers.iter().all(|w| *w == workers[0]), "one worker for the session: {workers:?}");
    g.stop().await;
}
