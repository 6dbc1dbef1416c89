//! The chat a Responses API request (`POST /v1/responses`) amounts to, so that it
//! tokenizes like one: a router hashes the prefix an engine prefills, and the simulated
//! worker prefills the same ids.
//!
//! The messages are built as vLLM 0.32 builds them (`construct_input_messages`):
//! `instructions` become the system message; a string `input` one user message; a list
//! of input items becomes messages one by one, where a `function_call` or a `reasoning`
//! item joins the assistant message before it (as its `tool_calls` or `reasoning`) and a
//! `function_call_output` becomes a `tool` message. Items with a `role` pass through,
//! their `input_text` and `output_text` parts read as `text` parts. Function tools are
//! rewritten from the Responses API's flat shape to the chat shape.
//!
//! What it cannot see: a `previous_response_id` names a conversation stored on one
//! engine, which the router does not hold, so only the new input counts. Work is linear
//! in the body.

use std::fmt;

use serde_json::{json, Map, Value};

/// Why a Responses API body has no chat.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResponsesError {
    /// `input` is absent, empty, or neither a string nor a list.
    BadInput,
    /// `instructions` is neither a string nor null.
    BadInstructions,
    /// Input item `index` is not an object, or of a type vLLM refuses.
    BadItem {
        /// Its position in `input`.
        index: usize,
    },
}

impl fmt::Display for ResponsesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResponsesError::BadInput => f.write_str("`input` must be a non-empty string or a non-empty list of items"),
            ResponsesError::BadInstructions => f.write_str("`instructions` must be a string"),
            ResponsesError::BadItem { index } => write!(f, "`input[{index}]` is not a supported input item"),
        }
    }
}

impl std::error::Error for ResponsesError {}

/// The chat body (`messages`, and `tools` and `chat_template_kwargs` when given) that a
/// Responses API `body` (a JSON object) renders as.
pub fn responses_chat(body: &Map<String, Value>) -> Result<Value, ResponsesError> {
    let mut messages: Vec<Value> = Vec::new();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(ResponsesError::BadInstructions),
    }
    match body.get("input") {
        Some(Value::String(s)) if !s.is_empty() => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (index, item) in items.iter().enumerate() {
                add_item(&mut messages, item).ok_or(ResponsesError::BadItem { index })?;
            }
        }
        _ => return Err(ResponsesError::BadInput),
    }
    let mut out = Map::new();
    out.insert("messages".into(), Value::Array(messages));
    if let Some(Value::Array(tools)) = body.get("tools") {
        let tools: Vec<Value> = tools.iter().filter_map(chat_tool).collect();
        if !tools.is_empty() {
            out.insert("tools".into(), Value::Array(tools));
        }
    }
    if let Some(kwargs @ Value::Object(_)) = body.get("chat_template_kwargs") {
        out.insert("chat_template_kwargs".into(), kwargs.clone());
    }
    Ok(Value::Object(out))
}

/// Adds one input item: a new message, or a part of the assistant message before it.
/// `None` for an item vLLM refuses.
fn add_item(messages: &mut Vec<Value>, item: &Value) -> Option<()> {
    let obj = item.as_object()?;
    let text_of = |v: Option<&Value>| -> Option<String> {
        match v? {
            Value::String(s) => Some(s.clone()),
            Value::Array(parts) => parts.first()?.get("text")?.as_str().map(String::from),
            _ => None,
        }
    };
    let (field, value) = match (obj.get("type").and_then(Value::as_str), obj.get("role").and_then(Value::as_str)) {
        (Some("function_call"), _) => {
            let call = json!({
                "id": obj.get("call_id")?,
                "type": "function",
                "function": {"name": obj.get("name")?, "arguments": obj.get("arguments").cloned().unwrap_or(json!(""))},
            });
            ("tool_calls", Value::Array(vec![call]))
        }
        (Some("reasoning"), _) => {
            let text = text_of(obj.get("content")).or_else(|| text_of(obj.get("summary"))).unwrap_or_default();
            ("reasoning", Value::String(text))
        }
        (Some("function_call_output"), _) => {
            let output = obj.get("output").cloned().unwrap_or(Value::Null);
            let id = obj.get("call_id").cloned().unwrap_or(Value::Null);
            messages.push(json!({"role": "tool", "content": output, "tool_call_id": id}));
            return Some(());
        }
        (_, Some("assistant")) => ("content", Value::String(text_of(obj.get("content"))?)),
        (_, Some(_)) => {
            messages.push(with_text_parts(obj));
            return Some(());
        }
        _ => return None,
    };
    join_assistant(messages, field, value);
    Some(())
}

/// Puts `value` under `field` of the assistant message just before, when it has none
/// (tool calls are appended), else in a new assistant message.
fn join_assistant(messages: &mut Vec<Value>, field: &str, value: Value) {
    if let Some(prev) = messages.last_mut().filter(|m| m.get("role") == Some(&json!("assistant"))) {
        match (prev.get_mut(field), value) {
            (None | Some(Value::Null), value) => {
                prev[field] = value;
                return;
            }
            (Some(Value::Array(calls)), Value::Array(more)) if field == "tool_calls" => {
                calls.extend(more);
                return;
            }
            (Some(_), value) => {
                messages.push(json!({"role": "assistant", field: value}));
                return;
            }
        }
    }
    messages.push(json!({"role": "assistant", field: value}));
}

/// A message item as a chat message: `type` dropped, text parts renamed.
fn with_text_parts(obj: &Map<String, Value>) -> Value {
    let mut m: Map<String, Value> =
        obj.iter().filter(|(k, _)| *k != "type" && *k != "id").map(|(k, v)| (k.clone(), v.clone())).collect();
    if let Some(Value::Array(parts)) = m.get_mut("content") {
        for p in parts.iter_mut() {
            if matches!(p.get("type").and_then(Value::as_str), Some("input_text" | "output_text")) {
                p["type"] = json!("text");
            }
        }
    }
    Value::Object(m)
}

/// A flat Responses function tool as a chat tool; `None` for other tool types.
fn chat_tool(tool: &Value) -> Option<Value> {
    let obj = tool.as_object().filter(|o| o.get("type") == Some(&json!("function")))?;
    let function: Map<String, Value> =
        obj.iter().filter(|(k, _)| *k != "type").map(|(k, v)| (k.clone(), v.clone())).collect();
    Some(json!({"type": "function", "function": function}))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[track_caller]
    fn check(body: Value, want: Result<Value, ResponsesError>) {
        let got = responses_chat(body.as_object().unwrap()).map(|c| c["messages"].clone());
        assert_eq!(got, want, "{body}");
    }

    #[test]
    fn inputs_become_vllms_messages() {
        check(json!({"input": "hi"}), Ok(json!([{"role": "user", "content": "hi"}])));
        check(
            json!({"input": "hi", "instructions": "be terse"}),
            Ok(json!([{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}])),
        );
        check(
            json!({"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]}]}),
            Ok(json!([{"role": "user", "content": [{"type": "text", "text": "a"}]}])),
        );
        check(
            json!({"input": [
                {"role": "user", "content": "q"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ]}),
            Ok(json!([
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
                ]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ])),
        );
        check(
            json!({"input": [{"type": "reasoning", "summary": [{"text": "think"}]}, {"role": "assistant", "content": "x"}]}),
            Ok(json!([{"role": "assistant", "reasoning": "think", "content": "x"}])),
        );
    }

    #[test]
    fn bad_bodies_are_typed_errors() {
        check(json!({}), Err(ResponsesError::BadInput));
        check(json!({"input": ""}), Err(ResponsesError::BadInput));
        check(json!({"input": []}), Err(ResponsesError::BadInput));
        check(json!({"input": 3}), Err(ResponsesError::BadInput));
        check(json!({"input": "x", "instructions": 1}), Err(ResponsesError::BadInstructions));
        check(json!({"input": ["x"]}), Err(ResponsesError::BadItem { index: 0 }));
        check(
            json!({"input": [{"role": "user", "content": "a"}, {"type": "web_search"}]}),
            Err(ResponsesError::BadItem { index: 1 }),
        );
        check(json!({"input": [{"type": "function_call", "name": "f"}]}), Err(ResponsesError::BadItem { index: 0 }));
    }

    #[test]
    fn function_tools_take_the_chat_shape() {
        let body = json!({"input": "x", "tools": [
            {"type": "function", "name": "f", "parameters": {"type": "object"}},
            {"type": "web_search"},
        ]});
        let chat = responses_chat(body.as_object().unwrap()).unwrap();
        assert_eq!(
            chat["tools"],
            json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
        );
        let empty = json!({"input": "x", "tools": []});
        assert!(responses_chat(empty.as_object().unwrap()).unwrap().get("tools").is_none());
    }
}
