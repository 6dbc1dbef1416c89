//! `data:` URLs, read as vLLM reads them (`_load_data_url` in
//! `vllm/multimodal/media/connector.py`, then `pybase64.b64decode(data, validate=True)`
//! in `vllm/multimodal/media/image.py`):
//!
//! * the scheme is matched case-insensitively on the first five characters;
//! * the header is everything before the first `,`; its last `;`-separated part must
//!   be exactly `base64`, and the media type is the header's first `;`-separated part;
//! * the data is standard-alphabet base64, padded to a multiple of four, with nothing
//!   else in it (no whitespace, no URL-safe alphabet); non-zero trailing bits are
//!   accepted, as Python's decoder accepts them.

use base64::alphabet::STANDARD;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine;

use crate::MediaError;

/// Python's `b64decode(validate=True)`: strict alphabet, canonical padding, lenient
/// trailing bits.
const PYTHON_STRICT: GeneralPurpose = GeneralPurpose::new(
    &STANDARD,
    GeneralPurposeConfig::new()
        .with_decode_allow_trailing_bits(true)
        .with_decode_padding_mode(DecodePaddingMode::RequireCanonical),
);

/// A decoded `data:` URL.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct DataUrl<'a> {
    /// The declared media type (`image/png`), possibly empty; vLLM ignores it.
    pub media_type: &'a str,
    /// The decoded bytes: what vLLM hashes.
    pub bytes: Vec<u8>,
}

/// True when `url` is a `data:` URL (scheme matched case-insensitively).
pub fn is_data_url(url: &str) -> bool {
    url.get(..5).is_some_and(|s| s.eq_ignore_ascii_case("data:"))
}

/// Decodes `url`, refusing data that would decode to more than `bytes_max` bytes
/// before decoding it. Work is linear in `url.len()`.
pub fn parse(url: &str, bytes_max: usize) -> Result<DataUrl<'_>, MediaError> {
    if !is_data_url(url) {
        return Err(MediaError::NotDataUrl);
    }
    let (spec, data) = url[5..].split_once(',').ok_or(MediaError::MissingComma)?;
    let (media_type, encoding) = spec.rsplit_once(';').ok_or(MediaError::NotBase64)?;
    if encoding != "base64" {
        return Err(MediaError::NotBase64);
    }
    let media_type = media_type.split(';').next().unwrap_or("");
    let decoded_max = data.len() / 4 * 3;
    if decoded_max > bytes_max {
        // Padding can only shave two bytes; past that the item is surely too large.
        let bytes = decoded_max.saturating_sub(2);
        if bytes > bytes_max {
            return Err(MediaError::TooLarge { bytes, bytes_max });
        }
    }
    let bytes = PYTHON_STRICT.decode(data).map_err(|_| MediaError::BadBase64)?;
    if bytes.len() > bytes_max {
        return Err(MediaError::TooLarge { bytes: bytes.len(), bytes_max });
    }
    Ok(DataUrl { media_type, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `url` decodes to `want` (bytes, or the error).
    #[track_caller]
    fn check(url: &str, want: Result<&[u8], MediaError>) {
        assert_eq!(parse(url, 16).map(|d| d.bytes), want.map(<[u8]>::to_vec), "{url:?}");
    }

    #[test]
    fn decodes_as_python_strict_base64() {
        // Cases checked against `pybase64.b64decode(s, validate=True)`.
        check("data:image/png;base64,aGk=", Ok(b"hi"));
        check("DATA:image/png;base64,aGk=", Ok(b"hi"));
        check("data:image/png;base64,aGl=", Ok(b"hi"));
        check("data:image/png;base64,YR==", Ok(b"a"));
        check("data:;base64,", Ok(b""));
        check("data:image/png;charset=x;base64,YQ==", Ok(b"a"));
        check("data:image/png;base64,aGk", Err(MediaError::BadBase64));
        check("data:image/png;base64,aG k=", Err(MediaError::BadBase64));
        check("data:image/png;base64,aGk=\n", Err(MediaError::BadBase64));
        check("data:image/png;base64,aGk==", Err(MediaError::BadBase64));
        check("data:image/png;base64,-_8=", Err(MediaError::BadBase64));
        check("data:image/png;base64,aGk=aGk=", Err(MediaError::BadBase64));
    }

    #[test]
    fn refuses_other_shapes() {
        check("http://x/a.png", Err(MediaError::NotDataUrl));
        check("dat", Err(MediaError::NotDataUrl));
        check("data:image/png;base64", Err(MediaError::MissingComma));
        check("data:image/png,aGk=", Err(MediaError::NotBase64));
        check("data:image/png;BASE64,aGk=", Err(MediaError::NotBase64));
        check("data:image/png;base64;x,aGk=", Err(MediaError::NotBase64));
        // 24 base64 characters decode to 18 bytes, over the 16 allowed.
        check("data:;base64,AAAAAAAAAAAAAAAAAAAAAAAA", Err(MediaError::TooLarge { bytes: 18, bytes_max: 16 }));
        check("data:;base64,AAAAAAAAAAAAAAAAAAAAAA==", Ok(&[0; 16]));
    }

    #[test]
    fn media_type_is_the_first_part() {
        assert_eq!(parse("data:image/webp;x=y;base64,", 0).unwrap().media_type, "image/webp");
        assert!(!is_data_url("dätä:"), "multi-byte characters are not a panic");
    }
}
