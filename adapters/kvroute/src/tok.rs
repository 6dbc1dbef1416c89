//! Hugging Face tokenizers behind the seams the servers define, so the router and the
//! simulated workers hash identical token ids.

use std::path::Path;
use std::sync::Arc;

use kvroute_sim_server::{PromptTokenizer, TokenizeError as SimTokenizeError};
use kvroute_tokenize::{ChatRequest, ModelTokenizer, TokenizerConfig};

/// A model's tokenizer and chat template, loaded from a local folder.
#[derive(Clone)]
pub struct HfTokenizer(pub Arc<ModelTokenizer>);

impl HfTokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, String> {
        Self::load_with(dir, TokenizerConfig::default())
    }

    /// [`Self::load`] with `config` (for example, a model's image text).
    pub fn load_with(dir: &Path, config: TokenizerConfig) -> Result<Self, String> {
        ModelTokenizer::from_dir_with(dir, config)
            .map(|t| HfTokenizer(Arc::new(t)))
            .map_err(|e| format!("cannot load tokenizer from {}: {e}", dir.display()))
    }

    /// Token ids of a chat completion body, rendered exactly as the engine renders it.
    pub fn chat_tokens(&self, body: &serde_json::Value) -> Result<Vec<u32>, kvroute_tokenize::TokenizeError> {
        let req: ChatRequest = serde_json::from_value(body.clone())
            .map_err(|e| kvroute_tokenize::TokenizeError::InvalidRequest { message: e.to_string() })?;
        self.0.encode_chat(&req)
    }
}

impl PromptTokenizer for HfTokenizer {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, SimTokenizeError> {
        self.0.encode_text(text, true).map_err(sim_error)
    }
    fn encode_chat(&self, body: &serde_json::Value) -> Result<Vec<u32>, SimTokenizeError> {
        self.chat_tokens(body).map_err(sim_error)
    }
}

/// The request's faults are a 400; the rest is the tokenizer's own failure, a 500.
fn sim_error(e: kvroute_tokenize::TokenizeError) -> SimTokenizeError {
    if e.is_bad_request() {
        SimTokenizeError::BadInput(e.to_string())
    } else {
        SimTokenizeError::Backend(Arc::new(e))
    }
}
