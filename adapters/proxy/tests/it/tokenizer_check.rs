//! The tokenizer check over real parts: sim-workers answer `/tokenize` with their own
//! tokenizer, the proxy asks each, and it sends a completion's prompt as token ids only to
//! the worker that tokenizes as it does. Each worker counts its own tokenizer's calls, so
//! which one read text and which one took ids is the workers' word, not the proxy's. And
//! a worker whose KV events can never match is routed on the router's predictions.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvroute_proxy::tokenize::{fallback_chat, fallback_text, Tokenize, TokenizeError};
use kvroute_proxy::{serve, ServeHandle, Tokenizers};
use kvroute_sim_server::{EngineConfig, PromptTokenizer, SimServerConfig, SimServerHandle};
use serde_json::{json, Value};

use super::*;

const SENT_AS_IDS: &str = "kvroute_prompts_sent_as_token_ids_total";

/// The proxy's tokenizer: the byte fallback.
struct Fallback;

impl Tokenize for Fallback {
    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        Ok(fallback_chat(body))
    }
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(fallback_text(text))
    }
}

/// A worker's tokenizer: the fallback, with `first` put before and `extra` appended to
/// every text (a BOS or an EOS the router does not add, say), counting its text calls.
#[derive(Default)]
struct Counting {
    first: Option<u32>,
    extra: Option<u32>,
    calls: AtomicUsize,
}

impl PromptTokenizer for Counting {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, kvroute_sim_server::TokenizeError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(self.first.into_iter().chain(fallback_text(text)).chain(self.extra).collect())
    }
    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, kvroute_sim_server::TokenizeError> {
        Ok(fallback_chat(body))
    }
}

async fn sim_worker(tok: Arc<Counting>) -> SimServerHandle {
    let cfg = SimServerConfig {
        model: MODEL.into(),
        replay_port: Some(0),
        engine: EngineConfig { speedup: 1000.0, block_size: 16, ..EngineConfig::default() },
        tokenizer: tok,
        ..SimServerConfig::default()
    };
    kvroute_sim_server::spawn(cfg).await.expect("sim worker starts")
}

/// Workers 1 (tokenizes as the proxy does) and 2 (adds a token) and 3 (nothing listens).
async fn proxy(w1: &SimServerHandle, w2: &SimServerHandle) -> ServeHandle {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut cfg = config(&[(1, w1.http_addr()), (2, w2.http_addr()), (3, closed)]);
    cfg.models[0].tokenizer = Some("the-test-tokenizer".into());
    cfg.models[0].forward_token_ids = true;
    cfg.learn.tokenizer_check_interval_ms = 60_000;
    let mut t = Tokenizers::new();
    t.insert(MODEL, Arc::new(Fallback));
    serve(cfg, t).await.expect("proxy starts")
}

async fn verdicts(addr: SocketAddr) -> Vec<Value> {
    let w = get(addr, "/workers").await.json();
    w["workers"].as_array().unwrap().iter().map(|w| w["tokenizer_check"].clone()).collect()
}

/// Sends `body` pinned to `worker`: the worker's own tokenizer reads the text exactly
/// when it is not sent as ids, and the proxy counts it as ids exactly when it is; the
/// answer's prompt length is `prompt_tokens`.
async fn check(addr: SocketAddr, worker: (&str, &Counting), body: Value, as_ids: bool, prompt_tokens: usize) {
    let (calls, sent) =
        (worker.1.calls.load(Ordering::SeqCst), total(&get(addr, "/metrics").await.text(), SENT_AS_IDS, ""));
    let a = post(addr, "/v1/completions", &[("x-worker-id", worker.0)], &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.worker().map(|w| w.to_string()).as_deref(), Some(worker.0));
    assert_eq!(usage(&a)["prompt_tokens"], json!(prompt_tokens), "worker {} {body}", worker.0);
    let read_text = worker.1.calls.load(Ordering::SeqCst) - calls;
    let counted = total(&get(addr, "/metrics").await.text(), SENT_AS_IDS, "") - sent;
    assert_eq!((read_text, counted), (usize::from(!as_ids), f64::from(u8::from(as_ids))), "worker {} {body}", worker.0);
}

/// An answer's usage, whole or streamed.
fn usage(a: &Answer) -> Value {
    let text = a.text();
    let data = text.lines().filter_map(|l| l.strip_prefix("data: "));
    let chunks: Vec<Value> = data.filter_map(|d| serde_json::from_str(d).ok()).collect();
    if chunks.is_empty() {
        return a.json()["usage"].clone();
    }
    chunks.into_iter().rev().find_map(|c| c.get("usage").filter(|u| !u.is_null()).cloned()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_go_as_ids_only_to_a_worker_that_tokenizes_as_the_router() {
    let same = Arc::new(Counting::default());
    let other = Arc::new(Counting { extra: Some(2), ..Counting::default() });
    let (w1, w2) = (sim_worker(same.clone()).await, sim_worker(other.clone()).await);
    let p = proxy(&w1, &w2).await;
    let addr = p.local_addr();
    let want = [json!("agrees"), json!("differs"), json!("unreachable")];
    eventually(10_000, "every worker checked", || async { verdicts(addr).await == want }).await;
    let m = get(addr, "/metrics").await.text();
    let agrees = |w: &str| sample(&m, "kvroute_worker_tokenizer_agrees", &[&format!("worker=\"{w}\"")]);
    assert_eq!((agrees("1"), agrees("2"), agrees("3")), (Some(1.0), Some(0.0), None), "{m}");
    for result in ["agrees", "differs", "unreachable"] {
        assert!(total(&m, "kvroute_tokenizer_checks_total", &format!("result=\"{result}\"")) >= 1.0, "{result}: {m}");
    }

    let prompt = "Twelve words of text, enough to fill a block or two of ids.";
    let n = fallback_text(prompt).len();
    let body = |extra: Value| {
        let mut b = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    check(addr, ("1", &same), body(json!({})), true, n).await;
    check(addr, ("1", &same), body(json!({"stream": true, "stream_options": {"include_usage": true}})), true, n).await;
    check(addr, ("2", &other), body(json!({})), false, n + 1).await;
    check(addr, ("2", &other), body(json!({"stream": true, "stream_options": {"include_usage": true}})), false, n + 1)
        .await;
    // What must stay text stays text, even for a worker that agrees.
    check(addr, ("1", &same), body(json!({"echo": true})), false, n).await;
    p.shutdown().await;
}

/// Worker 1 tokenizes as the proxy does; worker 2 puts a token first, so none of its KV
/// events ever matches a block the proxy hashes. Both publish events, and the router
/// makes no predictions of its own (`approximate` off). Once the check finds worker 2
/// differs, a prompt served there is predicted there: its repeat sees the whole prompt
/// cached on worker 2, and goes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_events_cannot_match_is_routed_on_predictions() {
    let shifted = Arc::new(Counting { first: Some(7), ..Counting::default() });
    let workers = [sim_worker(Arc::new(Counting::default())).await, sim_worker(shifted).await];
    let mut cfg = config(&[]);
    cfg.workers = super::fleet::sim_worker_configs(&workers, 1);
    cfg.router.mode = RouterMode::Kv;
    cfg.router.approximate = false;
    cfg.models[0].tokenizer = Some("the-test-tokenizer".into());
    cfg.learn.tokenizer_check_interval_ms = 60_000;
    let mut t = Tokenizers::new();
    t.insert(MODEL, Arc::new(Fallback));
    let p = serve(cfg, t).await.expect("proxy starts");
    let (addr, driver) = (p.local_addr(), p.driver(MODEL).expect("the model's driver"));
    eventually(10_000, "both workers checked", || async {
        verdicts(addr).await == [json!("agrees"), json!("differs")]
    })
    .await;
    // Its predictions start with its first accepted event: until then its cache is
    // unknown, as any worker's is before it publishes.
    let publishes = || driver.snapshot().workers.iter().any(|w| w.spec.id.0 == 2 && w.publishes_events);
    for n in 0..100 {
        if publishes() {
            break;
        }
        let warm = json!({"model": MODEL, "prompt": format!("warm-up {n} {}", "x".repeat(80)), "max_tokens": 1});
        assert_eq!(post(addr, "/v1/completions", &[("x-worker-id", "2")], &warm).await.status, 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(publishes(), "worker 2's events reach the router");

    let prompt: String = (0..160).map(|i| format!("w{i:03} ")).collect();
    let blocks = (fallback_text(&prompt).len() / 16) as u64;
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    assert_eq!(post(addr, "/v1/completions", &[("x-worker-id", "2")], &body).await.status, 200);
    eventually(10_000, "the request released", || released(addr)).await;
    let preview = post(addr, "/v1/completions", &[("x-kvroute-preview", "1")], &body).await.json();
    let rows = preview["explanation"].as_array().cloned().unwrap_or_default();
    let overlap = |id: u64| rows.iter().find(|r| r["worker"] == id).and_then(|r| r["overlap"]["device"].as_u64());
    assert_eq!((overlap(1), overlap(2)), (Some(0), Some(blocks)), "{preview}");
    assert_eq!(preview["worker"], json!(2), "the repeat goes where the prompt is: {preview}");
    driver.check_invariants().expect("router invariants");
    p.shutdown().await;
    for w in workers {
        w.shutdown().await;
    }
}
