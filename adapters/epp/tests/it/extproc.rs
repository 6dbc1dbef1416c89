//! The ext_proc conversation against simulated workers: the pick, KV awareness, the
//! release at the end of the response or on cancel, refusals and health.

use kvroute_epp::pb::core_v3::Metadata;
use kvroute_epp::pb::BodySendMode;
use prost_types::value::Kind;
use prost_types::{ListValue, Struct, Value as PbValue};
use serde_json::json;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use super::*;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

struct Fleet {
    workers: Vec<SimServerHandle>,
    epp: EppHandle,
}

impl Fleet {
    async fn start(n: usize, tune: impl FnOnce(&mut EppConfig)) -> Self {
        let mut workers = Vec::new();
        for _ in 0..n {
            workers.push(sim_worker().await);
        }
        let addrs: Vec<SocketAddr> = workers.iter().map(|w| w.http_addr()).collect();
        let mut cfg = config(&addrs);
        tune(&mut cfg);
        Fleet { workers, epp: start(cfg).await }
    }

    fn addrs(&self) -> Vec<String> {
        self.workers.iter().map(|w| w.http_addr().to_string()).collect()
    }

    async fn gateway(&self) -> Gateway {
        Gateway::connect(self.epp.local_addr()).await
    }

    async fn stop(self) {
        self.epp.shutdown().await;
        for w in self.workers {
            w.shutdown().await;
        }
    }
}

fn chat(text: &str) -> Vec<u8> {
    json!({"model": MODEL, "stream": true, "max_tokens": 4, "messages": [{"role": "user", "content": text}]})
        .to_string()
        .into_bytes()
}

fn completion(tokens: &[u32]) -> Vec<u8> {
    json!({"model": MODEL, "prompt": tokens, "max_tokens": 4, "stream": true}).to_string().into_bytes()
}

/// The body in `n` nearly equal chunks.
fn chunks(body: &[u8], n: usize) -> Vec<&[u8]> {
    body.chunks(body.len().div_ceil(n)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pick_is_a_real_worker_and_the_response_releases_it() {
    for mode in [BodySendMode::FullDuplexStreamed, BodySendMode::Buffered] {
        let f = Fleet::start(3, |_| {}).await;
        let mut gw = f.gateway().await;
        gw.mode = mode;
        let body = chat(&"a question that spans several chunks ".repeat(20));
        let mut s = gw.open().await;
        let parts = if mode == BodySendMode::Buffered { vec![&body[..]] } else { chunks(&body, 3) };
        let picked = s.ask(CHAT, &[("x-kvroute-token", "nope")], &parts, None).await;
        let Picked::Endpoint { endpoint, metadata, set, removed, body: passed } = &picked else { panic!("{picked:?}") };
        assert!(f.addrs().contains(endpoint), "{mode:?}: {endpoint} is one of the workers");
        assert_eq!(metadata, endpoint, "{mode:?}: header and metadata agree");
        assert!(set.contains_key("x-kvroute-worker"), "{mode:?}");
        assert_eq!(removed, &["x-kvroute-token"], "{mode:?}: the trust token never reaches a worker");
        if mode == BodySendMode::FullDuplexStreamed {
            assert_eq!(passed, &body, "the whole body is passed back");
        } else {
            assert!(passed.is_empty(), "an unchanged buffered body is not replaced");
        }
        assert_eq!(in_flight(&f.epp), 1, "{mode:?}: booked while the gateway forwards");

        let (status, text) = s.relay(endpoint, CHAT, body.clone()).await;
        assert_eq!(status, 200, "{text}");
        assert!(text.contains("data: [DONE]"), "{mode:?}: the whole stream passes: {text}");
        eventually(5_000, "released after the response ended", || released(&f.epp)).await;
        s.close();
        f.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_long_prompt_goes_to_the_same_worker() {
    let f = Fleet::start(3, |_| {}).await;
    let mut gw = f.gateway().await;
    let prompt: Vec<u32> = (0..640).map(|i| 1000 + i).collect();
    let body = completion(&prompt);
    let mut homes = Vec::new();
    for _ in 0..4 {
        let mut s = gw.open().await;
        let endpoint = s.ask(COMPLETIONS, &[], &chunks(&body, 2), None).await.endpoint().to_string();
        let (status, _) = s.relay(&endpoint, COMPLETIONS, body.clone()).await;
        assert_eq!(status, 200);
        s.close();
        eventually(5_000, "released", || released(&f.epp)).await;
        homes.push(endpoint);
    }
    assert!(homes.iter().all(|h| *h == homes[0]), "the prompt's cache decides: {homes:?}");
    // A different prompt on an idle fleet is free to go anywhere; the point is that the
    // repeats above were not spread.
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_closes_early_releases_its_load() {
    let f = Fleet::start(2, |_| {}).await;
    let mut gw = f.gateway().await;
    // (what the gateway got to before it went away)
    for step in ["decided", "response headers", "half the response"] {
        let mut s = gw.open().await;
        let body = chat("hello");
        let endpoint = s.ask(CHAT, &[], &[&body], None).await.endpoint().to_string();
        if step != "decided" {
            s.response_headers(200, false).await;
            let _ = s.recv().await;
        }
        if step == "half the response" {
            s.response_body(b"data: {}\n\n", false).await;
            let _ = s.recv().await;
        }
        assert_eq!(in_flight(&f.epp), 1, "{step}: held");
        drop(s);
        eventually(5_000, step, || released(&f.epp)).await;
        let _ = endpoint;
    }
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_and_a_queued_stream_that_leaves_frees_its_slot() {
    let f = Fleet::start(1, |c| {
        c.proxy.router.prefill_tokens_max = 1;
        c.proxy.router.queued_max = 1;
    })
    .await;
    let mut gw = f.gateway().await;
    let mut holder = gw.open().await;
    let _ = holder.ask(CHAT, &[], &[&chat(&"long ".repeat(40))], None).await.endpoint().to_string();

    // The second waits in the queue; the third finds it full.
    let mut queued = gw.open().await;
    let body = chat("second");
    queued.request_headers(&[(":method", "POST"), (":path", CHAT)], false, None).await;
    queued.request_body(&body, true).await;
    let driver = f.epp.driver(MODEL).unwrap();
    eventually(5_000, "queued", || driver.snapshot().queue_depth == 1).await;
    let mut third = gw.open().await;
    match third.ask(CHAT, &[], &[&chat("third")], None).await {
        Picked::Refused { status, body, .. } => {
            assert_eq!(status, 429);
            assert_eq!(body["error"]["code"], "queue_full", "{body}");
            assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
        }
        other => panic!("expected 429, got {other:?}"),
    }
    drop(queued);
    eventually(5_000, "the queue slot is freed", || driver.snapshot().queue_depth == 0).await;
    drop(holder);
    eventually(5_000, "released", || released(&f.epp)).await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kvroute_object_never_reaches_a_worker() {
    let f = Fleet::start(1, |_| {}).await;
    let body = json!({"model": MODEL, "prompt": "x", "kvroute": {"expected_output_tokens": 4}}).to_string();
    for mode in [BodySendMode::FullDuplexStreamed, BodySendMode::Buffered] {
        let mut gw = f.gateway().await;
        gw.mode = mode;
        let mut s = gw.open().await;
        let Picked::Endpoint { body: passed, set, .. } = s.ask(COMPLETIONS, &[], &[body.as_bytes()], None).await else {
            panic!("{mode:?}: refused")
        };
        let passed: serde_json::Value = serde_json::from_slice(&passed).expect("JSON");
        assert_eq!(passed, json!({"model": MODEL, "prompt": "x"}), "{mode:?}");
        if mode == BodySendMode::Buffered {
            let len = set.get("content-length").expect("the new length");
            assert_eq!(len.parse::<usize>().unwrap(), passed.to_string().len());
        }
        drop(s);
    }
    eventually(5_000, "released", || released(&f.epp)).await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_count_only_for_trusted_clients() {
    let f = Fleet::start(3, |c| c.proxy.trust.token = Some("s3cret".into())).await;
    let mut gw = f.gateway().await;
    let addrs = f.addrs();
    // (worker pinned, trusted, the pick must be the pinned worker)
    for (id, addr) in addrs.iter().enumerate() {
        let mut s = gw.open().await;
        let pin = id.to_string();
        let headers = [("x-worker-id", pin.as_str()), ("x-kvroute-token", "s3cret")];
        assert_eq!(s.ask(CHAT, &headers, &[&chat("pinned")], None).await.endpoint(), addr, "pinned to {id}");
    }
    let mut s = gw.open().await;
    let _ = s.ask(CHAT, &[("x-worker-id", "2")], &[&chat("pinned, untrusted")], None).await.endpoint().to_string();
    let metrics = f.epp.metrics_text();
    assert!(
        metrics.lines().any(|l| l.starts_with("kvroute_untrusted_fields_stripped") && l.contains("x-worker-id")),
        "the untrusted pin is stripped and counted: {metrics}"
    );
    drop(s);
    eventually(5_000, "released", || released(&f.epp)).await;
    f.stop().await;
}

#[track_caller]
fn check_refused(p: &Picked, want_status: i32, want_code: &str) {
    match p {
        Picked::Refused { status, body, details } => {
            assert_eq!((*status, body["error"]["code"].as_str()), (want_status, Some(want_code)), "{body}");
            assert!(body["error"]["message"].is_string(), "OpenAI-shaped: {body}");
            assert_eq!(details, &format!("kvroute_{want_code}"));
        }
        other => panic!("expected {want_status}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_local_replies() {
    let f = Fleet::start(1, |c| c.proxy.limits.body_bytes_max = 4096).await;
    let mut gw = f.gateway().await;
    let cases: [(&[u8], i32, &str); 5] = [
        (b"{not json", 400, "invalid_request"),
        (br#"{"model": "m", "messages": []}"#, 400, "invalid_request"),
        (br#"{"model": "m", "prompt": "x", "kvroute": {"bogus": 1}}"#, 400, "invalid_request"),
        (br#"{"model": "other", "prompt": "x"}"#, 404, "model_not_found"),
        (&[b' '; 5000], 413, "body_too_large"),
    ];
    for (body, status, code) in cases {
        let mut s = gw.open().await;
        let picked = s.ask(COMPLETIONS, &[], &chunks(body, 2), None).await;
        check_refused(&picked, status, code);
    }
    assert!(released(&f.epp));
    f.stop().await;
}

fn subset(endpoints: &[&str]) -> Metadata {
    let list = ListValue {
        values: endpoints.iter().map(|e| PbValue { kind: Some(Kind::StringValue(e.to_string())) }).collect(),
    };
    let inner = Struct {
        fields: [("x-gateway-destination-endpoint-subset".to_string(), PbValue { kind: Some(Kind::ListValue(list)) })]
            .into(),
    };
    Metadata { filter_metadata: [("envoy.lb.subset_hint".to_string(), inner)].into() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_subset_bounds_the_pick() {
    let f = Fleet::start(3, |_| {}).await;
    let mut gw = f.gateway().await;
    let addrs = f.addrs();
    for want in &addrs {
        let mut s = gw.open().await;
        let picked = s.ask(CHAT, &[], &[&chat("pick within")], Some(subset(&[want.as_str(), "10.9.9.9:1"]))).await;
        assert_eq!(picked.endpoint(), want);
    }
    let mut s = gw.open().await;
    let picked = s.ask(CHAT, &[], &[&chat("nowhere")], Some(subset(&["10.9.9.9:1"]))).await;
    check_refused(&picked, 503, "no_worker");
    eventually(5_000, "released", || released(&f.epp)).await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_body_goes_to_the_pool() {
    let f = Fleet::start(2, |_| {}).await;
    let mut gw = f.gateway().await;
    let mut s = gw.open().await;
    let picked = s.ask("/v1/models", &[], &[], None).await.endpoint().to_string();
    assert!(f.addrs().contains(&picked), "{picked}");
    s.response_headers(200, true).await;
    let _ = s.recv().await;
    eventually(5_000, "released", || released(&f.epp)).await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_serving() {
    let f = Fleet::start(1, |_| {}).await;
    let mut health = HealthClient::new(Gateway::channel(f.epp.local_addr()));
    for service in ["", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"] {
        let r = within(10_000, health.check(HealthCheckRequest { service: service.into() })).await.expect("answers");
        assert_eq!(r.into_inner().status, ServingStatus::Serving as i32, "{service:?}");
    }
    let metrics = f.epp.metrics_text();
    assert!(metrics.contains("kvroute"), "the exposition is there");
    f.stop().await;
}

#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_over_tls_gets_the_same_answers() {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig};
    let id = kvroute_epp::TlsIdentity::self_signed(&["localhost".into()]).unwrap();
    let health_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let f = Fleet::start(1, |c| {
        c.tls = Some(id.clone());
        c.health_listen = Some(health_port);
    })
    .await;
    // Probes reach the plaintext health port while the gateway's port speaks TLS.
    let mut health = HealthClient::new(Gateway::channel(health_port));
    let r = within(10_000, health.check(HealthCheckRequest { service: "readiness".into() })).await.expect("answers");
    assert_eq!(r.into_inner().status, ServingStatus::Serving as i32);
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&id.cert_pem)).domain_name("localhost");
    let channel = Channel::from_shared(format!("https://{}", f.epp.local_addr())).unwrap().tls_config(tls).unwrap();
    let channel = within(10_000, channel.connect()).await.expect("a TLS connection");
    let mut gw = Gateway::from_channel(channel);
    let mut s = gw.open().await;
    assert_eq!(s.ask(CHAT, &[], &[&chat("over tls")], None).await.endpoint(), f.addrs()[0]);
    drop(s);
    eventually(5_000, "released", || released(&f.epp)).await;
    f.stop().await;
}
