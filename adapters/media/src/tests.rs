//! Image parts end to end: what a proxy gets back for good and bad input.

use super::*;
use base64::Engine;
use proptest::prelude::*;

fn image(name: &str) -> Vec<u8> {
    std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/images").join(name)).unwrap()
}

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn url(u: &str) -> ImagePart<'_> {
    ImagePart { url: Some(u), uuid: None }
}

fn config(rule: PlaceholderRule, limits: Limits) -> MediaConfig {
    MediaConfig { model_id: "m".into(), algorithm: Algorithm::Blake3, io: ImageIo::default(), rule, limits }
}

const QWEN: PlaceholderRule =
    PlaceholderRule::Qwen2Vl { patch_size: 14, merge_size: 2, min_pixels: 3136, max_pixels: 50_176 };

/// `part` under `limits` resolves to `want`: tokens and whether the identifier is the
/// uuid, or the error with its HTTP status.
#[track_caller]
fn check(part: ImagePart<'_>, rule: PlaceholderRule, limits: Limits, want: Result<u32, (MediaError, u16)>) {
    let got = config(rule, limits).resolve(part);
    match (got, want) {
        (Ok(img), Ok(tokens)) => {
            assert_eq!(img.tokens, tokens);
            if let Some(uuid) = part.uuid {
                assert_eq!(img.identifier, uuid);
            }
        }
        (Err(e), Err((want, status))) => assert_eq!((e.http_status(), e), (status, want)),
        (got, want) => panic!("got {got:?}, want {want:?}"),
    }
}

#[test]
fn image_parts() {
    let jpg = data_url(&image("rgb.jpg"));
    let d = Limits::default();
    check(url(&jpg), QWEN, d, Ok(54));
    check(ImagePart { url: Some(&jpg), uuid: Some("u-1") }, QWEN, d, Ok(54));
    check(ImagePart { url: None, uuid: Some("u-1") }, PlaceholderRule::Fixed { tokens: 7 }, d, Ok(7));
    let unknown = MediaError::Unprocessable("an image given only by uuid has no known size");
    check(ImagePart { url: None, uuid: Some("u-1") }, QWEN, d, Err((unknown, 400)));
    check(ImagePart::default(), QWEN, d, Err((MediaError::NotDataUrl, 400)));
    check(url("https://example.invalid/a.png"), QWEN, d, Err((MediaError::NotDataUrl, 400)));
    check(url("data:image/png;base64,@@@@"), QWEN, d, Err((MediaError::BadBase64, 400)));
    check(url(&data_url(b"GIF89a....")), QWEN, d, Err((MediaError::UnknownFormat, 400)));
    let header = MediaError::UndecodableHeader("truncated PNG header");
    check(url(&data_url(b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR\0")), QWEN, d, Err((header, 400)));
    let small = Limits { bytes_max: 1000, ..d };
    check(url(&jpg), QWEN, small, Err((MediaError::TooLarge { bytes: 20071, bytes_max: 1000 }, 413)));
    let few = Limits { pixels_max: 1000, ..d };
    check(url(&jpg), QWEN, few, Err((MediaError::TooManyPixels { pixels: 307_200, pixels_max: 1000 }, 413)));
}

#[test]
fn too_many_items_are_refused_before_any_is_read() {
    let cfg = config(QWEN, Limits { items_max: 2, ..Limits::default() });
    let parts = [ImagePart { url: Some("data:bad"), uuid: None }; 3];
    assert_eq!(cfg.resolve_all(&parts), Err(MediaError::TooManyItems { items: 3, items_max: 2 }));
    assert_eq!(cfg.resolve_all(&parts[..2]), Err(MediaError::MissingComma));
}

#[test]
fn an_expanded_request_shares_blocks_only_with_the_same_image() {
    use router_core::{hash_tokens_with_media, BlockSize, HashSeed};
    let cfg = config(QWEN, Limits::default());
    let prompt: Vec<u32> = [1, 2, 3, 4, 5, 9].into_iter().chain(10..40).collect();
    let hashes = |file: &str| {
        let img = cfg.resolve_all(&[ImagePart { url: Some(&data_url(&image(file))), uuid: None }]).unwrap();
        let x = expand(&prompt, 9, &img, 4096).unwrap();
        let mut out = Vec::new();
        hash_tokens_with_media(&x.tokens, BlockSize::new(4).unwrap(), HashSeed::DEFAULT, &x.media, &mut out);
        (x, out)
    };
    let (a, ha) = hashes("rgb.jpg");
    assert_eq!((a.tokens.len(), a.media.items()[0].offset_tokens, a.media.items()[0].len_tokens), (89, 5, 54));
    let (_, ha2) = hashes("rgb.jpg");
    let (_, hb) = hashes("progressive.jpg");
    assert_eq!(ha, ha2);
    // Blocks 0 (tokens 0..4) is text only; block 1 holds the image's first token.
    assert_eq!(ha[0], hb[0]);
    assert!(ha[1..].iter().zip(&hb[1..]).all(|(x, y)| x != y));
}

proptest! {
    #[test]
    fn arbitrary_urls_never_panic(s in ".{0,80}", b in prop::collection::vec(any::<u8>(), 0..300)) {
        let cfg = config(QWEN, Limits { bytes_max: 256, ..Limits::default() });
        let _ = cfg.resolve(ImagePart { url: Some(&s), uuid: None });
        let _ = cfg.resolve(ImagePart { url: Some(&format!("data:;base64,{s}")), uuid: None });
        let _ = cfg.resolve(ImagePart { url: Some(&data_url(&b)), uuid: None });
    }
}
