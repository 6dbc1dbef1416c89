//! The `kvroute sim-worker` flags for images, and how they meet the model's own files.
//!
//! A worker takes images when its tokenizer folder's `config.json` describes a
//! vision-language model (as `kvroute serve` reads it, through
//! [`kvroute_media::ImageModel`]) or when `--image-token` and `--image-tokens` describe
//! a LLaVA-style one. Setting up takes two steps because the tokenizer must be loaded
//! knowing the image's text: [`MediaArgs::plan`] names that text, then
//! [`ImagePlan::finish`] asks the loaded tokenizer for its token id.

use clap::{Args, ValueEnum};
use kvroute_media::{Algorithm, ImageModel, Limits, MediaConfig, PlaceholderRule};

use super::SimMedia;
use crate::{PromptTokenizer, SimServerError};

/// How the worker reads images (for a vision-language model).
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct MediaArgs {
    /// The model id vLLM hashes into every image identifier: the engine's --model
    /// argument, a folder or hub name, not the served name. A router's `engine_model_id`
    /// for the model must be the same (kvroute's default is the model's `tokenizer`
    /// folder). Default: --tokenizer as given.
    #[arg(long, value_name = "ID")]
    pub mm_model_id: Option<String>,
    /// The digest of image identifiers (vLLM's --mm-hasher-algorithm; kvroute's proxy
    /// computes blake3 identifiers).
    #[arg(long, value_enum, value_name = "NAME", default_value_t = HasherArg::Blake3)]
    pub mm_hasher_algorithm: HasherArg,
    /// The text one image becomes in the templated prompt; it must be one token of the
    /// tokenizer. Default: the model's (`<image>` for LLaVA) when the tokenizer
    /// folder's config.json has a vision_config. With --image-tokens, a text model's
    /// folder takes images too.
    #[arg(long, value_name = "TEXT")]
    pub image_token: Option<String>,
    /// Placeholder tokens per image, a fixed count as LLaVA's processor gives, in place
    /// of config.json's rule.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub image_tokens: Option<u32>,
    /// Most images in one request; more are refused with 400.
    #[arg(long, value_name = "N", default_value_t = Limits::default().items_max)]
    pub mm_items_max: usize,
}

impl Default for MediaArgs {
    fn default() -> Self {
        MediaArgs {
            mm_model_id: None,
            mm_hasher_algorithm: HasherArg::Blake3,
            image_token: None,
            image_tokens: None,
            mm_items_max: Limits::default().items_max,
        }
    }
}

/// A digest as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum HasherArg {
    /// BLAKE3, vLLM's default.
    Blake3,
    /// SHA-256.
    Sha256,
    /// SHA-512.
    Sha512,
}

impl From<HasherArg> for Algorithm {
    fn from(h: HasherArg) -> Self {
        match h {
            HasherArg::Blake3 => Algorithm::Blake3,
            HasherArg::Sha256 => Algorithm::Sha256,
            HasherArg::Sha512 => Algorithm::Sha512,
        }
    }
}

/// What is known of the model's images before its tokenizer is loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImagePlan {
    /// The text each image renders as: load the tokenizer with it.
    pub image_text: String,
    rule: PlaceholderRule,
    /// The model's placeholder id, unless `--image-token` names the text.
    token_id: Option<u32>,
}

impl MediaArgs {
    /// Whether any image flag was given.
    pub fn any_image_flag(&self) -> bool {
        self.image_token.is_some() || self.image_tokens.is_some()
    }

    /// The worker's image plan from `model` (the tokenizer folder's facts, `None` for a
    /// text model) and the flags: `None` when it takes no images.
    pub fn plan(&self, model: Option<&ImageModel>) -> Result<Option<ImagePlan>, SimServerError> {
        let rule = self.image_tokens.map(|tokens| PlaceholderRule::Fixed { tokens });
        let plan = match (model, &self.image_token, rule) {
            (Some(m), text, rule) => ImagePlan {
                image_text: text.clone().unwrap_or_else(|| m.prompt_text.to_owned()),
                rule: rule.unwrap_or(m.rule),
                token_id: text.is_none().then_some(m.token_id),
            },
            (None, Some(text), Some(rule)) => ImagePlan { image_text: text.clone(), rule, token_id: None },
            (None, None, None) => return Ok(None),
            (None, _, _) => {
                return Err(SimServerError::Media(
                    "the tokenizer folder's config.json has no vision_config: give both --image-token and \
                     --image-tokens for a model that takes images"
                        .into(),
                ))
            }
        };
        if plan.image_text.trim().is_empty() {
            return Err(SimServerError::Media("--image-token is empty".into()));
        }
        Ok(Some(plan))
    }
}

impl ImagePlan {
    /// The worker's media: the placeholder's id from `tokenizer` (loaded with
    /// [`Self::image_text`]) unless the model named it, identifiers keyed on
    /// `--mm-model-id` or else `default_model_id`.
    pub fn finish(
        self,
        args: &MediaArgs,
        tokenizer: &dyn PromptTokenizer,
        default_model_id: &str,
    ) -> Result<SimMedia, SimServerError> {
        let token_id = match self.token_id {
            Some(id) => id,
            None => {
                let ids = tokenizer
                    .encode_text(&self.image_text)
                    .map_err(|e| SimServerError::Media(format!("cannot tokenize {:?}: {e}", self.image_text)))?;
                match ids[..] {
                    [id] => id,
                    _ => {
                        return Err(SimServerError::Media(format!(
                            "--image-token {:?} is {} tokens of the tokenizer; it must be one",
                            self.image_text,
                            ids.len()
                        )))
                    }
                }
            }
        };
        if args.mm_items_max == 0 || args.mm_items_max > router_core::MEDIA_ITEMS_MAX {
            return Err(SimServerError::Media(format!(
                "--mm-items-max must be in 1..={}",
                router_core::MEDIA_ITEMS_MAX
            )));
        }
        let config = MediaConfig {
            model_id: args.mm_model_id.clone().unwrap_or_else(|| default_model_id.to_owned()),
            algorithm: args.mm_hasher_algorithm.into(),
            io: Default::default(),
            rule: self.rule,
            limits: Limits { items_max: args.mm_items_max, ..Limits::default() },
        };
        Ok(SimMedia { config, token_id })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TokenizeError;

    /// Words to ids: each space-separated word is its length.
    struct Lengths;

    impl PromptTokenizer for Lengths {
        fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
            Ok(text.split_whitespace().map(|w| w.len() as u32).collect())
        }
        fn encode_chat(&self, _: &serde_json::Value) -> Result<Vec<u32>, TokenizeError> {
            Ok(Vec::new())
        }
    }

    fn llava() -> ImageModel {
        ImageModel { rule: PlaceholderRule::Fixed { tokens: 576 }, token_id: 32000, prompt_text: "<image>" }
    }

    /// `args` over `model` give the worker (text, token id, tokens per image, model id)
    /// or the error's message fragment.
    #[track_caller]
    fn check(args: MediaArgs, model: Option<ImageModel>, want: Result<Option<(&str, u32, u32, &str)>, &str>) {
        let got = args.plan(model.as_ref()).and_then(|p| {
            p.map(|p| {
                let text = p.image_text.clone();
                p.finish(&args, &Lengths, "dir").map(|m| (text, m))
            })
            .transpose()
        });
        match (got, want) {
            (Ok(None), Ok(None)) => {}
            (Ok(Some((text, m))), Ok(Some((t, id, n, model_id)))) => {
                assert_eq!((text.as_str(), m.token_id), (t, id));
                assert_eq!(
                    (m.config.rule, m.config.model_id.as_str()),
                    (PlaceholderRule::Fixed { tokens: n }, model_id)
                );
            }
            (Err(e), Err(frag)) => assert!(e.to_string().contains(frag), "{e}"),
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn the_model_and_the_flags_make_the_plan() {
        let d = MediaArgs::default();
        check(d.clone(), None, Ok(None));
        check(d.clone(), Some(llava()), Ok(Some(("<image>", 32000, 576, "dir"))));
        let fixed = MediaArgs { image_tokens: Some(9), mm_model_id: Some("org/m".into()), ..d.clone() };
        check(fixed.clone(), Some(llava()), Ok(Some(("<image>", 32000, 9, "org/m"))));
        check(fixed, None, Err("give both --image-token and --image-tokens"));
        let word = MediaArgs { image_token: Some("abc".into()), image_tokens: Some(4), ..d.clone() };
        check(word.clone(), None, Ok(Some(("abc", 3, 4, "dir"))));
        check(word, Some(llava()), Ok(Some(("abc", 3, 4, "dir"))));
        let two = MediaArgs { image_token: Some("a b".into()), image_tokens: Some(4), ..d.clone() };
        check(two, None, Err("is 2 tokens of the tokenizer"));
        let blank = MediaArgs { image_token: Some(" ".into()), image_tokens: Some(4), ..d.clone() };
        check(blank, None, Err("--image-token is empty"));
        check(MediaArgs { mm_items_max: 0, ..d }, Some(llava()), Err("--mm-items-max must be in"));
    }
}
