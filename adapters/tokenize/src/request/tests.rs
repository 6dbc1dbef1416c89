use super::*;
use serde_json::json;

fn vllm(tool_dump: ToolDump) -> Dialect {
    Dialect::Vllm(VllmOptions { content_format: ContentFormat::Auto, tool_dump, image_text: None })
}

fn request(messages: Json, tools: Json) -> ChatRequest {
    let mut req = ChatRequest::new(messages.as_array().cloned().unwrap_or_default());
    req.tools = tools.as_array().cloned();
    req
}

/// Renders the context and returns (messages, tools) as the template would see them.
#[track_caller]
fn check(dialect: &Dialect, openai: bool, messages: Json, tools: Json, want_messages: Json, want_tools: Json) {
    let ctx = render_context(&request(messages, tools), dialect, openai, &[]).unwrap();
    // Compare as strings so key order, which templates can observe, is checked too.
    assert_eq!(ctx["messages"].to_string(), want_messages.to_string());
    assert_eq!(ctx["tools"].to_string(), want_tools.to_string());
}

#[test]
fn vllm_rebuilds_messages() {
    let d = vllm(ToolDump::default());
    check(
        &d,
        false,
        json!([{"content": "hi", "role": "user", "metadata": 1, "name": "bob", "task": 3}]),
        Json::Null,
        json!([{"role": "user", "content": "hi", "name": "bob"}]),
        Json::Null,
    );
    check(
        &d,
        false,
        json!([{"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "text", "text": null}, {"type": "refusal", "refusal": "c"}]}]),
        Json::Null,
        json!([{"role": "user", "content": "a\nb\nc"}]),
        Json::Null,
    );
    check(
        &d,
        true,
        json!([{"role": "user", "content": "a"}, {"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}], "tool_call_id": "t1"}]),
        Json::Null,
        json!([{"role": "user", "content": [{"type": "text", "text": "a"}]}, {"role": "tool", "content": "x\ny", "tool_call_id": "t1"}]),
        Json::Null,
    );
    check(
        &d,
        false,
        json!([{"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": 2}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
            {"id": "c3", "type": "function", "function": {"name": "h"}},
            {"id": "c4", "type": "function", "function": {"name": "i", "arguments": "[1, 2]"}},
            {"id": "c5", "type": "function", "function": {"name": "j", "arguments": ["x"]}}
        ], "reasoning": "because"}]),
        Json::Null,
        json!([{"thinking": "because", "role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": 2}}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}},
            {"id": "c3", "type": "function", "function": {"name": "h", "arguments": {}}},
            {"id": "c4", "type": "function", "function": {"name": "i", "arguments": {}}},
            {"id": "c5", "type": "function", "function": {"name": "j", "arguments": {}}}
        ], "reasoning": "because", "reasoning_content": "because"}]),
        Json::Null,
    );
    check(
        &d,
        false,
        json!([{"role": "assistant", "content": "x", "tool_calls": []}, {"role": "developer", "content": "d"}]),
        Json::Null,
        json!([{"role": "assistant", "content": "x"}, {"role": "developer", "content": "d"}]),
        Json::Null,
    );
}

#[test]
fn vllm_dumps_tools_like_pydantic() {
    let q = || json!([{"role": "user", "content": "q"}]);
    let tools = json!([{"function": {"parameters": {"z": 1, "a": 2}, "name": "f", "x-extra": true}, "x-top": 1}]);
    let legacy = |strict_field| vllm(ToolDump::WithExtras { strict_field });
    check(
        &legacy(true),
        false,
        q(),
        tools.clone(),
        q(),
        json!([{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": 2}, "strict": null, "x-extra": true}, "x-top": 1}]),
    );
    check(
        &legacy(false),
        false,
        q(),
        tools.clone(),
        q(),
        json!([{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": 2}, "x-extra": true}, "x-top": 1}]),
    );
    check(
        &vllm(ToolDump::Declared),
        false,
        q(),
        tools,
        q(),
        json!([{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": 2}}}]),
    );
}

/// vLLM 0.32 leaves `strict` out of its tool dump when the client did not set it; printing
/// `"strict": null` per tool made kvroute count 8 more prompt tokens than vLLM for two tools.
#[test]
fn vllm_omits_unset_strict_and_defer_loading() {
    let q = || json!([{"role": "user", "content": "q"}]);
    let d = vllm(ToolDump::default());
    check(
        &d,
        false,
        q(),
        json!([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]),
        q(),
        json!([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]),
    );
    check(
        &d,
        false,
        q(),
        json!([{"type": "function", "function": {"strict": null, "name": "f", "defer_loading": null}, "defer_loading": null}]),
        q(),
        json!([{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}]),
    );
    check(
        &d,
        false,
        q(),
        json!([{"type": "function", "function": {"strict": true, "name": "f", "defer_loading": false}}]),
        q(),
        json!([{"type": "function", "function": {"name": "f", "description": null, "parameters": null, "strict": true, "defer_loading": false}}]),
    );
    // A tool-level `defer_loading` is kept and also copied into the function when unset there.
    check(
        &d,
        false,
        q(),
        json!([{"defer_loading": true, "type": "function", "function": {"name": "f"}}]),
        q(),
        json!([{"type": "function", "function": {"name": "f", "description": null, "parameters": null, "defer_loading": true}, "defer_loading": true}]),
    );
}

#[test]
fn transformers_passes_messages_through() {
    check(
        &Dialect::Transformers,
        false,
        json!([{"role": "user", "content": [{"type": "image_url"}], "extra": {"k": 1}, "name": null}]),
        json!([]),
        json!([{"role": "user", "content": [{"type": "image_url"}], "extra": {"k": 1}}]),
        json!([]),
    );
    check(
        &Dialect::Transformers,
        false,
        json!([{"role": "assistant", "content": "a", "reasoning_content": "r"}]),
        Json::Null,
        json!([{"thinking": "r", "role": "assistant", "content": "a", "reasoning_content": "r"}]),
        Json::Null,
    );
}

#[track_caller]
fn check_rejects(dialect: &Dialect, req: ChatRequest, want: fn(&TokenizeError) -> bool) {
    let err = render_context(&req, dialect, false, &[]).unwrap_err();
    assert!(want(&err), "{err:?}");
    assert!(err.is_bad_request());
}

#[test]
fn rejects_malformed_requests() {
    let d = vllm(ToolDump::default());
    let invalid = |e: &TokenizeError| matches!(e, TokenizeError::InvalidRequest { .. });
    check_rejects(&d, request(json!([]), Json::Null), invalid);
    check_rejects(&d, request(json!(["text"]), Json::Null), invalid);
    check_rejects(&d, request(json!([{"content": "no role"}]), Json::Null), invalid);
    check_rejects(&d, request(json!([{"role": "user", "content": 5}]), Json::Null), invalid);
    check_rejects(&d, request(json!([{"role": "user", "content": [{"text": "no type"}]}]), Json::Null), invalid);
    check_rejects(&d, request(json!([{"role": "assistant", "tool_calls": [{"id": "x"}]}]), Json::Null), invalid);
    check_rejects(&d, request(json!([{"role": "assistant", "tool_calls": {"a": 1}}]), Json::Null), invalid);
    let custom = json!([{"role": "assistant", "tool_calls": [{"type": "custom", "function": {"name": "f"}}]}]);
    check_rejects(&d, request(custom, Json::Null), invalid);
    check_rejects(
        &d,
        request(json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), Json::Null),
        |e| matches!(e, TokenizeError::UnsupportedContentPart { kind } if kind == "image_url"),
    );
    check_rejects(&d, request(json!([{"role": "user", "content": [{"image_url": "x"}]}]), Json::Null), |e| {
        matches!(e, TokenizeError::UnsupportedContentPart { .. })
    });
    let mut req = request(json!([{"role": "user", "content": "q"}]), Json::Null);
    req.chat_template_kwargs.insert("messages".into(), json!([]));
    check_rejects(&d, req, invalid);
    check_rejects(&Dialect::Transformers, request(json!([1]), Json::Null), invalid);
}

#[test]
fn kwargs_layer_over_special_tokens_and_request_fields() {
    let mut req = request(json!([{"role": "user", "content": "q"}]), Json::Null);
    req.chat_template_kwargs.insert("bos_token".into(), json!("<B>"));
    req.chat_template_kwargs.insert("add_generation_prompt".into(), json!(false));
    req.chat_template_kwargs.insert("enable_thinking".into(), json!(true));
    let specials = [("bos_token".to_owned(), "<s>".to_owned()), ("eos_token".to_owned(), "</s>".to_owned())];
    let ctx = render_context(&req, &vllm(ToolDump::default()), false, &specials).unwrap();
    assert_eq!(ctx["bos_token"], json!("<B>"));
    assert_eq!(ctx["eos_token"], json!("</s>"));
    assert_eq!(ctx["add_generation_prompt"], json!(false));
    assert_eq!(ctx["enable_thinking"], json!(true));
    assert_eq!(ctx["documents"], Json::Null);
    assert_eq!(ctx["tools"], Json::Null);
}

#[test]
fn requests_deserialize_with_engine_defaults() {
    let req: ChatRequest = serde_json::from_value(json!({"messages": [{"role": "user", "content": "q"}]})).unwrap();
    assert!(req.add_generation_prompt);
    assert_eq!(req.tools, None);
    assert!(req.chat_template_kwargs.is_empty());
}

fn with_images(text: &str) -> Dialect {
    Dialect::Vllm(VllmOptions { image_text: Some(text.into()), ..VllmOptions::default() })
}

#[test]
fn image_parts_render_as_vllm_renders_them() {
    let d = with_images("<image>");
    let img = json!({"type": "image_url", "image_url": {"url": "data:,"}});
    let bare = json!({"image_url": "data:,"});
    // "openai" format: an image part in place.
    check(
        &d,
        true,
        json!([{"role": "user", "content": [{"type": "text", "text": "a"}, img, "b"]}]),
        Json::Null,
        json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}]),
        Json::Null,
    );
    // A tool message keeps its parts when one is an image.
    check(
        &d,
        true,
        json!([{"role": "tool", "content": [bare, {"type": "text", "text": "x"}], "tool_call_id": "t"}]),
        Json::Null,
        json!([{"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "x"}], "tool_call_id": "t"}]),
        Json::Null,
    );
    // "string" format: the images' text first, then the text; none twice.
    check(
        &d,
        false,
        json!([{"role": "user", "content": [{"type": "text", "text": "a"}, img, "b", img]}]),
        Json::Null,
        json!([{"role": "user", "content": "<image>\n<image>\na\nb"}]),
        Json::Null,
    );
    check(
        &d,
        false,
        json!([{"role": "user", "content": ["see <image> here", img, img]}, {"role": "user", "content": [img]}]),
        Json::Null,
        json!([{"role": "user", "content": "<image>\nsee <image> here"}, {"role": "user", "content": "<image>"}]),
        Json::Null,
    );
    let too_many = request(json!([{"role": "user", "content": ["<image><image>", img]}]), Json::Null);
    check_rejects(&d, too_many, |e| matches!(e, TokenizeError::InvalidRequest { .. }));
    let audio = json!([{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "x"}}]}]);
    check_rejects(&d, request(audio, Json::Null), |e| matches!(e, TokenizeError::UnsupportedContentPart { .. }));
}
