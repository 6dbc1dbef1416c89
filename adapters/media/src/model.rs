//! What a vision-language model's Hugging Face files say about its images: the
//! placeholder rule, the token id vLLM's processor expands, and the text an image part
//! becomes when vLLM renders message content as a string.
//!
//! * The token id is `config.json`'s `image_token_index` (LLaVA) or `image_token_id`
//!   (Qwen2-VL), the id vLLM's processors look for in the prompt.
//! * The text is the model class's `get_placeholder_str` in vLLM
//!   (`vllm/model_executor/models/llava.py`, `qwen2_vl.py`): vLLM puts it before the
//!   message's text under the "string" content format. Under the "openai" format the
//!   chat template renders an `{"type": "image"}` part itself.

use serde_json::Value;

use crate::{MediaError, PlaceholderRule};

/// A model's image facts, read from its `config.json` and image processor config.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ImageModel {
    /// How many placeholder tokens an image becomes.
    pub rule: PlaceholderRule,
    /// The placeholder token id vLLM expands, once per image in the templated prompt.
    pub token_id: u32,
    /// The text of one image under the "string" content format.
    pub prompt_text: &'static str,
}

impl ImageModel {
    /// The model's facts, or `Ok(None)` for a model without a `vision_config` (a text
    /// model). `image_processor` is `preprocessor_config.json`, or the
    /// `image_processor` object of `processor_config.json`.
    pub fn from_hf_config(config: &Value, image_processor: Option<&Value>) -> Result<Option<Self>, MediaError> {
        if config.get("vision_config").is_none() {
            return Ok(None);
        }
        let rule = PlaceholderRule::from_hf_config(config, image_processor)?;
        let (key, prompt_text) = match config.get("model_type").and_then(Value::as_str) {
            Some("llava") => ("image_token_index", "<image>"),
            Some("qwen2_vl" | "qwen2_5_vl") => ("image_token_id", "<|vision_start|><|image_pad|><|vision_end|>"),
            _ => return Err(MediaError::Config("model_type is not llava, qwen2_vl or qwen2_5_vl")),
        };
        let token_id = config
            .get(key)
            .and_then(Value::as_u64)
            .and_then(|t| u32::try_from(t).ok())
            .ok_or(MediaError::Config("no image token id"))?;
        Ok(Some(ImageModel { rule, token_id, prompt_text }))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[track_caller]
    fn check(config: Value, pre: Option<Value>, want: Result<Option<(u32, &str)>, MediaError>) {
        let got = ImageModel::from_hf_config(&config, pre.as_ref()).map(|m| m.map(|m| (m.token_id, m.prompt_text)));
        assert_eq!(got, want);
    }

    #[test]
    fn families() {
        let clip = json!({"image_size": 112, "patch_size": 14});
        check(json!({"model_type": "llama"}), None, Ok(None));
        check(
            json!({"model_type": "llava", "image_token_index": 7, "vision_config": clip}),
            None,
            Ok(Some((7, "<image>"))),
        );
        let qwen = json!({"model_type": "qwen2_vl", "image_token_id": 10,
            "vision_config": {"patch_size": 14, "spatial_merge_size": 2}});
        check(qwen, Some(json!({"min_pixels": 3136})), Ok(Some((10, "<|vision_start|><|image_pad|><|vision_end|>"))));
        check(
            json!({"model_type": "llava", "vision_config": clip}),
            None,
            Err(MediaError::Config("no image token id")),
        );
        let other = json!({"model_type": "gemma3", "vision_config": {}});
        check(other, None, Err(MediaError::Config("model_type is not llava, qwen2_vl or qwen2_5_vl")));
    }
}
