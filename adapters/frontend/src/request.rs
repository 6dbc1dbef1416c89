//! Reading an OpenAI request: which endpoint, which model, what prompt, the `kvroute`
//! body object and the routing headers; and building the router's `Request` from them.

use http::{HeaderMap, HeaderName};
use router_core::{
    hash_tokens_with_media, BlockSize, DpRank, HashSeed, MediaItems, Priority, Request, RequestId, RoutingHints,
    WorkerId,
};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::headers::{PIN_HEADERS, PREVIEW_HEADER};

/// The proxied endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/embeddings`
    Embeddings,
    /// `POST /v1/responses`: routed by its input as a chat
    Responses,
    /// `POST /v1/score`, `/score`: routed by its query (`queries`, `text_1`, `data_1`)
    Score,
    /// `POST /v1/rerank`, `/rerank`, `/v2/rerank`: routed by its `query`
    Rerank,
    /// `POST /tokenize`: no cache work, routed by load
    Tokenize,
    /// `POST /detokenize`: no cache work, routed by load
    Detokenize,
}

impl Endpoint {
    /// The endpoint served at `path` (a query is ignored), whatever the method: every
    /// inference path of vLLM, with its aliases. The proxy and the picker share it.
    pub fn at(path: &str) -> Option<Self> {
        Some(match path.split('?').next().unwrap_or(path) {
            "/v1/chat/completions" => Endpoint::Chat,
            "/v1/completions" => Endpoint::Completions,
            "/v1/embeddings" => Endpoint::Embeddings,
            "/v1/responses" => Endpoint::Responses,
            "/v1/score" | "/score" => Endpoint::Score,
            "/v1/rerank" | "/rerank" | "/v2/rerank" => Endpoint::Rerank,
            "/tokenize" => Endpoint::Tokenize,
            "/detokenize" => Endpoint::Detokenize,
            _ => return None,
        })
    }

    /// The endpoint a body looks like (for `/route/preview`): `messages`, `prompt`;
    /// `input` with `instructions`, `max_output_tokens` or items (objects) is a
    /// Responses API request, else embeddings; `query` is a rerank, `queries`, `text_1`
    /// or `data_1` a score.
    pub fn guess(body: &Value) -> Option<Self> {
        let has = |k: &str| body.get(k).is_some();
        let items = matches!(body.get("input"), Some(Value::Array(a)) if a.first().is_some_and(Value::is_object));
        Some(if has("messages") {
            Endpoint::Chat
        } else if has("prompt") {
            Endpoint::Completions
        } else if has("input") && (items || has("instructions") || has("max_output_tokens")) {
            Endpoint::Responses
        } else if has("input") {
            Endpoint::Embeddings
        } else if has("query") {
            Endpoint::Rerank
        } else if has("queries") || has("text_1") || has("data_1") {
            Endpoint::Score
        } else {
            return None;
        })
    }

    /// Whether the engine's request takes a `cache_salt`, so that an isolated tenant's
    /// salt goes into the forwarded body. Pooling requests (embeddings, score, rerank)
    /// take one too: a pooling model may cache prefixes. Tokenizing touches no cache.
    pub fn takes_cache_salt(self) -> bool {
        !matches!(self, Endpoint::Tokenize | Endpoint::Detokenize)
    }
}

/// The optional `kvroute` object of a request body; removed before forwarding.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvrouteFields {
    /// Strict priority: higher leaves the queue first (trusted only).
    pub priority: Option<i32>,
    /// Moves the request ahead in the queue by this many seconds (trusted only).
    pub priority_jump: Option<f64>,
    /// The admission class (trusted only).
    pub policy_class: Option<String>,
    /// The LoRA adapter, when `model` does not name it.
    pub lora_name: Option<String>,
    /// A tenant's cache salt, when the body has no top-level `cache_salt`.
    pub cache_salt: Option<String>,
    /// The client's estimate of the output length.
    pub expected_output_tokens: Option<u32>,
}

impl KvrouteFields {
    /// Removes the fields only trusted clients may set; returns their names.
    pub fn strip_untrusted(&mut self) -> Vec<&'static str> {
        let mut gone = Vec::new();
        if self.priority.take().is_some() {
            gone.push("priority");
        }
        if self.priority_jump.take().is_some() {
            gone.push("priority_jump");
        }
        if self.policy_class.take().is_some() {
            gone.push("policy_class");
        }
        gone
    }
}

/// Where the routing tokens come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// A chat: the tokenizer gets the whole body.
    Chat,
    /// A text prompt (the first one of a batch).
    Text(String),
    /// Token ids given by the client (the first prompt of a batch).
    Tokens(Vec<u32>),
    /// A chat built from another endpoint's body (a Responses API request): the
    /// tokenizer gets this chat body instead of the request's.
    ChatBody(Value),
    /// Nothing to route on (`/tokenize`, `/detokenize`, a multimodal query): the request
    /// routes by load alone.
    Absent,
}

/// A parsed request body.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    /// The `model` field.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// The `kvroute` object.
    pub kv: KvrouteFields,
    /// The top-level `cache_salt`, or the `kvroute` one.
    pub cache_salt: Option<String>,
}

/// Reads `body` as a request to `endpoint`, removing its `kvroute` object. Work is
/// linear in the body.
pub fn parse(endpoint: Endpoint, body: &mut Value) -> Result<Parsed, ApiError> {
    let Some(obj) = body.as_object_mut() else {
        return Err(ApiError::bad_request("the request body must be a JSON object"));
    };
    let kv = match obj.remove("kvroute") {
        None | Some(Value::Null) => KvrouteFields::default(),
        Some(v) => {
            serde_json::from_value(v).map_err(|e| ApiError::bad_request(format!("invalid `kvroute` object: {e}")))?
        }
    };
    let model = match obj.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        // vLLM's tokenizer endpoints take no model: the default model's pool serves them.
        None | Some(Value::Null) if matches!(endpoint, Endpoint::Tokenize | Endpoint::Detokenize) => String::new(),
        _ => return Err(ApiError::bad_request("`model` must be a non-empty string")),
    };
    let prompt = match endpoint {
        Endpoint::Chat => match obj.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => Prompt::Chat,
            _ => return Err(ApiError::bad_request("`messages` must be a non-empty array")),
        },
        Endpoint::Completions => prompt_field(obj, "prompt")?,
        Endpoint::Embeddings => prompt_field(obj, "input")?,
        Endpoint::Responses => Prompt::ChatBody(
            kvroute_tokenize::responses::responses_chat(obj).map_err(|e| ApiError::bad_request(e.to_string()))?,
        ),
        Endpoint::Score => score_query(obj)?,
        Endpoint::Rerank => query_field(obj.get("query"), "query")?,
        Endpoint::Tokenize | Endpoint::Detokenize => Prompt::Absent,
    };
    let cache_salt = match obj.get("cache_salt") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Null) | None => kv.cache_salt.clone(),
        Some(_) => return Err(ApiError::bad_request("`cache_salt` must be a string")),
    };
    Ok(Parsed { model, prompt, kv, cache_salt })
}

/// `prompt` or `input`: a string, an array of strings, an array of token ids, or an
/// array of arrays of token ids. A batch routes on its first prompt.
fn prompt_field(obj: &Map<String, Value>, key: &str) -> Result<Prompt, ApiError> {
    let bad = || ApiError::bad_request(format!("`{key}` must be a string, a list of strings, or token ids"));
    match obj.get(key) {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => match items.first() {
            None => Err(bad()),
            Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
            Some(Value::Number(_)) => token_ids(items).map(Prompt::Tokens).ok_or_else(bad),
            Some(Value::Array(first)) if !first.is_empty() => token_ids(first).map(Prompt::Tokens).ok_or_else(bad),
            Some(_) => Err(bad()),
        },
        _ => Err(bad()),
    }
}

/// A score request's query side: `queries`, `text_1` or `data_1`, whichever it names.
fn score_query(obj: &Map<String, Value>) -> Result<Prompt, ApiError> {
    let key = ["queries", "text_1", "data_1"].into_iter().find(|k| obj.contains_key(*k));
    match key {
        Some(k) => query_field(obj.get(k), k),
        None => Err(ApiError::bad_request("a score request needs `queries` (or `text_1`, `data_1`)")),
    }
}

/// A query: a string routes by its text (the first of a list); a multimodal query
/// (an object) routes by load.
fn query_field(v: Option<&Value>, key: &str) -> Result<Prompt, ApiError> {
    match v {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => match items.first() {
            Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
            Some(Value::Object(_)) => Ok(Prompt::Absent),
            _ => Err(ApiError::bad_request(format!("`{key}` must be a string or a list of strings"))),
        },
        Some(Value::Object(_)) => Ok(Prompt::Absent),
        _ => Err(ApiError::bad_request(format!("`{key}` must be a string or a list of strings"))),
    }
}

fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items.iter().map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

/// Routing fields from headers, honoured only when trusted.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HeaderHints {
    /// The pins.
    pub hints: RoutingHints,
    /// Whether the preview flag was set.
    pub preview: bool,
}

/// Reads the pin and preview headers. Untrusted requests get none of it, and the names of
/// the headers they sent come back to be counted.
pub fn header_hints(h: &HeaderMap, trusted: bool) -> Result<(HeaderHints, Vec<&'static str>), ApiError> {
    let preview_set = h.get(PREVIEW_HEADER).is_some();
    if !trusted {
        let mut sent: Vec<&'static str> = PIN_HEADERS.iter().copied().filter(|p| h.contains_key(*p)).collect();
        if preview_set {
            sent.push(PREVIEW_HEADER);
        }
        return Ok((HeaderHints::default(), sent));
    }
    let num = |name: &str| -> Result<Option<u64>, ApiError> {
        match h.get(name) {
            None => Ok(None),
            Some(v) => v
                .to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .map(Some)
                .ok_or_else(|| ApiError::bad_request(format!("header {name} must be a non-negative integer"))),
        }
    };
    let rank = |name| -> Result<Option<DpRank>, ApiError> {
        num(name)?
            .map(|n| {
                u32::try_from(n)
                    .map(DpRank)
                    .map_err(|_| ApiError::bad_request(format!("header {name} is out of range")))
            })
            .transpose()
    };
    let hints = RoutingHints {
        backend_instance_id: num("x-worker-id")?.map(WorkerId),
        prefill_worker_id: num("x-prefill-worker-id")?.map(WorkerId),
        decode_worker_id: num("x-decode-worker-id")?.map(WorkerId),
        dp_rank: rank("x-dp-rank")?,
        prefill_dp_rank: rank("x-prefill-dp-rank")?,
        ..RoutingHints::default()
    };
    let preview = match h.get(PREVIEW_HEADER).map(|v| v.as_bytes()) {
        None | Some(b"0") | Some(b"false") => false,
        Some(_) => true,
    };
    Ok((HeaderHints { hints, preview }, Vec::new()))
}

/// The session id from header `name`: `None` without the header, else its bytes. An
/// empty, non-UTF-8, repeated or longer-than-`bytes_max` id is the client's mistake (400),
/// caught here before the body is hashed or the router sees it. Work is linear in the
/// header's length.
pub fn session_id(h: &HeaderMap, name: &HeaderName, bytes_max: usize) -> Result<Option<Vec<u8>>, ApiError> {
    let mut values = h.get_all(name).iter();
    let Some(v) = values.next() else { return Ok(None) };
    let bad = |why: String| Err(ApiError::bad_request(format!("bad session id in header {name}: {why}")));
    if values.next().is_some() {
        return bad("the header is repeated".into());
    }
    let bytes = v.as_bytes();
    if bytes.len() > bytes_max {
        return bad(format!("{} bytes, more than the {bytes_max} allowed", bytes.len()));
    }
    match std::str::from_utf8(bytes) {
        Err(_) => bad("not UTF-8".into()),
        Ok(s) if s.trim().is_empty() => bad("empty".into()),
        Ok(_) => Ok(Some(bytes.to_vec())),
    }
}

/// Everything the router needs besides the tokens.
pub struct Build<'a> {
    /// The request id.
    pub id: RequestId,
    /// Tokens per block of the pool.
    pub block_size: BlockSize,
    /// The LoRA adapter salting the hashes.
    pub lora: Option<&'a str>,
    /// The parsed body.
    pub parsed: &'a Parsed,
    /// Pins.
    pub hints: RoutingHints,
    /// The session id, if any.
    pub session: Option<Vec<u8>>,
}

/// `body`, a JSON object's text, with `member` (`"key":value`, already encoded) as its
/// first member: the client's bytes, not a re-encoding of them, so a long prompt is
/// copied once and never re-serialized. `None` when `body` does not start with `{` (after
/// blanks). The caller makes sure the object has no member of that name.
pub fn with_first_member(body: &[u8], member: &str) -> Option<bytes::Bytes> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace()).filter(|&i| body[i] == b'{')?;
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len() + member.len() + 1);
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(member.as_bytes());
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(out.into())
}

/// The router's request: the prompt's block hashes salted by adapter and cache salt,
/// the session, pins and queue placement. Linear in the tokens.
pub fn build(b: Build<'_>, tokens: &[u32]) -> Request {
    build_with_media(b, tokens, &MediaItems::none())
}

/// [`build`] for a prompt holding `media`'s images: each block hashed with the media
/// keys of the images it overlaps, as the engine's events hash it. Linear in the tokens
/// plus the items.
pub fn build_with_media(b: Build<'_>, tokens: &[u32], media: &MediaItems) -> Request {
    let seed = HashSeed::salted(b.lora, b.parsed.cache_salt.as_deref());
    let mut blocks = Vec::new();
    hash_tokens_with_media(tokens, b.block_size, seed, media, &mut blocks);
    let kv = &b.parsed.kv;
    Request {
        id: b.id,
        blocks: blocks.into_iter().map(|h| h.seq).collect(),
        isl_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
        session: b.session,
        hints: b.hints,
        priority: Priority {
            strict: kv.priority.unwrap_or(0),
            jump_ms: kv.priority_jump.map_or(0, |s| (s * 1000.0).clamp(-1e15, 1e15) as i64),
            class: kv.policy_class.clone(),
        },
        expected_output_tokens: kv.expected_output_tokens,
        ..Request::default()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[track_caller]
    fn check(endpoint: Endpoint, mut body: Value, want: Result<Prompt, &str>) {
        match (parse(endpoint, &mut body), want) {
            (Ok(p), Ok(w)) => assert_eq!(p.prompt, w),
            (Err(e), Err(w)) => {
                assert_eq!(e.status, 400);
                assert!(e.message.contains(w), "{} should mention {w}", e.message);
            }
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn a_member_goes_first_in_the_clients_text() {
        let with = |body: &[u8]| with_first_member(body, "\"k\":true").map(|b| b.to_vec());
        assert_eq!(with(b"{ } ").as_deref(), Some(&b"{\"k\":true } "[..]));
        assert_eq!(with(b" {\"a\":1}").as_deref(), Some(&b" {\"k\":true,\"a\":1}"[..]));
        assert!(with(b"[1]").is_none() && with(b"}").is_none() && with(b"").is_none());
    }

    #[test]
    fn prompts_of_every_shape() {
        use Endpoint::*;
        check(Chat, json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}), Ok(Prompt::Chat));
        check(Chat, json!({"model": "m", "messages": []}), Err("messages"));
        check(Chat, json!({"messages": [{}]}), Err("model"));
        check(Completions, json!({"model": "m", "prompt": "abc"}), Ok(Prompt::Text("abc".into())));
        check(Completions, json!({"model": "m", "prompt": ["a", "b"]}), Ok(Prompt::Text("a".into())));
        check(Completions, json!({"model": "m", "prompt": [1, 2, 3]}), Ok(Prompt::Tokens(vec![1, 2, 3])));
        check(Completions, json!({"model": "m", "prompt": [[4, 5], [6]]}), Ok(Prompt::Tokens(vec![4, 5])));
        check(Completions, json!({"model": "m", "prompt": [1, -2]}), Err("token ids"));
        check(Completions, json!({"model": "m", "prompt": [4294967296u64]}), Err("token ids"));
        check(Completions, json!({"model": "m", "prompt": {}}), Err("prompt"));
        check(Embeddings, json!({"model": "m", "input": "x"}), Ok(Prompt::Text("x".into())));
        check(Embeddings, json!({"model": "m"}), Err("input"));
        let chat = json!({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]});
        check(Responses, json!({"model": "m", "instructions": "s", "input": "q"}), Ok(Prompt::ChatBody(chat)));
        check(Responses, json!({"model": "m", "input": 7}), Err("input"));
        check(Score, json!({"model": "m", "queries": "q", "documents": ["d"]}), Ok(Prompt::Text("q".into())));
        check(Score, json!({"model": "m", "text_1": ["q1", "q2"], "text_2": ["d"]}), Ok(Prompt::Text("q1".into())));
        check(Score, json!({"model": "m", "data_1": {"content": []}, "data_2": "d"}), Ok(Prompt::Absent));
        check(Score, json!({"model": "m", "documents": ["d"]}), Err("queries"));
        check(Rerank, json!({"model": "m", "query": "q", "documents": ["d"]}), Ok(Prompt::Text("q".into())));
        check(Rerank, json!({"model": "m", "query": 3}), Err("query"));
        check(Tokenize, json!({"prompt": "x"}), Ok(Prompt::Absent));
        check(Detokenize, json!({"model": "m", "tokens": [1]}), Ok(Prompt::Absent));
        check(Embeddings, json!({"input": "x"}), Err("model"));
        check(Chat, json!([1]), Err("JSON object"));
        check(Chat, json!({"model": "m", "messages": [{}], "kvroute": {"prio": 1}}), Err("kvroute"));
    }

    #[test]
    fn a_preview_body_names_its_endpoint() {
        use Endpoint::*;
        for (body, want) in [
            (json!({"messages": []}), Some(Chat)),
            (json!({"prompt": "x"}), Some(Completions)),
            (json!({"input": "x"}), Some(Embeddings)),
            (json!({"input": [1, 2]}), Some(Embeddings)),
            (json!({"input": "x", "instructions": "s"}), Some(Responses)),
            (json!({"input": [{"role": "user", "content": "x"}]}), Some(Responses)),
            (json!({"query": "q", "documents": []}), Some(Rerank)),
            (json!({"text_1": "q", "text_2": "d"}), Some(Score)),
            (json!({"model": "m"}), None),
        ] {
            assert_eq!(Endpoint::guess(&body), want, "{body}");
        }
    }

    #[test]
    fn the_kvroute_object_is_removed_and_read() {
        let mut body = json!({"model": "m", "prompt": "x", "cache_salt": "t1",
            "kvroute": {"priority": 3, "priority_jump": 1.5, "lora_name": "sql", "expected_output_tokens": 9}});
        let p = parse(Endpoint::Completions, &mut body).unwrap();
        assert!(body.get("kvroute").is_none());
        assert_eq!(body["cache_salt"], "t1", "the engine's own fields stay");
        assert_eq!(
            (p.kv.priority, p.kv.lora_name.as_deref(), p.cache_salt.as_deref()),
            (Some(3), Some("sql"), Some("t1"))
        );
        let r = build(
            Build {
                id: RequestId(1),
                block_size: BlockSize::new(4).unwrap(),
                lora: None,
                parsed: &p,
                hints: RoutingHints::default(),
                session: None,
            },
            &[1, 2, 3, 4, 5, 6, 7, 8, 9],
        );
        assert_eq!((r.blocks.len(), r.isl_tokens, r.priority.jump_ms, r.expected_output_tokens), (2, 9, 1500, Some(9)));
    }

    #[test]
    fn salts_separate_caches() {
        let mut body = json!({"model": "m", "prompt": "x"});
        let p = parse(Endpoint::Completions, &mut body).unwrap();
        let bs = BlockSize::new(2).unwrap();
        let blocks = |lora, salt: Option<&str>| {
            let p = Parsed { cache_salt: salt.map(String::from), ..p.clone() };
            let b = Build {
                id: RequestId(1),
                block_size: bs,
                lora,
                parsed: &p,
                hints: RoutingHints::default(),
                session: None,
            };
            build(b, &[1, 2, 3, 4]).blocks
        };
        let plain = blocks(None, None);
        assert_ne!(plain, blocks(Some("sql"), None));
        assert_ne!(plain, blocks(None, Some("tenant")));
        assert_eq!(plain, blocks(None, None));
    }

    #[track_caller]
    fn check_session(values: &[&[u8]], want: Result<Option<&[u8]>, &str>) {
        let name = HeaderName::from_static("x-session-id");
        let mut h = HeaderMap::new();
        for v in values {
            h.append(&name, http::HeaderValue::from_bytes(v).unwrap());
        }
        match (session_id(&h, &name, 8), want) {
            (Ok(got), Ok(w)) => assert_eq!(got.as_deref(), w),
            (Err(e), Err(w)) => {
                assert_eq!(e.status, 400);
                assert!(e.message.contains(w), "{} should mention {w}", e.message);
            }
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn session_ids_are_checked() {
        check_session(&[], Ok(None));
        check_session(&[b"s1"], Ok(Some(b"s1")));
        check_session(&[b"12345678"], Ok(Some(b"12345678")));
        check_session(&["h\u{e9}!".as_bytes()], Ok(Some("h\u{e9}!".as_bytes())));
        check_session(&[b"123456789"], Err("more than the 8"));
        check_session(&[b""], Err("empty"));
        check_session(&[b"  "], Err("empty"));
        check_session(&[b"\xff\xfe"], Err("UTF-8"));
        check_session(&[b"a", b"b"], Err("repeated"));
    }

    #[test]
    fn pins_need_trust() {
        let mut h = HeaderMap::new();
        h.insert("x-worker-id", "3".parse().unwrap());
        h.insert("x-dp-rank", "1".parse().unwrap());
        h.insert("x-prefill-dp-rank", "2".parse().unwrap());
        h.insert("x-kvroute-preview", "1".parse().unwrap());
        let (hh, stripped) = header_hints(&h, false).unwrap();
        assert_eq!(hh, HeaderHints::default());
        assert_eq!(stripped, ["x-worker-id", "x-dp-rank", "x-prefill-dp-rank", "x-kvroute-preview"]);
        let (hh, stripped) = header_hints(&h, true).unwrap();
        assert!(stripped.is_empty() && hh.preview);
        let ranks = (hh.hints.dp_rank, hh.hints.prefill_dp_rank);
        assert_eq!(hh.hints.backend_instance_id, Some(WorkerId(3)));
        assert_eq!(ranks, (Some(DpRank(1)), Some(DpRank(2))));
        h.insert("x-prefill-dp-rank", "4294967296".parse().unwrap());
        assert_eq!(header_hints(&h, true).unwrap_err().status, 400);
        h.insert("x-prefill-dp-rank", "2".parse().unwrap());
        h.insert("x-worker-id", "three".parse().unwrap());
        assert_eq!(header_hints(&h, true).unwrap_err().status, 400);
    }
}
