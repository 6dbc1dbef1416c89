//! Turning a prompt into the token ids routing hashes: a [`Tokenize`] trait the binary
//! implements with a real tokenizer and chat template, and the fallback used for models
//! without one.
//!
//! The fallback packs the UTF-8 bytes of a canonical rendering of the prompt into `u32`
//! "tokens", four bytes each, so a block of 64 such tokens covers 256 bytes (about the
//! text of 64 real tokens) and prefix sharing between requests is preserved: tools
//! first, then every message in order, each rendered as JSON with sorted keys and ended
//! by a newline. Appending a message keeps every earlier block's hash. Workers never see
//! these ids; only the router's cache estimate is approximate.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde_json::Value;

/// A model's tokenizer. Called on the proxy's threads (or a blocking thread for large
/// prompts); implementations should be fast and must not block on I/O.
pub trait Tokenize: Send + Sync {
    /// The token ids of a chat request after applying the model's chat template; gets the
    /// whole request body (messages, tools, template options).
    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError>;
    /// The token ids of a plain text prompt.
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError>;
}

/// A tokenizer's failure; the proxy falls back to byte hashing and counts it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizeError(pub String);

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tokenizer failed: {}", self.0)
    }
}

impl std::error::Error for TokenizeError {}

/// Tokenizers by model name. Models without one route on the byte fallback.
#[derive(Clone, Default)]
pub struct Tokenizers {
    by_model: BTreeMap<String, Arc<dyn Tokenize>>,
}

impl Tokenizers {
    /// No tokenizers: every model uses the fallback.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `model`'s tokenizer (a model's LoRA adapters share it).
    pub fn insert(&mut self, model: impl Into<String>, tokenizer: Arc<dyn Tokenize>) {
        self.by_model.insert(model.into(), tokenizer);
    }

    /// `model`'s tokenizer, if registered.
    pub fn get(&self, model: &str) -> Option<&Arc<dyn Tokenize>> {
        self.by_model.get(model)
    }
}

impl fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.by_model.keys()).finish()
    }
}

/// The fallback tokens of a chat body: canonical tools, then each message. Linear in
/// the body's size.
pub fn fallback_chat(body: &Value) -> Vec<u32> {
    let mut out = Vec::new();
    if let Some(tools) = body.get("tools") {
        write_canonical(tools, &mut out);
        out.push(b'\n');
    }
    if let Some(Value::Array(messages)) = body.get("messages") {
        for m in messages {
            write_canonical(m, &mut out);
            out.push(b'\n');
        }
    }
    pack_bytes(&out)
}

/// The fallback tokens of a text prompt.
pub fn fallback_text(text: &str) -> Vec<u32> {
    pack_bytes(text.as_bytes())
}

/// Four bytes per token, little-endian, the last one zero-padded.
fn pack_bytes(bytes: &[u8]) -> Vec<u32> {
    let words = bytes.chunks_exact(4);
    let tail = words.remainder();
    let mut out: Vec<u32> = Vec::with_capacity(bytes.len().div_ceil(4));
    // Whole words convert without a copy call per token.
    out.extend(words.map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
    if !tail.is_empty() {
        let mut b = [0u8; 4];
        b[..tail.len()].copy_from_slice(tail);
        out.push(u32::from_le_bytes(b));
    }
    out
}

/// JSON with object keys sorted at every level, whatever order the input had.
pub fn write_canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                // Writing into a Vec cannot fail.
                let _ = serde_json::to_writer(&mut *out, k.as_str());
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        scalar => {
            let _ = serde_json::to_writer(&mut *out, scalar);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn canonical_rendering_ignores_key_order() {
        let a: Value = serde_json::from_str(r#"{"role":"user","content":"hi","x":{"b":1,"a":[2]}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"x":{"a":[2],"b":1},"content":"hi","role":"user"}"#).unwrap();
        assert_eq!(fallback_chat(&json!({"messages": [a]})), fallback_chat(&json!({"messages": [b]})));
    }

    #[test]
    fn appending_a_message_keeps_the_prefix() {
        let m1 = json!({"role": "system", "content": "x".repeat(600)});
        let m2 = json!({"role": "user", "content": "hello"});
        let one = fallback_chat(&json!({"messages": [m1.clone()]}));
        let two = fallback_chat(&json!({"messages": [m1, m2]}));
        let whole = one.len() - 1; // the last token may be zero-padded
        assert_eq!(one[..whole], two[..whole]);
        assert!(two.len() > one.len());
    }

    #[test]
    fn tools_count_and_change_the_tokens() {
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let plain = fallback_chat(&json!({"messages": msgs}));
        let tooled = fallback_chat(&json!({"messages": msgs, "tools": [{"type": "function"}]}));
        assert_ne!(plain, tooled);
    }

    #[test]
    fn bytes_pack_four_to_a_token() {
        assert_eq!(fallback_text("abcde"), vec![u32::from_le_bytes(*b"abcd"), u32::from(b'e')]);
        assert!(fallback_text("").is_empty());
    }
}
