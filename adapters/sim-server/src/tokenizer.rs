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
}

/// Equal when of the same kind with the same message (a backend error has no other
/// identity).
impl PartialEq for TokenizeError {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (TokenizeError::BadInput(a), TokenizeError::BadInput(b)) => a == b,
            (TokenizeError::Backend(a), TokenizeError::Backend(b)) => a.to_string() == b.to_string(),
            _ => false,
        }
    }
}

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizeError::BadInput(m) => write!(f, "invalid prompt: {m}"),
            TokenizeError::Backend(m) => write!(f, "tokenizer failed: {m}"),
        }
    }
}

impl std::error::Error for TokenizeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TokenizeError::BadInput(_) => None,
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
}
