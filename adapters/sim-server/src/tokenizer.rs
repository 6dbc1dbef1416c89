//! Prompt tokenization behind a small trait, and the built-in byte-level fallback.
//!
//! The simulated worker needs token ids to hash prompts into KV blocks and to time
//! prefill, so a router and the worker agree on prefixes exactly when they tokenize
//! alike. Real tokenizers (Hugging Face `tokenizer.json` plus chat templates) plug in
//! through [`PromptTokenizer`]; this module only ships the fallback, which is the
//! router's own fallback (`kvroute_tokenize::fallback`: four UTF-8 bytes per token,
//! about a BPE token's worth of text), so `kvroute serve` in front of simulated workers
//! sees the blocks they cache for models without a tokenizer. Use `--tokenizer` for
//! parity with a real model.

use std::fmt;
use std::sync::Arc;

use serde_json::Value;

pub use kvroute_tokenize::fallback::{fallback_chat, fallback_text};

/// Why a prompt could not be tokenized.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum TokenizeError {
    /// The request is malformed (for example `messages` is not an array): a 400.
    BadInput(String),
    /// The tokenizer itself failed (its error is the source): a 500.
    Backend(Arc<dyn std::error::Error + Send + Sync>),
    /// The tokenizer cannot do this (for example decode): a 501.
    Unsupported(&'static str),
}

/// Equal when of the same kind with the same message (a backend error has no other
/// identity).
impl PartialEq for TokenizeError {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (TokenizeError::BadInput(a), TokenizeError::BadInput(b)) => a == b,
            (TokenizeError::Backend(a), TokenizeError::Backend(b)) => a.to_string() == b.to_string(),
            (TokenizeError::Unsupported(a), TokenizeError::Unsupported(b)) => a == b,
            _ => false,
        }
    }
}

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizeError::BadInput(m) => write!(f, "invalid prompt: {m}"),
            TokenizeError::Backend(m) => write!(f, "tokenizer failed: {m}"),
            TokenizeError::Unsupported(what) => write!(f, "this tokenizer cannot {what}"),
        }
    }
}

impl std::error::Error for TokenizeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TokenizeError::BadInput(_) | TokenizeError::Unsupported(_) => None,
            TokenizeError::Backend(e) => Some(&**e),
        }
    }
}

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
    /// The text of `ids`, for `/detokenize` and `/tokenize`'s `return_token_strs`. The
    /// default cannot decode; ids it does not know must not panic.
    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        let _ = ids;
        Err(TokenizeError::Unsupported("decode token ids"))
    }
}

/// The built-in tokenizer: the router's fallback, [`fallback_text`] and
/// [`fallback_chat`] (approximate; use `--tokenizer` for parity with a real model).
#[derive(Clone, Copy, Debug, Default)]
pub struct FallbackTokenizer;

impl PromptTokenizer for FallbackTokenizer {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(fallback_text(text))
    }

    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        match body.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => Ok(fallback_chat(body)),
            Some(Value::Array(_)) => Err(TokenizeError::BadInput("`messages` is empty".into())),
            Some(_) => Err(TokenizeError::BadInput("`messages` must be an array".into())),
            None => Err(TokenizeError::BadInput("`messages` is required".into())),
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        Ok(fallback_decode(ids))
    }
}

/// Undoes [`fallback_text`]: the four bytes of each id, with the top bit that packing
/// cleared (each id's fourth byte) restored from its UTF-8 neighbours: set when a
/// multi-byte character still expects a continuation byte there, or when the byte
/// after it is a continuation byte (so it was a lead byte). Zero padding at the end is
/// dropped. Ids that no text packs to decode lossily, never panic. Linear in `ids`.
pub fn fallback_decode(ids: &[u32]) -> String {
    let mut bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    let is_continuation = |b: u8| (0x80..=0xbf).contains(&b);
    let mut expected = 0u8;
    for i in 0..bytes.len() {
        let b = bytes[i];
        if i % 4 == 3 {
            let lead = (0x42..=0x74).contains(&b) && bytes.get(i + 1).copied().is_some_and(is_continuation);
            if expected > 0 || lead {
                bytes[i] = b | 0x80;
            }
        }
        expected = match bytes[i] {
            0xc0..=0xdf => 1,
            0xe0..=0xef => 2,
            0xf0..=0xf7 => 3,
            c if is_continuation(c) => expected.saturating_sub(1),
            _ => 0,
        };
    }
    let padding = bytes.iter().rev().take(3).take_while(|&&b| b == 0).count();
    bytes.truncate(bytes.len() - padding);
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_fallback_is_the_routers_and_chat_needs_messages() {
        let t = FallbackTokenizer;
        assert_eq!(t.encode_text("abcde"), Ok(vec![u32::from_le_bytes(*b"abcd"), u32::from(b'e')]));
        let body = json!({"messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(t.encode_chat(&body), Ok(fallback_chat(&body)));
        for body in [json!({}), json!({"messages": "x"}), json!({"messages": []})] {
            assert!(matches!(t.encode_chat(&body), Err(TokenizeError::BadInput(_))), "{body}");
        }
    }

    #[track_caller]
    fn check_round_trip(text: &str) {
        assert_eq!(FallbackTokenizer.decode(&fallback_text(text)).as_deref(), Ok(text), "{text:?}");
    }

    #[test]
    fn the_fallback_decodes_what_it_encodes() {
        // Multi-byte characters at every offset, so each lands on a fourth byte.
        for text in
            ["", "a", "abcd", "abcde", "héllo wörld", "xé", "xxé", "xxxé", "xxx€", "xx€", "x€€", "😀", "x😀", "xxx😀x"]
        {
            check_round_trip(text);
        }
        let mixed: String = (0..64u32).filter_map(|i| char::from_u32(0x41 + i * 997 % 0x2fff)).collect();
        check_round_trip(&mixed);
    }

    #[test]
    fn decoding_ids_no_text_packs_to_never_panics() {
        let decoded = FallbackTokenizer.decode(&[u32::MAX, 0x8080_8080, 0, 0x7fff_ffff]).expect("the fallback decodes");
        assert!(!decoded.is_empty());
    }
}
