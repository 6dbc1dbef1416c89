use super::*;

const LIMITS: ParseLimits = ParseLimits { max_tokens_default: 16, max_tokens_max: 1000 };

#[track_caller]
fn check(kind: Kind, body: &str, want: Result<(PromptInput, u32, bool, bool), Option<&str>>) {
    let got = parse(kind, body.as_bytes(), &LIMITS);
    match (got, want) {
        (Ok((r, _)), Ok((prompt, max_tokens, stream, usage))) => {
            assert_eq!(r.prompt, prompt, "{body}");
            assert_eq!((r.max_tokens, r.stream, r.include_usage), (max_tokens, stream, usage), "{body}");
        }
        (Err(e), Err(param)) => {
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param, param, "{body}: {}", e.message);
            let b = e.body();
            for k in ["message", "type", "param", "code"] {
                assert!(b["error"].get(k).is_some(), "{k} missing in {b}");
            }
        }
        (got, want) => panic!("{body}: got {got:?}, want {want:?}"),
    }
}

fn text(s: &str) -> PromptInput {
    PromptInput::Text(s.to_string())
}

#[test]
fn completion_requests() {
    use Kind::Completions as C;
    check(C, r#"{"prompt":"hi"}"#, Ok((text("hi"), 16, false, false)));
    check(C, r#"{"prompt":["hi"],"max_tokens":3,"stream":true}"#, Ok((text("hi"), 3, true, false)));
    check(C, r#"{"prompt":[1,2,3],"max_tokens":null}"#, Ok((PromptInput::Tokens(vec![1, 2, 3]), 16, false, false)));
    check(
        C,
        r#"{"prompt":[[4,5]],"stream":true,"stream_options":{"include_usage":true}}"#,
        Ok((PromptInput::Tokens(vec![4, 5]), 16, true, true)),
    );
    check(C, r#"{"prompt":"x","max_completion_tokens":7,"max_tokens":9,"n":1}"#, Ok((text("x"), 7, false, false)));
    check(C, r#"{"prompt":"x","max_tokens":1000}"#, Ok((text("x"), 1000, false, false)));
}

#[test]
fn refusals_name_the_field() {
    use Kind::{Chat, Completions as C};
    for (kind, body, param) in [
        (C, "{", None),
        (C, "[]", None),
        (C, "", None),
        (C, r#"{"max_tokens":1}"#, Some("prompt")),
        (C, r#"{"prompt":""}"#, Some("prompt")),
        (C, r#"{"prompt":[]}"#, Some("prompt")),
        (C, r#"{"prompt":["a","b"]}"#, Some("prompt")),
        (C, r#"{"prompt":[1,-2]}"#, Some("prompt")),
        (C, r#"{"prompt":[1,2.5]}"#, Some("prompt")),
        (C, r#"{"prompt":[4294967296]}"#, Some("prompt")),
        (C, r#"{"prompt":{"a":1}}"#, Some("prompt")),
        (C, r#"{"prompt":"x","max_tokens":0}"#, Some("max_tokens")),
        (C, r#"{"prompt":"x","max_tokens":1001}"#, Some("max_tokens")),
        (C, r#"{"prompt":"x","max_tokens":"5"}"#, Some("max_tokens")),
        (C, r#"{"prompt":"x","max_completion_tokens":-1}"#, Some("max_completion_tokens")),
        (C, r#"{"prompt":"x","stream":"yes"}"#, Some("stream")),
        (C, r#"{"prompt":"x","stream_options":1}"#, Some("stream_options")),
        (C, r#"{"prompt":"x","n":2}"#, Some("n")),
        (C, r#"{"prompt":"x","kv_transfer_params":[1]}"#, Some("kv_transfer_params")),
        (C, r#"{"prompt":"x","bootstrap_host":""}"#, Some("bootstrap_host")),
        (C, r#"{"prompt":"x","bootstrap_port":0}"#, Some("bootstrap_port")),
        (C, r#"{"prompt":"x","bootstrap_port":65536}"#, Some("bootstrap_port")),
        (C, r#"{"prompt":"x","bootstrap_room":-1}"#, Some("bootstrap_room")),
        (C, r#"{"prompt":"x","bootstrap_room":"7"}"#, Some("bootstrap_room")),
        (Chat, r#"{"messages":[]}"#, Some("messages")),
        (Chat, r#"{"messages":"hi"}"#, Some("messages")),
        (Chat, r#"{"prompt":"hi"}"#, Some("messages")),
    ] {
        check(kind, body, Err(param));
    }
}

#[test]
fn chat_keeps_the_body_for_the_tokenizer() {
    let (r, body) = parse(Kind::Chat, br#"{"messages":[{"role":"user","content":"q"}],"max_tokens":2,"kv_transfer_params":{"do_remote_prefill":true}}"#, &LIMITS)
        .expect("valid chat");
    assert_eq!(r.prompt, PromptInput::Chat);
    assert_eq!(body["messages"][0]["content"], "q");
    assert_eq!(r.kv_transfer_params.and_then(|p| p.get("do_remote_prefill").cloned()), Some(Value::Bool(true)));
}

#[test]
fn bootstrap_fields_are_read() {
    let body =
        br#"{"prompt":"x","bootstrap_host":"10.0.0.5","bootstrap_port":8998,"bootstrap_room":9223372036854775807}"#;
    let (r, _) = parse(Kind::Completions, body, &LIMITS).expect("valid");
    let want = Bootstrap { host: Some("10.0.0.5".into()), port: Some(8998), room: Some((1 << 63) - 1) };
    assert_eq!(r.bootstrap, want);
    let (r, _) = parse(Kind::Completions, br#"{"prompt":"x"}"#, &LIMITS).expect("valid");
    assert_eq!(r.bootstrap, Bootstrap::default());
}

#[test]
fn response_shapes() {
    let done = Done { completion_tokens: 2, cached_tokens: 64, prompt_blocks: 1 };
    for kind in [Kind::Completions, Kind::Chat] {
        let meta = ResponseMeta { id: "x-1".into(), created: 5, model: "m".into(), kind, prompt_tokens: 70 };
        let full = full_response(&meta, "a b ", &done, Some(json!({"k": 1})));
        assert_eq!(
            full["usage"],
            json!({"prompt_tokens": 70, "completion_tokens": 2, "total_tokens": 72, "prompt_tokens_details": {"cached_tokens": 64}})
        );
        assert_eq!(full["kv_transfer_params"]["k"], 1);
        let first = chunk(&meta, Some("a "), true);
        let last = chunk(&meta, None, false);
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(first["choices"][0]["finish_reason"].is_null());
        match kind {
            Kind::Completions => {
                assert_eq!(full["object"], "text_completion");
                assert_eq!(full["choices"][0]["text"], "a b ");
                assert_eq!(first["choices"][0]["text"], "a ");
            }
            Kind::Chat => {
                assert_eq!(full["object"], "chat.completion");
                assert_eq!(full["choices"][0]["message"], json!({"role": "assistant", "content": "a b "}));
                assert_eq!(first["object"], "chat.completion.chunk");
                assert_eq!(first["choices"][0]["delta"], json!({"role": "assistant", "content": "a "}));
                assert_eq!(last["choices"][0]["delta"], json!({}));
            }
            Kind::Responses => unreachable!("not in this loop"),
        }
        assert_eq!(usage_chunk(&meta, &done)["choices"], json!([]));
    }
}

#[test]
fn a_responses_answer_is_a_response_object() {
    let done = Done { completion_tokens: 2, cached_tokens: 64, prompt_blocks: 1 };
    let meta =
        ResponseMeta { id: "resp_x-1".into(), created: 5, model: "m".into(), kind: Kind::Responses, prompt_tokens: 70 };
    let full = full_response(&meta, "a b ", &done, None);
    assert_eq!((&full["object"], &full["status"]), (&json!("response"), &json!("incomplete")));
    assert_eq!(
        full["output"][0]["content"][0],
        json!({"type": "output_text", "text": "a b ", "annotations": [], "logprobs": null})
    );
    assert_eq!(
        full["usage"],
        json!({"input_tokens": 70, "input_tokens_details": {"cached_tokens": 64}, "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 72})
    );
}
