use serde_json::json;

use super::*;

fn plan(endpoint: Endpoint, body: Value) -> Option<Plan> {
    let Value::Object(json) = body else { panic!("an object") };
    let yes = |k: &str| json.get(k).and_then(Value::as_bool) == Some(true);
    if !yes("stream") {
        return None;
    }
    let max_tokens = ["max_completion_tokens", "max_tokens"].iter().find_map(|k| json.get(*k)?.as_u64());
    Some(Plan {
        endpoint,
        client_ids: yes("return_token_ids"),
        refusal: refusal(endpoint, &json),
        include_usage: include_usage(&json),
        max_tokens,
        json,
        attempts_max: 3,
        deadline_ms: 1_000,
    })
}

#[track_caller]
fn check_refusal(body: Value, want: Option<&str>) {
    assert_eq!(structured(body.as_object().unwrap()), want, "{body}");
}

#[track_caller]
fn check_fidelity(endpoint: Endpoint, body: Value, want: Option<(&str, &str)>) {
    assert_eq!(refusal(endpoint, body.as_object().unwrap()), want, "{endpoint:?} {body}");
}

#[test]
fn what_a_continuation_would_change_is_refused() {
    use Endpoint::{Chat, Completions};
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    check_fidelity(Chat, json!({"logprobs": true, "top_logprobs": 2}), Some(("logprobs", "refused_fidelity")));
    check_fidelity(Chat, json!({"logprobs": false}), None);
    check_fidelity(Chat, json!({"logprobs": null}), None);
    check_fidelity(Completions, json!({"logprobs": 0}), Some(("logprobs", "refused_fidelity")));
    check_fidelity(Chat, json!({"tools": tool}), Some(("tools", "refused_fidelity")));
    check_fidelity(Chat, json!({"tools": tool, "tool_choice": "auto"}), Some(("tools", "refused_fidelity")));
    check_fidelity(Chat, json!({"tools": tool, "tool_choice": "none"}), None);
    check_fidelity(Chat, json!({"tools": []}), None);
    check_fidelity(
        Chat,
        json!({"tools": tool, "tool_choice": "required"}),
        Some(("a forced tool call", "refused_structured")),
    );
    check_fidelity(
        Completions,
        json!({"response_format": {"type": "json_object"}, "logprobs": 1}),
        Some(("response_format", "refused_structured")),
    );
}

#[test]
fn structured_output_is_refused() {
    check_refusal(json!({}), None);
    check_refusal(json!({"response_format": {"type": "text"}}), None);
    check_refusal(json!({"response_format": {"type": "json_object"}}), Some("response_format"));
    check_refusal(json!({"response_format": {"type": "json_schema", "json_schema": {}}}), Some("response_format"));
    check_refusal(json!({"guided_json": {"type": "object"}}), Some("guided decoding"));
    check_refusal(json!({"guided_choice": ["a", "b"]}), Some("guided decoding"));
    check_refusal(json!({"guided_regex": null}), None);
    check_refusal(json!({"structured_outputs": {"regex": "a+"}}), Some("guided decoding"));
    check_refusal(json!({"tool_choice": "required"}), Some("a forced tool call"));
    check_refusal(json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}), Some("a forced tool call"));
    check_refusal(json!({"tool_choice": "auto"}), None);
}

#[test]
fn a_completion_continues_from_its_ids_with_fewer_tokens_left() {
    let p = plan(
        Endpoint::Completions,
        json!({"model": "m", "prompt": "hi", "stream": true, "max_tokens": 10, "min_tokens": 4, "temperature": 0}),
    )
    .unwrap();
    let text = Bytes::from(serde_json::to_vec(&p.json).unwrap());
    assert!(p.first_body(&text).1.windows(22).any(|w| w == b"\"return_token_ids\":tru"));
    let (path, body) = p.continuation("/v1/completions", &[1, 2], &[7, 8, 9]).unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(path, "/v1/completions");
    assert_eq!(v["prompt"], json!([1, 2, 7, 8, 9]));
    assert_eq!((v["max_tokens"].clone(), v["min_tokens"].clone()), (json!(7), json!(1)));
    assert_eq!(
        (v["temperature"].clone(), v["stream"].clone(), v["return_token_ids"].clone()),
        (json!(0), json!(true), json!(true))
    );
    assert!(p.continuation("/v1/completions", &[1], &[0; 10]).is_none(), "nothing left to generate");
}

#[test]
fn a_chat_continues_on_the_completions_endpoint_without_chat_fields() {
    let body = json!({
        "model": "m", "stream": true, "max_completion_tokens": 5, "messages": [{"role": "user", "content": "x"}],
        "tools": [], "logprobs": true, "stream_options": {"include_usage": true}, "seed": 3,
    });
    let p = plan(Endpoint::Chat, body).unwrap();
    let (path, body) = p.continuation("/v1/chat/completions?a=1", &[4], &[5]).unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(path, "/v1/completions?a=1");
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(keys, ["max_tokens", "model", "prompt", "return_token_ids", "seed", "stream", "stream_options"]);
    assert_eq!((v["prompt"].clone(), v["max_tokens"].clone()), (json!([4, 5]), json!(4)));
    assert_eq!(completions_path("/x/chat/completions"), "/x/completions");
}

/// The first body of a completion plan over the client's text `text`: it must parse to
/// the client's object with `return_token_ids` true, unless the plan refuses to continue,
/// when it is the client's text unchanged.
#[track_caller]
fn check_first_body(text: &str) {
    let client: Value = serde_json::from_str(text).unwrap();
    let p = plan(Endpoint::Completions, client.clone()).unwrap();
    let (json, body) = p.first_body(&Bytes::from(text.to_owned()));
    if p.refusal.is_some() {
        assert_eq!((&*json, &body[..]), (&client, text.as_bytes()), "{text}");
        return;
    }
    let mut want = client;
    want["return_token_ids"] = json!(true);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap(), want, "{text}");
    assert_eq!(*json, want, "{text}");
}

#[test]
fn the_first_body_asks_for_token_ids_whatever_the_clients_text() {
    check_first_body(r#"{"model":"m","prompt":"hi","stream":true}"#);
    check_first_body(" {\n \"model\" : \"m\", \"prompt\": \"} {\", \"stream\": true } \n");
    check_first_body(r#"{"stream":true,"return_token_ids":false}"#);
    check_first_body(r#"{"stream":true,"response_format":{"type":"json_object"}}"#);
}
