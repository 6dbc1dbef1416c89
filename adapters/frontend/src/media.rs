//! Images of chat requests, routed by the KV blocks they fill: each image part is
//! identified and sized as vLLM will ([`kvroute_media`]), the tokenizer renders one
//! placeholder per image, and [`expand`] widens each into the image's tokens with the
//! core's per-block media keys, so that the prompt hashes as the engine's events do.
//!
//! Only `data:` URLs and client `uuid`s are read by default. An `http://` URL is fetched
//! only when it is under a prefix of `[media] url_allow` (empty by default), with
//! `fetch_bytes_max` and `fetch_timeout_ms`, and without following redirects; any other
//! URL is the client's mistake (400), so the router never fetches what its operator did
//! not name. Bad images are 400 (413 when too large), never a fallback: the engine
//! would refuse them too.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use kvroute_media::{Algorithm, ImageModel, ImagePart, Limits, MediaConfig, MediaError, ResolvedImage};
use kvroute_tokenize::images::ImagePartError;
use router_core::MediaItems;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

mod fetch;

pub use fetch::Fetcher;
/// One image part of a chat: its URL and the client's `uuid`.
pub use kvroute_tokenize::images::ImagePartRef as Part;

/// Longest prompt, in tokens, that images may expand to.
const EXPANDED_TOKENS_MAX: usize = 1 << 22;

/// Limits on the images of chat requests (`[media]`), for every model that takes them.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MediaSection {
    /// Most images per request (default 16; at most 1,024); more get 400.
    pub items_max: usize,
    /// Largest image, decoded, in bytes (default 20 MiB); larger gets 413.
    pub image_bytes_max: usize,
    /// `http://` or `https://` URL prefixes, each naming its host and ending in a path
    /// with a `/`, that image parts may point to (default none: only `data:` URLs and
    /// `uuid`s).
    pub url_allow: Vec<String>,
    /// A PEM bundle of the roots that `https` image hosts are verified against (default
    /// the system's).
    pub ca_path: Option<PathBuf>,
    /// Largest fetched image, in bytes (default 20 MiB); larger gets 413.
    pub fetch_bytes_max: usize,
    /// Time one fetch may take, in ms (default 5,000); slower gets 400.
    pub fetch_timeout_ms: u64,
    /// The engines' `--mm-hasher-algorithm`: `blake3` (default, vLLM's), `sha256` or
    /// `sha512`. An image's identifier is its digest, so it must match the engines'.
    pub hasher_algorithm: String,
}

impl Default for MediaSection {
    fn default() -> Self {
        MediaSection {
            items_max: 16,
            image_bytes_max: 20 << 20,
            url_allow: Vec::new(),
            ca_path: None,
            fetch_bytes_max: 20 << 20,
            fetch_timeout_ms: 5_000,
            hasher_algorithm: "blake3".into(),
        }
    }
}

impl MediaSection {
    /// The offending key and why, if any.
    pub fn check(&self) -> Result<(), (String, String)> {
        if self.items_max == 0 || self.items_max > router_core::MEDIA_ITEMS_MAX {
            return Err(("media.items_max".into(), format!("must be in 1..={}", router_core::MEDIA_ITEMS_MAX)));
        }
        if self.image_bytes_max == 0 || self.fetch_bytes_max == 0 || self.fetch_timeout_ms == 0 {
            return Err((
                "media".into(),
                "image_bytes_max, fetch_bytes_max and fetch_timeout_ms must be above 0".into(),
            ));
        }
        if Algorithm::from_name(&self.hasher_algorithm).is_none() {
            let why = format!("{:?} is not one of blake3, sha256, sha512", self.hasher_algorithm);
            return Err(("media.hasher_algorithm".into(), why));
        }
        if let Some(p) = &self.ca_path {
            crate::tls::client_config(Some(p)).map_err(|e| ("media.ca_path".to_string(), e.to_string()))?;
        }
        for (i, p) in self.url_allow.iter().enumerate() {
            fetch::Prefix::parse(p).map_err(|why| (format!("media.url_allow[{i}]"), why))?;
        }
        Ok(())
    }
}

/// How one model's images are read: the engine's identifiers and placeholder rule,
/// the placeholder token, and what may be fetched.
#[derive(Clone, Debug)]
pub struct ChatMedia {
    /// Identifiers, placeholder counts and limits.
    pub config: MediaConfig,
    /// The placeholder token the templated prompt holds once per image.
    pub token_id: u32,
    /// Fetches of allowed `http://` images.
    pub fetcher: Arc<Fetcher>,
}

impl ChatMedia {
    /// `model`'s media, served by an engine started with `--model engine_model_id`.
    pub fn new(model: &ImageModel, engine_model_id: &str, section: &MediaSection) -> Self {
        let limits = Limits { bytes_max: section.image_bytes_max, items_max: section.items_max, ..Limits::default() };
        let config = MediaConfig {
            model_id: engine_model_id.to_owned(),
            // `check` refused any other name.
            algorithm: Algorithm::from_name(&section.hasher_algorithm).unwrap_or_default(),
            io: Default::default(),
            rule: model.rule,
            limits,
        };
        ChatMedia { config, token_id: model.token_id, fetcher: Arc::new(Fetcher::new(section)) }
    }
}

/// The image facts of the model in folder `dir`: `Ok(None)` for a text model (its
/// `config.json` has no `vision_config`, or there is none). The image processor's
/// settings come from `preprocessor_config.json`, else `processor_config.json`'s
/// `image_processor`.
pub fn load_image_model(dir: &Path) -> Result<Option<ImageModel>, String> {
    let read = |name: &str| -> Result<Option<Value>, String> {
        let path = dir.join(name);
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    };
    let Some(config) = read("config.json")? else { return Ok(None) };
    let pre = match read("preprocessor_config.json")? {
        Some(p) => Some(p),
        None => read("processor_config.json")?.and_then(|p| p.get("image_processor").cloned()),
    };
    ImageModel::from_hf_config(&config, pre.as_ref()).map_err(|e| format!("{}: {e}", dir.display()))
}

/// The image parts of a chat body, in prompt order (the order of vLLM's items),
/// refusing more than `items_max`. Work is linear in the body.
pub fn image_parts(body: &Value, items_max: usize) -> Result<Vec<Part<'_>>, ApiError> {
    kvroute_tokenize::images::image_parts(body, items_max).map_err(|e| match e {
        ImagePartError::TooMany { items_max } => {
            ApiError::media(&MediaError::TooManyItems { items: items_max + 1, items_max })
        }
        e => ApiError::bad_request(e.to_string()),
    })
}

/// Whether the body sets what changes vLLM's identifiers in ways not followed here
/// (`mm_processor_kwargs`, `media_io_kwargs`): such a request routes without media.
pub fn has_media_kwargs(body: &Value) -> bool {
    ["mm_processor_kwargs", "media_io_kwargs"].iter().any(|k| body.get(*k).is_some_and(|v| !v.is_null()))
}

/// The bytes of each allowed `http://` image of the body's parts, in part order (`None`
/// for a part that needs no fetch). Any URL that is neither `data:` nor allowed is
/// refused here, before anything is fetched.
pub async fn fetch_all(media: &ChatMedia, body: &Value) -> Result<Vec<Option<Bytes>>, ApiError> {
    let parts = image_parts(body, media.config.limits.items_max)?;
    fn remote<'a>(p: &Part<'a>) -> Option<&'a str> {
        p.url.filter(|u| !kvroute_media::data_url::is_data_url(u))
    }
    if parts.iter().filter_map(remote).any(|u| !media.fetcher.allows(u)) {
        return Err(ApiError::image_url_not_allowed());
    }
    let mut out = Vec::with_capacity(parts.len());
    for p in &parts {
        out.push(match remote(p) {
            Some(url) => Some(media.fetcher.fetch(url).await?),
            None => None,
        });
    }
    Ok(out)
}

/// Each image part of `body` resolved: `data:` URLs and `uuid`s as they are, fetched
/// images from `fetched` ([`fetch_all`]'s answer for the same body). An image that
/// cannot be read is refused. Work is linear in the body and the fetched bytes.
pub fn resolve(media: &ChatMedia, body: &Value, fetched: &[Option<Bytes>]) -> Result<Vec<ResolvedImage>, ApiError> {
    let parts = image_parts(body, media.config.limits.items_max)?;
    let mut out = Vec::with_capacity(parts.len());
    for (i, p) in parts.iter().enumerate() {
        let resolved = match fetched.get(i).and_then(Option::as_ref) {
            Some(bytes) => media.config.resolve_bytes(bytes, p.uuid.as_deref()),
            None => media.config.resolve(ImagePart { url: p.url, uuid: p.uuid.as_deref() }),
        };
        out.push(resolved.map_err(|e| ApiError::media(&e))?);
    }
    Ok(out)
}

/// `prompt` (tokenized, one placeholder per image) with each placeholder widened into
/// its image's tokens, and the media items to hash it with; `None` when the prompt's
/// placeholders do not match the images (the template or the tokenizer disagrees with
/// the engine's), which the caller routes as text and counts.
pub fn expand(media: &ChatMedia, prompt: &[u32], images: &[ResolvedImage]) -> Option<(Vec<u32>, MediaItems)> {
    kvroute_media::expand(prompt, media.token_id, images, EXPANDED_TOKENS_MAX).ok().map(|e| (e.tokens, e.media))
}

#[cfg(test)]
mod tests;
