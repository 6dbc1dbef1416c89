//! The identifier vLLM gives a media item: `MultiModalHasher.hash_kwargs` in
//! `vllm/multimodal/hasher.py`, called from `ProcessorInputs.get_mm_hashes` in
//! `vllm/multimodal/processing/inputs.py` as
//! `hash_kwargs(algorithm, model_id=<model>, image=<item>)`.
//!
//! The digest (blake3 by default, sha256 or sha512 by `--mm-hasher-algorithm`) runs
//! over framed chunks, keyword arguments sorted by name (`image` before `model_id`):
//!
//! * a key or leaf chunk is its length as 8 little-endian bytes, then the bytes;
//! * a value is tagged: `0x00` None, `0x01` sequence (then its length as 8 LE bytes),
//!   `0x02` mapping (length, then each framed key and its value), `0x03` leaf;
//! * an image decoded from bytes (`MediaWithBytes`) is the leaf
//!   `iter_item_to_bytes("image", original_bytes)`: the client's encoded bytes, not
//!   pixels. When decoding converted its mode (`image_mode`, "RGB" by default, differs
//!   from the file's), the leaf is instead the mapping
//!   `{"io_config": {"image_mode", "rgba_background_color"}, "data": original_bytes}`;
//! * a string is its UTF-8 bytes, an int (as in the background colour) numpy's int64.
//!
//! The identifier is the digest's lowercase hex. A client's `uuid` for an item stands
//! in for it as is when the request carries no `mm_processor_kwargs` and no
//! `media_io_kwargs` (with those, vLLM hashes them too, and this crate does not follow).
//! With `--enable-tower-connector-lora`, vLLM prefixes `"<lora name>:"`
//! (`_get_mm_identifier` in `vllm/v1/engine/input_processor.py`).

use sha2::Digest as _;

/// The digest vLLM's `--mm-hasher-algorithm` selects.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// BLAKE3, vLLM's default.
    #[default]
    Blake3,
    /// SHA-256.
    Sha256,
    /// SHA-512.
    Sha512,
}

impl Algorithm {
    /// The algorithm vLLM names `name` (`blake3`, `sha256`, `sha512`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "blake3" => Some(Algorithm::Blake3),
            "sha256" => Some(Algorithm::Sha256),
            "sha512" => Some(Algorithm::Sha512),
            _ => None,
        }
    }
}

/// How the engine decodes images (`--media-io-kwargs '{"image": {...}}'`).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ImageIo {
    /// The mode images are converted to; `None` keeps each file's own. Default "RGB".
    pub image_mode: Option<String>,
    /// The background an alpha channel is flattened onto. Default white.
    pub rgba_background: [u8; 3],
}

impl Default for ImageIo {
    fn default() -> Self {
        ImageIo { image_mode: Some("RGB".into()), rgba_background: [255; 3] }
    }
}

/// What stands for one image in its identifier.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ImageItem<'a> {
    /// The client's encoded bytes, and the PIL mode the file decodes to.
    Bytes {
        /// The bytes as sent (decoded from base64).
        bytes: &'a [u8],
        /// The mode PIL opens the file in (`RGB`, `RGBA`, `L`, `P`, ...).
        mode: &'a str,
    },
    /// The client's `uuid` for the item.
    Uuid(&'a str),
}

/// vLLM's identifier for `item` served as `model_id` (the engine's `--model`
/// argument, not the served name), with `algorithm` and the engine's image decoding.
pub fn identifier(algorithm: Algorithm, model_id: &str, item: ImageItem<'_>, io: &ImageIo) -> String {
    let bytes = match item {
        ImageItem::Uuid(uuid) => return uuid.to_owned(),
        ImageItem::Bytes { bytes, .. } => bytes,
    };
    let converted = match (&io.image_mode, item) {
        (Some(target), ImageItem::Bytes { mode, .. }) => target != mode,
        _ => false,
    };
    let mut h = Hasher::new(algorithm);
    h.key(b"image");
    h.tag(TAG_LEAF);
    h.key(b"image");
    if converted {
        h.tag(TAG_MAPPING);
        h.len(2);
        h.key(b"io_config");
        io_config(&mut h, io);
        h.key(b"data");
    }
    h.tag(TAG_LEAF);
    h.key(bytes);
    h.key(b"model_id");
    h.tag(TAG_LEAF);
    h.key(model_id.as_bytes());
    h.hex()
}

/// `{"image_mode": <mode>, "rgba_background_color": (r, g, b)}`, called only when the
/// mode is set.
fn io_config(h: &mut Hasher, io: &ImageIo) {
    h.tag(TAG_MAPPING);
    h.len(2);
    h.key(b"image_mode");
    h.tag(TAG_LEAF);
    h.key(io.image_mode.as_deref().unwrap_or("").as_bytes());
    h.key(b"rgba_background_color");
    h.tag(TAG_SEQUENCE);
    h.len(3);
    for c in io.rgba_background {
        h.tag(TAG_LEAF);
        h.key(&i64::from(c).to_le_bytes());
    }
}

const TAG_SEQUENCE: u8 = 0x01;
const TAG_MAPPING: u8 = 0x02;
const TAG_LEAF: u8 = 0x03;

enum Hasher {
    Blake3(Box<blake3::Hasher>),
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

impl Hasher {
    fn new(a: Algorithm) -> Self {
        match a {
            Algorithm::Blake3 => Hasher::Blake3(Box::new(blake3::Hasher::new())),
            Algorithm::Sha256 => Hasher::Sha256(sha2::Sha256::new()),
            Algorithm::Sha512 => Hasher::Sha512(sha2::Sha512::new()),
        }
    }

    fn update(&mut self, b: &[u8]) {
        match self {
            Hasher::Blake3(h) => {
                h.update(b);
            }
            Hasher::Sha256(h) => h.update(b),
            Hasher::Sha512(h) => h.update(b),
        }
    }

    fn tag(&mut self, t: u8) {
        self.update(&[t]);
    }

    fn len(&mut self, n: usize) {
        self.update(&(n as u64).to_le_bytes());
    }

    /// A framed chunk: its length, then its bytes.
    fn key(&mut self, b: &[u8]) {
        self.len(b.len());
        self.update(b);
    }

    fn hex(self) -> String {
        match self {
            Hasher::Blake3(h) => h.finalize().to_hex().to_string(),
            Hasher::Sha256(h) => hex(&h.finalize()),
            Hasher::Sha512(h) => hex(&h.finalize()),
        }
    }
}

fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(DIGITS[usize::from(x >> 4)] as char);
        s.push(DIGITS[usize::from(x & 15)] as char);
    }
    s
}

#[cfg(test)]
mod tests;
