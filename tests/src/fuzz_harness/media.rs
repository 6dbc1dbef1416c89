//! `media_hash`: bytes as an image (its header, and a `data:` URL of it resolved as an
//! image part), as a URL string, and as a layout of media items hashed over a prompt.

use base64::Engine;
use kvroute_media::{data_url, header, ImageIo, ImagePart, Limits, MediaConfig, PlaceholderRule};
use router_core::{hash_tokens, hash_tokens_with_media, BlockSize, HashSeed, MediaItem, MediaItems};

/// Never panics; refusals are typed and map to 400 or 413, a resolved image has a
/// 64-hex-digit identifier, and hashing a valid layout is deterministic and leaves the
/// blocks before the first item as plain tokens hash them.
pub fn media_hash(data: &[u8]) {
    let cfg = MediaConfig {
        model_id: "m".into(),
        algorithm: kvroute_media::Algorithm::Blake3,
        io: ImageIo::default(),
        rule: PlaceholderRule::Qwen2Vl { patch_size: 14, merge_size: 2, min_pixels: 3136, max_pixels: 1 << 20 },
        limits: Limits { bytes_max: 1 << 16, pixels_max: 1 << 26, items_max: 4 },
    };
    let _ = header::read(data);
    let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(data));
    check_part(&cfg, &url);
    if let Ok(s) = std::str::from_utf8(data) {
        check_part(&cfg, s);
        let _ = data_url::parse(s, 1 << 16);
    }
    layout(data);
}

fn check_part(cfg: &MediaConfig, url: &str) {
    match cfg.resolve(ImagePart { url: Some(url), uuid: None }) {
        Ok(img) => assert_eq!(img.identifier.len(), 64, "a blake3 hex digest"),
        Err(e) => assert!(matches!(e.http_status(), 400 | 413), "{e}"),
    }
}

/// Items from 4-byte groups (offset, length, identifier) over a 256-token prompt.
fn layout(data: &[u8]) {
    let tokens: Vec<u32> = (0..256).map(|t| t % 13).collect();
    let items: Vec<MediaItem> =
        data.chunks_exact(4).take(8).map(|c| MediaItem::new(&c[3..], u32::from(c[0]), u32::from(c[1] % 64))).collect();
    let Ok(media) = MediaItems::new(items, tokens.len(), 8) else { return };
    let bs = BlockSize::new(16).expect("a valid size");
    let (mut a, mut b, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    hash_tokens_with_media(&tokens, bs, HashSeed::DEFAULT, &media, &mut a);
    hash_tokens_with_media(&tokens, bs, HashSeed::DEFAULT, &media, &mut b);
    hash_tokens(&tokens, bs, HashSeed::DEFAULT, &[], &mut plain);
    assert_eq!(a, b);
    let first = media.items().first().map_or(a.len(), |it| it.offset_tokens as usize / 16);
    assert_eq!(a[..first], plain[..first]);
    assert!(a[first..].iter().zip(&plain[first..]).all(|(x, y)| x != y), "from the first image on, no block is text");
}
