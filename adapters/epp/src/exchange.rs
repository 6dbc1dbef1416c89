//! One gateway stream, from the request headers to the end of the response.
//!
//! The request side gathers headers and body until the body is complete, then decides
//! (see [`crate::decide`]) and answers in the gateway's body mode: in full-duplex mode
//! the destination rides on the (held back) answer to the request headers, followed by
//! the body passed back in chunks; otherwise every message is answered as it comes and
//! the destination rides on the answer to the last body chunk.
//!
//! The response side holds the request's [`Booking`]: the response headers confirm it,
//! the first body bytes mark the prefill done, the end of the body (or the trailers)
//! finishes it (a 5xx fails it as the worker's fault), and a stream that closes before
//! that drops it, which cancels it. A gateway that stops listening while the request
//! waits in the admission queue frees its slot at once.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH};
use kvroute_driver::{Booking, DispatchFailure};
use kvroute_frontend::ApiError;
use prost_types::value::Kind;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tonic::{Status, Streaming};

use crate::config::BodyMode;
use crate::decide::{decide, Asked, Decided, Undecided};
use crate::pb::core_v3::{HeaderMap as PbHeaderMap, Metadata};
use crate::pb::ext_proc::processing_request::Request as Msg;
use crate::pb::ext_proc::{HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse};
use crate::reply::{self, Part, SUBSET_KEY, SUBSET_NAMESPACE};
use crate::Shared;

type Tx = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// Whether the stream goes on.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Flow {
    Go,
    Stop,
}

/// Runs one stream until the gateway closes it or stops listening.
pub(crate) async fn run(shared: Arc<Shared>, mut inbound: Streaming<ProcessingRequest>, tx: Tx) {
    let mut x = Exchange::new(shared);
    loop {
        let msg = tokio::select! {
            m = inbound.message() => m,
            () = tx.closed() => break,
        };
        let flow = match msg {
            Ok(Some(m)) => x.handle(m, &tx).await,
            Ok(None) | Err(_) => Flow::Stop,
        };
        if flow == Flow::Stop {
            break;
        }
    }
    x.close();
}

/// A routed request being answered.
struct Flight {
    booking: Option<Booking>,
    model: String,
    worker: u64,
    /// The response status, once its headers arrived.
    status: Option<u16>,
    first_bytes_seen: bool,
    _permit: OwnedSemaphorePermit,
}

/// How a flight ended.
enum End {
    Finished,
    Cancelled,
}

struct Exchange {
    shared: Arc<Shared>,
    /// Request and response body modes, from the first message.
    modes: Option<(BodyMode, BodyMode)>,
    asked: Asked,
    body: BytesMut,
    decided: bool,
    flight: Option<Flight>,
}

impl Exchange {
    fn new(shared: Arc<Shared>) -> Self {
        Exchange { shared, modes: None, asked: Asked::default(), body: BytesMut::new(), decided: false, flight: None }
    }

    fn request_mode(&self) -> BodyMode {
        self.modes.map_or(self.shared.cfg.assumed_body_mode, |m| m.0)
    }

    fn response_mode(&self) -> BodyMode {
        self.modes.map_or(self.shared.cfg.assumed_body_mode, |m| m.1)
    }

    async fn handle(&mut self, m: ProcessingRequest, tx: &Tx) -> Flow {
        if self.modes.is_none() {
            let assumed = self.shared.cfg.assumed_body_mode;
            self.modes = Some(m.protocol_config.as_ref().map_or((assumed, assumed), |p| {
                (BodyMode::from_envoy(p.request_body_mode), BodyMode::from_envoy(p.response_body_mode))
            }));
        }
        if m.observability_mode {
            // The gateway ignores answers; nothing here can route.
            return Flow::Go;
        }
        match m.request {
            Some(Msg::RequestHeaders(h)) => {
                self.asked.subset = m.metadata_context.as_ref().and_then(subset);
                self.asked.client_ip = client_ip(&m.attributes);
                self.on_request_headers(h, tx).await
            }
            Some(Msg::RequestBody(b)) => self.on_request_body(b, tx).await,
            Some(Msg::RequestTrailers(_)) => self.on_request_trailers(tx).await,
            Some(Msg::ResponseHeaders(h)) => self.on_response_headers(&h, tx).await,
            Some(Msg::ResponseBody(b)) => self.on_response_body(b, tx).await,
            Some(Msg::ResponseTrailers(_)) => {
                let flow = send(tx, reply::proceed(Part::ResponseTrailers)).await;
                self.end(End::Finished);
                flow
            }
            None => Flow::Go,
        }
    }

    async fn on_request_headers(&mut self, h: HttpHeaders, tx: &Tx) -> Flow {
        let (headers, path, _) = http_headers(h.headers.as_ref());
        self.asked.headers = headers;
        self.asked.path = path;
        if h.end_of_stream || self.request_mode() == BodyMode::None {
            return self.decide(Part::RequestHeaders, true, tx).await;
        }
        match self.request_mode() {
            BodyMode::FullDuplex => Flow::Go,
            _ => send(tx, reply::proceed(Part::RequestHeaders)).await,
        }
    }

    async fn on_request_body(&mut self, b: HttpBody, tx: &Tx) -> Flow {
        if self.decided {
            return Flow::Go;
        }
        let max = self.shared.cfg.proxy.limits.body_bytes_max;
        if (self.body.len() + b.body.len()) as u64 > max {
            return self.refuse(ApiError::too_large(max), "unknown", tx).await;
        }
        self.body.extend_from_slice(&b.body);
        if b.end_of_stream {
            return self.decide(Part::RequestBody, true, tx).await;
        }
        match self.request_mode() {
            BodyMode::FullDuplex => Flow::Go,
            _ => send(tx, reply::proceed(Part::RequestBody)).await,
        }
    }

    async fn on_request_trailers(&mut self, tx: &Tx) -> Flow {
        if !self.decided {
            // Trailers end a body whose last chunk did not say so.
            if self.decide(Part::RequestTrailers, false, tx).await == Flow::Stop {
                return Flow::Stop;
            }
            if self.request_mode() != BodyMode::FullDuplex {
                return Flow::Go;
            }
        }
        send(tx, reply::proceed(Part::RequestTrailers)).await
    }

    /// Routes the gathered request and answers `part` with the destination. `body_ends`
    /// says whether the passed-back body ends the stream (no trailers follow).
    async fn decide(&mut self, part: Part, body_ends: bool, tx: &Tx) -> Flow {
        self.decided = true;
        let Ok(permit) = self.shared.concurrency.clone().try_acquire_owned() else {
            return self.refuse(ApiError::overloaded(), "unknown", tx).await;
        };
        let body = std::mem::take(&mut self.body).freeze();
        let had_body = !body.is_empty();
        let decided = decide(&self.shared, &self.asked, body.clone(), tx.closed()).await;
        let d = match decided {
            None => return Flow::Stop,
            Some(Ok(d)) => d,
            Some(Err(Undecided::Refused { model, error })) => return self.refuse(error, &model, tx).await,
            Some(Err(Undecided::Preview(json))) => {
                let _ = send(tx, reply::json_reply(http::StatusCode::OK, &json, "kvroute_preview")).await;
                return Flow::Stop;
            }
        };
        let Decided { booking, model, mut destination, forward_body } = d;
        let worker = booking.target().worker.0;
        let metadata = destination.metadata();
        let answers = match self.request_mode() {
            BodyMode::FullDuplex => {
                let mut answers = vec![reply::with_common(Part::RequestHeaders, destination.common())];
                if had_body {
                    answers.extend(reply::streamed_body(Part::RequestBody, &forward_body, body_ends));
                }
                answers
            }
            _ if part == Part::RequestTrailers => vec![reply::proceed(part)],
            _ => {
                let common = if forward_body != body && part == Part::RequestBody {
                    destination.set.push((CONTENT_LENGTH.as_str().to_string(), forward_body.len().to_string()));
                    let mut c = destination.common();
                    c.body_mutation = Some(reply::replaced_body(&forward_body));
                    c
                } else {
                    destination.common()
                };
                vec![reply::with_common(part, common)]
            }
        };
        self.flight = Some(Flight {
            booking: Some(booking),
            model,
            worker,
            status: None,
            first_bytes_seen: false,
            _permit: permit,
        });
        let mut answers = answers.into_iter();
        if let Some(mut first) = answers.next() {
            first.dynamic_metadata = Some(metadata);
            if send(tx, first).await == Flow::Stop {
                return Flow::Stop;
            }
        }
        for a in answers {
            if send(tx, a).await == Flow::Stop {
                return Flow::Stop;
            }
        }
        Flow::Go
    }

    async fn refuse(&mut self, e: ApiError, model: &str, tx: &Tx) -> Flow {
        self.shared.metrics.request(model, None, e.code, e.status.as_u16());
        let _ = send(tx, reply::immediate(&e)).await;
        // The gateway answers the client itself and ignores anything more.
        Flow::Stop
    }

    async fn on_response_headers(&mut self, h: &HttpHeaders, tx: &Tx) -> Flow {
        let (_, _, status) = http_headers(h.headers.as_ref());
        if let Some(f) = &mut self.flight {
            f.status = Some(status.unwrap_or(200));
            if let Some(b) = &mut f.booking {
                let _ = b.dispatched();
            }
        }
        let flow = send(tx, reply::proceed(Part::ResponseHeaders)).await;
        if h.end_of_stream {
            self.end(End::Finished);
        }
        flow
    }

    async fn on_response_body(&mut self, b: HttpBody, tx: &Tx) -> Flow {
        if let Some(f) = &mut self.flight {
            if !b.body.is_empty() && !f.first_bytes_seen {
                f.first_bytes_seen = true;
                if let Some(booking) = &f.booking {
                    let _ = booking.prefill_done();
                }
            } else if let Some(booking) = &f.booking {
                // Server-sent events after the first message time the decode.
                let events = b.body.windows(5).filter(|w| *w == b"data:").count();
                booking.output_chunks(u32::try_from(events).unwrap_or(u32::MAX));
            }
        }
        let flow = match self.response_mode() {
            BodyMode::FullDuplex => {
                let mut flow = Flow::Go;
                for a in reply::streamed_body(Part::ResponseBody, &Bytes::from(b.body), b.end_of_stream) {
                    flow = send(tx, a).await;
                    if flow == Flow::Stop {
                        break;
                    }
                }
                flow
            }
            _ => send(tx, reply::proceed(Part::ResponseBody)).await,
        };
        if b.end_of_stream {
            self.end(End::Finished);
        }
        flow
    }

    /// The stream closed: a response the gateway never sends a body of ends with its
    /// headers; anything else still held was cut short.
    fn close(&mut self) {
        let headers_seen = self.flight.as_ref().is_some_and(|f| f.status.is_some());
        if headers_seen && self.response_mode() == BodyMode::None {
            self.end(End::Finished);
        } else {
            self.end(End::Cancelled);
        }
    }

    fn end(&mut self, how: End) {
        let Some(mut f) = self.flight.take() else { return };
        let Some(booking) = f.booking.take() else { return };
        let status = f.status.unwrap_or(0);
        let outcome = match how {
            End::Finished if status >= 500 => {
                let _ = booking.fail(DispatchFailure::Worker);
                "upstream_error"
            }
            End::Finished => {
                let _ = booking.finish();
                if status >= 400 {
                    "upstream_error"
                } else {
                    "ok"
                }
            }
            End::Cancelled => {
                // Dropping the booking cancels it: the worker did nothing wrong.
                drop(booking);
                "cancelled"
            }
        };
        self.shared.metrics.request(&f.model, Some(f.worker), outcome, status);
    }
}

async fn send(tx: &Tx, answer: ProcessingResponse) -> Flow {
    match tx.send(Ok(answer)).await {
        Ok(()) => Flow::Go,
        Err(_) => Flow::Stop,
    }
}

/// The headers as an HTTP map (pseudo-headers left out; values that are not valid header
/// values skipped), with `:path` and `:status`.
fn http_headers(map: Option<&PbHeaderMap>) -> (http::HeaderMap, Option<String>, Option<u16>) {
    let mut out = http::HeaderMap::new();
    let (mut path, mut status) = (None, None);
    for h in map.map_or(&[][..], |m| &m.headers[..]) {
        let value: &[u8] = if h.raw_value.is_empty() { h.value.as_bytes() } else { &h.raw_value };
        match h.key.as_str() {
            ":path" => path = Some(String::from_utf8_lossy(value).into_owned()),
            ":status" => status = std::str::from_utf8(value).ok().and_then(|s| s.parse().ok()),
            k if k.starts_with(':') => {}
            k => {
                if let (Ok(name), Ok(v)) = (HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_bytes(value)) {
                    out.append(name, v);
                }
            }
        }
    }
    (out, path, status)
}

/// The gateway's endpoint subset: a list of `ip:port` (or one comma-separated string)
/// under `envoy.lb.subset_hint`.
fn subset(md: &Metadata) -> Option<Vec<String>> {
    let v = md.filter_metadata.get(SUBSET_NAMESPACE)?.fields.get(SUBSET_KEY)?;
    let strings = |s: &str| s.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
    match v.kind.as_ref()? {
        Kind::ListValue(l) => Some(
            l.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                    _ => None,
                })
                .collect(),
        ),
        Kind::StringValue(s) => Some(strings(s)),
        _ => None,
    }
}

/// The client's address from the `source.address` request attribute, if the gateway
/// is configured to send it.
fn client_ip(attributes: &std::collections::HashMap<String, prost_types::Struct>) -> Option<IpAddr> {
    attributes.values().find_map(|s| match s.fields.get("source.address")?.kind.as_ref()? {
        Kind::StringValue(a) => a.parse::<SocketAddr>().map(|s| s.ip()).or_else(|_| a.parse::<IpAddr>()).ok(),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use prost_types::{ListValue, Struct, Value};

    use super::*;
    use crate::pb::core_v3::HeaderValue as PbHeaderValue;

    fn string(s: &str) -> Value {
        Value { kind: Some(Kind::StringValue(s.into())) }
    }

    fn metadata(ns: &str, key: &str, v: Value) -> Metadata {
        let inner = Struct { fields: [(key.to_string(), v)].into() };
        Metadata { filter_metadata: [(ns.to_string(), inner)].into() }
    }

    #[track_caller]
    fn check_subset(md: Metadata, want: Option<&[&str]>) {
        let want = want.map(|w| w.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(subset(&md), want);
    }

    #[test]
    fn subsets_as_lists_or_strings() {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue { values: vec![string("10.0.0.1:8000"), string(" 10.0.0.2:8000 ")] })),
        };
        check_subset(metadata(SUBSET_NAMESPACE, SUBSET_KEY, list), Some(&["10.0.0.1:8000", "10.0.0.2:8000"]));
        check_subset(
            metadata(SUBSET_NAMESPACE, SUBSET_KEY, string("10.0.0.1:8000, 10.0.0.3:8000,")),
            Some(&["10.0.0.1:8000", "10.0.0.3:8000"]),
        );
        check_subset(metadata(SUBSET_NAMESPACE, "other", string("10.0.0.1:8000")), None);
        check_subset(metadata("envoy.lb", SUBSET_KEY, string("10.0.0.1:8000")), None);
        check_subset(metadata(SUBSET_NAMESPACE, SUBSET_KEY, Value { kind: Some(Kind::NumberValue(1.0)) }), None);
    }

    #[test]
    fn the_client_address_comes_from_the_source_attribute() {
        let attrs = |v: Value| -> HashMap<String, Struct> {
            [("envoy.filters.http.ext_proc".to_string(), Struct { fields: [("source.address".to_string(), v)].into() })]
                .into()
        };
        assert_eq!(client_ip(&attrs(string("10.1.2.3:5555"))), Some("10.1.2.3".parse().unwrap()));
        assert_eq!(client_ip(&attrs(string("[fd00::7]:80"))), Some("fd00::7".parse().unwrap()));
        assert_eq!(client_ip(&attrs(string("10.1.2.3"))), Some("10.1.2.3".parse().unwrap()));
        assert_eq!(client_ip(&attrs(string("somewhere"))), None);
        assert_eq!(client_ip(&HashMap::new()), None);
    }

    #[test]
    fn headers_prefer_raw_values_and_keep_pseudo_headers_apart() {
        let h =
            |k: &str, v: &str, raw: &[u8]| PbHeaderValue { key: k.into(), value: v.into(), raw_value: raw.to_vec() };
        let map = PbHeaderMap {
            headers: vec![
                h(":path", "", b"/v1/completions?x=1"),
                h(":status", "", b"503"),
                h(":authority", "", b"gw"),
                h("x-session-id", "old", b"s1"),
                h("x-dp-rank", "2", b""),
                h("bad header", "", b"v"),
                h("x-bin", "", b"\x01bad\n"),
            ],
        };
        let (headers, path, status) = http_headers(Some(&map));
        assert_eq!((path.as_deref(), status), (Some("/v1/completions?x=1"), Some(503)));
        assert_eq!(headers.len(), 2, "{headers:?}");
        assert_eq!((headers["x-session-id"].as_bytes(), headers["x-dp-rank"].as_bytes()), (&b"s1"[..], &b"2"[..]));
    }
}
