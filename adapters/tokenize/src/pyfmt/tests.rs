use super::*;
use serde_json::json;

fn value(j: serde_json::Value) -> Value {
    Value::from(minijinja::value::Serde(j))
}

#[track_caller]
fn check_dumps(j: serde_json::Value, opts: DumpOptions, want: &str) {
    assert_eq!(dumps(&value(j), &opts).unwrap(), want);
}

fn ascii() -> DumpOptions {
    DumpOptions { ensure_ascii: true, ..DumpOptions::default() }
}

// Every expected string below was printed by CPython 3.11's `json.dumps` / `repr`.
#[test]
fn floats_print_like_python_repr() {
    let cases = [
        (json!(1.0), "1.0"),
        (json!(1e-7), "1e-07"),
        (json!(1e16), "1e+16"),
        (json!(123456789.25), "123456789.25"),
        (json!(-0.0), "-0.0"),
        (json!(2.5e-5), "2.5e-05"),
        (json!(0.1), "0.1"),
        (json!(1e15), "1000000000000000.0"),
        (json!(12345678901234567.0), "1.2345678901234568e+16"),
        (json!(1.5e300), "1.5e+300"),
        (json!(100.0), "100.0"),
        (json!(0.0001), "0.0001"),
        (json!(1e-5), "1e-05"),
        (json!(-42), "-42"),
        (json!(18446744073709551615u64), "18446744073709551615"),
    ];
    for (j, want) in cases {
        check_dumps(j, DumpOptions::default(), want);
    }
}

#[test]
fn strings_and_containers_like_json_dumps() {
    let obj = json!({"b": [1, {"c": null}], "a": "x\u{e9}\n\u{1}\"\\\u{2028}🚀"});
    check_dumps(obj.clone(), ascii(), r#"{"b": [1, {"c": null}], "a": "x\u00e9\n\u0001\"\\\u2028\ud83d\ude80"}"#);
    check_dumps(
        obj,
        DumpOptions::default(),
        "{\"b\": [1, {\"c\": null}], \"a\": \"x\u{e9}\\n\\u0001\\\"\\\\\u{2028}🚀\"}",
    );
    let sorted =
        DumpOptions { ensure_ascii: true, indent: Some("  ".into()), sort_keys: true, ..DumpOptions::default() };
    check_dumps(
        json!({"b": [1, {"c": null}], "a": "x\u{e9}"}),
        sorted,
        "{\n  \"a\": \"x\\u00e9\",\n  \"b\": [\n    1,\n    {\n      \"c\": null\n    }\n  ]\n}",
    );
    let zero_indent = DumpOptions { indent: Some(String::new()), ..DumpOptions::default() };
    check_dumps(json!({"a": [], "b": {}}), zero_indent, "{\n\"a\": [],\n\"b\": {}\n}");
    let compact =
        DumpOptions { item_separator: Some(",".into()), key_separator: Some(":".into()), ..DumpOptions::default() };
    check_dumps(json!([1, 2, {"k": true}]), compact, r#"[1,2,{"k":true}]"#);
    check_dumps(json!({"a": "\u{7f}\t"}), ascii(), r#"{"a": "\u007f\t"}"#);
    check_dumps(json!({"a": "\u{7f}\t"}), DumpOptions::default(), "{\"a\": \"\u{7f}\\t\"}");
}

#[test]
fn undefined_is_not_serializable() {
    assert!(dumps(&Value::UNDEFINED, &DumpOptions::default()).is_err());
}

#[test]
fn str_prints_like_python() {
    let cases = [
        (json!({"a": null, "b": [true, 1.5, "it's"]}), r#"{'a': None, 'b': [True, 1.5, "it's"]}"#),
        (json!(null), "None"),
        (json!(false), "False"),
        (json!("plain"), "plain"),
        (json!(["a\nb", 2]), r"['a\nb', 2]"),
    ];
    for (j, want) in cases {
        assert_eq!(py_str(&value(j)).unwrap(), want);
    }
    assert_eq!(py_str(&Value::UNDEFINED).unwrap(), "");
}
