//! Hugging Face tokenizers behind the seams the servers define, so the router and the
//! simulated workers hash identical token ids.

use std::path::Path;
use std::sync::Arc;

use kvroute_frontend::media::load_image_model;
use kvroute_sim_server::{MediaArgs, PromptTokenizer, SimMedia, TokenizeError as SimTokenizeError};
use kvroute_tokenize::{CacheConfig, ChatRequest, Dialect, ModelTokenizer, TokenizerConfig, VllmOptions};

/// A model's tokenizer and chat template, loaded from a local folder.
#[derive(Clone)]
pub struct HfTokenizer(pub Arc<ModelTokenizer>);

impl HfTokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` from `dir`, with `config` (for
    /// example, a model's image text).
    pub fn load_with(dir: &Path, config: TokenizerConfig) -> Result<Self, String> {
        ModelTokenizer::from_dir_with(dir, config)
            .map(|t| HfTokenizer(Arc::new(t)))
            .map_err(|e| format!("cannot load tokenizer from {}: {e}", dir.display()))
    }

    /// [`Self::load_with`] with the cache's limits `cache`, for a model whose chat image parts
    /// render as `image_text` (its placeholder text, `<image>` for LLaVA); `None`: image
    /// parts are refused.
    pub fn load_for_images(dir: &Path, image_text: Option<&str>, cache: CacheConfig) -> Result<Self, String> {
        let options = VllmOptions { image_text: image_text.map(Into::into), ..VllmOptions::default() };
        Self::load_with(dir, TokenizerConfig { dialect: Dialect::Vllm(options), cache, ..TokenizerConfig::default() })
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

/// `kvroute sim-worker`'s tokenizer from `dir`, and its images when the folder's
/// config.json (read as `kvroute serve` reads it) or the image flags say it takes them.
pub fn sim_worker_tokenizer(dir: &Path, flags: &MediaArgs) -> Result<(HfTokenizer, Option<SimMedia>), String> {
    let model = load_image_model(dir)?;
    let plan = flags.plan(model.as_ref()).map_err(|e| e.to_string())?;
    let tok = HfTokenizer::load_for_images(dir, plan.as_ref().map(|p| p.image_text.as_str()), CacheConfig::default())?;
    let default_model_id = dir.display().to_string();
    let media = plan.map(|p| p.finish(flags, &tok, &default_model_id)).transpose().map_err(|e| e.to_string())?;
    Ok((tok, media))
}

/// The request's faults are a 400; the rest is the tokenizer's own failure, a 500.
fn sim_error(e: kvroute_tokenize::TokenizeError) -> SimTokenizeError {
    if e.is_bad_request() {
        SimTokenizeError::BadInput(e.to_string())
    } else {
        SimTokenizeError::Backend(Arc::new(e))
    }
}
