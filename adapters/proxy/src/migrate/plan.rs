//! How a stream that may migrate is forwarded and continued ([`Plan`]): which requests
//! may, the first try's body, and each continuation's path and body. Plain data: it
//! sends nothing and reads no clock.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Map, Value};

use kvroute_frontend::request::with_first_member;

use crate::config::MigrationConfig;
use crate::prepared::Prepared;
use crate::request::Endpoint;

/// Fields of a chat request that a completion continuation does not take.
const CHAT_ONLY: [&str; 14] = [
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "echo",
];

/// Fields that make a request's output structured (its grammar cannot be resumed).
const GUIDED: [&str; 6] =
    ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "guided_decoding"];

/// How a stream that may migrate is forwarded and continued.
pub(crate) struct Plan {
    endpoint: Endpoint,
    /// The forwarded body.
    json: Map<String, Value>,
    /// The client asked for `return_token_ids` itself: the fields stay in its chunks.
    pub(crate) client_ids: bool,
    /// Why a break cannot be continued, if it cannot: the reason, and the `outcome`
    /// label it is counted under.
    pub(crate) refusal: Option<(&'static str, &'static str)>,
    /// The client asked for a final usage chunk (`stream_options.include_usage`).
    pub(crate) include_usage: bool,
    /// The output limit the client set, if any.
    max_tokens: Option<u64>,
    pub(crate) attempts_max: u32,
    pub(crate) deadline_ms: u64,
}

impl Plan {
    /// The plan for a request, `None` when it is not a single streamed completion or
    /// chat, or migration is off.
    pub(crate) fn of(p: &Prepared, cfg: &MigrationConfig) -> Option<Plan> {
        // Only a stream can be continued: any other body is not parsed again.
        if cfg.attempts_max == 0 || !p.shape.stream || !matches!(p.endpoint, Endpoint::Chat | Endpoint::Completions) {
            return None;
        }
        let Value::Object(json) = &*p.json else { return None };
        let one = |k: &str| json.get(k).is_none_or(|v| v.is_null() || v.as_u64() == Some(1));
        let yes = |k: &str| json.get(k).and_then(Value::as_bool) == Some(true);
        if !yes("stream") || !one("n") || !one("best_of") || yes("echo") || yes("use_beam_search") {
            return None;
        }
        let max_tokens = ["max_completion_tokens", "max_tokens"].iter().find_map(|k| json.get(*k)?.as_u64());
        Some(Plan {
            endpoint: p.endpoint,
            client_ids: yes("return_token_ids"),
            refusal: refusal(p.endpoint, json),
            include_usage: include_usage(json),
            max_tokens,
            json: json.clone(),
            attempts_max: cfg.attempts_max,
            deadline_ms: cfg.deadline_ms,
        })
    }

    /// The body of the first try, and its object: the client's (`forwarded` is its text),
    /// asking for token ids when the stream could be continued. The key goes into the
    /// client's text when the client did not name it, rather than the whole body being
    /// re-encoded: this runs before routing, and prompts are long.
    pub(crate) fn first_body(&self, forwarded: &Bytes) -> (Arc<Value>, Bytes) {
        let mut json = self.json.clone();
        if self.refusal.is_none() {
            let named = json.insert("return_token_ids".into(), Value::Bool(true)).is_some();
            let json = Value::Object(json);
            let spliced = if named { None } else { with_first_member(forwarded, "\"return_token_ids\":true") };
            let body = spliced.unwrap_or_else(|| Bytes::from(json.to_string()));
            return (Arc::new(json), body);
        }
        (Arc::new(Value::Object(json)), forwarded.clone())
    }

    /// Whether a stream whose first frame is `first` is worth following: it names the
    /// prompt's token ids, or it is structured output (whose break gets its own error).
    pub(crate) fn can_continue(&self, first: Option<&http_body::Frame<Bytes>>) -> bool {
        let ids =
            first.and_then(|f| f.data_ref()).is_some_and(|d| memchr::memmem::find(d, b"prompt_token_ids").is_some());
        ids || self.refusal.is_some()
    }

    /// Whether the client's stream is a chat.
    pub(crate) fn is_chat(&self) -> bool {
        self.endpoint == Endpoint::Chat
    }

    /// The continuation after `generated` ids of a prompt of `prompt_ids`: the path
    /// (relative to the client's `path`) and body, or `None` when the output limit is
    /// already reached.
    pub(crate) fn continuation(&self, path: &str, prompt_ids: &[u32], generated: &[u32]) -> Option<(String, Bytes)> {
        let done = generated.len() as u64;
        let left = match self.max_tokens {
            Some(m) if m <= done => return None,
            Some(m) => Some(m - done),
            None => None,
        };
        let mut json = self.json.clone();
        for k in CHAT_ONLY {
            json.remove(k);
        }
        let ids: Vec<Value> = prompt_ids.iter().chain(generated).map(|&t| Value::from(t)).collect();
        json.insert("prompt".into(), Value::Array(ids));
        json.insert("return_token_ids".into(), Value::Bool(true));
        if let Some(left) = left {
            json.insert("max_tokens".into(), Value::from(left));
        }
        if let Some(min) = json.get("min_tokens").and_then(Value::as_u64) {
            json.insert("min_tokens".into(), Value::from(min.saturating_sub(done)));
        }
        let path = match self.endpoint {
            Endpoint::Chat => completions_path(path),
            _ => path.to_string(),
        };
        Some((path, Bytes::from(Value::Object(json).to_string())))
    }
}

/// Why a stream of `json` cannot be continued, with the outcome it counts as.
fn refusal(endpoint: Endpoint, json: &Map<String, Value>) -> Option<(&'static str, &'static str)> {
    structured(json)
        .map(|why| (why, "refused_structured"))
        .or_else(|| unfaithful(endpoint, json).map(|why| (why, "refused_fidelity")))
}

/// What a continuation on `/v1/completions` would drop or change for the client, if
/// `json` asks for it.
fn unfaithful(endpoint: Endpoint, json: &Map<String, Value>) -> Option<&'static str> {
    let logprobs = match json.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(_) => true,
    };
    if logprobs {
        return Some("logprobs");
    }
    let tools = json.get("tools").and_then(Value::as_array).is_some_and(|t| !t.is_empty());
    let none = json.get("tool_choice").and_then(Value::as_str) == Some("none");
    (endpoint == Endpoint::Chat && tools && !none).then_some("tools")
}

/// Whether the client asked for a final usage chunk.
fn include_usage(json: &Map<String, Value>) -> bool {
    json.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool) == Some(true)
}

/// Why `json` asks for structured output, if it does.
fn structured(json: &Map<String, Value>) -> Option<&'static str> {
    let format = json.get("response_format").and_then(|f| f.get("type")).and_then(Value::as_str);
    if format.is_some_and(|t| t != "text") {
        return Some("response_format");
    }
    if GUIDED.iter().any(|k| json.get(*k).is_some_and(|v| !v.is_null())) {
        return Some("guided decoding");
    }
    match json.get("tool_choice") {
        Some(Value::Object(_)) => Some("a forced tool call"),
        Some(Value::String(s)) if s == "required" => Some("a forced tool call"),
        _ => None,
    }
}

/// The completions path next to a chat path: `/v1/chat/completions?x` → `/v1/completions?x`.
fn completions_path(path: &str) -> String {
    let (p, q) = path.split_once('?').map_or((path, None), |(p, q)| (p, Some(q)));
    let p = p.strip_suffix("chat/completions").map_or_else(|| p.to_string(), |head| format!("{head}completions"));
    q.map_or(p.clone(), |q| format!("{p}?{q}"))
}

#[cfg(test)]
mod tests;
