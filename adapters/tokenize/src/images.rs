//! The image parts of a chat request, in the order vLLM reads them (the order their
//! placeholders take in the prompt): what a router needs to hash a request's images and
//! a simulated engine to cache them, before either tokenizes it.

use serde_json::Value as Json;

use crate::is_image_part;

/// One image part: `image_url.url` (or `image_url` as a string) and the part's `uuid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImagePartRef<'a> {
    /// The image's URL, as given.
    pub url: Option<&'a str>,
    /// The part's `uuid`, as vLLM reads it (`str(uuid)` of a string or an integer).
    pub uuid: Option<String>,
}

/// Why a request's image parts were refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ImagePartError {
    /// More image parts than `items_max`.
    TooMany {
        /// The limit.
        items_max: usize,
    },
    /// A part's `uuid` is neither a string nor an integer.
    BadUuid,
    /// A part names neither an image URL nor a `uuid`.
    NoImage,
}

impl std::fmt::Display for ImagePartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImagePartError::TooMany { items_max } => write!(f, "more than {items_max} images"),
            ImagePartError::BadUuid => f.write_str("an image part's `uuid` must be a string"),
            ImagePartError::NoImage => f.write_str("an image part needs `image_url.url` or a `uuid`"),
        }
    }
}

impl std::error::Error for ImagePartError {}

/// The image parts of a chat `body`'s messages, in prompt order, refusing more than
/// `items_max` before reading the rest. Work is linear in the body.
pub fn image_parts(body: &Json, items_max: usize) -> Result<Vec<ImagePartRef<'_>>, ImagePartError> {
    let messages = body.get("messages").and_then(Json::as_array).map_or(&[][..], Vec::as_slice);
    let parts = messages.iter().filter_map(|m| m.get("content")?.as_array()).flatten();
    let mut out = Vec::new();
    for part in parts.filter_map(Json::as_object).filter(|p| is_image_part(p)) {
        if out.len() == items_max {
            return Err(ImagePartError::TooMany { items_max });
        }
        let url = match part.get("image_url") {
            Some(Json::String(u)) => Some(u.as_str()),
            Some(Json::Object(o)) => o.get("url").and_then(Json::as_str),
            _ => None,
        };
        let uuid = match part.get("uuid") {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
            Some(_) => return Err(ImagePartError::BadUuid),
        };
        if url.is_none() && uuid.is_none() {
            return Err(ImagePartError::NoImage);
        }
        out.push(ImagePartRef { url, uuid });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Each part's `(url, uuid)`.
    type Parts<'a> = Vec<(Option<&'a str>, Option<&'a str>)>;

    /// The parts of a chat with `content` (one user message, then one more image part
    /// in a second message), or the error.
    #[track_caller]
    fn check(content: Json, items_max: usize, want: Result<Parts<'_>, ImagePartError>) {
        let body = json!({"messages": [
            {"role": "system", "content": "text only"},
            {"role": "user", "content": content},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "last"}}]},
        ]});
        let got = image_parts(&body, items_max);
        let got = got.as_ref().map(|ps| ps.iter().map(|p| (p.url, p.uuid.as_deref())).collect::<Vec<_>>());
        assert_eq!(got.map_err(|e| *e), want);
    }

    #[test]
    fn parts_in_prompt_order_or_refused() {
        let img = |u: &str| json!({"type": "image_url", "image_url": {"url": u}});
        check(json!("no parts"), 4, Ok(vec![(Some("last"), None)]));
        let mixed = json!([img("a"), {"type": "text", "text": "x"}, {"image_url": "b"}, {"type": "input_audio"}]);
        check(mixed, 4, Ok(vec![(Some("a"), None), (Some("b"), None), (Some("last"), None)]));
        check(json!([{"type": "image_url", "uuid": 42}]), 4, Ok(vec![(None, Some("42")), (Some("last"), None)]));
        check(json!([{"type": "image_url", "uuid": "u"}]), 4, Ok(vec![(None, Some("u")), (Some("last"), None)]));
        check(json!([{"type": "image_url", "uuid": 1.5}]), 4, Err(ImagePartError::BadUuid));
        check(json!([{"type": "image_url"}]), 4, Err(ImagePartError::NoImage));
        check(json!([img("a")]), 1, Err(ImagePartError::TooMany { items_max: 1 }));
        check(json!([img("a")]), 2, Ok(vec![(Some("a"), None), (Some("last"), None)]));
    }
}
