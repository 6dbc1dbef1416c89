//! Images of chat requests, prepared as vLLM's engine prepares them, so that the blocks
//! this worker caches and announces are the blocks a router computes for the request.
//!
//! For a worker serving a vision-language model ([`SimMedia`]), each `image_url` part
//! (a `data:` URL, or a client `uuid`) is identified and sized by `kvroute-media`
//! exactly as the router's front end does; the tokenizer renders one placeholder token
//! per image; [`kvroute_media::expand`] widens each placeholder into the image's tokens
//! and gives the core's [`MediaItems`]. The engine then hashes the prompt with
//! `router_core::hash_tokens_with_media` (the router's call), and each `BlockStored`
//! carries the `[identifier, offset]` extra keys vLLM publishes for those blocks,
//! derived from the same items by the core's own overlap rule.
//!
//! Not modelled: `http(s)` image URLs (refused, as a vLLM server without network
//! access refuses them), `mm_processor_kwargs` and `media_io_kwargs` (ignored), and the
//! vision encoder's time (an image's tokens prefill like text).

use std::sync::Arc;

use hyper::StatusCode;
use kvroute_media::{ImagePart, MediaConfig, MediaError, ResolvedImage};
use kvroute_tokenize::images::{ImagePartError, ImagePartRef};
use router_core::{MediaItems, MediaKey};
use serde_json::Value;

use crate::openai::ApiError;

mod flags;

pub use flags::{HasherArg, ImagePlan, MediaArgs};

/// Longest prompt, in tokens, that images may expand to (the engine's own prompt
/// limit is checked after).
const EXPANDED_TOKENS_MAX: usize = 1 << 24;

/// How the worker's model reads images: vLLM's item identifiers (the engine's model
/// id, its hasher, its image decoding), the placeholder rule and limits, and the
/// placeholder token its tokenizer renders once per image.
#[derive(Clone, Debug)]
pub struct SimMedia {
    /// Identifiers, placeholder counts and limits, as `kvroute-media` computes them.
    pub config: MediaConfig,
    /// The placeholder token id the templated prompt holds once per image.
    pub token_id: u32,
}

/// A prompt's images, placed: the core's items, and each item's identifier for the
/// events. Shared by the request's ledger entries.
#[derive(Debug)]
pub(crate) struct PromptMedia {
    pub(crate) items: MediaItems,
    names: Vec<(MediaKey, Arc<str>)>,
}

/// One media key of a stored block as vLLM publishes it: the item's identifier and
/// where it starts relative to the block's first token.
pub(crate) type BlockMediaKey = (Arc<str>, i64);

impl PromptMedia {
    /// Appends the media keys of block `[start, end)` (in tokens) to `out`, in prompt
    /// order: the core's [`MediaItems::block_extra_keys`], with each key's identifier
    /// put back. Linear in the items.
    pub(crate) fn block_keys(&self, start: u64, end: u64, out: &mut Vec<BlockMediaKey>) {
        let mut words = Vec::new();
        self.items.block_extra_keys(start, end, &mut words);
        for pair in words.chunks_exact(2) {
            let name = self.names.iter().find(|(k, _)| k.0 == pair[0]).map(|(_, n)| n.clone());
            // Every key came from `names`; the fallback only guards a broken invariant.
            out.push((name.unwrap_or_else(|| Arc::from("")), pair[1] as i64));
        }
    }
}

/// `ids` (the tokenizer's, one placeholder per image) with the body's images placed,
/// for a worker that takes images; `ids` as they are, with no media, for a body
/// without image parts. Bad images are the client's error (400, 413 when too large).
/// Work is linear in the body and the expanded prompt.
pub(crate) fn place(
    media: &SimMedia,
    ids: Vec<u32>,
    body: &Value,
) -> Result<(Vec<u32>, Option<Arc<PromptMedia>>), ApiError> {
    let parts = image_parts(body, media.config.limits.items_max)?;
    if parts.is_empty() {
        return Ok((ids, None));
    }
    let resolve = |p: &ImagePartRef<'_>| media.config.resolve(ImagePart { url: p.url, uuid: p.uuid.as_deref() });
    let images = parts.iter().map(resolve).collect::<Result<Vec<_>, _>>();
    let images = images.map_err(|e| media_error(&e))?;
    let expanded =
        kvroute_media::expand(&ids, media.token_id, &images, EXPANDED_TOKENS_MAX).map_err(|e| media_error(&e))?;
    let names = names(&images, &expanded.media);
    Ok((expanded.tokens, Some(Arc::new(PromptMedia { items: expanded.media, names }))))
}

/// Each item's key with its identifier. The items are in prompt order, as the images
/// are (the i-th placeholder is the i-th image).
fn names(images: &[ResolvedImage], items: &MediaItems) -> Vec<(MediaKey, Arc<str>)> {
    images.iter().zip(items.items()).map(|(img, it)| (it.key, Arc::from(img.identifier.as_str()))).collect()
}

/// The image parts of a chat body in prompt order (the order of vLLM's items), as the
/// router reads them, refusing more than `items_max` and parts that name no image.
fn image_parts(body: &Value, items_max: usize) -> Result<Vec<ImagePartRef<'_>>, ApiError> {
    kvroute_tokenize::images::image_parts(body, items_max).map_err(|e| match e {
        ImagePartError::TooMany { items_max } => {
            media_error(&MediaError::TooManyItems { items: items_max + 1, items_max })
        }
        e => ApiError::bad(Some("messages"), e.to_string()),
    })
}

/// 413 for an image over the limits, else 400, with the reason.
fn media_error(e: &MediaError) -> ApiError {
    let message = format!("invalid image: {e}");
    match e.http_status() {
        413 => ApiError {
            param: Some("messages"),
            ..ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message)
        },
        _ => ApiError::bad(Some("messages"), message),
    }
}

#[cfg(test)]
mod tests;
