//! Disaggregated serving end to end, for both wire protocols: real `kvroute sim-worker`
//! prefill and decode fleets (and scripted or dead workers for failures) behind the
//! proxy on loopback.

use std::net::SocketAddr;

use http::Method;
use kvroute_proxy::config::DisaggProtocol;
use kvroute_sim_server::{EngineConfig, EngineRole, SimServerConfig, SimServerHandle};
use serde_json::{json, Value};

use crate::sims::counted;
use crate::*;

const BOTH: [DisaggProtocol; 2] = [DisaggProtocol::VllmNixl, DisaggProtocol::SglangBootstrap];

/// Prompts of at least this many uncached tokens are split.
const ISL_MIN_TOKENS: u32 = 64;
const LONG: usize = 160;
const SHORT: usize = 20;
/// Output tokens asked for.
const OUT: u64 = 5;

/// Prefill workers get ids from 1, decode workers from 11.
const PREFILL_ID0: u64 = 1;
const DECODE_ID0: u64 = 11;

/// One worker of a test fleet.
enum W {
    /// A simulated worker of the slot's role.
    Sim,
    /// A simulated worker of the slot's role that computes one request at a time, at a
    /// quarter of the modelled speed.
    Serial,
    /// An address nothing listens on.
    Dead,
    /// A scripted upstream.
    Fake(Fake),
}

struct Fleet {
    proxy: ServeHandle,
    /// Sim workers by id (a dead or fake worker has none).
    sims: Vec<(u64, SimServerHandle)>,
}

impl Fleet {
    fn addr(&self) -> SocketAddr {
        self.proxy.local_addr()
    }

    fn sim(&self, id: u64) -> &SimServerHandle {
        &self.sims.iter().find(|(i, _)| *i == id).expect("a sim worker").1
    }

    async fn shutdown(self) {
        let _ = self.proxy.shutdown().await;
        for (_, s) in self.sims {
            s.shutdown().await;
        }
    }
}

async fn sim(role: EngineRole, speedup: f64) -> SimServerHandle {
    sim_with(EngineConfig { speedup, block_size: 16, role, ..EngineConfig::default() }).await
}

async fn sim_with(engine: EngineConfig) -> SimServerHandle {
    let role = engine.role;
    let cfg = SimServerConfig {
        model: MODEL.into(),
        engine,
        bootstrap_port: (role == EngineRole::Prefill).then_some(0),
        ..SimServerConfig::default()
    };
    kvroute_sim_server::spawn(cfg).await.expect("sim worker starts")
}

/// A proxy over `prefill` and `decode` workers of one disaggregated model.
async fn fleet(
    protocol: DisaggProtocol,
    prefill: Vec<W>,
    decode: Vec<W>,
    tweak: impl FnOnce(&mut ProxyConfig),
) -> Fleet {
    let mut sims = Vec::new();
    let mut workers = Vec::new();
    // A bootstrap server that no prefill of any request reaches: decode workers paired
    // with a fake or dead prefill worker wait there until their own timeout.
    let lonely = sim(EngineRole::Prefill, 1000.0).await;
    let lonely_port = lonely.bootstrap_port();
    sims.push((0, lonely));
    for (slots, id0, role) in [(prefill, PREFILL_ID0, "prefill"), (decode, DECODE_ID0, "decode")] {
        for (i, w) in slots.into_iter().enumerate() {
            let id = id0 + i as u64;
            let (url, bootstrap_port) = match w {
                W::Sim | W::Serial => {
                    let role = if role == "prefill" { EngineRole::Prefill } else { EngineRole::Decode };
                    let s = match w {
                        W::Serial => {
                            let e = EngineConfig {
                                speedup: 0.25,
                                block_size: 16,
                                max_num_seqs: 1,
                                role,
                                ..Default::default()
                            };
                            sim_with(e).await
                        }
                        _ => sim(role, 1000.0).await,
                    };
                    let out = (s.base_url(), s.bootstrap_port());
                    sims.push((id, s));
                    out
                }
                W::Dead => (format!("http://{}", Fake::dead_addr().await), Some(Fake::dead_addr().await.port())),
                W::Fake(f) => (f.url(), lonely_port),
            };
            let mut w = json!({"id": id, "url": url, "model": MODEL, "role": role});
            if role == "prefill" && protocol == DisaggProtocol::SglangBootstrap {
                w["bootstrap_port"] = json!(bootstrap_port);
            }
            workers.push(serde_json::from_value(w).unwrap());
        }
    }
    let mut cfg = config(&[]);
    cfg.workers = workers;
    cfg.models[0].disagg_protocol = Some(protocol);
    cfg.models[0].disagg_isl_min_tokens = Some(ISL_MIN_TOKENS);
    cfg.ejection.consecutive_failures = 0;
    cfg.retry.budget_initial = 100;
    tweak(&mut cfg);
    Fleet { proxy: start(cfg).await, sims }
}

fn sims(n: usize) -> Vec<W> {
    (0..n).map(|_| W::Sim).collect()
}

/// A token-id completion of `tokens` tokens; `seed` keeps prompts apart.
fn completion(tokens: usize, stream: bool, seed: u32) -> Value {
    let prompt: Vec<u32> = (0..tokens as u32).map(|i| seed * 10_000 + i).collect();
    json!({"model": MODEL, "prompt": prompt, "max_tokens": OUT, "stream": stream})
}

fn header(a: &Answer, name: &str) -> Option<u64> {
    a.headers.get(name).map(|v| v.to_str().unwrap().parse().unwrap())
}

fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    sample(text, name, labels).unwrap_or(0.0)
}

/// Requests a sim worker received.
async fn received(s: &SimServerHandle) -> f64 {
    metric(&get(s.http_addr(), "/metrics").await.text(), "kvroute_sim:requests_total", &[])
}

/// A split answer: decode worker `decode` streamed it (or answered it whole), prefill
/// worker `prefill` prefilled it.
#[track_caller]
fn check_split(a: &Answer, stream: bool, prefill: &[u64], decode: &[u64]) {
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let (p, d) = (header(a, "x-kvroute-prefill-worker"), a.worker());
    assert!(p.is_some_and(|p| prefill.contains(&p)), "prefill worker {p:?} not in {prefill:?}");
    assert!(d.is_some_and(|d| decode.contains(&d)), "decode worker {d:?} not in {decode:?}");
    if stream {
        let text = a.text();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        let tokens = text.matches("\"text\":\"").count() - 1;
        assert_eq!(tokens as u64, OUT, "every token from the decode worker, then the final chunk: {text}");
    } else {
        assert_eq!(a.json()["usage"]["completion_tokens"], OUT, "{}", a.text());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_requests_stream_or_answer_whole() {
    for protocol in BOTH {
        let f = fleet(protocol, sims(2), sims(2), |_| {}).await;
        for (i, stream) in [false, true, false, true].into_iter().enumerate() {
            let a = post(f.addr(), "/v1/completions", &[], &completion(LONG, stream, i as u32)).await;
            check_split(&a, stream, &[1, 2], &[11, 12]);
        }
        // Without a tokenizer the proxy routes on four bytes per token.
        let chat = json!({"model": MODEL, "max_tokens": OUT, "stream": true,
            "messages": [{"role": "user", "content": "x".repeat(4 * LONG)}]});
        let a = post(f.addr(), "/v1/chat/completions", &[], &chat).await;
        assert_eq!(a.status, StatusCode::OK, "{protocol}: {}", a.text());
        assert!(a.text().ends_with("data: [DONE]\n\n") && header(&a, "x-kvroute-prefill-worker").is_some());
        let m = get(f.addr(), "/metrics").await.text();
        assert_eq!(metric(&m, "kvroute_disagg_plans_total", &["plan=\"split\""]), 5.0, "{protocol}");
        let prefilled = received(f.sim(1)).await + received(f.sim(2)).await;
        let decoded = received(f.sim(11)).await + received(f.sim(12)).await;
        assert_eq!((prefilled, decoded), (5.0, 5.0), "{protocol}: one prefill and one decode per request");
        eventually(10_000, "both phases released", || released(f.addr())).await;
        f.proxy.driver(MODEL).unwrap().check_invariants().expect("router invariants");
        f.shutdown().await;
    }
}

/// Pins by header: the answer names exactly the pinned workers.
#[track_caller]
fn check_pinned(a: &Answer, prefill: u64, decode: u64) {
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!((header(a, "x-kvroute-prefill-worker"), a.worker()), (Some(prefill), Some(decode)), "{}", a.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phases_are_pinned_independently() {
    for protocol in BOTH {
        let f = fleet(protocol, sims(2), sims(3), |_| {}).await;
        for (i, (p, d)) in [(1, 13), (2, 11), (2, 13), (1, 12)].into_iter().enumerate() {
            let (ps, ds) = (p.to_string(), d.to_string());
            let pins = [("x-prefill-worker-id", ps.as_str()), ("x-decode-worker-id", ds.as_str())];
            let a = post(f.addr(), "/v1/completions", &pins, &completion(LONG, i % 2 == 0, i as u32)).await;
            check_pinned(&a, p, d);
        }
        // A prefill pin splits even a short prompt.
        let a = post(f.addr(), "/v1/completions", &[("x-prefill-worker-id", "2")], &completion(SHORT, true, 9)).await;
        assert_eq!(header(&a, "x-kvroute-prefill-worker"), Some(2), "{protocol}");
        // A pin to a worker of the other role is the client's mistake.
        let a = post(f.addr(), "/v1/completions", &[("x-decode-worker-id", "1")], &completion(LONG, false, 10)).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{protocol}: {}", a.text());
        eventually(10_000, "released", || released(f.addr())).await;
        f.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_workers_share_the_prefill_workers_node() {
    let nodes = [(1, "a"), (2, "b"), (11, "a"), (12, "b"), (13, "b")];
    for protocol in BOTH {
        let f = fleet(protocol, sims(2), sims(3), |c| {
            c.models[0].disagg_same_label = Some("node".into());
            for w in &mut c.workers {
                let node = nodes.iter().find(|(id, _)| *id == w.id).map(|(_, n)| n.to_string());
                w.labels.extend(node.map(|n| ("node".to_string(), n)));
            }
        })
        .await;
        let cases: [(u64, &[u64]); 4] = [(1, &[11]), (2, &[12, 13]), (1, &[11]), (2, &[12, 13])];
        for (i, (prefill, decode)) in cases.into_iter().enumerate() {
            let pin = prefill.to_string();
            let pins = [("x-prefill-worker-id", pin.as_str())];
            let a = post(f.addr(), "/v1/completions", &pins, &completion(LONG, i % 2 == 0, i as u32)).await;
            check_split(&a, i % 2 == 0, &[prefill], decode);
        }
        eventually(10_000, "released", || released(f.addr())).await;
        f.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefill_worker_is_retried_on_another() {
    for protocol in BOTH {
        let f = fleet(protocol, vec![W::Dead, W::Sim], sims(1), |_| {}).await;
        for i in 0..4 {
            let a = post(f.addr(), "/v1/completions", &[], &completion(LONG, i % 2 == 1, i)).await;
            check_split(&a, i % 2 == 1, &[2], &[11]);
        }
        let m = get(f.addr(), "/metrics").await.text();
        let refused = metric(&m, "kvroute_upstream_failures_total", &["worker=\"1\"", "kind=\"connect\""]);
        assert!(refused >= 1.0, "{protocol}: round-robin starts some prefills on the dead worker");
        assert_eq!(metric(&m, "kvroute_retries_total", &[]), refused, "{protocol}: each refusal retried once");
        let decoded = received(f.sim(11)).await;
        match protocol {
            DisaggProtocol::VllmNixl => assert_eq!(decoded, 4.0, "decode starts only after a prefill succeeded"),
            // The decode half of an aborted pair may have reached the worker.
            _ => assert!((4.0..=4.0 + refused).contains(&decoded), "{decoded} decode requests"),
        }
        eventually(10_000, "released", || released(f.addr())).await;
        f.shutdown().await;
    }
}

/// A decode failure: the client gets `status`, and nothing stays booked on either side.
async fn check_decode_failure(protocol: DisaggProtocol, decode: Vec<W>, status: u16) {
    let f = fleet(protocol, sims(1), decode, |c| c.retry.retries_max = 0).await;
    let a = post(f.addr(), "/v1/completions", &[], &completion(LONG, true, 1)).await;
    assert_eq!(a.status.as_u16(), status, "{protocol}: {}", a.text());
    eventually(10_000, "both phases released", || released(f.addr())).await;
    let snap = f.proxy.driver(MODEL).unwrap().snapshot();
    for w in &snap.workers {
        for k in &w.keys {
            assert_eq!(k.load, Default::default(), "{protocol}: worker {} still loaded", w.spec.id.0);
        }
    }
    f.proxy.driver(MODEL).unwrap().check_invariants().expect("router invariants");
    f.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_failure_releases_both_sides() {
    for protocol in BOTH {
        let failing = Fake::start(&[MODEL]).await;
        failing.set(Behavior::Status(500));
        check_decode_failure(protocol, vec![W::Fake(failing)], 500).await;
        check_decode_failure(protocol, vec![W::Dead], 502).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_decode_connection_is_retried_on_another() {
    for protocol in BOTH {
        let f = fleet(protocol, sims(1), vec![W::Dead, W::Sim], |_| {}).await;
        for i in 0..4 {
            let a = post(f.addr(), "/v1/completions", &[], &completion(LONG, true, i)).await;
            check_split(&a, true, &[1], &[12]);
        }
        eventually(10_000, "released", || released(f.addr())).await;
        f.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_aborts_its_waiting_decode() {
    // The decode worker waits on a bootstrap room nobody prefills (for 30 s); the proxy
    // must cut it as soon as the prefill fails.
    let failing = Fake::start(&[MODEL]).await;
    failing.set(Behavior::Status(500));
    let f = fleet(DisaggProtocol::SglangBootstrap, vec![W::Fake(failing)], sims(1), |_| {}).await;
    let a = post(f.addr(), "/v1/completions", &[], &completion(LONG, true, 1)).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.text());
    let m = get(f.addr(), "/metrics").await.text();
    assert_eq!(metric(&m, "kvroute_disagg_aborts_total", &["aborted=\"decode\"", "cause=\"status_5xx\""]), 1.0);
    // The only prefill worker failed: the retry found nowhere to go, so none was made.
    assert_eq!(metric(&m, "kvroute_retries_total", &[]), 0.0, "{m}");
    eventually(10_000, "released", || released(f.addr())).await;
    f.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_refusal_reaches_the_client() {
    for protocol in BOTH {
        let refusing = Fake::start(&[MODEL]).await;
        refusing.set(Behavior::Status(400));
        let f = fleet(protocol, vec![W::Fake(refusing)], sims(1), |_| {}).await;
        let a = post(f.addr(), "/v1/completions", &[], &completion(LONG, false, 1)).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{protocol}: {}", a.text());
        assert_eq!(header(&a, "x-kvroute-prefill-worker"), Some(1));
        eventually(10_000, "released", || released(f.addr())).await;
        f.shutdown().await;
    }
}

/// A bypassed request: served whole by a decode worker, counted under `plan`.
async fn check_bypass(protocol: DisaggProtocol, prefill: usize, tokens: usize, plan: &str) {
    let f = fleet(protocol, sims(prefill), sims(2), |_| {}).await;
    let a = post(f.addr(), "/v1/completions", &[], &completion(tokens, true, 1)).await;
    assert_eq!(a.status, StatusCode::OK, "{protocol}: {}", a.text());
    assert!(a.worker().is_some_and(|w| w >= DECODE_ID0), "{protocol}: a decode worker serves it");
    assert_eq!(header(&a, "x-kvroute-prefill-worker"), None, "{protocol}: no prefill worker took part");
    let m = get(f.addr(), "/metrics").await.text();
    assert_eq!(metric(&m, "kvroute_disagg_plans_total", &[&format!("plan=\"{plan}\"")]), 1.0, "{protocol}\n{m}");
    assert_eq!(metric(&m, "kvroute_disagg_plans_total", &["plan=\"split\""]), 0.0, "{protocol}");
    for id in PREFILL_ID0..PREFILL_ID0 + prefill as u64 {
        assert_eq!(received(f.sim(id)).await, 0.0, "{protocol}: prefill worker {id} stays idle");
    }
    eventually(10_000, "released", || released(f.addr())).await;
    f.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_and_empty_prefill_pools_bypass() {
    for protocol in BOTH {
        check_bypass(protocol, 1, SHORT, "short_prompt").await;
        check_bypass(protocol, 0, LONG, "no_prefill_workers").await;
    }
}

/// A preview of `body`: the decode (or aggregated) pick on top, the prefill pick under
/// `prefill` when split, and the plan under `disagg`.
async fn check_preview(f: &Fleet, body: &Value, want_plan: &str) {
    let a = call(f.addr(), Method::POST, "/route/preview", &[], Some(body)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let v = a.json();
    assert_eq!(v["disagg"]["plan"], want_plan, "{v}");
    let decode = v["worker"].as_u64().expect("a decode pick");
    assert!(decode >= DECODE_ID0, "{v}");
    // Each explanation covers every worker; only those of the phase's role are eligible.
    let rows = |pick: &Value| -> Vec<u64> {
        let rows = pick["explanation"].as_array().unwrap();
        assert_eq!(rows.len(), 4, "{pick}");
        rows.iter().filter(|r| r["eligible"] == true).map(|r| r["worker"].as_u64().unwrap()).collect()
    };
    assert_eq!(rows(&v), [11, 12], "the decode explanation lists the decode workers: {v}");
    if want_plan == "split" {
        let prefill = &v["prefill"];
        assert!(prefill["worker"].as_u64().is_some_and(|w| w < DECODE_ID0), "{v}");
        assert_eq!(rows(prefill), [1, 2], "the prefill explanation lists the prefill workers: {v}");
    } else {
        assert!(v.get("prefill").is_none(), "{v}");
        assert_eq!(v["disagg"]["effective_isl_tokens"], SHORT, "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preview_shows_both_picks() {
    for protocol in BOTH {
        let f = fleet(protocol, sims(2), sims(2), |_| {}).await;
        check_preview(&f, &completion(LONG, false, 1), "split").await;
        check_preview(&f, &completion(SHORT, false, 1), "short_prompt").await;
        let m = get(f.addr(), "/metrics").await.text();
        assert_eq!(total(&m, "kvroute_disagg_plans_total", ""), 0.0, "previews count no plans");
        assert!(released(f.addr()).await, "previews book nothing");
        f.shutdown().await;
    }
}

/// One worker of the `faulty` side answers `behavior`; the other side and the rest are
/// sim workers. Every request succeeds on a sim worker, and each that met the faulty
/// worker was retried, counted under `reason`.
async fn check_leg_retried(protocol: DisaggProtocol, prefill_faulty: bool, behavior: Behavior, reason: &str) {
    let faulty = Fake::start(&[MODEL]).await;
    faulty.set(behavior);
    let (prefill, decode) = match prefill_faulty {
        true => (vec![W::Fake(faulty.clone()), W::Sim], sims(1)),
        false => (sims(1), vec![W::Fake(faulty.clone()), W::Sim]),
    };
    let f = fleet(protocol, prefill, decode, |c| {
        c.retry.backoff_base_ms = 1;
        c.retry.first_byte_timeout_base_ms = 300;
        c.retry.first_byte_timeout_per_token_us = 0;
        c.retry.answer_timeout_per_output_token_ms = 20;
    })
    .await;
    let (want_prefill, want_decode) = if prefill_faulty { ([2], [11]) } else { ([1], [12]) };
    for i in 0..4 {
        let a = post(f.addr(), "/v1/completions", &[], &completion(LONG, i % 2 == 1, i)).await;
        check_split(&a, i % 2 == 1, &want_prefill, &want_decode);
    }
    let met = faulty.seen().len() as f64;
    assert!(met >= 1.0, "{protocol}: round-robin sent some requests to the faulty worker");
    let m = get(f.addr(), "/metrics").await.text();
    let case = format!("{protocol} {reason} prefill_faulty={prefill_faulty}");
    assert!(metric(&m, "kvroute_retries_total", &[&format!("reason=\"{reason}\"")]) >= met, "{case}\n{m}");
    let against = metric(&m, "kvroute_upstream_failures_total", &["worker=\"1\""])
        + metric(&m, "kvroute_upstream_failures_total", &["worker=\"11\""]);
    assert_eq!(against == 0.0, reason == "status_429", "{case}: only a 429 is not the worker's fault\n{m}");
    eventually(10_000, "released", || released(f.addr())).await;
    f.proxy.driver(MODEL).unwrap().check_invariants().expect("router invariants");
    f.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_429_or_silent_worker_on_either_leg_is_retried_by_the_retry_rules() {
    for protocol in BOTH {
        check_leg_retried(protocol, false, Behavior::Status(503), "status_5xx").await;
        check_leg_retried(protocol, false, Behavior::Status(429), "status_429").await;
        check_leg_retried(protocol, true, Behavior::Status(429), "status_429").await;
        check_leg_retried(protocol, true, Behavior::Stall { ms: 5_000 }, "first_byte_timeout").await;
        check_leg_retried(protocol, false, Behavior::Stall { ms: 5_000 }, "first_byte_timeout").await;
    }
}

/// A prefill worker with a queue of prompts (computed one at a time, slowly) is busy,
/// not wedged: a prefill waiting past its first-byte timeout while the worker answers
/// others waits on, with no retry and no failure counted against the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_prefill_worker_past_its_first_byte_timeout_is_waited_for() {
    for protocol in BOTH {
        let f = fleet(protocol, vec![W::Serial], sims(1), |c| {
            c.retry.first_byte_timeout_base_ms = 150;
            c.retry.first_byte_timeout_per_token_us = 0;
            c.ejection.consecutive_failures = 2;
        })
        .await;
        let addr = f.addr();
        let burst: Vec<_> = (0..6)
            .map(|i| tokio::spawn(async move { post(addr, "/v1/completions", &[], &completion(LONG, false, i)).await }))
            .collect();
        for h in burst {
            check_split(&h.await.expect("the client task"), false, &[1], &[11]);
        }
        let m = get(addr, "/metrics").await.text();
        let extended = counted(&m, "kvroute_first_byte_waits_extended_total", &[]);
        assert!(extended >= 1.0, "{protocol}: the burst outlived the timeout only if a wait was extended\n{m}");
        assert_eq!(counted(&m, "kvroute_retries_total", &["reason=\"first_byte_timeout\""]), 0.0, "{protocol}\n{m}");
        assert_eq!(counted(&m, "kvroute_upstream_failures_total", &[]), 0.0, "{protocol}\n{m}");
        eventually(10_000, "released", || released(addr)).await;
        f.shutdown().await;
    }
}

/// The decode worker answers its headers at once and then never sends a token: the
/// client's stream ends at the idle timeout with a `stream_stalled` error event, the
/// stall counts against the decode worker, and nothing stays booked.
async fn check_decode_stalls_after_its_headers(protocol: DisaggProtocol) {
    let wedged = Fake::start(&[MODEL]).await;
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    wedged.set(Behavior::Gated { chunks: crate::fake::sse_chunks(2), gate });
    let f = fleet(protocol, sims(1), vec![W::Fake(wedged.clone())], |c| {
        c.retry.idle_stream_timeout_ms = 300;
        c.limits.request_timeout_ms = 60_000;
        c.ejection.consecutive_failures = 0;
    })
    .await;
    let t = std::time::Instant::now();
    let mut ev = crate::sims::Events::open(f.addr(), "/v1/completions", &[], &completion(LONG, true, 7)).await;
    assert_eq!(ev.status, 200, "{protocol}");
    let got = crate::sims::read(&ev.rest().await);
    let e = got.error.as_ref().unwrap_or_else(|| panic!("{protocol}: an error event: {got:?}"));
    assert_eq!(e["error"]["code"], "stream_stalled", "{protocol}: {e}");
    assert!(t.elapsed() < std::time::Duration::from_secs(20), "{protocol}: ended by the idle timeout");
    let m = get(f.addr(), "/metrics").await.text();
    let against = metric(&m, "kvroute_upstream_failures_total", &["worker=\"11\"", "kind=\"idle_timeout\""]);
    assert_eq!(against, 1.0, "{protocol}: counted against the decode worker\n{m}");
    eventually(10_000, "released", || released(f.addr())).await;
    f.proxy.driver(MODEL).unwrap().check_invariants().expect("router invariants");
    f.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_stalls_after_its_headers_ends_at_the_idle_timeout() {
    for protocol in BOTH {
        check_decode_stalls_after_its_headers(protocol).await;
    }
}
