//! The chat request as the router receives it, and the rewriting an engine applies to it
//! before its chat template sees it. It leaves rendering to `template.rs`.
//!
//! Parity with the engine means rendering what the engine renders, and vLLM does not hand
//! the client's messages to the template as they came. [`Dialect::Vllm`] mirrors vLLM's
//! OpenAI server (`parse_chat_messages` and `_postprocess_messages`):
//! - each message is rebuilt from `role`, `content`, and per role `tool_calls` and
//!   `reasoning` (assistant, copied to `reasoning_content` too), `tool_call_id` (tool),
//!   `tools` (developer), plus `name` and `task` when they are strings; other fields are
//!   dropped;
//! - `content` becomes a string (text parts joined by `"\n"`, `null` becomes `""`) or, for
//!   templates that loop over `message.content` (the "openai" content format, detected the
//!   way vLLM does), a list of `{"type": "text", "text": ...}` parts; tool messages always
//!   get a string when all parts are text;
//! - tool-call `arguments` given as a JSON string are parsed (invalid JSON becomes `{}`) and
//!   an empty `tool_calls` list is removed;
//! - tools are dumped as vLLM's pydantic model does ([`ToolDump`]); in vLLM 0.32:
//!   `{"type", "function": {"name", "description", "parameters"[, "strict"][,
//!   "defer_loading"]}[, "defer_loading"]}`, `description` and `parameters` as `null` when
//!   absent, `strict` and `defer_loading` only when set, other fields dropped.
//!
//! Then both dialects apply what transformers' `apply_chat_template` does: keys whose value
//! is `null` are dropped from each message, and a message's reasoning is also offered as
//! `thinking` and `reasoning_content`. [`Dialect::Transformers`] does only that, for callers
//! that render through transformers directly.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use crate::TokenizeError;

/// A chat request: the parts of an OpenAI `/v1/chat/completions` body a template can see.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    /// The conversation, each message a JSON object (`role`, `content`, `tool_calls`, ...).
    pub messages: Vec<Json>,
    /// The tool schemas, if the request offers tools. `Some(vec![])` still selects a
    /// model's `tool_use` template, as in transformers.
    #[serde(default)]
    pub tools: Option<Vec<Json>>,
    /// Documents for retrieval-augmented templates (`documents` in the template).
    #[serde(default)]
    pub documents: Option<Vec<Json>>,
    /// Whether the template appends the assistant header; vLLM's default is `true`.
    #[serde(default = "default_true")]
    pub add_generation_prompt: bool,
    /// Extra template variables (`chat_template_kwargs`), e.g. `enable_thinking`. They
    /// override the special tokens; `add_generation_prompt` and `documents` given here
    /// override the fields above, as vLLM merges them.
    #[serde(default)]
    pub chat_template_kwargs: Map<String, Json>,
}

fn default_true() -> bool {
    true
}

impl ChatRequest {
    /// A request with these messages, no tools and the generation prompt on.
    pub fn new(messages: Vec<Json>) -> Self {
        Self { messages, tools: None, documents: None, add_generation_prompt: true, chat_template_kwargs: Map::new() }
    }
}

/// Which engine's view of the request to render.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dialect {
    /// vLLM's OpenAI-compatible server (see the module doc for the rewriting it applies).
    Vllm(VllmOptions),
    /// transformers' `apply_chat_template` called on the request's JSON as it is.
    Transformers,
}

impl Default for Dialect {
    fn default() -> Self {
        Self::Vllm(VllmOptions::default())
    }
}

/// Knobs of [`Dialect::Vllm`] that differ between vLLM versions or deployments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmOptions {
    /// `--chat-template-content-format`; default [`ContentFormat::Auto`].
    pub content_format: ContentFormat,
    /// How the engine dumps each tool for the template; default [`ToolDump::Declared`].
    pub tool_dump: ToolDump,
    /// Whether the model takes images, and what one becomes under the "string" content
    /// format: the model's placeholder text in vLLM (`get_placeholder_str`, `<image>` for
    /// LLaVA). `None` (default): image parts are refused.
    pub image_text: Option<String>,
}

impl Default for VllmOptions {
    fn default() -> Self {
        Self { content_format: ContentFormat::Auto, tool_dump: ToolDump::default(), image_text: None }
    }
}

/// How vLLM turns each request tool into the dict its chat template sees (`tojson` prints
/// it, so every key is prompt tokens).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ToolDump {
    /// vLLM 0.32: declared fields only. `name`, `description`, `parameters` (`null` when
    /// absent), then `strict` and `defer_loading` only when not `null`; a tool-level
    /// `defer_loading` is also copied into an unset function one. Client extras are dropped.
    #[default]
    Declared,
    /// Earlier releases: `name`, `description`, `parameters` and, with `strict_field`,
    /// `strict`, each `null` when absent; the client's extra fields follow.
    WithExtras {
        /// Whether `FunctionDefinition` declares `strict` (printed as `null` when unset).
        strict_field: bool,
    },
}

/// How message content reaches the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Detect from the template: "openai" if it loops over a message's `content`.
    Auto,
    /// Content is one string.
    String,
    /// Content is a list of `{"type": "text", "text": ...}` parts.
    OpenAi,
}

/// Keys of `chat_template_kwargs` that would clobber what the engine passes itself.
const RESERVED_KWARGS: [&str; 5] = ["messages", "tools", "chat_template", "tokenize", "conversation"];

/// The template variables for `req`: special tokens, then kwargs, then the request fields.
pub(crate) fn render_context(
    req: &ChatRequest,
    dialect: &Dialect,
    openai_content: bool,
    special_tokens: &[(String, String)],
) -> Result<Map<String, Json>, TokenizeError> {
    if req.messages.is_empty() {
        return Err(TokenizeError::invalid("the conversation has no messages"));
    }
    let mut ctx = Map::new();
    for (k, v) in special_tokens {
        ctx.insert(k.clone(), Json::String(v.clone()));
    }
    for (k, v) in &req.chat_template_kwargs {
        if RESERVED_KWARGS.contains(&k.as_str()) {
            return Err(TokenizeError::invalid(format!("chat_template_kwargs may not set {k:?}")));
        }
        ctx.insert(k.clone(), v.clone());
    }
    let (messages, tools) = match dialect {
        Dialect::Vllm(opts) => (
            vllm_messages(&req.messages, openai_content, opts.image_text.as_deref())?,
            req.tools.as_ref().map(|t| t.iter().map(|x| vllm_tool(x, opts.tool_dump)).collect()),
        ),
        Dialect::Transformers => (req.messages.clone(), req.tools.clone()),
    };
    let messages = transformers_messages(messages)?;
    ctx.insert("messages".into(), Json::Array(messages));
    ctx.insert("tools".into(), tools.map_or(Json::Null, Json::Array));
    if !ctx.contains_key("documents") {
        let docs = req.documents.clone().map_or(Json::Null, Json::Array);
        ctx.insert("documents".into(), docs);
    }
    if !ctx.contains_key("add_generation_prompt") {
        ctx.insert("add_generation_prompt".into(), Json::Bool(req.add_generation_prompt));
    }
    Ok(ctx)
}

/// transformers drops `null` keys and aliases reasoning under `thinking`/`reasoning_content`.
fn transformers_messages(messages: Vec<Json>) -> Result<Vec<Json>, TokenizeError> {
    let mut out = Vec::with_capacity(messages.len());
    for message in messages {
        let Json::Object(map) = message else {
            return Err(TokenizeError::invalid("each message must be a JSON object"));
        };
        let map: Map<String, Json> = map.into_iter().filter(|(_, v)| !v.is_null()).collect();
        let reasoning = ["reasoning_content", "thinking", "reasoning"].iter().find_map(|k| map.get(*k).cloned());
        let map = match reasoning {
            None => map,
            Some(r) => {
                let mut aliased = Map::with_capacity(map.len() + 2);
                aliased.insert("thinking".into(), r.clone());
                for (k, v) in map {
                    aliased.insert(k, v);
                }
                aliased.insert("reasoning_content".into(), r);
                aliased
            }
        };
        out.push(Json::Object(map));
    }
    Ok(out)
}

fn vllm_messages(messages: &[Json], openai_content: bool, image: Option<&str>) -> Result<Vec<Json>, TokenizeError> {
    messages.iter().map(|m| vllm_message(m, openai_content, image)).collect()
}

fn vllm_message(message: &Json, openai_content: bool, image: Option<&str>) -> Result<Json, TokenizeError> {
    let Json::Object(msg) = message else {
        return Err(TokenizeError::invalid("each message must be a JSON object"));
    };
    let role = match msg.get("role") {
        Some(Json::String(r)) => r.as_str(),
        _ => return Err(TokenizeError::invalid("each message needs a string `role`")),
    };
    let pieces = content_pieces(msg.get("content"), image.is_some())?;
    // vLLM keeps a tool message's parts as a list only when one is not text.
    let has_image = pieces.iter().any(|p| matches!(p, Piece::Image));
    let openai = openai_content && (role != "tool" || has_image);
    let mut out = Map::new();
    out.insert("role".into(), Json::String(role.to_owned()));
    out.insert("content".into(), content_value(&pieces, openai, image.unwrap_or_default())?);
    match role {
        "assistant" => {
            if let Some(calls) = msg.get("tool_calls").filter(|v| !v.is_null()) {
                if let Some(calls) = vllm_tool_calls(calls)? {
                    out.insert("tool_calls".into(), calls);
                }
            }
            if let Some(r) = msg.get("reasoning").filter(|v| !v.is_null()) {
                out.insert("reasoning".into(), r.clone());
                out.insert("reasoning_content".into(), r.clone());
            }
        }
        "tool" => {
            if let Some(id) = msg.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(Json::String(s)) = msg.get(key) {
            out.insert(key.into(), Json::String(s.clone()));
        }
    }
    if role == "developer" {
        out.insert("tools".into(), msg.get("tools").cloned().unwrap_or(Json::Null));
    }
    Ok(Json::Object(out))
}

/// One content part as the template sees it.
enum Piece {
    Text(String),
    Image,
}

/// Whether `part` is an image part as vLLM's parser reads one: `type` `image_url`, or
/// no `type` and an `image_url` field. A router finds a request's images with it, in the
/// order their placeholders take in the prompt.
pub fn is_image_part(part: &Map<String, Json>) -> bool {
    match part.get("type") {
        Some(Json::String(t)) => t == "image_url",
        None => part.contains_key("image_url"),
        Some(_) => false,
    }
}

/// Each content part, in order; text parts whose text is `null` are skipped. Image parts
/// are kept when `images`, else refused.
fn content_pieces(content: Option<&Json>, images: bool) -> Result<Vec<Piece>, TokenizeError> {
    let parts = match content {
        None | Some(Json::Null) => return Ok(Vec::new()),
        Some(Json::String(s)) => return Ok(vec![Piece::Text(s.clone())]),
        Some(Json::Array(parts)) => parts,
        Some(_) => return Err(TokenizeError::invalid("message content must be a string, a list of parts or null")),
    };
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        let obj = match part {
            Json::String(s) => {
                texts.push(Piece::Text(s.clone()));
                continue;
            }
            Json::Object(o) => o,
            _ => return Err(TokenizeError::invalid("a content part must be an object")),
        };
        if images && is_image_part(obj) {
            texts.push(Piece::Image);
            continue;
        }
        let kind = match obj.get("type") {
            Some(Json::String(t)) => t.as_str(),
            Some(_) => return Err(TokenizeError::invalid("invalid content part `type`")),
            None => return Err(missing_type(obj)),
        };
        let field = match kind {
            "text" | "input_text" | "output_text" => "text",
            "refusal" => "refusal",
            "thinking" => "thinking",
            other => return Err(TokenizeError::UnsupportedContentPart { kind: other.to_owned() }),
        };
        match obj.get(field) {
            None | Some(Json::Null) => {}
            Some(Json::String(s)) => texts.push(Piece::Text(s.clone())),
            Some(_) => return Err(TokenizeError::invalid("content part text must be a string")),
        }
    }
    Ok(texts)
}

fn missing_type(part: &Map<String, Json>) -> TokenizeError {
    let media = ["image_url", "image_pil", "image_embeds", "audio_url", "input_audio", "video_url"];
    match media.iter().find(|k| part.contains_key(**k)) {
        Some(k) => TokenizeError::UnsupportedContentPart { kind: (*k).to_owned() },
        None => TokenizeError::invalid("content part without `type`"),
    }
}

/// The message's content for the template: `{"type": "text" | "image"}` parts under the
/// "openai" format; else one string, each image's `image_text` put before the text
/// (unless the text holds it already), as vLLM's `_get_full_multimodal_text_prompt`
/// does without `interleave_mm_strings`.
fn content_value(pieces: &[Piece], openai: bool, image_text: &str) -> Result<Json, TokenizeError> {
    if openai {
        let parts = pieces
            .iter()
            .map(|piece| {
                let mut p = Map::new();
                match piece {
                    Piece::Text(t) => {
                        p.insert("type".into(), Json::String("text".into()));
                        p.insert("text".into(), Json::String(t.clone()));
                    }
                    Piece::Image => {
                        p.insert("type".into(), Json::String("image".into()));
                    }
                }
                Json::Object(p)
            })
            .collect();
        return Ok(Json::Array(parts));
    }
    let texts: Vec<&str> = pieces
        .iter()
        .filter_map(|p| match p {
            Piece::Text(t) => Some(t.as_str()),
            Piece::Image => None,
        })
        .collect();
    let text = texts.join("\n");
    let images = pieces.len() - texts.len();
    if images == 0 {
        return Ok(Json::String(text));
    }
    let written = text.matches(image_text).count();
    let Some(missing) = images.checked_sub(written) else {
        return Err(TokenizeError::invalid("the text holds more image placeholders than there are images"));
    };
    let mut out: Vec<&str> = std::iter::repeat_n(image_text, missing).collect();
    if !text.is_empty() {
        out.push(&text);
    }
    Ok(Json::String(out.join("\n")))
}

/// vLLM parses string `arguments` to JSON and drops an empty call list (`None`).
/// A call whose `type` is not `"function"` is a bad request, as in vLLM 0.32.
fn vllm_tool_calls(calls: &Json) -> Result<Option<Json>, TokenizeError> {
    let Json::Array(items) = calls else {
        return Err(TokenizeError::invalid("tool_calls must be a list"));
    };
    if items.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let mut call = match item {
            Json::Object(o) => o.clone(),
            _ => return Err(TokenizeError::invalid("each tool call must be an object")),
        };
        if call.get("type").is_some_and(|t| t != "function") {
            return Err(TokenizeError::invalid("only tool calls of type `function` are supported"));
        }
        let Some(Json::Object(function)) = call.get_mut("function") else {
            return Err(TokenizeError::invalid("each tool call needs a `function` object"));
        };
        // vLLM 0.32 hands templates a mapping only: anything else becomes `{}`.
        let args = match function.get("arguments") {
            Some(Json::String(s)) => serde_json::from_str(s).ok().filter(Json::is_object),
            Some(v @ Json::Object(_)) => Some(v.clone()),
            _ => None,
        };
        function.insert("arguments".into(), args.unwrap_or_else(|| Json::Object(Map::new())));
        out.push(Json::Object(call));
    }
    Ok(Some(Json::Array(out)))
}

/// vLLM's `ChatCompletionToolsParam.model_dump()` as `dump` says. A tool that is not an
/// object with a `function` object passes through (vLLM rejects it before rendering).
fn vllm_tool(tool: &Json, dump: ToolDump) -> Json {
    let Json::Object(t) = tool else {
        return tool.clone();
    };
    let Some(Json::Object(f)) = t.get("function") else {
        return tool.clone();
    };
    let mut function = Map::new();
    for key in ["name", "description", "parameters"] {
        function.insert(key.into(), f.get(key).cloned().unwrap_or(Json::Null));
    }
    let mut out = Map::new();
    out.insert("type".into(), t.get("type").cloned().unwrap_or_else(|| Json::String("function".into())));
    match dump {
        ToolDump::Declared => {
            let tool_defer = t.get("defer_loading").filter(|v| !v.is_null());
            insert_set(&mut function, "strict", f.get("strict"));
            insert_set(&mut function, "defer_loading", f.get("defer_loading").filter(|v| !v.is_null()).or(tool_defer));
            out.insert("function".into(), Json::Object(function));
            insert_set(&mut out, "defer_loading", tool_defer);
        }
        ToolDump::WithExtras { strict_field } => {
            if strict_field {
                function.insert("strict".into(), f.get("strict").cloned().unwrap_or(Json::Null));
            }
            let declared = ["name", "description", "parameters", "strict"];
            function
                .extend(f.iter().filter(|(k, _)| !declared.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())));
            out.insert("function".into(), Json::Object(function));
            out.extend(t.iter().filter(|(k, _)| *k != "type" && *k != "function").map(|(k, v)| (k.clone(), v.clone())));
        }
    }
    Json::Object(out)
}

/// Inserts `key` only when `value` is present and not `null`, as vLLM's serializers do.
fn insert_set(map: &mut Map<String, Json>, key: &str, value: Option<&Json>) {
    if let Some(v) = value.filter(|v| !v.is_null()) {
        map.insert(key.into(), v.clone());
    }
}

#[cfg(test)]
mod tests;
