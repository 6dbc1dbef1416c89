//! How many placeholder tokens an image becomes, and where they sit in the prompt.
//!
//! vLLM replaces each image's placeholder token in the templated prompt with as many
//! copies as the model's processor gives the image; the copies are the item's
//! placeholder range (its `mm_position`), which the block hashes key on.
//!
//! * LLaVA-style models (`vllm/model_executor/models/llava.py`, `clip.py`,
//!   `vision.py`): a fixed count, `(image_size / patch_size)² + 1` CLIP tokens less one
//!   for `vision_feature_select_strategy = "default"`, all of them for `"full"`.
//! * Qwen2-VL-style models (`qwen2_vl.py`, `_get_vision_info`): the image is resized
//!   by transformers' `smart_resize` (factor `patch_size × merge_size`, between
//!   `min_pixels` and `max_pixels`), then `(h / patch) × (w / patch) / merge²` tokens.

use serde_json::Value;

use crate::MediaError;

/// The Qwen2-VL defaults: `min_pixels`, `max_pixels`.
const QWEN2VL_PIXELS: (u64, u64) = (56 * 56, 28 * 28 * 1280);

/// A model's rule for an image's placeholder tokens.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum PlaceholderRule {
    /// Every image takes the same number of tokens (LLaVA-style).
    Fixed {
        /// Tokens per image.
        tokens: u32,
    },
    /// Tokens from the image's size (Qwen2-VL-style).
    Qwen2Vl {
        /// The vision tower's patch side, in pixels.
        patch_size: u32,
        /// Patches merged per token along each side.
        merge_size: u32,
        /// The fewest pixels an image is resized to.
        min_pixels: u64,
        /// The most pixels an image is resized to.
        max_pixels: u64,
    },
}

impl PlaceholderRule {
    /// A LLaVA-style rule from its vision tower's `image_size` and `patch_size` and
    /// the model's `vision_feature_select_strategy` (`default` or `full`).
    pub fn llava(image_size: u32, patch_size: u32, strategy: &str) -> Result<Self, MediaError> {
        if patch_size == 0 || !image_size.is_multiple_of(patch_size) || image_size / patch_size > 1024 {
            return Err(MediaError::Config("image_size is not a multiple of patch_size"));
        }
        let clip = (image_size / patch_size).pow(2) + 1;
        let tokens = match strategy {
            "default" => clip - 1,
            "full" => clip,
            _ => return Err(MediaError::Config("vision_feature_select_strategy is neither default nor full")),
        };
        Ok(PlaceholderRule::Fixed { tokens })
    }

    /// The rule for a model from its `config.json` and, for Qwen2-VL, its
    /// `preprocessor_config.json`; `model_type` picks the family.
    pub fn from_hf_config(config: &Value, preprocessor: Option<&Value>) -> Result<Self, MediaError> {
        let vision = config.get("vision_config").ok_or(MediaError::Config("no vision_config"))?;
        let uint = |v: &Value, k: &'static str| -> Result<u64, MediaError> {
            v.get(k).and_then(Value::as_u64).ok_or(MediaError::Config(k))
        };
        match config.get("model_type").and_then(Value::as_str) {
            Some("llava") => {
                let strategy =
                    config.get("vision_feature_select_strategy").and_then(Value::as_str).unwrap_or("default");
                let (image, patch) = (uint(vision, "image_size")?, uint(vision, "patch_size")?);
                Self::llava(small(image)?, small(patch)?, strategy)
            }
            Some("qwen2_vl" | "qwen2_5_vl") => {
                let (min_pixels, max_pixels) = qwen_pixels(preprocessor)?;
                let patch_size = small(uint(vision, "patch_size")?)?;
                let merge_size = small(uint(vision, "spatial_merge_size")?)?;
                if patch_size == 0 || merge_size == 0 || max_pixels == 0 {
                    return Err(MediaError::Config("zero patch_size, spatial_merge_size or max_pixels"));
                }
                Ok(PlaceholderRule::Qwen2Vl { patch_size, merge_size, min_pixels, max_pixels })
            }
            _ => Err(MediaError::Config("model_type is not llava, qwen2_vl or qwen2_5_vl")),
        }
    }

    /// The placeholder tokens for an image of `width × height` pixels (after EXIF
    /// orientation).
    pub fn tokens(&self, width: u32, height: u32) -> Result<u32, MediaError> {
        match *self {
            PlaceholderRule::Fixed { tokens } => Ok(tokens),
            PlaceholderRule::Qwen2Vl { patch_size, merge_size, min_pixels, max_pixels } => {
                let factor = u64::from(patch_size) * u64::from(merge_size);
                let (h, w) = smart_resize(u64::from(height), u64::from(width), factor, min_pixels, max_pixels)?;
                let patches = (h / u64::from(patch_size)) * (w / u64::from(patch_size));
                u32::try_from(patches / u64::from(merge_size).pow(2)).map_err(|_| MediaError::Config("token count"))
            }
        }
    }
}

fn small(v: u64) -> Result<u32, MediaError> {
    u32::try_from(v).map_err(|_| MediaError::Config("a size beyond u32"))
}

/// `size.shortest_edge` / `size.longest_edge`, overridden by `min_pixels` /
/// `max_pixels`, as the processor's constructor reads them.
fn qwen_pixels(pre: Option<&Value>) -> Result<(u64, u64), MediaError> {
    let (mut min, mut max) = QWEN2VL_PIXELS;
    let Some(pre) = pre else { return Ok((min, max)) };
    let field = |v: Option<&Value>| -> Result<Option<u64>, MediaError> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or(MediaError::Config("a pixel bound is not an integer")),
        }
    };
    if let Some(size) = pre.get("size") {
        min = field(size.get("shortest_edge"))?.unwrap_or(min);
        max = field(size.get("longest_edge"))?.unwrap_or(max);
    }
    min = field(pre.get("min_pixels"))?.unwrap_or(min);
    max = field(pre.get("max_pixels"))?.unwrap_or(max);
    Ok((min, max))
}

/// transformers' `smart_resize`, in the same floating-point steps (Python's `round`
/// rounds half to even).
fn smart_resize(
    height: u64,
    width: u64,
    factor: u64,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u64, u64), MediaError> {
    let (hf, wf, ff) = (height as f64, width as f64, factor as f64);
    if hf.max(wf) / hf.min(wf) > 200.0 {
        return Err(MediaError::Unprocessable("aspect ratio above 200"));
    }
    let mut h = (hf / ff).round_ties_even() as u64 * factor;
    let mut w = (wf / ff).round_ties_even() as u64 * factor;
    if h.saturating_mul(w) > max_pixels {
        let beta = ((hf * wf) / max_pixels as f64).sqrt();
        h = factor.max((hf / beta / ff).floor() as u64 * factor);
        w = factor.max((wf / beta / ff).floor() as u64 * factor);
    } else if h.saturating_mul(w) < min_pixels {
        let beta = (min_pixels as f64 / (hf * wf)).sqrt();
        h = (hf * beta / ff).ceil() as u64 * factor;
        w = (wf * beta / ff).ceil() as u64 * factor;
    }
    Ok((h, w))
}

/// A prompt with its placeholders expanded.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Placed {
    /// The expanded prompt.
    pub tokens: Vec<u32>,
    /// Each image's `(offset, length)` in `tokens`, in tokens.
    pub spans: Vec<(u32, u32)>,
}

/// The prompt with each `placeholder` token replaced by `counts[i]` copies (the i-th
/// occurrence for the i-th image), and each image's `(offset, length)` in the result.
/// Work is linear in the result, which must hold at most `tokens_max` tokens.
pub fn expand_placeholders(
    prompt: &[u32],
    placeholder: u32,
    counts: &[u32],
    tokens_max: usize,
) -> Result<Placed, MediaError> {
    let found = prompt.iter().filter(|&&t| t == placeholder).count();
    if found != counts.len() {
        return Err(MediaError::PlaceholderCount { found, items: counts.len() });
    }
    let total = (prompt.len() - found) as u64 + counts.iter().map(|&c| u64::from(c)).sum::<u64>();
    if total > tokens_max as u64 || total > u64::from(u32::MAX) {
        return Err(MediaError::PromptTooLong { tokens: total, tokens_max });
    }
    let mut out = Vec::with_capacity(total as usize);
    let mut spans = Vec::with_capacity(counts.len());
    let mut next = counts.iter();
    for &t in prompt {
        match (t == placeholder).then(|| next.next()).flatten() {
            Some(&n) => {
                spans.push((out.len() as u32, n));
                out.extend(std::iter::repeat_n(placeholder, n as usize));
            }
            None => out.push(t),
        }
    }
    Ok(Placed { tokens: out, spans })
}

#[cfg(test)]
mod tests;
