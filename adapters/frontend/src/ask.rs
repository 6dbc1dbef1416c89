//! The transport-neutral question and answer: a buffered request body and its headers
//! become the router's [`Request`] for one pool ([`question`]), and a decision becomes
//! the JSON a preview answers with ([`routed_json`]). The proxy asks it for every HTTP
//! request; the endpoint picker for every gateway stream.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName};
use router_core::{MediaItems, Request, Routed};
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::error::ApiError;
use crate::fleet::{Fleet, Pool};
use crate::media;
use crate::metrics::Metrics;
use crate::request::{self, Build, Endpoint, Prompt};
use crate::shape::BodyShape;
use crate::tenants::CacheSalt;
use crate::tokenize::{fallback_chat, fallback_text, Tokenize, Tokenizers};

/// Bodies larger than this are tokenized on a blocking thread, off the reactor.
const TOKENIZE_INLINE_BYTES_MAX: usize = 64 << 10;

/// What turning a request into a routing question reads: pools, tokenizers, metrics and
/// the session header. The proxy lends its own; the endpoint picker builds one.
pub struct Asker<'a> {
    /// Pools and workers.
    pub fleet: &'a Fleet,
    /// Tokenizers by model.
    pub tokenizers: &'a Tokenizers,
    /// Where parse and tokenize times, fallbacks and stripped fields are counted.
    pub metrics: &'a Metrics,
    /// The session id header.
    pub session_header: &'a HeaderName,
    /// Longest session id accepted, in bytes.
    pub session_id_bytes_max: usize,
    /// The caller's tenant's cache salt, when it is isolated: it leads the body's
    /// `cache_salt` of a chat or completion, and seeds the block hashes.
    pub cache_salt: Option<&'a CacheSalt>,
}

/// A request body turned into the router's question.
pub struct Question {
    /// The pool serving it.
    pub pool: Arc<Pool>,
    /// The router's question.
    pub request: Request,
    /// The body to forward: the `kvroute` object removed.
    pub forward_body: Bytes,
    /// The forward body, parsed.
    pub json: Arc<Value>,
    /// The prompt's token ids, when its pool sends a prompt as ids (`forward_token_ids`)
    /// and this one may go so: one completion's text, which the model's tokenizer
    /// encoded. Only a worker that tokenizes as the router does is sent them
    /// ([`ids_body`], [`crate::fleet::Fleet::sends_ids_to`]).
    pub ids: Option<Arc<[u32]>>,
    /// Whether the trusted preview flag was set.
    pub preview: bool,
    /// The endpoint the request came to (or looks like).
    pub endpoint: Endpoint,
    /// Whether it streams and its output limit, read from the same parse.
    pub shape: BodyShape,
}

/// Checks a buffered request body with its headers, finds its pool and hashes its prompt
/// into the router's question. Pins, priorities and the preview flag count only when
/// `trusted`. `endpoint: None` guesses it from the body. Work is linear in the body;
/// large prompts are tokenized on a blocking thread.
pub async fn question(
    cx: &Asker<'_>,
    trusted: bool,
    headers: &HeaderMap,
    raw: Bytes,
    endpoint: Option<Endpoint>,
    model_label: &mut String,
) -> Result<Question, ApiError> {
    question_timed(cx, trusted, headers, raw, endpoint, model_label).await.map(|(q, _)| q)
}

/// [`question`], and when its parsing ended and tokenizing began (for the proxy's
/// `parse` and `tokenize` spans).
pub async fn question_timed(
    cx: &Asker<'_>,
    trusted: bool,
    headers: &HeaderMap,
    raw: Bytes,
    endpoint: Option<Endpoint>,
    model_label: &mut String,
) -> Result<(Question, Instant), ApiError> {
    let t0 = Instant::now();
    let mut json: Value =
        serde_json::from_slice(&raw).map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let endpoint = match endpoint.or_else(|| Endpoint::guess(&json)) {
        Some(e) => e,
        None => return Err(ApiError::bad_request("the body has none of `messages`, `prompt`, `input`")),
    };
    let had_kvroute = json.get("kvroute").is_some();
    let mut parsed = request::parse(endpoint, &mut json)?;
    let Some((pool, alias_lora)) = cx.fleet.resolve(&parsed.model) else {
        if parsed.model.is_empty() {
            return Err(ApiError::bad_request("`model` is required here: no default_model is configured"));
        }
        return Err(ApiError::model_not_found(&parsed.model));
    };
    let pool = pool.clone();
    *model_label = pool.name.clone();
    let lora = parsed.kv.lora_name.clone().or(alias_lora.map(String::from));
    let (hh, stripped_headers) = request::header_hints(headers, trusted)?;
    let stripped_fields = if trusted { Vec::new() } else { parsed.kv.strip_untrusted() };
    let (cost, cost_sent) = crate::cost_header::overrides(headers, trusted)?;
    let cost_stripped = cost_sent.then_some(crate::cost_header::COST_HEADER);
    for f in stripped_headers.into_iter().chain(stripped_fields).chain(cost_stripped) {
        cx.metrics.untrusted(f);
    }
    let session = request::session_id(headers, cx.session_header, cx.session_id_bytes_max)?;
    let mut spliced = None;
    let salted = match cx.cache_salt {
        Some(salt) if endpoint.takes_cache_salt() => {
            // A body with no salt of its own takes the tenant's in front, not re-encoded.
            if !had_kvroute && json.get("cache_salt").is_none() {
                spliced = salt.prepend_to(&raw);
            }
            let s = salt.combine(parsed.cache_salt.as_deref());
            json["cache_salt"] = Value::String(s.clone());
            parsed.cache_salt = Some(s);
            true
        }
        _ => false,
    };
    let forward_body = match spliced {
        Some(b) => b,
        None if had_kvroute || salted => Bytes::from(json.to_string()),
        None => raw,
    };
    cx.metrics.stage("parse", t0.elapsed());

    let shape = BodyShape::of(&json);
    let as_ids = pool.forward_token_ids && lora.is_none() && sends_ids(endpoint, &json);
    let json = Arc::new(json);
    let t1 = Instant::now();
    let Tokens { ids: tokens, media, from_model } =
        tokens(cx, &pool.name, &parsed.prompt, json.clone(), forward_body.len()).await?;
    // A preview forwards nothing.
    let ids = (as_ids && from_model && !hh.preview).then(|| Arc::from(tokens.as_slice()));
    let build = Build {
        id: pool.driver.next_request_id(),
        block_size: pool.block_size,
        lora: lora.as_deref(),
        parsed: &parsed,
        hints: hh.hints,
        session,
    };
    let request = Request { cost, ..request::build_with_media(build, &tokens, &media) };
    cx.metrics.stage("tokenize", t1.elapsed());
    Ok((Question { pool, request, forward_body, json, ids, preview: hh.preview, endpoint, shape }, t1))
}

/// The routing tokens and the images they hold: the model's tokenizer if it has one,
/// else hashed bytes. A chat's images are read first (see [`crate::media`]); an image
/// that cannot be read is the client's error. Large bodies are decoded, hashed and
/// tokenized on a blocking thread.
async fn tokens(
    cx: &Asker<'_>,
    model: &str,
    prompt: &Prompt,
    body: Arc<Value>,
    body_len: usize,
) -> Result<Tokens, ApiError> {
    let given = |ids: Vec<u32>| Tokens { ids, media: MediaItems::none(), from_model: false };
    match prompt {
        Prompt::Tokens(t) => return Ok(given(t.clone())),
        Prompt::Absent => return Ok(given(Vec::new())),
        _ => {}
    }
    let Some(tok) = cx.tokenizers.get(model).cloned() else {
        cx.metrics.fallback(model, "no_tokenizer");
        return Ok(given(fallback(prompt, &body)));
    };
    let fetched = match (tok.media(), prompt) {
        (Some(m), Prompt::Chat) => Some(media::fetch_all(m, &body).await?),
        _ => None,
    };
    let prompt = prompt.clone();
    let run = move || encode(&*tok, &prompt, &body, fetched.as_deref());
    let encoded = if body_len > TOKENIZE_INLINE_BYTES_MAX {
        tokio::task::spawn_blocking(run).await.unwrap_or(Ok(Encoded::Failed("tokenizer_panic", Vec::new())))
    } else {
        run()
    };
    match encoded? {
        Encoded::Tokens(ids, media) => Ok(Tokens { ids, media, from_model: true }),
        Encoded::Failed(reason, ids) => {
            cx.metrics.fallback(model, reason);
            Ok(given(ids))
        }
    }
}

/// A prompt's routing tokens.
struct Tokens {
    /// The ids, images expanded.
    ids: Vec<u32>,
    /// The images they hold.
    media: MediaItems,
    /// Whether the model's tokenizer made them (not the client, nor the byte fallback).
    from_model: bool,
}

/// Whether a body's prompt may reach the worker as its token ids (when its pool asks for
/// it, and it names no adapter, whose tokenizer may differ): one completion's non-empty
/// text. A body that echoes the prompt keeps its text, as does one whose ids would
/// differ from the router's (`add_special_tokens`) or that sends `prompt_embeds`.
fn sends_ids(endpoint: Endpoint, json: &Value) -> bool {
    let falsy = |k: &str| json.get(k).is_none_or(|v| v.is_null() || v == &Value::Bool(false));
    endpoint == Endpoint::Completions
        && json.get("prompt").and_then(Value::as_str).is_some_and(|p| !p.is_empty())
        && falsy("echo")
        && ["add_special_tokens", "prompt_embeds"].iter().all(|k| json.get(*k).is_none())
}

/// `json` (an object) with its `prompt` replaced by `ids`, serialized. Written member by
/// member, so the ids never become a tree of values.
pub fn ids_body(json: &Value, ids: &[u32]) -> Bytes {
    use std::io::Write;
    let mut out = Vec::with_capacity(ids.len() * 6 + 256);
    out.push(b'{');
    for (i, (k, v)) in json.as_object().into_iter().flatten().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        // Writing to a Vec cannot fail.
        let _ = serde_json::to_writer(&mut out, k);
        out.push(b':');
        if k == "prompt" {
            out.push(b'[');
            for (j, id) in ids.iter().enumerate() {
                let _ = write!(out, "{}{id}", if j > 0 { "," } else { "" });
            }
            out.push(b']');
        } else {
            let _ = serde_json::to_writer(&mut out, v);
        }
    }
    out.push(b'}');
    Bytes::from(out)
}

/// What the tokenizer made of a prompt.
enum Encoded {
    /// Its tokens, images expanded, and the images.
    Tokens(Vec<u32>, MediaItems),
    /// Why it fell back (a metrics reason), and the tokens routed on instead.
    Failed(&'static str, Vec<u32>),
}

/// `prompt`'s tokens from `tok`: a chat's images resolved (`fetched`: the fetched bytes
/// of its images, when the model takes images) and expanded. Work is linear in the body
/// plus tokenizing.
fn encode(
    tok: &dyn Tokenize,
    prompt: &Prompt,
    body: &Value,
    fetched: Option<&[Option<Bytes>]>,
) -> Result<Encoded, ApiError> {
    let images = match (tok.media(), fetched) {
        (Some(m), Some(f)) => media::resolve(m, body, f)?,
        _ => Vec::new(),
    };
    if !images.is_empty() && media::has_media_kwargs(body) {
        return Ok(Encoded::Failed("media_kwargs", fallback(prompt, body)));
    }
    let ids = match prompt {
        Prompt::Text(t) => tok.encode_text(t),
        Prompt::ChatBody(chat) => tok.encode_chat(chat),
        _ => tok.encode_chat(body),
    };
    let ids = match ids {
        Ok(ids) => ids,
        Err(e) => {
            tracing::debug!(error = %e, "tokenizer failed; routing on bytes");
            return Ok(Encoded::Failed("tokenizer_error", fallback(prompt, body)));
        }
    };
    let Some(m) = tok.media().filter(|_| !images.is_empty()) else {
        return Ok(Encoded::Tokens(ids, MediaItems::none()));
    };
    Ok(match media::expand(m, &ids, &images) {
        Some((ids, items)) => Encoded::Tokens(ids, items),
        // The rendered prompt disagrees with the images: its blocks would match nothing.
        None => Encoded::Failed("media_placeholders", ids),
    })
}

fn fallback(prompt: &Prompt, body: &Value) -> Vec<u32> {
    match prompt {
        Prompt::Text(t) => fallback_text(t),
        Prompt::Tokens(t) => t.clone(),
        Prompt::Chat => fallback_chat(body),
        Prompt::ChatBody(chat) => fallback_chat(chat),
        Prompt::Absent => Vec::new(),
    }
}

/// A decision as JSON: the target and each candidate's overlap, score or exclusion.
pub fn routed_json(model: &str, isl_tokens: u32, r: &Routed) -> Value {
    let rows: Vec<Value> = r
        .explanation
        .iter()
        .map(|row| {
            json!({
                "worker": row.key.worker.0,
                "rank": row.key.rank.0,
                "overlap": {"device": row.overlap.device, "host": row.overlap.host, "disk": row.overlap.disk},
                "eligible": row.excluded.is_none(),
                "excluded": row.excluded.as_ref().map(|e| e.as_str()),
                "excluded_detail": row.excluded.as_ref().map(|e| e.to_string()),
                "cost": row.score.as_ref().map(|s| s.cost),
                "overlap_effective": row.score.as_ref().map(|s| s.overlap_effective),
                "prefill_blocks": row.score.as_ref().map(|s| s.prefill_blocks),
                "decode_blocks": row.score.as_ref().map(|s| s.decode_blocks),
            })
        })
        .collect();
    json!({
        "model": model,
        "worker": r.target.worker.0,
        "rank": r.target.rank.0,
        "overlap_blocks": r.overlap.raw(),
        "max_overlap_blocks": r.max_overlap_blocks,
        "request_blocks": r.request_blocks,
        "isl_tokens": isl_tokens,
        "explanation": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(endpoint: Endpoint, body: Value, want: bool) {
        assert_eq!(sends_ids(endpoint, &body), want, "{endpoint:?} {body}");
    }

    /// A completion of "hello" with `extra`'s keys.
    fn completion(extra: Value) -> Value {
        let mut b = json!({"model": "m", "prompt": "hello", "max_tokens": 4});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    }

    #[test]
    fn only_one_completions_text_that_is_not_echoed_is_sent_as_ids() {
        use Endpoint::*;
        check(Completions, completion(json!({})), true);
        check(Completions, completion(json!({"echo": false, "stream": true, "logprobs": 2})), true);
        check(Completions, completion(json!({"echo": null})), true);
        check(Completions, completion(json!({"echo": true})), false);
        check(Completions, completion(json!({"echo": 1})), false);
        check(Completions, completion(json!({"add_special_tokens": true})), false);
        check(Completions, completion(json!({"prompt_embeds": "AAAA"})), false);
        check(Completions, completion(json!({"prompt": ""})), false);
        check(Completions, completion(json!({"prompt": ["a", "b"]})), false);
        check(Completions, completion(json!({"prompt": [1, 2]})), false);
        check(Chat, json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]}), false);
        check(Embeddings, json!({"model": "m", "input": "hello"}), false);
        check(Tokenize, json!({"model": "m", "prompt": "hello"}), false);
    }

    #[test]
    fn the_ids_replace_the_prompt_and_nothing_else() {
        let body = json!({"model": "m", "prompt": "hello world", "max_tokens": 3, "cache_salt": "s", "stream": true,
            "stop": ["\n", "\"end\""], "stream_options": {"include_usage": true}, "we\"ird key": null});
        let sent = ids_body(&body, &[5, 0, u32::MAX]);
        let mut want = body;
        want["prompt"] = json!([5, 0, u32::MAX]);
        assert_eq!(serde_json::from_slice::<Value>(&sent).unwrap(), want);
    }
}
