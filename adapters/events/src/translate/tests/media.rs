//! Media keys in events hash as the same items in a request: the events side folds
//! vLLM's `[identifier, offset]` pairs, the request side `hash_tokens_with_media`.

use super::*;
use router_core::{hash_tokens_with_media, MediaItem, MediaItems};

/// What a request with `items` (identifier, offset, length) would look up.
fn request(tokens: &[u32], lora: Option<&str>, salt: Option<&str>, items: &[(&str, u32, u32)]) -> Vec<SeqHash> {
    let list = items.iter().map(|&(id, off, len)| MediaItem::new(id.as_bytes(), off, len)).collect();
    let media = MediaItems::new(list, tokens.len(), 8).expect("valid items");
    let mut out = Vec::new();
    hash_tokens_with_media(tokens, BlockSize::new(4).unwrap(), HashSeed::salted(lora, salt), &media, &mut out);
    out.into_iter().map(|b| b.seq).collect()
}

#[test]
fn media_pairs_index_what_a_request_with_the_image_looks_up() {
    let t12 = &TOKENS[..12];
    // An image over tokens 2..9: its offset from each block's start, as vLLM writes it.
    let (b0, b1, b2): (&[K<'_>], &[K<'_>], &[K<'_>]) =
        (&[K::Mm("img-a", 2)], &[K::Mm("img-a", -2)], &[K::Mm("img-a", -6)]);
    let want = request(t12, None, None, &[("img-a", 2, 7)]);
    let t =
        check(None, &[ev(&[1, 2, 3], None, t12, Some(&[Some(b0), Some(b1), Some(b2)]))], std::slice::from_ref(&want));
    assert_eq!((t.stats().media_blocks, t.stats().opaque_blocks), (3, 0));
    // Split over two events, the child continues the chain.
    let (first, rest) = ([Some(b0)], [Some(b1), Some(b2)]);
    let split = [ev(&[1], None, &t12[..4], Some(&first)), ev(&[2, 3], Some(1), &t12[4..], Some(&rest))];
    check(None, &split, &[want[..1].to_vec(), want[1..].to_vec()]);
    // Another image, or none, shares no block with it.
    let other = request(t12, None, None, &[("img-b", 2, 7)]);
    assert!(want.iter().all(|h| !other.contains(h) && !salted(t12, None, None).contains(h)));
}

#[test]
fn media_pairs_sit_between_the_lora_name_and_the_salt() {
    let t12 = &TOKENS[..12];
    // vLLM's order: LoRA name, media pairs, the cache salt (first block only).
    let b0: &[K<'_>] = &[K::S("ad"), K::Mm("x", 1), K::Mm("y", 3), K::S("t")];
    let b1: &[K<'_>] = &[K::S("ad"), K::Mm("y", -1)];
    let b2: &[K<'_>] = &[K::S("ad")];
    let want = request(t12, Some("ad"), Some("t"), &[("x", 1, 2), ("y", 3, 2)]);
    let blocks = [Some(b0), Some(b1), Some(b2)];
    let lora = Ev { lora: Some("ad"), ..ev(&[1, 2, 3], None, t12, Some(&blocks)) };
    check(None, &[lora], &[want]);
    // The salt before a media pair is out of vLLM's order: not reproducible.
    let swapped: &[K<'_>] = &[K::S("t"), K::Mm("x", 1)];
    let t = check(None, &[ev(&[1], None, &t12[..4], Some(&[Some(swapped)]))], &[vec![]]);
    assert_eq!(t.stats().opaque_blocks, 1);
}

#[test]
fn keys_the_router_cannot_reproduce_next_to_media_stay_unmatchable() {
    let t8 = &TOKENS[..8];
    // Media then an embeddings digest in block 1: block 0 is indexed, block 1 is not.
    let b0: &[K<'_>] = &[K::Mm("img-a", 0)];
    let b1: &[K<'_>] = &[K::Mm("img-a", -4), K::B(&[1; 32])];
    let want = request(t8, None, None, &[("img-a", 0, 8)]);
    let t = check(None, &[ev(&[1, 2], None, t8, Some(&[Some(b0), Some(b1)]))], &[want[..1].to_vec()]);
    assert_eq!((t.stats().media_blocks, t.stats().opaque_blocks), (1, 1));
}
