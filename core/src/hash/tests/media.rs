//! Per-block media keys: which items each block carries, and at which offset, compared
//! with a line-by-line port of vLLM's `_gen_mm_extra_hash_keys` loop.

use super::*;
use alloc::vec;
use alloc::vec::Vec;
use proptest::prelude::*;

/// vLLM's loop, ported as written (`curr_mm_idx` carried from block to block): the
/// `(item key, offset relative to the block)` pairs of each full block.
fn vllm_keys(items: &[MediaItem], prompt_tokens: usize, bs: usize) -> Vec<Vec<(u64, i64)>> {
    let mut out = Vec::new();
    let mut curr = 0;
    for b in 0..prompt_tokens / bs {
        let (start, end) = ((b * bs) as i64, ((b + 1) * bs) as i64);
        let mut keys = Vec::new();
        let last = items.last().map(|l| i64::from(l.offset_tokens) + i64::from(l.len_tokens));
        if last.is_some_and(|l| l > start) {
            while curr < items.len() {
                let (off, len) = (i64::from(items[curr].offset_tokens), i64::from(items[curr].len_tokens));
                if end <= off {
                    break;
                }
                if start >= off + len {
                    curr += 1;
                    continue;
                }
                keys.push((items[curr].key.0, off - start));
                if end >= off + len {
                    curr += 1;
                } else {
                    break;
                }
            }
        }
        out.push(keys);
    }
    out
}

/// The router's extra keys of each full block, as `(item key, offset)` pairs.
fn router_keys(media: &MediaItems, prompt_tokens: usize, bs: usize) -> Vec<Vec<(u64, i64)>> {
    (0..prompt_tokens / bs)
        .map(|b| {
            let mut words = Vec::new();
            media.block_extra_keys((b * bs) as u64, ((b + 1) * bs) as u64, &mut words);
            words.chunks_exact(2).map(|w| (w[0], w[1] as i64)).collect()
        })
        .collect()
}

/// Items named by identifier; checks each block's `(identifier, offset)` keys against
/// `want` and against vLLM's loop.
#[track_caller]
fn check(bs: usize, prompt_tokens: usize, items: &[(&str, u32, u32)], want: &[&[(&str, i64)]]) {
    let list = items.iter().map(|&(id, off, len)| MediaItem::new(id.as_bytes(), off, len)).collect();
    let media = MediaItems::new(list, prompt_tokens, 16).expect("valid items");
    let got = router_keys(&media, prompt_tokens, bs);
    let name = |k: u64| items.iter().find(|i| MediaKey::of(i.0.as_bytes()).0 == k).map_or("?", |i| i.0);
    let named: Vec<Vec<(&str, i64)>> = got.iter().map(|blk| blk.iter().map(|&(k, o)| (name(k), o)).collect()).collect();
    let want: Vec<Vec<(&str, i64)>> = want.iter().map(|b| b.to_vec()).collect();
    assert_eq!(named, want, "router keys");
    assert_eq!(got, vllm_keys(media.items(), prompt_tokens, bs), "against vLLM's loop");
}

#[test]
fn block_keys() {
    // One image inside block 0 only.
    check(8, 16, &[("a", 2, 4)], &[&[("a", 2)], &[]]);
    // One image across three blocks: its offset goes negative after the first.
    check(4, 12, &[("a", 2, 8)], &[&[("a", 2)], &[("a", -2)], &[("a", -6)]]);
    // Starting exactly on a boundary, ending exactly on one: the next block is clear.
    check(4, 12, &[("a", 4, 4)], &[&[], &[("a", 0)], &[]]);
    // Two images in one block, given out of order: prompt order wins.
    check(8, 8, &[("b", 5, 2), ("a", 1, 3)], &[&[("a", 1), ("b", 5)]]);
    // The same image twice at different positions: two keys with their own offsets.
    check(4, 8, &[("a", 0, 2), ("a", 3, 3)], &[&[("a", 0), ("a", 3)], &[("a", -1)]]);
    // An image in the trailing partial block touches no full block.
    check(4, 10, &[("a", 8, 2)], &[&[], &[]]);
}

#[track_caller]
fn check_err(prompt_tokens: usize, items_max: usize, items: &[(u32, u32)], want: MediaError) {
    let list = items.iter().map(|&(off, len)| MediaItem::new(b"x", off, len)).collect();
    assert_eq!(MediaItems::new(list, prompt_tokens, items_max), Err(want));
}

#[test]
fn refused_items() {
    check_err(100, 2, &[(0, 1), (1, 1), (2, 1)], MediaError::TooMany { items: 3, items_max: 2 });
    let many = vec![(0, 1); MEDIA_ITEMS_MAX + 1];
    check_err(100, usize::MAX, &many, MediaError::TooMany { items: MEDIA_ITEMS_MAX + 1, items_max: MEDIA_ITEMS_MAX });
    check_err(100, 4, &[(0, 1), (5, 0)], MediaError::EmptySpan { index: 1 });
    check_err(10, 4, &[(8, 3)], MediaError::OutOfRange { index: 0, end_tokens: 11, prompt_tokens: 10 });
    check_err(
        10,
        4,
        &[(u32::MAX, u32::MAX)],
        MediaError::OutOfRange { index: 0, end_tokens: 2 * u64::from(u32::MAX), prompt_tokens: 10 },
    );
    check_err(100, 4, &[(10, 5), (0, 3), (12, 1)], MediaError::Overlap { index: 2 });
}

#[test]
fn no_media_hashes_as_plain_tokens() {
    let tokens: Vec<u32> = (0..40).collect();
    let bs = BlockSize::new(8).unwrap();
    let seed = HashSeed::salted(Some("l"), Some("s"));
    let (mut a, mut b) = (Vec::new(), Vec::new());
    hash_tokens_with_media(&tokens, bs, seed, &MediaItems::none(), &mut a);
    hash_tokens(&tokens, bs, seed, &[], &mut b);
    assert_eq!(a, b);
}

#[test]
fn a_media_key_is_two_words_after_the_tokens() {
    // The fold is part of the wire between requests and events: pin it.
    let key = MediaKey::of(b"abc");
    assert_eq!(key.extra_keys(-2), [key.0, u64::MAX - 1]);
    let media = MediaItems::new(vec![MediaItem::new(b"abc", 1, 2)], 4, 1).unwrap();
    let mut out = Vec::new();
    hash_tokens_with_media(&[9, 8, 7, 6], BlockSize::new(4).unwrap(), HashSeed::DEFAULT, &media, &mut out);
    assert_eq!(out[0].local, local_hash(&[9, 8, 7, 6], &[key.0, 1], HashSeed::DEFAULT));
}

/// Sorted, non-overlapping items from (gap, length, identifier) triples.
fn layout(parts: &[(u32, u32, u8)]) -> (Vec<MediaItem>, usize) {
    let mut at = 0u32;
    let mut items = Vec::new();
    for &(gap, len, id) in parts {
        at += gap;
        items.push(MediaItem::new(&[id], at, len));
        at += len;
    }
    (items, at as usize + 7)
}

fn parts() -> impl Strategy<Value = Vec<(u32, u32, u8)>> {
    prop::collection::vec((0u32..20, 1u32..20, 0u8..4), 0..6)
}

fn hashes(tokens: &[u32], bs: BlockSize, media: &MediaItems) -> Vec<BlockHash> {
    let mut out = Vec::new();
    hash_tokens_with_media(tokens, bs, HashSeed::DEFAULT, media, &mut out);
    out
}

proptest! {
    #[test]
    fn keys_follow_vllms_loop(p in parts(), shift in 0u32..3) {
        let bs = 1usize << shift.min(3);
        let (items, n) = layout(&p);
        let media = MediaItems::new(items.clone(), n, 16).unwrap();
        prop_assert_eq!(router_keys(&media, n, bs), vllm_keys(&items, n, bs));
    }

    #[test]
    fn a_shared_image_shares_blocks_and_another_diverges_where_it_starts(
        before in 0usize..40, len in 1u32..30, after in 0usize..40, bs_shift in 0u32..4,
    ) {
        let bs = BlockSize::new(1 << bs_shift).unwrap();
        let n = before + len as usize + after;
        let tokens: Vec<u32> = (0..n as u32).map(|t| t % 7).collect();
        let item = |id: &[u8]| MediaItems::new(vec![MediaItem::new(id, before as u32, len)], n, 1).unwrap();
        let (a, a2, b) = (hashes(&tokens, bs, &item(b"cat")), hashes(&tokens, bs, &item(b"cat")), hashes(&tokens, bs, &item(b"dog")));
        let text = hashes(&tokens, bs, &MediaItems::none());
        prop_assert_eq!(&a, &a2);
        let first = before / bs.tokens() as usize;
        for i in 0..a.len() {
            prop_assert_eq!(a[i] == b[i], i < first, "block {} against another image", i);
            prop_assert_eq!(a[i] == text[i], i < first, "block {} against text only", i);
        }
    }
}
