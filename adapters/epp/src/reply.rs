//! The answers the endpoint picker sends: the destination header and metadata, passed-on
//! body chunks, plain "continue"s and local error replies in the OpenAI error shape.
//!
//! Names follow the Gateway API Inference Extension's endpoint picker protocol: the chosen
//! `ip:port` goes in the `x-gateway-destination-endpoint` request header and, with the same
//! value, in the dynamic metadata namespace `envoy.lb` under the same key.

use bytes::Bytes;
use http::StatusCode;
use kvroute_frontend::ApiError;
use prost_types::{value::Kind, Struct, Value};

use crate::pb::core_v3::{header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption};
use crate::pb::envoy::r#type::v3::HttpStatus;
use crate::pb::ext_proc::{
    body_mutation::Mutation, processing_response::Response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};

/// The header naming the chosen endpoint.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The dynamic-metadata namespace of the chosen endpoint.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The filter-metadata namespace where a gateway may restrict the candidates.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of that restriction: a list of `ip:port`.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// Largest body chunk passed back in one message; Envoy recommends at most 64 KiB.
pub const CHUNK_BYTES_MAX: usize = 62_000;

/// Which message an answer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The request headers.
    RequestHeaders,
    /// A request body chunk.
    RequestBody,
    /// The request trailers.
    RequestTrailers,
    /// The response headers.
    ResponseHeaders,
    /// A response body chunk.
    ResponseBody,
    /// The response trailers.
    ResponseTrailers,
}

/// "Carry on unchanged" for `part`.
pub fn proceed(part: Part) -> ProcessingResponse {
    with_common(part, CommonResponse::default())
}

/// Wraps `common` as the answer to `part` (trailers carry only a header mutation).
pub fn with_common(part: Part, common: CommonResponse) -> ProcessingResponse {
    let response = match part {
        Part::RequestHeaders => Response::RequestHeaders(HeadersResponse { response: Some(common) }),
        Part::ResponseHeaders => Response::ResponseHeaders(HeadersResponse { response: Some(common) }),
        Part::RequestBody => Response::RequestBody(BodyResponse { response: Some(common) }),
        Part::ResponseBody => Response::ResponseBody(BodyResponse { response: Some(common) }),
        Part::RequestTrailers => {
            Response::RequestTrailers(TrailersResponse { header_mutation: common.header_mutation })
        }
        Part::ResponseTrailers => {
            Response::ResponseTrailers(TrailersResponse { header_mutation: common.header_mutation })
        }
    };
    ProcessingResponse { response: Some(response), ..ProcessingResponse::default() }
}

/// The headers to set on the routed request and the ones to remove.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Destination {
    /// `ip:port` of the chosen worker.
    pub endpoint: String,
    /// Further headers to set (worker id, dp rank, content length).
    pub set: Vec<(String, String)>,
    /// Headers to remove (the trust token).
    pub remove: Vec<String>,
}

impl Destination {
    /// The header mutation, with the route cache cleared so the gateway routes on it.
    pub fn common(&self) -> CommonResponse {
        let mut set_headers = vec![header(DESTINATION_HEADER, &self.endpoint)];
        set_headers.extend(self.set.iter().map(|(k, v)| header(k, v)));
        CommonResponse {
            header_mutation: Some(HeaderMutation { set_headers, remove_headers: self.remove.clone() }),
            clear_route_cache: true,
            ..CommonResponse::default()
        }
    }

    /// `{"envoy.lb": {"x-gateway-destination-endpoint": "ip:port"}}`.
    pub fn metadata(&self) -> Struct {
        let inner = Struct { fields: [(DESTINATION_HEADER.to_string(), string(&self.endpoint))].into() };
        Struct { fields: [(DESTINATION_NAMESPACE.to_string(), Value { kind: Some(Kind::StructValue(inner)) })].into() }
    }
}

/// A header that replaces any value the request had.
pub fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.to_string(), value: String::new(), raw_value: value.as_bytes().to_vec() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

fn string(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.to_string())) }
}

/// Body chunks to pass on in full-duplex mode, each at most [`CHUNK_BYTES_MAX`]; the last
/// one says `end_of_stream` when `last` is true. An empty body is one empty chunk.
pub fn streamed_body(part: Part, body: &Bytes, last: bool) -> Vec<ProcessingResponse> {
    let n = body.len().div_ceil(CHUNK_BYTES_MAX).max(1);
    (0..n)
        .map(|i| {
            let chunk = body.slice((i * CHUNK_BYTES_MAX).min(body.len())..((i + 1) * CHUNK_BYTES_MAX).min(body.len()));
            let streamed = StreamedBodyResponse { body: chunk.to_vec(), end_of_stream: last && i + 1 == n };
            let common = CommonResponse {
                body_mutation: Some(BodyMutation { mutation: Some(Mutation::StreamedResponse(streamed)) }),
                ..CommonResponse::default()
            };
            with_common(part, common)
        })
        .collect()
}

/// Replaces a buffered body (when the `kvroute` object was removed from it).
pub fn replaced_body(body: &Bytes) -> BodyMutation {
    BodyMutation { mutation: Some(Mutation::Body(body.to_vec())) }
}

/// A local reply: the error's status, JSON body, content type and `Retry-After`.
pub fn immediate(e: &ApiError) -> ProcessingResponse {
    let mut reply = json_reply(e.status, &e.body_json(), &format!("kvroute_{}", e.code));
    if let (Some(s), Some(Response::ImmediateResponse(r))) = (e.retry_after_s, reply.response.as_mut()) {
        if let Some(h) = r.headers.as_mut() {
            h.set_headers.push(header("retry-after", &s.to_string()));
        }
    }
    reply
}

/// A local reply with a JSON body; `details` shows in the gateway's logs.
pub fn json_reply(status: StatusCode, body: &serde_json::Value, details: &str) -> ProcessingResponse {
    let reply = ImmediateResponse {
        status: Some(HttpStatus { code: i32::from(status.as_u16()) }),
        headers: Some(HeaderMutation {
            set_headers: vec![header("content-type", "application/json")],
            remove_headers: Vec::new(),
        }),
        body: body.to_string().into_bytes(),
        grpc_status: None,
        details: details.to_string(),
    };
    ProcessingResponse { response: Some(Response::ImmediateResponse(reply)), ..ProcessingResponse::default() }
}
