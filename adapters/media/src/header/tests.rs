//! Header reading on hand-made and arbitrary bytes (the committed images are checked
//! against Pillow's answers in `tests/it/fixtures.rs`).

use super::*;
use proptest::prelude::*;

fn png(depth: u8, colour: u8, width: u32, height: u32) -> Vec<u8> {
    let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    b.extend_from_slice(&width.to_be_bytes());
    b.extend_from_slice(&height.to_be_bytes());
    b.extend_from_slice(&[depth, colour, 0, 0, 0, 0, 0, 0, 0]);
    b
}

/// A JPEG with one SOF0 of `bits`, `height`, `width`, `layers`.
fn jpeg(bits: u8, height: u16, width: u16, layers: u8) -> Vec<u8> {
    let mut b = vec![0xff, 0xd8, 0xff, 0xc0, 0, 8, bits];
    b.extend_from_slice(&height.to_be_bytes());
    b.extend_from_slice(&width.to_be_bytes());
    b.extend_from_slice(&[layers, 0xff, 0xda]);
    b
}

#[track_caller]
fn check(bytes: &[u8], want: Result<(u32, u32, &str, u8), &'static str>) {
    let got = read(bytes).map(|h| (h.width, h.height, h.mode, h.orientation));
    assert_eq!(got, want.map_err(MediaError::UndecodableHeader));
}

#[test]
fn hand_made_headers() {
    check(&png(8, 2, 3, 4), Ok((3, 4, "RGB", 1)));
    check(&png(16, 4, 3, 4), Ok((3, 4, "RGBA", 1)));
    check(&png(1, 0, 3, 4), Ok((3, 4, "1", 1)));
    check(&png(4, 3, 3, 4), Ok((3, 4, "P", 1)));
    check(&png(16, 3, 3, 4), Err("PNG bit depth and colour type Pillow does not open"));
    check(&png(8, 2, 0, 4), Err("zero width or height"));
    check(&png(8, 2, 3, 4)[..20], Err("truncated PNG header"));
    check(&jpeg(8, 5, 6, 3), Ok((6, 5, "RGB", 1)));
    check(&jpeg(8, 5, 6, 4), Ok((6, 5, "CMYK", 1)));
    check(&jpeg(12, 5, 6, 3), Err("JPEG of other than 8 bits per sample"));
    check(&jpeg(8, 5, 6, 2), Err("JPEG with other than 1, 3 or 4 components"));
    check(&[0xff, 0xd8, 0xff, 0xda], Err("JPEG without a frame header before its scan"));
    check(&[0xff, 0xd8, 0x00], Err("JPEG segment without a marker"));
    check(b"RIFF\0\0\0\0WEBPVP8X", Err("truncated WebP header"));
    assert_eq!(read(b"GIF89a"), Err(MediaError::UnknownFormat));
    assert_eq!(read(b""), Err(MediaError::UnknownFormat));
}

#[test]
fn orientation_from_exif_then_xmp() {
    // Big-endian TIFF, one IFD entry: orientation (0x0112), SHORT, count 1, value 6.
    let tiff = b"MM\0*\0\0\0\x08\0\x01\x01\x12\0\x03\0\0\0\x01\0\x06\0\0";
    assert_eq!(exif::orientation(tiff), Some(6));
    assert_eq!(exif::orientation(&[b"Exif\0\0".as_slice(), tiff].concat()), Some(6));
    assert_eq!(exif::orientation(&tiff[..15]), None, "truncated");
    assert_eq!(exif::xmp_orientation(b"<x tiff:Orientation=\"8\"/>"), Some(8));
    assert_eq!(exif::xmp_orientation(b"<tiff:Orientation>3</tiff:Orientation>"), Some(3));
    assert_eq!(exif::xmp_orientation(b"tiff:Orientation=x tiff:Orientation=\"5\""), Some(5));
    // EXIF wins even with a value that means nothing; XMP only fills in for none.
    assert_eq!(exif::settle(Some(Some(9)), Some(6)), 1);
    assert_eq!(exif::settle(Some(None), Some(6)), 6);
    assert_eq!(exif::settle(None, None), 1);
    let mut jpeg_exif = vec![0xff, 0xd8, 0xff, 0xe1, 0, (2 + 6 + tiff.len()) as u8];
    jpeg_exif.extend_from_slice(b"Exif\0\0");
    jpeg_exif.extend_from_slice(tiff);
    jpeg_exif.extend_from_slice(&jpeg(8, 5, 6, 3)[2..]);
    let h = read(&jpeg_exif).unwrap();
    assert_eq!((h.orientation, h.display_size()), (6, (5, 6)));
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = read(&b);
        for prefix in [&b"\x89PNG\r\n\x1a\n"[..], &[0xff, 0xd8], b"RIFF\0\0\0\0WEBPVP8 ", b"RIFF\0\0\0\0WEBPVP8X"] {
            let _ = read(&[prefix, &b].concat());
        }
        let _ = exif::orientation(&b);
        let _ = exif::xmp_orientation(&b);
    }

    #[test]
    fn every_prefix_of_a_real_image_is_an_answer_or_an_error(cut in 0usize..5000) {
        for name in ["rgb.jpg", "rotated.webp", "rotated.png", "alpha.webp"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/images").join(name);
            let b = std::fs::read(path).unwrap();
            let _ = read(&b[..cut.min(b.len())]);
        }
    }
}
