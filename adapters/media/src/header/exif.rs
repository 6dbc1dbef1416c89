//! The orientation tag, as Pillow's `Image.getexif` finds it: EXIF's tag 0x0112 in the
//! first IFD of a TIFF structure, and only when EXIF has none, the first digit after
//! `tiff:Orientation="` or `tiff:Orientation>` in XMP.

/// The orientation tag's value in `tiff` (optionally behind `Exif\0\0`): `Some` when
/// the tag is present, whatever its value; `None` when absent or unreadable.
pub(super) fn orientation(tiff: &[u8]) -> Option<u16> {
    let t = tiff.strip_prefix(b"Exif\0\0").unwrap_or(tiff);
    let le = match t.get(..4)? {
        b"II*\0" => true,
        b"MM\0*" => false,
        _ => return None,
    };
    let u16_at = |at: usize| -> Option<u16> {
        let b: [u8; 2] = t.get(at..at + 2)?.try_into().ok()?;
        Some(if le { u16::from_le_bytes(b) } else { u16::from_be_bytes(b) })
    };
    let u32_at = |at: usize| -> Option<u32> {
        let b: [u8; 4] = t.get(at..at + 4)?.try_into().ok()?;
        Some(if le { u32::from_le_bytes(b) } else { u32::from_be_bytes(b) })
    };
    let ifd = u32_at(4)? as usize;
    let count = usize::from(u16_at(ifd)?);
    (0..count).find_map(|i| {
        let e = ifd + 2 + 12 * i;
        // A SHORT (type 3) with its value in the entry's first two value bytes.
        (u16_at(e)? == 0x0112 && u16_at(e + 2)? == 3).then(|| u16_at(e + 8)).flatten()
    })
}

/// The orientation digit in an XMP packet, if any.
pub(super) fn xmp_orientation(xmp: &[u8]) -> Option<u16> {
    const KEY: &[u8] = b"tiff:Orientation";
    let mut rest = xmp;
    while let Some(i) = rest.windows(KEY.len()).position(|w| w == KEY) {
        let after = &rest[i + KEY.len()..];
        let digit = match after {
            [b'=', b'"', d, ..] | [b'>', d, ..] if d.is_ascii_digit() => Some(d),
            _ => None,
        };
        if let Some(d) = digit {
            return Some(u16::from(d - b'0'));
        }
        rest = after;
    }
    None
}

/// The orientation `exif_transpose` acts on: EXIF's tag if present, else XMP's; a
/// value outside 1 to 8 acts as 1.
pub(super) fn settle(exif: Option<Option<u16>>, xmp: Option<u16>) -> u8 {
    match exif.flatten().or(xmp) {
        Some(v @ 1..=8) => v as u8,
        _ => 1,
    }
}
