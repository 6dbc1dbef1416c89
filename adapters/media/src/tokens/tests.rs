//! Placeholder counts. The Qwen2-VL cases were printed by transformers' own
//! `smart_resize` (5.19, the engine venv's), including its round-half-even ties.

use super::*;
use proptest::prelude::*;
use serde_json::json;

const QWEN_DEFAULT: PlaceholderRule =
    PlaceholderRule::Qwen2Vl { patch_size: 14, merge_size: 2, min_pixels: 3136, max_pixels: 1_003_520 };
const QWEN_SMALL: PlaceholderRule =
    PlaceholderRule::Qwen2Vl { patch_size: 14, merge_size: 2, min_pixels: 3136, max_pixels: 50_176 };

/// `height × width` gives `want` tokens (or the error) under `rule`.
#[track_caller]
fn check(rule: PlaceholderRule, height: u32, width: u32, want: Result<u32, MediaError>) {
    assert_eq!(rule.tokens(width, height), want, "{height}x{width} under {rule:?}");
}

#[test]
fn qwen2vl_counts_match_transformers() {
    let ratio = Err(MediaError::Unprocessable("aspect ratio above 200"));
    for (h, w, default, small) in [
        (1, 1, Ok(4), Ok(4)),
        (42, 42, Ok(4), Ok(4)),
        (70, 70, Ok(4), Ok(4)),
        (14, 28, Ok(6), Ok(6)),
        (28, 5600, Ok(200), Ok(113)),
        (28, 5601, ratio.clone(), ratio),
        (480, 640, Ok(391), Ok(54)),
        (1080, 1920, Ok(1222), Ok(60)),
        (4000, 3000, Ok(1230), Ok(54)),
        (3, 599, Ok(29), Ok(29)),
        (100_000, 1000, Ok(1071), Ok(80)),
    ] {
        check(QWEN_DEFAULT, h, w, default);
        check(QWEN_SMALL, h, w, small);
    }
}

#[test]
fn llava_counts_are_fixed() {
    assert_eq!(PlaceholderRule::llava(336, 14, "default"), Ok(PlaceholderRule::Fixed { tokens: 576 }));
    assert_eq!(PlaceholderRule::llava(336, 14, "full"), Ok(PlaceholderRule::Fixed { tokens: 577 }));
    check(PlaceholderRule::llava(224, 16, "default").unwrap(), 5, 7000, Ok(196));
    assert!(PlaceholderRule::llava(336, 14, "class").is_err());
    assert!(PlaceholderRule::llava(335, 14, "default").is_err());
    assert!(PlaceholderRule::llava(336, 0, "default").is_err());
}

#[test]
fn rules_from_hugging_face_configs() {
    let llava = json!({"model_type": "llava", "vision_config": {"image_size": 336, "patch_size": 14}});
    assert_eq!(PlaceholderRule::from_hf_config(&llava, None), Ok(PlaceholderRule::Fixed { tokens: 576 }));
    let qwen = json!({"model_type": "qwen2_vl", "vision_config": {"patch_size": 14, "spatial_merge_size": 2}});
    assert_eq!(PlaceholderRule::from_hf_config(&qwen, None), Ok(QWEN_DEFAULT));
    // `size` first, then min_pixels / max_pixels override it, as the processor reads them.
    let pre = json!({"size": {"shortest_edge": 100, "longest_edge": 200_000}, "max_pixels": 50_176});
    let want = PlaceholderRule::Qwen2Vl { patch_size: 14, merge_size: 2, min_pixels: 100, max_pixels: 50_176 };
    assert_eq!(PlaceholderRule::from_hf_config(&qwen, Some(&pre)), Ok(want));
    for bad in [
        json!({"model_type": "llama"}),
        json!({"model_type": "llava", "vision_config": {"image_size": 336}}),
        json!({"model_type": "qwen2_vl", "vision_config": {"patch_size": 0, "spatial_merge_size": 2}}),
        json!({"model_type": "llava", "vision_config": {"image_size": -1, "patch_size": 14}}),
    ] {
        assert!(matches!(PlaceholderRule::from_hf_config(&bad, None), Err(MediaError::Config(_))), "{bad}");
    }
    let bad_pre = json!({"max_pixels": "many"});
    assert!(PlaceholderRule::from_hf_config(&qwen, Some(&bad_pre)).is_err());
}

/// The expanded tokens and spans, or the error.
type Want<'a> = Result<(&'a [u32], &'a [(u32, u32)]), MediaError>;

#[track_caller]
fn check_expand(prompt: &[u32], counts: &[u32], want: Want<'_>) {
    let got = expand_placeholders(prompt, 9, counts, 12);
    let want = want.map(|(t, s)| Placed { tokens: t.to_vec(), spans: s.to_vec() });
    assert_eq!(got, want, "{prompt:?} {counts:?}");
}

#[test]
fn placeholders_expand_in_order() {
    check_expand(&[1, 9, 2], &[3], Ok((&[1, 9, 9, 9, 2], &[(1, 3)])));
    check_expand(&[9, 1, 9], &[2, 1], Ok((&[9, 9, 1, 9], &[(0, 2), (3, 1)])));
    check_expand(&[1, 2], &[], Ok((&[1, 2], &[])));
    check_expand(&[1, 9, 2], &[], Err(MediaError::PlaceholderCount { found: 1, items: 0 }));
    check_expand(&[1, 2], &[4], Err(MediaError::PlaceholderCount { found: 0, items: 1 }));
    check_expand(&[1, 9], &[12], Err(MediaError::PromptTooLong { tokens: 13, tokens_max: 12 }));
    let huge = expand_placeholders(&[9, 9], 9, &[u32::MAX, u32::MAX], usize::MAX);
    assert!(matches!(huge, Err(MediaError::PromptTooLong { .. })));
}

proptest! {
    #[test]
    fn any_size_gives_a_count_or_an_error(w in 0u32.., h in 0u32.., min in 0u64..1 << 40, max in 1u64..1 << 40) {
        let rule = PlaceholderRule::Qwen2Vl { patch_size: 14, merge_size: 2, min_pixels: min, max_pixels: max };
        let _ = rule.tokens(w, h);
    }

    #[test]
    fn expanded_spans_hold_the_placeholders(prompt in prop::collection::vec(0u32..12, 0..40), seed in 0u32..9) {
        let found = prompt.iter().filter(|&&t| t == 9).count();
        let counts: Vec<u32> = (0..found as u32).map(|i| (i * 7 + seed) % 5 + 1).collect();
        let Placed { tokens, spans } = expand_placeholders(&prompt, 9, &counts, 1000).unwrap();
        prop_assert_eq!(tokens.len(), prompt.len() - found + counts.iter().sum::<u32>() as usize);
        for (&(off, len), &n) in spans.iter().zip(&counts) {
            prop_assert_eq!(len, n);
            prop_assert!(tokens[off as usize..(off + len) as usize].iter().all(|&t| t == 9));
        }
    }
}
