//! Tracing end to end: the proxy exports over OTLP/HTTP to a real receiver on loopback
//! (a hyper server decoding `ExportTraceServiceRequest`), and the workers record the
//! `traceparent` they were sent.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvroute_proxy::config::{DisaggProtocol, TracingConfig};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use tokio::net::TcpListener;

use crate::*;

/// A span as the receiver decoded it, ids in hex.
#[derive(Clone, Debug)]
struct Got {
    service: String,
    name: String,
    kind: i32,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attrs: BTreeMap<String, String>,
    events: Vec<String>,
    start_ns: u64,
    end_ns: u64,
}

/// An OTLP/HTTP receiver: `POST /v1/traces` with a protobuf body; anything else is 404,
/// an undecodable body 400 (and counted).
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Got>>>,
    malformed: Arc<Mutex<u32>>,
}

impl Receiver {
    async fn start() -> (Receiver, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let r = Receiver::default();
        let rx = r.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let rx = rx.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let rx = rx.clone();
                        async move { Ok::<_, Infallible>(rx.serve(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
                });
            }
        });
        (r, addr)
    }

    async fn serve(&self, req: http::Request<Incoming>) -> http::Response<Full<Bytes>> {
        let ok_path = req.method() == http::Method::POST && req.uri().path() == "/v1/traces";
        let ctype = req.headers().get("content-type").cloned();
        let body = req.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        if !ok_path {
            return status(404, Bytes::new());
        }
        assert_eq!(ctype.as_ref().map(|v| v.to_str().unwrap()), Some("application/x-protobuf"));
        let Ok(export) = ExportTraceServiceRequest::decode(body) else {
            *self.malformed.lock().unwrap() += 1;
            return status(400, Bytes::new());
        };
        self.spans.lock().unwrap().extend(flatten(export));
        status(200, ExportTraceServiceResponse::default().encode_to_vec().into())
    }

    fn spans(&self) -> Vec<Got> {
        assert_eq!(*self.malformed.lock().unwrap(), 0, "every export decodes");
        self.spans.lock().unwrap().clone()
    }

    /// The spans of `trace_id`, polled until `n` arrived (or the deadline fails the test).
    async fn trace(&self, trace_id: &str, n: usize) -> Vec<Got> {
        let of = |r: &Receiver| r.spans().into_iter().filter(|s| s.trace_id == trace_id).collect::<Vec<_>>();
        eventually(10_000, &format!("{n} spans of trace {trace_id} exported"), || async { of(self).len() >= n }).await;
        of(self)
    }
}

fn status(code: u16, body: Bytes) -> http::Response<Full<Bytes>> {
    let mut r = http::Response::new(Full::new(body));
    *r.status_mut() = http::StatusCode::from_u16(code).unwrap();
    r.headers_mut().insert("content-type", "application/x-protobuf".parse().unwrap());
    r
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn text(v: Option<&Any>) -> String {
    match v {
        Some(Any::StringValue(s)) => s.clone(),
        Some(Any::IntValue(i)) => i.to_string(),
        Some(Any::DoubleValue(d)) => d.to_string(),
        Some(Any::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

fn flatten(export: ExportTraceServiceRequest) -> Vec<Got> {
    let mut out = Vec::new();
    for rs in export.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(kv.value.as_ref().and_then(|v| v.value.as_ref())))
            .unwrap_or_default();
        for s in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
            let attrs =
                s.attributes.iter().map(|kv| (kv.key.clone(), text(kv.value.as_ref().and_then(|v| v.value.as_ref()))));
            out.push(Got {
                service: service.clone(),
                name: s.name.clone(),
                kind: s.kind,
                trace_id: hex(&s.trace_id),
                span_id: hex(&s.span_id),
                parent_span_id: hex(&s.parent_span_id),
                attrs: attrs.collect(),
                events: s.events.iter().map(|e| e.name.clone()).collect(),
                start_ns: s.start_time_unix_nano,
                end_ns: s.end_time_unix_nano,
            });
        }
    }
    out
}

/// Tracing to `receiver`, exporting every 50 ms.
fn tracing_to(receiver: SocketAddr) -> TracingConfig {
    let mut t = TracingConfig::new(format!("http://{receiver}"));
    t.service_name = "kvroute-test".into();
    t.export_interval_ms = 50;
    t
}

/// Two fakes behind a proxy tracing to `receiver` with `tracing` adjusted by `set`.
async fn traced_proxy(receiver: SocketAddr, set: impl FnOnce(&mut TracingConfig)) -> (ServeHandle, [Fake; 2]) {
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    let mut cfg = config(&[(1, fakes[0].addr), (2, fakes[1].addr)]);
    let mut t = tracing_to(receiver);
    set(&mut t);
    cfg.tracing = Some(t);
    (start(cfg).await, fakes)
}

/// The `traceparent` each request the fakes received carried, in arrival order per fake.
fn parents(fakes: &[Fake]) -> Vec<Option<String>> {
    fakes
        .iter()
        .flat_map(|f| f.seen())
        .map(|s| s.headers.get("traceparent").map(|v| v.to_str().unwrap().to_string()))
        .collect()
}

fn named<'a>(spans: &'a [Got], name: &str) -> &'a Got {
    let mut it = spans.iter().filter(|s| s.name == name);
    let s = it.next().unwrap_or_else(|| panic!("no {name} span in {spans:#?}"));
    assert!(it.next().is_none(), "one {name} span");
    s
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test]
async fn a_client_trace_continues_through_the_proxy_to_the_worker() {
    let (receiver, raddr) = Receiver::start().await;
    let (proxy, fakes) = traced_proxy(raddr, |_| {}).await;
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let headers = [("traceparent", parent.as_str()), ("tracestate", "vendor=opaque")];
    let a = post(proxy.local_addr(), "/v1/chat/completions", &headers, &chat("hello tracing")).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(a.text().contains("[DONE]"), "the stream ended: {}", a.text());
    let worker = a.worker().expect("the proxy names the worker");

    let spans = receiver.trace(CLIENT_TRACE, 6).await;
    let mut names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["kvroute.request", "parse", "queue_wait", "route", "tokenize", "upstream"]);
    let request = named(&spans, "kvroute.request");
    assert_eq!(request.parent_span_id, CLIENT_SPAN, "the request span continues the client's span");
    assert_eq!(request.kind, SpanKind::Server as i32);
    assert_eq!(request.service, "kvroute-test");
    assert_eq!(request.attrs["kvroute.model"], MODEL);
    assert_eq!(request.attrs["kvroute.policy"], "round-robin");
    assert_eq!(request.attrs["http.response.status_code"], "200");
    for s in spans.iter().filter(|s| s.name != "kvroute.request") {
        assert_eq!(s.parent_span_id, request.span_id, "{} is a child of the request span", s.name);
        assert!(request.start_ns <= s.start_ns && s.end_ns <= request.end_ns, "{} lies within the request", s.name);
    }
    let route = named(&spans, "route");
    assert_eq!(route.attrs["kvroute.worker.id"], worker.to_string(), "the route span names the worker that served");
    for key in ["kvroute.overlap_blocks", "kvroute.request_blocks", "kvroute.queued"] {
        assert!(route.attrs.contains_key(key), "route has {key}: {:?}", route.attrs);
    }
    let upstream = named(&spans, "upstream");
    assert_eq!(upstream.kind, SpanKind::Client as i32);
    assert_eq!(upstream.attrs["kvroute.worker.id"], worker.to_string());
    assert_eq!(upstream.events, ["first_byte"]);
    assert!(upstream.start_ns >= route.end_ns, "the try starts after its decision");
    let (parse, tokenize) = (named(&spans, "parse"), named(&spans, "tokenize"));
    assert!(parse.end_ns <= tokenize.start_ns + 1_000, "tokenize follows parse");

    // The worker that served got the trace: same trace id, the try's span as its parent,
    // sampled, and the client's tracestate; the other worker got nothing.
    let served = &fakes[worker as usize - 1].seen();
    assert_eq!(served.len(), 1);
    let sent = served[0].headers.get("traceparent").expect("the worker gets a traceparent").to_str().unwrap();
    assert_eq!(sent, format!("00-{CLIENT_TRACE}-{}-01", upstream.span_id));
    assert_eq!(served[0].headers.get("tracestate").map(|v| v.to_str().unwrap()), Some("vendor=opaque"));
    assert_eq!(parents(&fakes).len(), 1, "one request reached the workers");
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_request_without_a_trace_starts_one_and_sends_it_on() {
    let (receiver, raddr) = Receiver::start().await;
    let (proxy, fakes) = traced_proxy(raddr, |_| {}).await;
    // A malformed traceparent counts as none (W3C): a new trace starts.
    for headers in [&[][..], &[("traceparent", "00-zz-00f067aa0ba902b7-01")][..]] {
        let a = post(proxy.local_addr(), "/v1/chat/completions", headers, &chat("no trace here")).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    proxy.shutdown().await; // flushes
    let spans = receiver.spans();
    let roots: Vec<&Got> = spans.iter().filter(|s| s.name == "kvroute.request").collect();
    assert_eq!(roots.len(), 2, "{spans:#?}");
    let mut sent = parents(&fakes);
    sent.sort();
    let mut want = Vec::new();
    for root in roots {
        assert_eq!(root.parent_span_id, "", "a new trace has no parent");
        assert_eq!(spans.iter().filter(|s| s.trace_id == root.trace_id).count(), 6);
        let upstream = spans.iter().find(|s| s.trace_id == root.trace_id && s.name == "upstream").unwrap();
        want.push(Some(format!("00-{}-{}-01", root.trace_id, upstream.span_id)));
    }
    want.sort();
    assert_eq!(sent, want, "each worker request carries its own new trace");
}

#[tokio::test]
async fn unsampled_requests_work_export_nothing_and_still_carry_the_trace() {
    let (receiver, raddr) = Receiver::start().await;
    let (proxy, fakes) = traced_proxy(raddr, |t| t.sampling_ratio = 0.0).await;
    for i in 0..4 {
        let a = post(proxy.local_addr(), "/v1/chat/completions", &[], &chat(&format!("unsampled {i}"))).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    // An unsampled client trace is followed too: not recorded, sent on with flag 00.
    let unsampled = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-00");
    let a = post(proxy.local_addr(), "/v1/chat/completions", &[("traceparent", &unsampled)], &chat("u")).await;
    assert_eq!(a.status, 200);
    let sent = parents(&fakes);
    assert_eq!(sent.len(), 5);
    for p in &sent {
        let p = p.as_deref().expect("an unsampled request still carries a traceparent");
        assert!(p.starts_with("00-") && p.ends_with("-00") && p.len() == 55, "unsampled: {p}");
    }
    assert_eq!(sent.iter().filter(|p| p.as_deref().unwrap().contains(CLIENT_TRACE)).count(), 1);
    // The sampler follows a sampled parent whatever the ratio.
    let sampled = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let a = post(proxy.local_addr(), "/v1/chat/completions", &[("traceparent", &sampled)], &chat("s")).await;
    assert_eq!(a.status, 200);
    proxy.shutdown().await; // flushes
    let spans = receiver.spans();
    assert_eq!(spans.len(), 6, "only the sampled client's request is exported: {spans:#?}");
    assert!(spans.iter().all(|s| s.trace_id == CLIENT_TRACE));
}

#[tokio::test]
async fn without_start_traces_only_client_traces_are_followed() {
    let (receiver, raddr) = Receiver::start().await;
    let (proxy, fakes) = traced_proxy(raddr, |t| t.start_traces = false).await;
    let a = post(proxy.local_addr(), "/v1/chat/completions", &[], &chat("untraced")).await;
    assert_eq!(a.status, 200);
    assert_eq!(parents(&fakes), [None], "no trace is made up");
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    // A refused request is traced too: its span carries the status.
    let bad = json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]});
    let a = post(proxy.local_addr(), "/v1/chat/completions", &[("traceparent", &parent)], &bad).await;
    assert_eq!(a.status, 404);
    proxy.shutdown().await;
    let spans = receiver.spans();
    assert_eq!(spans.len(), 1, "{spans:#?}");
    assert_eq!((spans[0].name.as_str(), spans[0].parent_span_id.as_str()), ("kvroute.request", CLIENT_SPAN));
    assert_eq!(spans[0].attrs["http.response.status_code"], "404");
}

/// A fake of `role` in a disaggregated fleet (a prefill fake names a bootstrap port it
/// does not serve: the decode fake never looks).
fn leg_worker(id: u64, fake: &Fake, role: &str) -> kvroute_proxy::config::WorkerConfig {
    let mut w = json!({"id": id, "url": fake.url(), "model": MODEL, "role": role});
    if role == "prefill" {
        w["bootstrap_port"] = json!(1);
    }
    serde_json::from_value(w).unwrap()
}

/// Each leg of a split request is a span of its own, which its worker's `traceparent`
/// names; the decode span ends with the stream. For both protocols.
#[tokio::test]
async fn each_leg_of_a_disaggregated_request_is_a_span_its_worker_continues() {
    const GAP_MS: u64 = 100;
    for protocol in [DisaggProtocol::VllmNixl, DisaggProtocol::SglangBootstrap] {
        let (receiver, raddr) = Receiver::start().await;
        let (prefill, decode) = (Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await);
        prefill.set(Behavior::Json);
        decode.set(Behavior::Stream { chunks: sse_chunks(3), gap_ms: GAP_MS });
        let mut cfg = config(&[]);
        cfg.workers = vec![leg_worker(1, &prefill, "prefill"), leg_worker(2, &decode, "decode")];
        cfg.models[0].disagg_protocol = Some(protocol);
        cfg.models[0].disagg_isl_min_tokens = Some(1);
        cfg.tracing = Some(tracing_to(raddr));
        let proxy = start(cfg).await;
        let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
        let body = chat("a prompt long enough to be split in two");
        let a = post(proxy.local_addr(), "/v1/chat/completions", &[("traceparent", &parent)], &body).await;
        assert_eq!(a.status, 200, "{protocol:?}: {}", a.text());
        assert_eq!(a.headers.get("x-kvroute-prefill-worker").map(|v| v.to_str().unwrap()), Some("1"), "{protocol:?}");
        proxy.shutdown().await; // flushes
        let spans = receiver.spans();
        let request = named(&spans, "kvroute.request");
        assert!(!spans.iter().any(|s| s.name == "upstream"), "{protocol:?}: a split request's tries are its legs");
        for (leg, fake, id) in [("prefill", &prefill, 1), ("decode", &decode, 2)] {
            let s = named(&spans, leg);
            let what = format!("{protocol:?} {leg}");
            assert_eq!(s.kind, SpanKind::Client as i32, "{what}");
            assert_eq!(s.parent_span_id, request.span_id, "{what} is a child of the request span");
            assert!(request.start_ns <= s.start_ns && s.end_ns <= request.end_ns, "{what} lies within the request");
            assert_eq!(s.attrs["kvroute.worker.id"], id.to_string(), "{what}");
            assert_eq!(s.attrs["http.response.status_code"], "200", "{what}");
            assert_eq!(s.events, ["first_byte"], "{what}");
            let seen = fake.seen();
            assert_eq!(seen.len(), 1, "{what}: one request");
            let sent = seen[0].headers.get("traceparent").expect("a traceparent").to_str().unwrap();
            assert_eq!(sent, format!("00-{CLIENT_TRACE}-{}-01", s.span_id), "{what}: the worker continues its leg");
        }
        let decode = named(&spans, "decode");
        let lasted_ms = (decode.end_ns - decode.start_ns) / 1_000_000;
        assert!(lasted_ms >= 2 * GAP_MS, "{protocol:?}: the decode span ends with its stream ({lasted_ms} ms)");
    }
}

/// A collector that takes connections and never answers.
async fn stalled_collector() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    addr
}

fn dropped(proxy: &ServeHandle, reason: &str) -> u64 {
    let line = format!("kvroute_trace_spans_dropped_total{{reason=\"{reason}\"}} ");
    let text = proxy.metrics_text();
    text.lines().find_map(|l| l.strip_prefix(&line)).map_or(0, |n| n.parse().unwrap())
}

#[tokio::test]
async fn spans_past_the_queue_or_refused_by_the_collector_are_counted() {
    let (proxy, _fakes) = traced_proxy(stalled_collector().await, |t| {
        t.spans_queued_max = 4;
        t.export_timeout_ms = 3_000;
    })
    .await;
    for i in 0..2 {
        let a = post(proxy.local_addr(), "/v1/chat/completions", &[], &chat(&format!("dropped {i}"))).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    // 12 spans: 4 wait on the stalled export, the other 8 find the queue full; then the
    // export times out and its 4 are lost too.
    eventually(10_000, "8 spans dropped at the full queue", || async { dropped(&proxy, "queue_full") == 8 }).await;
    eventually(10_000, "the stalled batch counted as failed", || async { dropped(&proxy, "export_failed") == 4 }).await;
    assert_eq!(dropped(&proxy, "queue_full"), 8, "nothing else was dropped");
    proxy.shutdown().await;
}
