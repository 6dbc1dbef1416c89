//! OTLP/HTTP protobuf encoding of finished spans, written straight from the SDK's
//! `SpanData` into one buffer.
//!
//! The OTLP exporter crate first copies every span into generated message structs (a
//! `String` per name and key, a `Vec` per attribute list) and then encodes those; at
//! full sampling that copy was most of what tracing cost the proxy. This writes the same
//! `ExportTraceServiceRequest` bytes without it: each nested message is written into a
//! reused scratch buffer and then copied behind its length. What it leaves to others:
//! sampling, batching and the HTTP post ([`crate::otel`]).

use std::time::{SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{SpanKind, Status};
use opentelemetry::{Array, InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::trace::SpanData;

/// Protobuf wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

/// `SpanFlags`: the context says whether the parent is remote, and it is.
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

/// An `ExportTraceServiceRequest` of `spans`, one resource (`resource` attributes) with
/// one scope entry per instrumentation scope, in order of first appearance.
pub fn encode_request(resource: &[KeyValue], spans: &[SpanData]) -> Vec<u8> {
    let mut scopes: Vec<&InstrumentationScope> = Vec::new();
    for s in spans {
        if !scopes.contains(&&s.instrumentation_scope) {
            scopes.push(&s.instrumentation_scope);
        }
    }
    let mut w = Writer::default();
    w.message(1, |w| {
        w.message(1, |w| {
            for kv in resource {
                w.message(1, |w| w.key_value(kv));
            }
        });
        for scope in scopes {
            w.message(2, |w| {
                w.message(1, |w| {
                    w.string(1, scope.name());
                    w.string(2, scope.version().unwrap_or(""));
                    for kv in scope.attributes() {
                        w.message(3, |w| w.key_value(kv));
                    }
                });
                for s in spans.iter().filter(|s| &s.instrumentation_scope == scope) {
                    w.message(2, |w| w.span(s));
                }
                w.string(3, scope.schema_url().unwrap_or(""));
            });
        }
    });
    w.out
}

/// Nested messages are built in `stack` buffers (reused across messages of the same
/// depth) and copied into their parent behind their length.
#[derive(Default)]
struct Writer {
    out: Vec<u8>,
    stack: Vec<Vec<u8>>,
    depth: usize,
}

impl Writer {
    fn message(&mut self, field: u32, body: impl FnOnce(&mut Writer)) {
        if self.stack.len() <= self.depth {
            self.stack.push(Vec::new());
        }
        let parent = std::mem::replace(&mut self.out, std::mem::take(&mut self.stack[self.depth]));
        self.depth += 1;
        body(self);
        self.depth -= 1;
        let inner = std::mem::replace(&mut self.out, parent);
        self.key(field, LEN);
        self.varint(inner.len() as u64);
        self.out.extend_from_slice(&inner);
        let mut inner = inner;
        inner.clear();
        self.stack[self.depth] = inner;
    }

    fn span(&mut self, s: &SpanData) {
        let cx = &s.span_context;
        self.bytes(1, &cx.trace_id().to_bytes());
        self.bytes(2, &cx.span_id().to_bytes());
        self.string(3, &cx.trace_state().header());
        if s.parent_span_id != opentelemetry::trace::SpanId::INVALID {
            self.bytes(4, &s.parent_span_id.to_bytes());
        }
        self.string(5, &s.name);
        self.uint(6, kind(&s.span_kind));
        self.fixed64(7, nanos(s.start_time));
        self.fixed64(8, nanos(s.end_time));
        for kv in &s.attributes {
            self.message(9, |w| w.key_value(kv));
        }
        self.uint(10, u64::from(s.dropped_attributes_count));
        for e in s.events.iter() {
            self.message(11, |w| {
                w.fixed64(1, nanos(e.timestamp));
                w.string(2, &e.name);
                for kv in &e.attributes {
                    w.message(3, |w| w.key_value(kv));
                }
                w.uint(4, u64::from(e.dropped_attributes_count));
            });
        }
        self.uint(12, u64::from(s.events.dropped_count));
        for l in s.links.iter() {
            self.message(13, |w| {
                w.bytes(1, &l.span_context.trace_id().to_bytes());
                w.bytes(2, &l.span_context.span_id().to_bytes());
                w.string(3, &l.span_context.trace_state().header());
                for kv in &l.attributes {
                    w.message(4, |w| w.key_value(kv));
                }
                w.uint(5, u64::from(l.dropped_attributes_count));
                let remote = if l.span_context.is_remote() { IS_REMOTE } else { 0 };
                w.fixed32(6, u32::from(l.span_context.trace_flags().to_u8()) | HAS_IS_REMOTE | remote);
            });
        }
        self.uint(14, u64::from(s.links.dropped_count));
        // Always present, as the exporter crate writes it: code 0 (unset), 1 (ok), 2 (error).
        self.message(15, |w| match &s.status {
            Status::Error { description } => {
                w.string(2, description);
                w.uint(3, 2);
            }
            Status::Ok => w.uint(3, 1),
            Status::Unset => {}
        });
        let remote = if s.parent_span_is_remote { IS_REMOTE } else { 0 };
        self.fixed32(16, u32::from(cx.trace_flags().to_u8()) | HAS_IS_REMOTE | remote);
    }

    fn key_value(&mut self, kv: &KeyValue) {
        self.string(1, kv.key.as_str());
        self.message(2, |w| w.any_value(&kv.value));
    }

    fn any_value(&mut self, v: &Value) {
        match v {
            Value::Bool(b) => self.key_varint(2, u64::from(*b)),
            Value::I64(i) => self.key_varint(3, *i as u64),
            Value::F64(f) => {
                self.key(4, FIXED64);
                self.out.extend_from_slice(&f.to_bits().to_le_bytes());
            }
            Value::String(s) => self.key_string(1, s.as_str()),
            Value::Array(a) => self.message(5, |w| match a {
                Array::Bool(xs) => xs.iter().for_each(|x| w.message(1, |w| w.any_value(&Value::Bool(*x)))),
                Array::I64(xs) => xs.iter().for_each(|x| w.message(1, |w| w.any_value(&Value::I64(*x)))),
                Array::F64(xs) => xs.iter().for_each(|x| w.message(1, |w| w.any_value(&Value::F64(*x)))),
                Array::String(xs) => xs.iter().for_each(|x| w.message(1, |w| w.key_string(1, x.as_str()))),
                // A kind added to the API later is written as its text.
                other => w.message(1, |w| w.key_string(1, &other.to_string())),
            }),
            other => self.key_string(1, &other.to_string()),
        }
    }

    fn key(&mut self, field: u32, wire: u32) {
        self.varint(u64::from(field << 3 | wire));
    }

    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.out.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.out.push(v as u8);
    }

    /// A scalar field; proto3 leaves zero out.
    fn uint(&mut self, field: u32, v: u64) {
        if v != 0 {
            self.key_varint(field, v);
        }
    }

    /// A varint field written even when zero (a oneof member must be present).
    fn key_varint(&mut self, field: u32, v: u64) {
        self.key(field, VARINT);
        self.varint(v);
    }

    fn fixed64(&mut self, field: u32, v: u64) {
        if v != 0 {
            self.key(field, FIXED64);
            self.out.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn fixed32(&mut self, field: u32, v: u32) {
        if v != 0 {
            self.key(field, FIXED32);
            self.out.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn bytes(&mut self, field: u32, b: &[u8]) {
        if !b.is_empty() {
            self.key_string_bytes(field, b);
        }
    }

    fn string(&mut self, field: u32, s: &str) {
        self.bytes(field, s.as_bytes());
    }

    /// A string field written even when empty (a oneof member must be present).
    fn key_string(&mut self, field: u32, s: &str) {
        self.key_string_bytes(field, s.as_bytes());
    }

    fn key_string_bytes(&mut self, field: u32, b: &[u8]) {
        self.key(field, LEN);
        self.varint(b.len() as u64);
        self.out.extend_from_slice(b);
    }
}

fn kind(k: &SpanKind) -> u64 {
    match k {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::time::Duration;

    use opentelemetry::trace::Link;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use opentelemetry::{Array, InstrumentationScope, KeyValue, StringValue};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use opentelemetry_sdk::Resource;
    use prost::Message;

    use super::*;

    fn span(id: u64, parent: u64, scope: &InstrumentationScope, status: Status) -> SpanData {
        let t0 = UNIX_EPOCH + Duration::from_nanos(1_764_600_000_123_456_789 + id);
        let flags = if id.is_multiple_of(2) { TraceFlags::SAMPLED } else { TraceFlags::default() };
        let state = TraceState::from_key_value([("vendor", "v1")]).expect("a trace state");
        let cx = SpanContext::new(
            TraceId::from(0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736 + u128::from(id)),
            SpanId::from(id),
            flags,
            false,
            state,
        );
        let mut events = SpanEvents::default();
        events.events.push(opentelemetry::trace::Event::new(
            "first_byte",
            t0 + Duration::from_micros(7),
            vec![KeyValue::new("n", 1)],
            2,
        ));
        let mut links = SpanLinks::default();
        links.links.push(Link::new(cx.clone(), vec![KeyValue::new("why", "retry")], 0));
        links.dropped_count = 1;
        SpanData {
            span_context: cx,
            parent_span_id: SpanId::from(parent),
            parent_span_is_remote: parent == 1,
            span_kind: [SpanKind::Server, SpanKind::Client, SpanKind::Internal][id as usize % 3].clone(),
            name: Cow::Borrowed(["kvroute.request", "upstream", "route"][id as usize % 3]),
            start_time: t0,
            end_time: t0 + Duration::from_millis(id),
            attributes: vec![
                KeyValue::new("kvroute.worker.id", -3i64),
                KeyValue::new("kvroute.cost", 12.5),
                KeyValue::new("kvroute.queued", false),
                KeyValue::new("kvroute.model", ""),
                KeyValue::new("ids", Value::Array(Array::I64(vec![1, -2]))),
                KeyValue::new(
                    "names",
                    Value::Array(Array::String(vec![StringValue::from("a"), StringValue::from("")])),
                ),
                KeyValue::new("flags", Value::Array(Array::Bool(vec![true]))),
                KeyValue::new("shares", Value::Array(Array::F64(vec![0.5]))),
            ],
            dropped_attributes_count: id as u32,
            events,
            links,
            status,
            instrumentation_scope: scope.clone(),
        }
    }

    /// Encodes `spans` and checks the decoded request equals the exporter crate's
    /// conversion of the same spans (scope entries sorted by name, since it groups in a
    /// hash map).
    fn check(spans: Vec<SpanData>) {
        let resource = Resource::builder_empty().with_service_name("kvroute").build();
        let attrs: Vec<KeyValue> = resource.iter().map(|(k, v)| KeyValue::new(k.clone(), v.clone())).collect();
        let ours = encode_request(&attrs, &spans);
        let mut got = ExportTraceServiceRequest::decode(ours.as_slice()).expect("our bytes decode");
        let want = group_spans_by_resource_and_scope(spans, &ResourceAttributesWithSchema::from(&resource));
        let mut want = ExportTraceServiceRequest { resource_spans: want };
        for r in got.resource_spans.iter_mut().chain(want.resource_spans.iter_mut()) {
            r.scope_spans.sort_by(|a, b| {
                a.scope.as_ref().map(|s| s.name.clone()).cmp(&b.scope.as_ref().map(|s| s.name.clone()))
            });
        }
        assert_eq!(got, want);
    }

    #[test]
    fn encodes_what_the_exporter_crate_encodes() {
        let kv = InstrumentationScope::builder("kvroute").build();
        let other = InstrumentationScope::builder("other")
            .with_version("1.2")
            .with_schema_url("https://opentelemetry.io/schemas/1.0")
            .with_attributes([KeyValue::new("a", "b")])
            .build();
        check(vec![span(2, 0, &kv, Status::Unset)]);
        check(vec![
            span(2, 0, &kv, Status::Ok),
            span(3, 1, &kv, Status::error("status 502")),
            span(4, 2, &other, Status::Unset),
            span(5, 2, &kv, Status::error("")),
        ]);
    }
}
