//! What the engine learns from an image file before its pixels: its size, the mode
//! Pillow opens it in, and the orientation `ImageOps.exif_transpose` applies (vLLM's
//! `normalize_image` in `vllm/multimodal/image.py`), read from PNG, JPEG and WebP
//! headers without decoding the image.
//!
//! The modes follow Pillow's plugins: PNG from the IHDR bit depth and colour type
//! (`PngImagePlugin._MODES`), JPEG from the SOF's component count (1 `L`, 3 `RGB`,
//! 4 `CMYK`; 8-bit only), WebP `RGBA` when the bitstream declares alpha, else `RGB`.
//! The orientation comes from the EXIF orientation tag, or failing that from XMP's
//! `tiff:Orientation`, as `Image.getexif` reads them; an ImageMagick "Raw profile
//! type exif" text chunk is not read.

mod exif;

use crate::MediaError;

/// The image formats read.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Format {
    /// PNG.
    Png,
    /// JPEG (JFIF or EXIF).
    Jpeg,
    /// WebP (lossy, lossless or extended).
    Webp,
}

/// An image's header facts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ImageHeader {
    /// The container format.
    pub format: Format,
    /// Width as stored, in pixels.
    pub width: u32,
    /// Height as stored, in pixels.
    pub height: u32,
    /// The mode Pillow opens the file in (`RGB`, `RGBA`, `L`, `P`, `CMYK`, ...).
    pub mode: &'static str,
    /// The EXIF orientation, 1 to 8 (1 when absent or invalid).
    pub orientation: u8,
}

impl ImageHeader {
    /// Width and height after `exif_transpose`: swapped for orientations 5 to 8.
    pub fn display_size(&self) -> (u32, u32) {
        if (5..=8).contains(&self.orientation) {
            (self.height, self.width)
        } else {
            (self.width, self.height)
        }
    }

    /// Width times height.
    pub fn pixels(&self) -> u64 {
        u64::from(self.width) * u64::from(self.height)
    }
}

/// Reads the header of a PNG, JPEG or WebP file. Work is linear in `bytes.len()` at
/// most (a PNG's or JPEG's segments are walked; no pixel data is decoded).
pub fn read(bytes: &[u8]) -> Result<ImageHeader, MediaError> {
    let h = if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        png(bytes)?
    } else if bytes.starts_with(&[0xff, 0xd8]) {
        jpeg(bytes)?
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        webp(bytes)?
    } else {
        return Err(MediaError::UnknownFormat);
    };
    if h.width == 0 || h.height == 0 {
        return Err(bad("zero width or height"));
    }
    Ok(h)
}

fn bad(why: &'static str) -> MediaError {
    MediaError::UndecodableHeader(why)
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn le24(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at + 3)?;
    Some(u32::from(s[0]) | u32::from(s[1]) << 8 | u32::from(s[2]) << 16)
}

// ---- PNG ----

fn png(b: &[u8]) -> Result<ImageHeader, MediaError> {
    let truncated = || bad("truncated PNG header");
    if b.get(12..16) != Some(b"IHDR") {
        return Err(bad("PNG without IHDR first"));
    }
    let (width, height) = (be32(b, 16).ok_or_else(truncated)?, be32(b, 20).ok_or_else(truncated)?);
    let (depth, colour) = (*b.get(24).ok_or_else(truncated)?, *b.get(25).ok_or_else(truncated)?);
    let mode = png_mode(depth, colour).ok_or(bad("PNG bit depth and colour type Pillow does not open"))?;
    let mut exif_orientation = None;
    let mut xmp_orientation = None;
    let mut at = 8;
    while let (Some(len), Some(kind)) = (be32(b, at), b.get(at + 4..at + 8)) {
        let Some(data) = b.get(at + 8..(at + 8).saturating_add(len as usize)) else { break };
        match kind {
            b"eXIf" if exif_orientation.is_none() => exif_orientation = Some(exif::orientation(data)),
            b"iTXt" if data.starts_with(b"XML:com.adobe.xmp\0") => xmp_orientation = exif::xmp_orientation(data),
            b"IEND" => break,
            _ => {}
        }
        at += 12 + len as usize;
    }
    let orientation = exif::settle(exif_orientation, xmp_orientation);
    Ok(ImageHeader { format: Format::Png, width, height, mode, orientation })
}

fn png_mode(depth: u8, colour: u8) -> Option<&'static str> {
    Some(match (depth, colour) {
        (1, 0) => "1",
        (2 | 4 | 8, 0) => "L",
        (16, 0) => "I;16",
        (8 | 16, 2) => "RGB",
        (1 | 2 | 4 | 8, 3) => "P",
        (8, 4) => "LA",
        (16, 4) | (8 | 16, 6) => "RGBA",
        _ => return None,
    })
}

// ---- JPEG ----

fn jpeg(b: &[u8]) -> Result<ImageHeader, MediaError> {
    let mut at = 2;
    let mut sof = None;
    let mut exif_orientation = None;
    let mut xmp_orientation = None;
    loop {
        // Markers may be padded with any number of 0xff bytes.
        while b.get(at) == Some(&0xff) && b.get(at + 1) == Some(&0xff) {
            at += 1;
        }
        let (Some(0xff), Some(&marker)) = (b.get(at), b.get(at + 1)) else {
            return Err(bad("JPEG segment without a marker"));
        };
        if marker == 0xda || marker == 0xd9 {
            break;
        }
        let len = be16(b, at + 2).ok_or(bad("truncated JPEG segment"))? as usize;
        let seg = b.get(at + 4..at + 2 + len.max(2)).ok_or(bad("truncated JPEG segment"))?;
        match marker {
            0xc0..=0xcf if !matches!(marker, 0xc4 | 0xc8 | 0xcc) => sof = sof.or(Some(seg)),
            0xe1 if seg.starts_with(b"Exif\0\0") && exif_orientation.is_none() => {
                exif_orientation = Some(exif::orientation(&seg[6..]));
            }
            0xe1 if seg.starts_with(b"http://ns.adobe.com/xap/1.0/\0") => xmp_orientation = exif::xmp_orientation(seg),
            _ => {}
        }
        at += 2 + len;
    }
    let sof = sof.ok_or(bad("JPEG without a frame header before its scan"))?;
    let (Some(&bits), Some(height), Some(width), Some(&layers)) = (sof.first(), be16(sof, 1), be16(sof, 3), sof.get(5))
    else {
        return Err(bad("truncated JPEG frame header"));
    };
    if bits != 8 {
        return Err(bad("JPEG of other than 8 bits per sample"));
    }
    let mode = match layers {
        1 => "L",
        3 => "RGB",
        4 => "CMYK",
        _ => return Err(bad("JPEG with other than 1, 3 or 4 components")),
    };
    let orientation = exif::settle(exif_orientation, xmp_orientation);
    Ok(ImageHeader { format: Format::Jpeg, width: width.into(), height: height.into(), mode, orientation })
}

// ---- WebP ----

fn webp(b: &[u8]) -> Result<ImageHeader, MediaError> {
    let truncated = || bad("truncated WebP header");
    let kind = b.get(12..16).ok_or_else(truncated)?;
    let d = b.get(20..).ok_or_else(truncated)?;
    let (width, height, alpha) = match kind {
        b"VP8 " => {
            if d.get(3..6) != Some(&[0x9d, 0x01, 0x2a]) {
                return Err(bad("VP8 frame without its start code"));
            }
            let s = d.get(6..10).ok_or_else(truncated)?;
            let dim = |lo: u8, hi: u8| u32::from(u16::from_le_bytes([lo, hi]) & 0x3fff);
            (dim(s[0], s[1]), dim(s[2], s[3]), false)
        }
        b"VP8L" => {
            if d.first() != Some(&0x2f) {
                return Err(bad("VP8L without its signature"));
            }
            let bits = le32(d, 1).ok_or_else(truncated)?;
            ((bits & 0x3fff) + 1, (bits >> 14 & 0x3fff) + 1, bits >> 28 & 1 == 1)
        }
        b"VP8X" => {
            let flags = *d.first().ok_or_else(truncated)?;
            let w = le24(d, 4).ok_or_else(truncated)? + 1;
            (w, le24(d, 7).ok_or_else(truncated)? + 1, flags & 0x10 != 0)
        }
        _ => return Err(bad("WebP with an unknown first chunk")),
    };
    let mode = if alpha { "RGBA" } else { "RGB" };
    let orientation = webp_orientation(b);
    Ok(ImageHeader { format: Format::Webp, width, height, mode, orientation })
}

/// The orientation from a WebP's `EXIF` chunk, else its `XMP ` chunk.
fn webp_orientation(b: &[u8]) -> u8 {
    let (mut exif_o, mut xmp_o) = (None, None);
    let mut at = 12;
    while let (Some(kind), Some(len)) = (b.get(at..at + 4), le32(b, at + 4)) {
        let Some(data) = b.get(at + 8..(at + 8).saturating_add(len as usize)) else { break };
        match kind {
            b"EXIF" if exif_o.is_none() => exif_o = Some(exif::orientation(data)),
            b"XMP " => xmp_o = exif::xmp_orientation(data),
            _ => {}
        }
        at += 8 + len as usize + (len as usize & 1);
    }
    exif::settle(exif_o, xmp_o)
}

#[cfg(test)]
mod tests;
