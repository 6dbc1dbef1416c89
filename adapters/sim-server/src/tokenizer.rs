//! Prompt tokenization behind a small trait, and the built-in byte-level fallback.
//!
//! The simulated worker needs token ids only to hash prompts into KV blocks, so a router
//! and the worker agree on prefixes exactly when they tokenize alike. Real tokenizers
//! (Hugging Face `tokenizer.json` plus chat templates) plug in through
//! [`PromptTokenizer`]; this module only ships the fallback, which maps each UTF-8 byte
//! to one token id. The fallback is approximate (about four times more tokens than a
//! BPE tokenizer, so more blocks per prompt): use `--tokenizer` for parity with a real
//! model. A router that wants to match the fallback calls the same two public functions.

use std::fmt;

use serde_json::Value;

/// Why a prompt could not be tokenized.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenizeError {
    /// The request is malformed (for example `messages` is not an array): a 400.
    BadInput(String),
    /// The tokenizer itself failed: a 500.
    Backend(String),
}

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizeError::BadInput(m) => write!(f, "invalid prompt: {m}"),
            TokenizeError::Backend(m) => write!(f, "tokenizer failed: {m}"),
        }
    }
}

impl std::error::Error for TokenizeError {}

/// Turns a request's prompt into the token ids the engine hashes.
///
/// Implementations must be deterministic: the same text or body gives the same ids, or
/// prefix caching (and a router's view of it) breaks. Ids must stay below 2^31 (the
/// range above is reserved for generated tokens).
pub trait PromptTokenizer: Send + Sync + 'static {
    /// Token ids of a completion prompt.
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError>;
    /// Token ids of a whole chat request body (messages, tools, template), as the model
    /// would see it rendered.
    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError>;
}

/// The built-in tokenizer: one token per UTF-8 byte (approximate; use `--tokenizer`
/// for parity with a real model).
#[derive(Clone, Copy, Debug, Default)]
pub struct FallbackTokenizer;

impl PromptTokenizer for FallbackTokenizer {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(fallback_text_tokens(text))
    }

    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        match body.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => Ok(fallback_chat_tokens(body)),
            Some(Value::Array(_)) => Err(TokenizeError::BadInput("`messages` is empty".into())),
            Some(_) => Err(TokenizeError::BadInput("`messages` must be an array".into())),
            None => Err(TokenizeError::BadInput("`messages` is required".into())),
        }
    }
}

/// The fallback's ids for a text: each UTF-8 byte becomes the id of its value (0-255).
pub fn fallback_text_tokens(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// The fallback's ids for a chat body: [`fallback_text_tokens`] of a deterministic
/// rendering of everything the model would see.
///
/// The rendering is, in order: `<|tools|>` and the `tools` array as canonical JSON (keys
/// sorted, no spaces) if present and non-empty, then one line per message,
/// `<|ROLE|>` followed by its content (a string as is; an array of parts as each text
/// part's text, other parts as canonical JSON), then `<|tool_calls|>` and canonical JSON
/// of `tool_calls`, and `<|name|>`/`<|tool_call_id|>` fields if present, ending in a
/// newline; and finally `<|assistant|>` (the generation prompt). Anything that is not an
/// object in `messages` is rendered as canonical JSON. Work is linear in the body size.
pub fn fallback_chat_tokens(body: &Value) -> Vec<u32> {
    fallback_text_tokens(&render_chat(body))
}

fn render_chat(body: &Value) -> String {
    let mut out = String::new();
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty())) {
        out.push_str("<|tools|>");
        canonical_json(tools, &mut out);
        out.push('\n');
    }
    let empty = Vec::new();
    let messages = body.get("messages").and_then(Value::as_array).unwrap_or(&empty);
    for m in messages {
        let Some(obj) = m.as_object() else {
            canonical_json(m, &mut out);
            out.push('\n');
            continue;
        };
        out.push_str("<|");
        out.push_str(obj.get("role").and_then(Value::as_str).unwrap_or("user"));
        out.push_str("|>");
        match obj.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    match p.get("text").and_then(Value::as_str) {
                        Some(t) => out.push_str(t),
                        None => canonical_json(p, &mut out),
                    }
                }
            }
            Some(other) => canonical_json(other, &mut out),
        }
        for key in ["tool_calls", "name", "tool_call_id"] {
            if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
                out.push_str("<|");
                out.push_str(key);
                out.push_str("|>");
                match v {
                    Value::String(s) => out.push_str(s),
                    other => canonical_json(other, &mut out),
                }
            }
        }
        out.push('\n');
    }
    out.push_str("<|assistant|>");
    out
}

/// JSON with object keys sorted and no whitespace, independent of how serde_json was
/// built (its `preserve_order` feature changes map order).
fn canonical_json(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                canonical_json(&map[k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[track_caller]
    fn check_render(body: Value, want: &str) {
        assert_eq!(render_chat(&body), want);
        assert_eq!(fallback_chat_tokens(&body), fallback_text_tokens(want));
    }

    #[test]
    fn renders_every_part_of_a_chat() {
        check_render(json!({"messages": [{"role": "user", "content": "hi"}]}), "<|user|>hi\n<|assistant|>");
        check_render(
            json!({"messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}
            ], "tools": [{"type": "function", "function": {"name": "f"}}]}),
            concat!(
                "<|tools|>[{\"function\":{\"name\":\"f\"},\"type\":\"function\"}]\n",
                "<|system|>be brief\n",
                "<|user|>a{\"image_url\":{\"url\":\"u\"},\"type\":\"image_url\"}\n",
                "<|assistant|><|tool_calls|>[{\"function\":{\"arguments\":\"{}\",\"name\":\"f\"},\"id\":\"c1\"}]\n",
                "<|tool|>42<|tool_call_id|>c1\n",
                "<|assistant|>"
            ),
        );
        // Empty tools add nothing; odd message shapes still render deterministically.
        check_render(json!({"messages": [7, {"content": 1}], "tools": []}), "7\n<|user|>1\n<|assistant|>");
    }

    #[test]
    fn key_order_does_not_matter() {
        let a: Value = serde_json::from_str(r#"{"messages":[{"role":"user","content":[{"type":"x","b":1,"a":2}]}]}"#)
            .expect("valid json");
        let b: Value = serde_json::from_str(r#"{"messages":[{"content":[{"a":2,"b":1,"type":"x"}],"role":"user"}]}"#)
            .expect("valid json");
        assert_eq!(fallback_chat_tokens(&a), fallback_chat_tokens(&b));
    }

    #[test]
    fn text_is_bytes_and_chat_needs_messages() {
        assert_eq!(fallback_text_tokens("aé"), vec![97, 0xc3, 0xa9]);
        let t = FallbackTokenizer;
        for body in [json!({}), json!({"messages": "x"}), json!({"messages": []})] {
            assert!(matches!(t.encode_chat(&body), Err(TokenizeError::BadInput(_))), "{body}");
        }
    }
}
