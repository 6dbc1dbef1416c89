//! vLLM's pooling endpoints, answered at once from the prompt's token ids without the
//! engine (they generate nothing): `POST /v1/embeddings`, `/v1/score` (and `/score`)
//! and `/v1/rerank` (and `/rerank`, `/v2/rerank`).
//!
//! The vectors are not a model's: each is a fixed function of the ids (a hashed bag of
//! ids, [`EMBEDDING_DIMS`] wide, unit length), so equal texts embed equally and texts
//! sharing tokens score higher together. Shapes (vLLM 0.32):
//! - embeddings: `input` a string, a list of strings, a list of ids or a list of id
//!   lists; answers `{"id": "embd-…", "object": "list", "created", "model", "data":
//!   [{"index", "object": "embedding", "embedding"}], "usage"}`, the vector as floats,
//!   or as base64 of little-endian `f32`s with `encoding_format: "base64"` (the default
//!   of the official `openai` client);
//! - score: `queries`/`documents` (or `text_1`/`text_2`, `data_1`/`data_2`,
//!   `queries`/`items`), each a string or a list; one query scores against every
//!   document, else they pair up; answers `{"id", "object": "list", "created",
//!   "model", "data": [{"index", "object": "score", "score"}], "usage"}`;
//! - rerank: `query` and `documents`, with `top_n` (0: all); answers `{"id", "model",
//!   "usage": {"prompt_tokens", "total_tokens"}, "results": [{"index", "document":
//!   {"text"}, "relevance_score"}]}`, best first.
//!
//! Multimodal inputs (objects) are refused: the simulator reads text. Work is linear in
//! the inputs' length; at most [`POOLING_INPUTS_MAX`] inputs per request.

use base64::Engine as _;
use serde_json::{json, Map, Value};

use crate::http::State;
use crate::openai::{token_ids, ApiError};
use crate::preprocess::tokenize_error;

/// Width of a simulated embedding.
pub(crate) const EMBEDDING_DIMS: usize = 16;
/// Most inputs (or documents) one pooling request takes.
pub(crate) const POOLING_INPUTS_MAX: usize = 1024;

/// `POST /v1/embeddings`.
pub(crate) fn embeddings(state: &State, body: &[u8]) -> Result<Value, ApiError> {
    let obj = object(body)?;
    let inputs = match obj.get("input") {
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_number) => {
            vec![token_ids(items).map_err(|e| ApiError { param: Some("input"), ..e })?]
        }
        Some(v) => texts(v, "input")?.iter().map(|t| ids(state, t)).collect::<Result<_, _>>()?,
        None => return Err(ApiError::bad(Some("input"), "`input` is required")),
    };
    let base64 = match obj.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(_) => return Err(ApiError::bad(Some("encoding_format"), "`encoding_format` must be float or base64")),
    };
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, ids)| {
            let v = embed(ids);
            let embedding = if base64 { Value::from(encode_base64(&v)) } else { json!(v) };
            json!({"index": index, "object": "embedding", "embedding": embedding})
        })
        .collect();
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    Ok(json!({
        "id": answer_id(state, "embd"),
        "object": "list",
        "created": state.created,
        "model": state.model,
        "data": data,
        "usage": usage(tokens),
    }))
}

/// `POST /v1/score`, `/score`.
pub(crate) fn score(state: &State, body: &[u8]) -> Result<Value, ApiError> {
    let obj = object(body)?;
    let pick = |keys: &[&'static str]| keys.iter().copied().find(|k| obj.contains_key(*k));
    let (Some(k1), Some(k2)) =
        (pick(&["queries", "text_1", "data_1"]), pick(&["documents", "items", "text_2", "data_2"]))
    else {
        return Err(ApiError::bad(None, "a score request needs `queries` and `documents` (or `text_1` and `text_2`)"));
    };
    let (queries, docs) = (texts(&obj[k1], k1)?, texts(&obj[k2], k2)?);
    let pairs: Vec<(&String, &String)> = match (queries.len(), docs.len()) {
        (1, _) => docs.iter().map(|d| (&queries[0], d)).collect(),
        (q, d) if q == d => queries.iter().zip(docs.iter()).collect(),
        (q, d) => return Err(ApiError::bad(Some(k1), format!("{q} queries cannot pair with {d} documents"))),
    };
    let mut tokens = 0;
    let mut data = Vec::with_capacity(pairs.len());
    for (index, (q, d)) in pairs.into_iter().enumerate() {
        let (qi, di) = (ids(state, q)?, ids(state, d)?);
        tokens += qi.len() + di.len();
        data.push(json!({"index": index, "object": "score", "score": similarity(&qi, &di)}));
    }
    Ok(json!({
        "id": answer_id(state, "score"),
        "object": "list",
        "created": state.created,
        "model": state.model,
        "data": data,
        "usage": usage(tokens),
    }))
}

/// `POST /v1/rerank`, `/rerank`, `/v2/rerank`.
pub(crate) fn rerank(state: &State, body: &[u8]) -> Result<Value, ApiError> {
    let obj = object(body)?;
    let query = match obj.get("query") {
        Some(Value::String(q)) if !q.is_empty() => q.clone(),
        _ => return Err(ApiError::bad(Some("query"), "`query` must be a non-empty string")),
    };
    let docs = texts(obj.get("documents").unwrap_or(&Value::Null), "documents")?;
    let top_n = match obj.get("top_n") {
        None | Some(Value::Null) => 0,
        Some(v) => v.as_u64().ok_or_else(|| ApiError::bad(Some("top_n"), "`top_n` must be a non-negative integer"))?,
    };
    let qi = ids(state, &query)?;
    let mut tokens = 0;
    let mut results = Vec::with_capacity(docs.len());
    for (index, d) in docs.iter().enumerate() {
        let di = ids(state, d)?;
        tokens += qi.len() + di.len();
        results.push((index, d, similarity(&qi, &di)));
    }
    // Best first; equal scores keep the documents' order.
    results.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)));
    if top_n > 0 {
        results.truncate(usize::try_from(top_n).unwrap_or(usize::MAX));
    }
    let results: Vec<Value> = results
        .into_iter()
        .map(|(index, d, s)| json!({"index": index, "document": {"text": d}, "relevance_score": s}))
        .collect();
    Ok(json!({
        "id": answer_id(state, "rerank"),
        "model": state.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }))
}

/// A fresh answer id, `PREFIX-…` as vLLM's.
fn answer_id(state: &State, prefix: &str) -> String {
    let n = state.next_response.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}-{:x}-{n}", state.created)
}

fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::bad(None, "the request body must be a JSON object")),
        Err(e) => Err(ApiError::bad(None, format!("invalid JSON body: {e}"))),
    }
}

/// A string or a non-empty list of strings, at most [`POOLING_INPUTS_MAX`].
fn texts(v: &Value, key: &'static str) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| ApiError::bad(Some(key), m);
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) if items.len() > POOLING_INPUTS_MAX => {
            Err(bad(format!("at most {POOLING_INPUTS_MAX} items in `{key}`")))
        }
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|i| i.as_str().map(String::from).ok_or_else(|| bad(format!("`{key}` must hold text only"))))
            .collect(),
        _ => Err(bad(format!("`{key}` must be a string or a non-empty list of strings"))),
    }
}

fn ids(state: &State, text: &str) -> Result<Vec<u32>, ApiError> {
    let ids = state.tokenizer.encode_text(text).map_err(tokenize_error)?;
    if ids.is_empty() {
        return Err(ApiError::bad(None, "an input tokenizes to nothing"));
    }
    Ok(ids)
}

fn usage(tokens: usize) -> Value {
    json!({"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": null})
}

/// A unit vector from the ids: each id adds ±1 to a few dimensions picked by a hash.
fn embed(ids: &[u32]) -> Vec<f32> {
    let mut v = [0f32; EMBEDDING_DIMS];
    for &id in ids {
        let h = u64::from(id).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for k in 0..3 {
            let bits = h >> (k * 16);
            let sign = if bits & 0x100 == 0 { 1.0 } else { -1.0 };
            v[(bits & 0xff) as usize % EMBEDDING_DIMS] += sign;
        }
    }
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter().map(|x| if norm > 0.0 { x / norm } else { 0.0 }).collect()
}

/// Cosine similarity mapped to 0..=1.
fn similarity(a: &[u32], b: &[u32]) -> f32 {
    let dot: f32 = embed(a).iter().zip(embed(b)).map(|(x, y)| x * y).sum();
    ((dot + 1.0) / 2.0).clamp(0.0, 1.0)
}

fn encode_base64(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeddings_are_unit_vectors_equal_for_equal_ids() {
        let a = embed(&[1, 2, 3]);
        assert_eq!(a.len(), EMBEDDING_DIMS);
        assert!((a.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-5);
        assert_eq!(a, embed(&[1, 2, 3]));
        assert!(similarity(&[1, 2, 3], &[1, 2, 3]) > similarity(&[1, 2, 3], &[7, 8, 9]));
        assert!((similarity(&[5], &[5]) - 1.0).abs() < 1e-5);
    }
}
