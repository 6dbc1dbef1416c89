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
    let h = |k: &str, v: &str, raw: &[u8]| PbHeaderValue { key: k.into(), value: v.into(), raw_value: raw.to_vec() };
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
