//! Why a media item was refused.

use std::fmt;

/// Why a media item of a request could not be read. Each maps to a client error: an
/// over-size item to 413, everything else to 400.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum MediaError {
    /// The URL does not start with `data:` (other schemes are the caller's business).
    NotDataUrl,
    /// A `data:` URL without the `,` between its header and its data.
    MissingComma,
    /// A `data:` URL whose header does not end in `;base64` (vLLM reads no other).
    NotBase64,
    /// The data is not strict, padded, standard-alphabet base64.
    BadBase64,
    /// The encoded or decoded item is larger than allowed.
    TooLarge {
        /// Its size (or a lower bound), in bytes.
        bytes: usize,
        /// The limit, in bytes.
        bytes_max: usize,
    },
    /// The image has more pixels than allowed.
    TooManyPixels {
        /// Its width times height.
        pixels: u64,
        /// The limit.
        pixels_max: u64,
    },
    /// The bytes are not PNG, JPEG or WebP. The engine may still open them (GIF, BMP,
    /// TIFF ...), so a proxy may forward such a request unmatched instead of refusing it.
    UnknownFormat,
    /// A PNG, JPEG or WebP header that cannot be read (truncated, or a variant Pillow
    /// does not open either).
    UndecodableHeader(&'static str),
    /// The request carries more media items than allowed.
    TooManyItems {
        /// Items in the request.
        items: usize,
        /// The limit.
        items_max: usize,
    },
    /// The prompt holds another number of placeholder tokens than there are items.
    PlaceholderCount {
        /// Placeholder tokens found in the prompt.
        found: usize,
        /// Items given.
        items: usize,
    },
    /// The expanded prompt would be longer than allowed.
    PromptTooLong {
        /// Tokens it would hold.
        tokens: u64,
        /// The limit.
        tokens_max: usize,
    },
    /// The model's processor refuses the image (as transformers does an aspect ratio
    /// above 200).
    Unprocessable(&'static str),
    /// The core refused the items (an empty placeholder span).
    Items(router_core::MediaError),
    /// A model's processor configuration lacks a field or holds a bad value.
    Config(&'static str),
}

impl MediaError {
    /// The HTTP status a proxy answers with: 413 for an over-size item, else 400.
    pub fn http_status(&self) -> u16 {
        match self {
            MediaError::TooLarge { .. } | MediaError::TooManyPixels { .. } => 413,
            _ => 400,
        }
    }
}

impl fmt::Display for MediaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MediaError::NotDataUrl => f.write_str("not a data: URL"),
            MediaError::MissingComma => f.write_str("malformed data: URL: no ',' before the data"),
            MediaError::NotBase64 => f.write_str("malformed data: URL: only ';base64' data is accepted"),
            MediaError::BadBase64 => f.write_str("malformed data: URL: the data is not valid base64"),
            MediaError::TooLarge { bytes, bytes_max } => {
                write!(f, "media item of {bytes} bytes is larger than the {bytes_max} allowed")
            }
            MediaError::TooManyPixels { pixels, pixels_max } => {
                write!(f, "image of {pixels} pixels is larger than the {pixels_max} allowed")
            }
            MediaError::UnknownFormat => f.write_str("the image is not PNG, JPEG or WebP"),
            MediaError::UndecodableHeader(why) => write!(f, "undecodable image header: {why}"),
            MediaError::TooManyItems { items, items_max } => {
                write!(f, "{items} media items, more than the {items_max} allowed")
            }
            MediaError::PlaceholderCount { found, items } => {
                write!(f, "the prompt holds {found} image placeholders for {items} images")
            }
            MediaError::PromptTooLong { tokens, tokens_max } => {
                write!(f, "the prompt with its images would be {tokens} tokens, more than the {tokens_max} allowed")
            }
            MediaError::Unprocessable(why) => write!(f, "the model's processor refuses the image: {why}"),
            MediaError::Items(e) => write!(f, "media items: {e}"),
            MediaError::Config(why) => write!(f, "processor configuration: {why}"),
        }
    }
}

impl std::error::Error for MediaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            MediaError::Items(e) => Some(e),
            _ => None,
        }
    }
}
