//! The OpenAI request and response shapes the worker speaks: parsing a completion or
//! chat request into what the engine needs, and building responses, stream chunks and
//! error bodies.
//!
//! Parsing is by hand over a `serde_json::Value` so every refusal names the offending
//! field; nothing here panics on any input. Unknown fields are ignored, as vLLM does.

use hyper::StatusCode;
use serde_json::{json, Map, Value};

use crate::engine_task::Done;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Completions,
    Chat,
    /// The Responses API: a chat built from `instructions` and `input`.
    Responses,
}

/// A completion prompt as given.
#[derive(Debug, PartialEq)]
pub(crate) enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
    /// Chat: the whole body goes to the tokenizer.
    Chat,
}

/// What the worker needs from a generation request.
#[derive(Debug)]
pub(crate) struct GenRequest {
    pub(crate) prompt: PromptInput,
    pub(crate) max_tokens: u32,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// vLLM's `return_token_ids`: chunks carry `token_ids`, the first `prompt_token_ids`.
    pub(crate) return_token_ids: bool,
    pub(crate) kv_transfer_params: Option<Map<String, Value>>,
    pub(crate) bootstrap: Bootstrap,
}

/// SGLang's disaggregation fields: where the prefill's bootstrap server is, and the room
/// pairing this request's prefill and decode.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Bootstrap {
    pub(crate) host: Option<String>,
    pub(crate) port: Option<u16>,
    pub(crate) room: Option<u64>,
}

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, PartialEq)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) kind: &'static str,
    pub(crate) param: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn bad(param: Option<&'static str>, message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param }
    }

    pub(crate) fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None }
    }

    pub(crate) fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

/// Limits parsing enforces.
pub(crate) struct ParseLimits {
    pub(crate) max_tokens_default: u32,
    pub(crate) max_tokens_max: u32,
}

/// Parses a request body. Linear in the body size.
pub(crate) fn parse(kind: Kind, body: &[u8], limits: &ParseLimits) -> Result<(GenRequest, Value), ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad(None, format!("invalid JSON body: {e}")))?;
    let Some(obj) = v.as_object() else {
        return Err(ApiError::bad(None, "the request body must be a JSON object"));
    };
    let (prompt, chat) = match kind {
        Kind::Completions => (parse_prompt(obj.get("prompt"))?, None),
        Kind::Responses => {
            let chat = kvroute_tokenize::responses::responses_chat(obj)
                .map_err(|e| ApiError::bad(Some("input"), e.to_string()))?;
            (PromptInput::Chat, Some(chat))
        }
        Kind::Chat => {
            if !matches!(obj.get("messages"), Some(Value::Array(m)) if !m.is_empty()) {
                return Err(ApiError::bad(Some("messages"), "`messages` must be a non-empty array"));
            }
            (PromptInput::Chat, None)
        }
    };
    let max_tokens = parse_max_tokens(obj, limits)?;
    let stream = opt_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage")?.unwrap_or(false),
        Some(_) => return Err(ApiError::bad(Some("stream_options"), "`stream_options` must be an object")),
    };
    match obj.get("n") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64() == Some(1) => {}
        Some(_) => return Err(ApiError::bad(Some("n"), "only n = 1 is supported")),
    }
    let kv_transfer_params = match obj.get("kv_transfer_params") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => Some(o.clone()),
        Some(_) => return Err(ApiError::bad(Some("kv_transfer_params"), "`kv_transfer_params` must be an object")),
    };
    let bootstrap = parse_bootstrap(obj)?;
    let return_token_ids = opt_bool(obj, "return_token_ids")?.unwrap_or(false);
    let req = GenRequest { prompt, max_tokens, stream, include_usage, return_token_ids, kv_transfer_params, bootstrap };
    // A Responses request tokenizes as the chat it amounts to.
    Ok((req, chat.unwrap_or(v)))
}

fn parse_bootstrap(obj: &Map<String, Value>) -> Result<Bootstrap, ApiError> {
    let host = match obj.get("bootstrap_host") {
        None | Some(Value::Null) => None,
        Some(Value::String(h)) if !h.is_empty() => Some(h.clone()),
        Some(_) => return Err(ApiError::bad(Some("bootstrap_host"), "`bootstrap_host` must be a non-empty string")),
    };
    let port = match obj.get("bootstrap_port") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64().and_then(|p| u16::try_from(p).ok()).filter(|&p| p > 0) {
            Some(p) => Some(p),
            None => return Err(ApiError::bad(Some("bootstrap_port"), "`bootstrap_port` must be a port in 1..=65535")),
        },
    };
    let room = match obj.get("bootstrap_room") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(r) => Some(r),
            None => {
                return Err(ApiError::bad(Some("bootstrap_room"), "`bootstrap_room` must be a non-negative integer"))
            }
        },
    };
    Ok(Bootstrap { host, port, room })
}

fn parse_prompt(p: Option<&Value>) -> Result<PromptInput, ApiError> {
    let bad = |m: &str| ApiError::bad(Some("prompt"), m);
    let prompt = match p {
        None | Some(Value::Null) => return Err(bad("`prompt` is required")),
        Some(Value::String(s)) => PromptInput::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => PromptInput::Text(s.clone()),
            [Value::Array(ids)] => PromptInput::Tokens(token_ids(ids)?),
            [] => return Err(bad("`prompt` is empty")),
            ids if ids.iter().all(Value::is_number) => PromptInput::Tokens(token_ids(ids)?),
            _ => return Err(bad("batched prompts are not supported: send one string or one array of token ids")),
        },
        Some(_) => return Err(bad("`prompt` must be a string or an array of token ids")),
    };
    match &prompt {
        PromptInput::Text(s) if s.is_empty() => Err(bad("`prompt` is empty")),
        PromptInput::Tokens(t) if t.is_empty() => Err(bad("`prompt` is empty")),
        _ => Ok(prompt),
    }
}

pub(crate) fn token_ids(ids: &[Value]) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| ApiError::bad(Some("prompt"), format!("token id {v} is not an integer in 0..2^32")))
        })
        .collect()
}

pub(crate) fn parse_max_tokens(obj: &Map<String, Value>, limits: &ParseLimits) -> Result<u32, ApiError> {
    // `max_output_tokens` is the Responses API's name.
    for key in ["max_completion_tokens", "max_output_tokens", "max_tokens"] {
        match obj.get(key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                let n = v.as_u64().filter(|&n| n >= 1 && n <= u64::from(limits.max_tokens_max));
                return n.map(|n| n as u32).ok_or_else(|| {
                    ApiError::bad(Some(key), format!("`{key}` must be an integer in 1..={}", limits.max_tokens_max))
                });
            }
        }
    }
    Ok(limits.max_tokens_default)
}

pub(crate) fn opt_bool(obj: &Map<String, Value>, key: &'static str) -> Result<Option<bool>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::bad(Some(key), format!("`{key}` must be a boolean"))),
    }
}

/// Where a decode worker pulls a prefill worker's KV from.
pub(crate) struct KvSource {
    pub(crate) engine_id: String,
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl KvSource {
    /// The `kv_transfer_params` a prefill worker answers with, shaped like vLLM's NIXL
    /// connector's. Block ids are the prompt's full-block indices (the model has no
    /// physical block numbers).
    pub(crate) fn params(&self, prompt_blocks: u32) -> Value {
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": (0..prompt_blocks).collect::<Vec<u32>>(),
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        })
    }
}

/// Identity of one response.
pub(crate) struct ResponseMeta {
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) kind: Kind,
    pub(crate) prompt_tokens: u32,
}

pub(crate) fn usage(meta: &ResponseMeta, done: &Done) -> Value {
    json!({
        "prompt_tokens": meta.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": u64::from(meta.prompt_tokens) + u64::from(done.completion_tokens),
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    })
}

/// A whole non-streaming response.
pub(crate) fn full_response(meta: &ResponseMeta, text: &str, done: &Done, kv: Option<Value>) -> Value {
    let choice = match meta.kind {
        Kind::Responses => return crate::responses::response(meta, text, Some(done)),
        Kind::Completions => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}),
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": "length",
        }),
    };
    let mut v = json!({
        "id": meta.id,
        "object": if meta.kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage(meta, done),
    });
    if let (Some(kv), Some(o)) = (kv, v.as_object_mut()) {
        o.insert("kv_transfer_params".into(), kv);
    }
    v
}

/// One stream chunk; `content` is `None` for the final chunk, which carries
/// `finish_reason`. Chat's first chunk also sets the role.
pub(crate) fn chunk(meta: &ResponseMeta, content: Option<&str>, first: bool) -> Value {
    let finish = if content.is_none() { json!("length") } else { Value::Null };
    let choice = match meta.kind {
        Kind::Completions => {
            json!({"index": 0, "text": content.unwrap_or(""), "logprobs": null, "finish_reason": finish})
        }
        Kind::Chat | Kind::Responses => {
            let delta = match (first, content) {
                (true, Some(c)) => json!({"role": "assistant", "content": c}),
                (_, Some(c)) => json!({"content": c}),
                (_, None) => json!({}),
            };
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        }
    };
    json!({
        "id": meta.id,
        "object": if meta.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    })
}

/// The usage-only chunk sent last when `stream_options.include_usage` is set.
pub(crate) fn usage_chunk(meta: &ResponseMeta, done: &Done) -> Value {
    json!({
        "id": meta.id,
        "object": if meta.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage(meta, done),
    })
}

#[cfg(test)]
mod tests;
