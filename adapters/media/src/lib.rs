//! `kvroute-media` reads the images of a chat request the way vLLM will, so that the
//! router hashes an image request's blocks exactly as the engine's KV events report
//! them:
//!
//! * [`data_url`]: `data:` URLs, decoded as vLLM decodes them;
//! * [`digest`]: the item identifier vLLM computes from the client's encoded bytes (or
//!   the client's `uuid`), blake3 by default, sha256 or sha512 by configuration;
//! * [`header`]: size, mode and EXIF orientation from PNG, JPEG and WebP headers;
//! * [`tokens`]: the placeholder token count a model's processor gives an image, and
//!   the prompt with each image's placeholder expanded;
//! * [`ImageModel`]: a model's placeholder rule, token and text from its config files;
//! * [`MediaConfig::resolve`] puts these together per image part, and
//!   [`expand`] places them in the prompt as the core's [`router_core::MediaItems`].
//!
//! It does no I/O: fetching `http(s)` images is left to the caller's policy.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod data_url;
pub mod digest;
mod error;
pub mod header;
mod model;
pub mod tokens;

pub use digest::{identifier, Algorithm, ImageIo, ImageItem};
pub use error::MediaError;
pub use header::{Format, ImageHeader};
pub use model::ImageModel;
pub use tokens::{expand_placeholders, Placed, PlaceholderRule};

use router_core::{MediaItem, MediaItems};

/// Limits on a request's images.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Limits {
    /// Largest decoded image, in bytes. Default 20 MiB.
    pub bytes_max: usize,
    /// Most pixels per image. Default 89,478,485 (Pillow's decompression-bomb bound).
    pub pixels_max: u64,
    /// Most images per request. Default 16.
    pub items_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { bytes_max: 20 << 20, pixels_max: 89_478_485, items_max: 16 }
    }
}

/// How one model's engine identifies and expands images.
#[derive(Clone, Debug)]
pub struct MediaConfig {
    /// The engine's model id: its `--model` argument (a path or a hub name), which
    /// vLLM hashes into every identifier; not the served model name.
    pub model_id: String,
    /// The engine's `--mm-hasher-algorithm`.
    pub algorithm: Algorithm,
    /// The engine's image decoding (`--media-io-kwargs`).
    pub io: ImageIo,
    /// The model's placeholder rule.
    pub rule: PlaceholderRule,
    /// Limits per request.
    pub limits: Limits,
}

/// One image part of a chat message: `image_url.url` and the part's `uuid`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ImagePart<'a> {
    /// The image's URL; only `data:` URLs are read.
    pub url: Option<&'a str>,
    /// The client's identifier for the image, which vLLM uses as is.
    pub uuid: Option<&'a str>,
}

/// One image as the engine will see it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ResolvedImage {
    /// vLLM's identifier, as in its KV events.
    pub identifier: String,
    /// Placeholder tokens it expands to.
    pub tokens: u32,
    /// Its header, when the image itself was sent.
    pub header: Option<ImageHeader>,
}

impl MediaConfig {
    /// Resolves one image part. A part with a `uuid` and no URL resolves only under a
    /// fixed placeholder rule (the size is unknown). Work is linear in the URL.
    pub fn resolve(&self, part: ImagePart<'_>) -> Result<ResolvedImage, MediaError> {
        let Some(url) = part.url else {
            let uuid = part.uuid.ok_or(MediaError::NotDataUrl)?;
            let PlaceholderRule::Fixed { tokens } = self.rule else {
                return Err(MediaError::Unprocessable("an image given only by uuid has no known size"));
            };
            return Ok(ResolvedImage { identifier: uuid.to_owned(), tokens, header: None });
        };
        let data = data_url::parse(url, self.limits.bytes_max)?;
        self.resolve_bytes(&data.bytes, part.uuid)
    }

    /// Resolves an image given as its encoded bytes (a `data:` URL's, or a fetched
    /// file's) and the part's `uuid`. Work is linear in the bytes.
    pub fn resolve_bytes(&self, bytes: &[u8], uuid: Option<&str>) -> Result<ResolvedImage, MediaError> {
        if bytes.len() > self.limits.bytes_max {
            return Err(MediaError::TooLarge { bytes: bytes.len(), bytes_max: self.limits.bytes_max });
        }
        let header = header::read(bytes)?;
        if header.pixels() > self.limits.pixels_max {
            return Err(MediaError::TooManyPixels { pixels: header.pixels(), pixels_max: self.limits.pixels_max });
        }
        let (w, h) = header.display_size();
        let tokens = self.rule.tokens(w, h)?;
        let item = match uuid {
            Some(uuid) => ImageItem::Uuid(uuid),
            None => ImageItem::Bytes { bytes, mode: header.mode },
        };
        let identifier = identifier(self.algorithm, &self.model_id, item, &self.io);
        Ok(ResolvedImage { identifier, tokens, header: Some(header) })
    }

    /// Resolves every part, refusing more than `limits.items_max` before reading any.
    pub fn resolve_all(&self, parts: &[ImagePart<'_>]) -> Result<Vec<ResolvedImage>, MediaError> {
        if parts.len() > self.limits.items_max {
            return Err(MediaError::TooManyItems { items: parts.len(), items_max: self.limits.items_max });
        }
        parts.iter().map(|p| self.resolve(*p)).collect()
    }
}

/// A prompt with its images' placeholders expanded, and the items to hash it with.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Expanded {
    /// The prompt's tokens, as the engine will hold them.
    pub tokens: Vec<u32>,
    /// The images' items, for [`router_core::hash_tokens_with_media`].
    pub media: MediaItems,
}

/// Expands each `placeholder` token of `prompt` (the templated, tokenized prompt, one
/// placeholder per image in order) into its image's tokens, refusing a result longer
/// than `tokens_max`. Work is linear in the result.
pub fn expand(
    prompt: &[u32],
    placeholder: u32,
    images: &[ResolvedImage],
    tokens_max: usize,
) -> Result<Expanded, MediaError> {
    let counts: Vec<u32> = images.iter().map(|i| i.tokens).collect();
    let tokens::Placed { tokens, spans } = expand_placeholders(prompt, placeholder, &counts, tokens_max)?;
    let items = images.iter().zip(spans).map(|(i, (off, len))| MediaItem::new(i.identifier.as_bytes(), off, len));
    let media = MediaItems::new(items.collect(), tokens.len(), images.len()).map_err(MediaError::Items)?;
    Ok(Expanded { tokens, media })
}

#[cfg(test)]
mod tests;
