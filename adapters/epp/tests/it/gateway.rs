//! The gateway's part, played by a client generated from the picker's own protos: it
//! sends the request headers and body, reads the picked endpoint, forwards the request
//! to that worker itself, and streams the worker's response back through the picker.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_epp::pb::core_v3::{HeaderMap, HeaderValue, Metadata};
use kvroute_epp::pb::ext_proc::body_mutation::Mutation;
use kvroute_epp::pb::ext_proc::external_processor_client::ExternalProcessorClient;
use kvroute_epp::pb::ext_proc::processing_request::Request as Msg;
use kvroute_epp::pb::ext_proc::processing_response::Response as Answer;
use kvroute_epp::pb::ext_proc::{
    CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use kvroute_epp::pb::BodySendMode;
use prost_types::value::Kind;
use serde_json::Value;
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic::Streaming;

use super::within;

/// A connection to the picker.
pub struct Gateway {
    client: ExternalProcessorClient<Channel>,
    /// The body mode announced on every stream.
    pub mode: BodySendMode,
}

impl Gateway {
    pub async fn connect(addr: SocketAddr) -> Self {
        let channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.expect("connects");
        Gateway { client: ExternalProcessorClient::new(channel), mode: BodySendMode::FullDuplexStreamed }
    }

    pub fn from_channel(channel: Channel) -> Self {
        Gateway { client: ExternalProcessorClient::new(channel), mode: BodySendMode::FullDuplexStreamed }
    }

    pub fn channel(addr: SocketAddr) -> Channel {
        Channel::from_shared(format!("http://{addr}")).unwrap().connect_lazy()
    }

    /// Opens one request's stream.
    pub async fn open(&mut self) -> Stream {
        let (tx, rx) = mpsc::channel(64);
        let outbound = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        let answers = within(10_000, self.client.process(outbound)).await.expect("the stream opens").into_inner();
        Stream { tx: Some(tx), answers, mode: self.mode, first: true }
    }
}

/// One request's ext_proc stream.
pub struct Stream {
    tx: Option<mpsc::Sender<ProcessingRequest>>,
    answers: Streaming<ProcessingResponse>,
    mode: BodySendMode,
    first: bool,
}

/// What the picker said about a request.
#[derive(Debug)]
pub enum Picked {
    /// Routed: the endpoint, the dynamic metadata's copy, the headers set and removed,
    /// and the body passed back (full-duplex) or replaced (buffered).
    Endpoint { endpoint: String, metadata: String, set: BTreeMap<String, String>, removed: Vec<String>, body: Vec<u8> },
    /// A local reply.
    Refused { status: i32, body: Value, details: String },
}

impl Picked {
    pub fn endpoint(&self) -> &str {
        match self {
            Picked::Endpoint { endpoint, .. } => endpoint,
            Picked::Refused { status, body, .. } => panic!("refused with {status}: {body}"),
        }
    }
}

pub fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue { key: k.to_string(), value: String::new(), raw_value: v.as_bytes().to_vec() })
            .collect(),
    }
}

impl Stream {
    pub async fn send(&mut self, mut m: ProcessingRequest) {
        if std::mem::take(&mut self.first) {
            m.protocol_config = Some(ProtocolConfiguration {
                request_body_mode: self.mode as i32,
                response_body_mode: self.mode as i32,
                send_body_without_waiting_for_header_response: false,
            });
        }
        let tx = self.tx.as_ref().expect("stream open");
        within(10_000, tx.send(m)).await.expect("the picker reads");
    }

    pub async fn recv(&mut self) -> Answer {
        let m = within(10_000, self.answers.message()).await.expect("a good stream").expect("an answer");
        m.response.expect("a response kind")
    }

    pub async fn recv_full(&mut self) -> ProcessingResponse {
        within(10_000, self.answers.message()).await.expect("a good stream").expect("an answer")
    }

    /// Ends the gateway's side of the stream cleanly (the HTTP exchange is over).
    pub fn close(&mut self) {
        self.tx = None;
    }

    pub async fn request_headers(&mut self, headers: &[(&str, &str)], end_of_stream: bool, md: Option<Metadata>) {
        let h = HttpHeaders { headers: Some(header_map(headers)), end_of_stream };
        self.send(ProcessingRequest {
            request: Some(Msg::RequestHeaders(h)),
            metadata_context: md,
            ..Default::default()
        })
        .await;
    }

    pub async fn request_body(&mut self, body: &[u8], end_of_stream: bool) {
        let b = HttpBody { body: body.to_vec(), end_of_stream };
        self.send(ProcessingRequest { request: Some(Msg::RequestBody(b)), ..Default::default() }).await;
    }

    pub async fn response_headers(&mut self, status: u16, end_of_stream: bool) {
        let h = HttpHeaders { headers: Some(header_map(&[(":status", &status.to_string())])), end_of_stream };
        self.send(ProcessingRequest { request: Some(Msg::ResponseHeaders(h)), ..Default::default() }).await;
    }

    pub async fn response_body(&mut self, body: &[u8], end_of_stream: bool) {
        let b = HttpBody { body: body.to_vec(), end_of_stream };
        self.send(ProcessingRequest { request: Some(Msg::ResponseBody(b)), ..Default::default() }).await;
    }

    /// Sends a POST to `path` with its body in `chunks` and reads the picker's decision,
    /// in the stream's body mode.
    pub async fn ask(&mut self, path: &str, extra: &[(&str, &str)], chunks: &[&[u8]], md: Option<Metadata>) -> Picked {
        let mut headers = vec![(":method", "POST"), (":path", path), ("content-type", "application/json")];
        headers.extend_from_slice(extra);
        self.request_headers(&headers, chunks.is_empty(), md).await;
        let duplex = self.mode == BodySendMode::FullDuplexStreamed;
        if !duplex && !chunks.is_empty() {
            match self.recv().await {
                Answer::RequestHeaders(h) => assert_eq!(h.response.unwrap_or_default(), CommonResponse::default()),
                other => return refused(other),
            }
        }
        for (i, c) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            self.request_body(c, last).await;
            if !duplex && !last {
                match self.recv().await {
                    Answer::RequestBody(b) => assert_eq!(b.response.unwrap_or_default(), CommonResponse::default()),
                    other => return refused(other),
                }
            }
        }
        let first = self.recv_full().await;
        let metadata = destination_metadata(&first);
        let common = match first.response.expect("a response kind") {
            Answer::RequestHeaders(h) if duplex || chunks.is_empty() => h.response.expect("common"),
            Answer::RequestBody(b) if !duplex => b.response.expect("common"),
            other => return refused(other),
        };
        let mutation = common.header_mutation.clone().expect("a header mutation");
        let set: BTreeMap<String, String> = mutation
            .set_headers
            .iter()
            .map(|o| {
                let h = o.header.clone().unwrap();
                (h.key, String::from_utf8(h.raw_value).unwrap())
            })
            .collect();
        assert!(common.clear_route_cache, "the route is recomputed");
        let mut body = Vec::new();
        if let Some(Mutation::Body(b)) = common.body_mutation.and_then(|m| m.mutation) {
            body = b;
        }
        if duplex && !chunks.is_empty() {
            body = self.passed_back(true).await;
        }
        let endpoint = set.get("x-gateway-destination-endpoint").cloned().expect("the destination header");
        Picked::Endpoint {
            endpoint,
            metadata: metadata.expect("dynamic metadata"),
            set,
            removed: mutation.remove_headers,
            body,
        }
    }

    /// Collects the body chunks the picker passes back until one ends the stream.
    pub async fn passed_back(&mut self, request: bool) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let b = match self.recv().await {
                Answer::RequestBody(b) if request => b,
                Answer::ResponseBody(b) if !request => b,
                other => panic!("expected a body answer, got {other:?}"),
            };
            match b.response.and_then(|c| c.body_mutation).and_then(|m| m.mutation) {
                Some(Mutation::StreamedResponse(s)) => {
                    body.extend_from_slice(&s.body);
                    if s.end_of_stream {
                        return body;
                    }
                }
                other => panic!("expected a streamed body, got {other:?}"),
            }
        }
    }

    /// Forwards the request to `endpoint` as the gateway would, and streams the worker's
    /// response back through the picker frame by frame; returns the body the picker
    /// passed back (full-duplex) or the worker's (buffered).
    pub async fn relay(&mut self, endpoint: &str, path: &str, body: Vec<u8>) -> (u16, String) {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let req = http::Request::post(format!("http://{endpoint}{path}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = within(10_000, client.request(req)).await.expect("the worker answers");
        let status = resp.status().as_u16();
        self.response_headers(status, false).await;
        assert!(matches!(self.recv().await, Answer::ResponseHeaders(_)));
        let duplex = self.mode == BodySendMode::FullDuplexStreamed;
        let mut body = resp.into_body();
        let mut out = Vec::new();
        while let Some(frame) = within(10_000, body.frame()).await {
            let Ok(data) = frame.expect("a frame").into_data() else { continue };
            self.response_body(&data, false).await;
            if duplex {
                let mut chunk = Vec::new();
                // A chunk passes back in one or more pieces; the last piece is not the end.
                while chunk.len() < data.len() {
                    match self.recv().await {
                        Answer::ResponseBody(b) => {
                            match b.response.and_then(|c| c.body_mutation).and_then(|m| m.mutation) {
                                Some(Mutation::StreamedResponse(s)) => chunk.extend_from_slice(&s.body),
                                other => panic!("expected a streamed body, got {other:?}"),
                            }
                        }
                        other => panic!("expected a body answer, got {other:?}"),
                    }
                }
                out.extend_from_slice(&chunk);
            } else {
                assert!(matches!(self.recv().await, Answer::ResponseBody(_)));
                out.extend_from_slice(&data);
            }
        }
        self.response_body(b"", true).await;
        if duplex {
            out.extend(self.passed_back(false).await);
        } else {
            assert!(matches!(self.recv().await, Answer::ResponseBody(_)));
        }
        (status, String::from_utf8_lossy(&out).into_owned())
    }
}

fn refused(a: Answer) -> Picked {
    match a {
        Answer::ImmediateResponse(r) => Picked::Refused {
            status: r.status.map_or(0, |s| s.code),
            body: serde_json::from_slice(&r.body).unwrap_or(Value::Null),
            details: r.details,
        },
        other => panic!("expected a decision or a local reply, got {other:?}"),
    }
}

/// `envoy.lb` / `x-gateway-destination-endpoint` of the dynamic metadata.
fn destination_metadata(r: &ProcessingResponse) -> Option<String> {
    let ns = r.dynamic_metadata.as_ref()?.fields.get("envoy.lb")?;
    let Some(Kind::StructValue(s)) = &ns.kind else { return None };
    match &s.fields.get("x-gateway-destination-endpoint")?.kind {
        Some(Kind::StringValue(v)) => Some(v.clone()),
        _ => None,
    }
}
