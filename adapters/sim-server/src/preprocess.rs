//! vLLM's preprocessing endpoints: the render pair, which answers with vLLM's
//! `GenerateRequest`s (the token ids the engine would run, without running them), and
//! `/tokenize` and `/detokenize`.
//!
//! Every id comes from [`prompt_ids`], the call generation tokenizes with, so a router
//! that tokenizes through these endpoints (vllm-router's `kv_aware` does, per worker)
//! hashes exactly the blocks this worker's KV events announce. As in generation,
//! `model` and `add_special_tokens` are read but do not change the ids: the worker
//! tokenizes every request one way.
//!
//! Shapes (vLLM 0.32):
//! - `POST /v1/completions/render`: a completion body; answers a JSON array with one
//!   `GenerateRequest` per prompt (a batch of strings or of id lists is accepted here,
//!   though generation takes one prompt): `{"request_id", "token_ids", "features": null,
//!   "sampling_params": {"n", "max_tokens"}, "model", "stream", "stream_options",
//!   "cache_salt", "priority", "kv_transfer_params": null}`.
//! - `POST /v1/chat/completions/render`: a chat body; answers one `GenerateRequest`.
//! - `POST /tokenize`: `{"prompt": "..."}` or `{"messages": [...]}` (plus `model`,
//!   `add_special_tokens`, `return_token_strs`, the chat template's fields); answers
//!   `{"count", "max_model_len", "tokens", "token_strs"}`.
//! - `POST /detokenize`: `{"tokens": [...]}`; answers `{"prompt": "..."}`.

use std::sync::Arc;

use hyper::StatusCode;
use serde_json::{json, Map, Value};

use crate::http::State;
use crate::media::{self, PromptMedia};
use crate::openai::{opt_bool, parse_max_tokens, token_ids, ApiError, Kind, PromptInput};
use crate::tokenizer::TokenizeError;

/// Prompts one render call takes; a batch beyond it is refused.
pub(crate) const RENDER_PROMPTS_MAX: usize = 1024;

/// Token ids at or above this belong to generated tokens (`kvroute_sim::prompt`).
const PROMPT_ID_END: u32 = 1 << 31;

/// The token ids the worker hashes and prefills for `prompt`; `body` is the whole
/// request, which a chat template reads. A chat's images are expanded into their
/// placeholder tokens (see [`crate::media`]). Refuses what tokenizes to nothing.
pub(crate) fn prompt_ids(state: &State, prompt: &PromptInput, body: &Value) -> Result<Vec<u32>, ApiError> {
    engine_prompt(state, prompt, body).map(|(ids, _)| ids)
}

/// [`prompt_ids`] and the images placed in them.
pub(crate) fn engine_prompt(
    state: &State,
    prompt: &PromptInput,
    body: &Value,
) -> Result<(Vec<u32>, Option<Arc<PromptMedia>>), ApiError> {
    let ids = match prompt {
        PromptInput::Text(t) => state.tokenizer.encode_text(t),
        PromptInput::Tokens(t) => Ok(t.clone()),
        PromptInput::Chat => state.tokenizer.encode_chat(body),
    }
    .map_err(tokenize_error)?;
    let (ids, media) = match (&state.media, prompt) {
        (Some(m), PromptInput::Chat) => media::place(m, ids, body)?,
        _ => (ids, None),
    };
    if ids.is_empty() {
        return Err(ApiError::bad(Some("prompt"), "the prompt tokenizes to nothing"));
    }
    Ok((ids, media))
}

/// `/v1/completions/render` (an array) or `/v1/chat/completions/render` (one object).
/// Linear in the body and the prompts' length.
pub(crate) fn render(state: &State, kind: Kind, body: &[u8]) -> Result<Value, ApiError> {
    let v = parse_object(body)?;
    let obj = v.as_object().ok_or_else(not_an_object)?;
    let max_tokens = parse_max_tokens(obj, &state.limits)?;
    let stream = opt_bool(obj, "stream")?.unwrap_or(false);
    let prompts = match kind {
        Kind::Completions => completion_prompts(obj.get("prompt"))?,
        Kind::Chat | Kind::Responses => {
            check_messages(obj)?;
            vec![PromptInput::Chat]
        }
    };
    let mut out = Vec::with_capacity(prompts.len());
    for prompt in &prompts {
        let ids = prompt_ids(state, prompt, &v)?;
        if let Some((index, id)) = ids.iter().enumerate().find(|(_, &id)| id >= PROMPT_ID_END) {
            let message = format!("token {index} has id {id}; ids must be below 2^31");
            return Err(ApiError::bad(Some("prompt"), message));
        }
        out.push(json!({
            "request_id": state.response_id(kind),
            "token_ids": ids,
            "features": null,
            "sampling_params": {"n": 1, "max_tokens": max_tokens},
            "model": obj.get("model").cloned().unwrap_or(Value::Null),
            "stream": stream,
            "stream_options": if stream { obj.get("stream_options").cloned().unwrap_or(Value::Null) } else { Value::Null },
            "cache_salt": obj.get("cache_salt").cloned().unwrap_or(Value::Null),
            "priority": obj.get("priority").cloned().unwrap_or(json!(0)),
            "kv_transfer_params": null,
        }));
    }
    Ok(match kind {
        Kind::Completions => Value::Array(out),
        Kind::Chat | Kind::Responses => out.pop().unwrap_or(Value::Null),
    })
}

/// `/tokenize`: a text prompt or a chat. Linear in the body and the prompt's length.
pub(crate) fn tokenize(state: &State, body: &[u8]) -> Result<Value, ApiError> {
    let v = parse_object(body)?;
    let obj = v.as_object().ok_or_else(not_an_object)?;
    opt_bool(obj, "add_special_tokens")?;
    let want_strs = opt_bool(obj, "return_token_strs")?.unwrap_or(false);
    let prompt = if obj.contains_key("messages") {
        check_messages(obj)?;
        PromptInput::Chat
    } else {
        match obj.get("prompt") {
            Some(Value::String(s)) if !s.is_empty() => PromptInput::Text(s.clone()),
            _ => return Err(ApiError::bad(Some("prompt"), "`prompt` must be a non-empty string (or send `messages`)")),
        }
    };
    let ids = prompt_ids(state, &prompt, &v)?;
    let strs = match want_strs {
        true => Value::from(
            ids.iter()
                .map(|&id| state.tokenizer.decode(&[id]))
                .collect::<Result<Vec<_>, _>>()
                .map_err(tokenize_error)?,
        ),
        false => Value::Null,
    };
    Ok(json!({"count": ids.len(), "max_model_len": state.facts.max_model_len(), "tokens": ids, "token_strs": strs}))
}

/// `/detokenize`: the text of `tokens`. Linear in their number.
pub(crate) fn detokenize(state: &State, body: &[u8]) -> Result<Value, ApiError> {
    let v = parse_object(body)?;
    let obj = v.as_object().ok_or_else(not_an_object)?;
    let ids = match obj.get("tokens") {
        Some(Value::Array(items)) => token_ids(items).map_err(|e| ApiError { param: Some("tokens"), ..e })?,
        _ => return Err(ApiError::bad(Some("tokens"), "`tokens` must be an array of token ids")),
    };
    let text = state.tokenizer.decode(&ids).map_err(tokenize_error)?;
    Ok(json!({"prompt": text}))
}

/// A completion's `prompt` as a list: one string, one id list, or a batch of either.
fn completion_prompts(p: Option<&Value>) -> Result<Vec<PromptInput>, ApiError> {
    let bad = |m: &str| ApiError::bad(Some("prompt"), m);
    let prompts = match p {
        Some(Value::String(s)) => vec![PromptInput::Text(s.clone())],
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => vec![PromptInput::Tokens(token_ids(items)?)],
        Some(Value::Array(items)) if items.len() > RENDER_PROMPTS_MAX => {
            return Err(bad(&format!("at most {RENDER_PROMPTS_MAX} prompts per render")))
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(PromptInput::Text(s.clone())),
                Value::Array(ids) => Ok(PromptInput::Tokens(token_ids(ids)?)),
                _ => Err(bad("each prompt of a batch must be a string or an array of token ids")),
            })
            .collect::<Result<Vec<_>, _>>()?,
        None | Some(Value::Null) => return Err(bad("`prompt` is required")),
        Some(_) => return Err(bad("`prompt` must be a string or an array of token ids")),
    };
    let empty = |p: &PromptInput| {
        matches!(p, PromptInput::Text(s) if s.is_empty()) || matches!(p, PromptInput::Tokens(t) if t.is_empty())
    };
    if prompts.is_empty() || prompts.iter().any(empty) {
        return Err(bad("`prompt` is empty"));
    }
    Ok(prompts)
}

fn check_messages(obj: &Map<String, Value>) -> Result<(), ApiError> {
    match obj.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => Ok(()),
        _ => Err(ApiError::bad(Some("messages"), "`messages` must be a non-empty array")),
    }
}

fn parse_object(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad(None, format!("invalid JSON body: {e}")))
}

fn not_an_object() -> ApiError {
    ApiError::bad(None, "the request body must be a JSON object")
}

/// The request's faults are a 400, the tokenizer's a 500, what it cannot do a 501.
pub(crate) fn tokenize_error(e: TokenizeError) -> ApiError {
    match e {
        TokenizeError::BadInput(m) => ApiError::bad(Some("prompt"), m),
        TokenizeError::Unsupported(_) => {
            ApiError::new(StatusCode::NOT_IMPLEMENTED, "not_implemented_error", e.to_string())
        }
        other => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", other.to_string()),
    }
}
