use base64::Engine as _;
use kvroute_media::{Limits, PlaceholderRule};
use serde_json::json;

use super::*;

const PNG: &[u8] = include_bytes!("../../../media/tests/images/rgb.png");
const RGBA: &[u8] = include_bytes!("../../../media/tests/images/rgba.png");
const IMAGE: u32 = 7;

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn llava(limits: Limits) -> SimMedia {
    let config = MediaConfig {
        model_id: "m".into(),
        algorithm: Default::default(),
        io: Default::default(),
        rule: PlaceholderRule::Fixed { tokens: 5 },
        limits,
    };
    SimMedia { config, token_id: IMAGE }
}

fn chat(parts: Value) -> Value {
    json!({"messages": [{"role": "user", "content": parts}]})
}

fn img(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// Per block, its `(identifier, offset)` keys.
type Keys = Vec<Vec<(String, i64)>>;

/// What [`place`] makes of `ids` and `body`: the expanded ids and, per block of 4
/// tokens, its keys; or the error's status.
#[track_caller]
fn check(limits: Limits, ids: &[u32], body: Value, want: Result<(Vec<u32>, Keys), u16>) {
    let got = place(&llava(limits), ids.to_vec(), &body).map(|(ids, media)| {
        let blocks = (0..ids.len() as u64 / 4).map(|b| {
            let mut keys = Vec::new();
            if let Some(m) = &media {
                m.block_keys(b * 4, b * 4 + 4, &mut keys);
            }
            keys.into_iter().map(|(id, off)| (id.to_string(), off)).collect()
        });
        (ids.clone(), blocks.collect())
    });
    assert_eq!(got.map_err(|e| e.status.as_u16()), want);
}

fn id_of(bytes: &[u8]) -> String {
    llava(Limits::default()).config.resolve_bytes(bytes, None).unwrap().identifier
}

#[test]
fn images_expand_and_key_the_blocks_they_touch() {
    let (a, b) = (id_of(PNG), id_of(RGBA));
    assert_ne!(a, b);
    let d = Limits::default();
    let body = chat(json!([img(&data_url(PNG)), {"type": "text", "text": "x"}, {"image_url": data_url(RGBA)}]));
    let ids = vec![1, IMAGE, 2, IMAGE, 3];
    let want_ids = vec![1, 7, 7, 7, 7, 7, 2, 7, 7, 7, 7, 7, 3];
    let k = |id: &String, off: i64| (id.clone(), off);
    let blocks = vec![vec![k(&a, 1)], vec![k(&a, -3), k(&b, 3)], vec![k(&b, -1)]];
    check(d, &ids, body, Ok((want_ids, blocks)));
    check(d, &[1, 2, 3, 4, 5], chat(json!("text only")), Ok((vec![1, 2, 3, 4, 5], vec![vec![]])));
    let uuid = chat(json!([{"type": "image_url", "uuid": "pic"}]));
    check(
        d,
        &[IMAGE, 1, 2, 3],
        uuid,
        Ok((vec![7, 7, 7, 7, 7, 1, 2, 3], vec![vec![k(&"pic".into(), 0)], vec![k(&"pic".into(), -4)]])),
    );
}

#[test]
fn bad_images_are_client_errors() {
    let d = Limits::default();
    let one = [1, IMAGE, 2];
    check(d, &one, chat(json!([img("data:image/png;base64,!!!!")])), Err(400));
    check(d, &one, chat(json!([img("data:image/png;base64,aGVsbG8=")])), Err(400));
    check(d, &one, chat(json!([img("https://example.com/a.png")])), Err(400));
    check(d, &one, chat(json!([{"type": "image_url"}])), Err(400));
    check(d, &one, chat(json!([{"type": "image_url", "uuid": true}])), Err(400));
    check(d, &[1, 2], chat(json!([img(&data_url(PNG))])), Err(400));
    check(Limits { bytes_max: 64, ..d }, &one, chat(json!([img(&data_url(PNG))])), Err(413));
    let two = chat(json!([img(&data_url(PNG)), img(&data_url(PNG))]));
    check(Limits { items_max: 1, ..d }, &[IMAGE, IMAGE], two, Err(400));
}
