//! Turning a prompt into the token ids routing hashes: a [`Tokenize`] trait the binary
//! implements with a real tokenizer and chat template, and the fallback used for models
//! without one.
//!
//! The fallback ([`fallback_text`], [`fallback_chat`], from `kvroute-tokenize`) packs the
//! UTF-8 bytes of a canonical rendering of the prompt four to a `u32` "token", so prefix
//! sharing between requests is preserved. `kvroute sim-worker` tokenizes the same way by
//! default, so its KV events match these ids; a real engine's never do, and the router
//! then predicts overlap from its own decisions (see `router_core::RouterConfig`).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde_json::Value;

use crate::media::ChatMedia;

pub use kvroute_tokenize::fallback::{fallback_chat, fallback_text, write_canonical};

/// A model's tokenizer. Called on the proxy's threads (or a blocking thread for large
/// prompts); implementations should be fast and must not block on I/O.
pub trait Tokenize: Send + Sync {
    /// The token ids of a chat request after applying the model's chat template; gets the
    /// whole request body (messages, tools, template options).
    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError>;
    /// The token ids of a plain text prompt.
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError>;
    /// How the model's images are read, for a model that takes images; its
    /// [`encode_chat`](Self::encode_chat) then renders one placeholder token
    /// ([`ChatMedia::token_id`]) per image part. Default none: image parts are not read.
    fn media(&self) -> Option<&ChatMedia> {
        None
    }
    /// The counters of the tokenizer's prefix cache, for one that keeps one. Default none.
    fn cache_stats(&self) -> Option<kvroute_tokenize::CacheStats> {
        None
    }
}

/// A tokenizer's failure, carrying the tokenizer's own error as its source; the proxy
/// falls back to byte hashing and counts it.
#[derive(Clone, Debug)]
pub struct TokenizeError(Arc<dyn std::error::Error + Send + Sync>);

impl TokenizeError {
    /// Wraps the tokenizer's error.
    pub fn new(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        TokenizeError(Arc::from(source.into()))
    }
}

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tokenizer failed: {}", self.0)
    }
}

impl std::error::Error for TokenizeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

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

    /// Every registered model and its tokenizer, by model name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Arc<dyn Tokenize>)> {
        self.by_model.iter().map(|(m, t)| (m.as_str(), t))
    }
}

impl fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.by_model.keys()).finish()
    }
}

/// The warning logged once for a model in [`crate::Fleet::tokenizer_missing`], when its
/// first worker that publishes KV events joins.
pub fn tokenizer_missing_warning(model: &str) -> String {
    format!(
        "model {model:?} has no `tokenizer` but its workers publish KV events: the router hashes \
         prompts with its byte fallback, which matches those events only for workers that \
         tokenize the same way (kvroute sim-worker does). With a real engine, set `tokenizer` \
         under this model's [[models]] to a local folder holding the model's tokenizer.json and \
         tokenizer_config.json. Until then this model routes on predictions from the router's \
         own decisions."
    )
}
