use base64::Engine as _;
use serde_json::json;

use super::*;

const PNG: &[u8] = include_bytes!("../../../media/tests/images/rgb.png");

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn llava(section: &MediaSection) -> ChatMedia {
    let model =
        ImageModel { rule: kvroute_media::PlaceholderRule::Fixed { tokens: 5 }, token_id: 7, prompt_text: "<image>" };
    ChatMedia::new(&model, "m", section)
}

fn chat(parts: Value) -> Value {
    json!({"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]})
}

/// The body's images resolve to `want`: each image's token count, or the error's
/// status and code.
#[track_caller]
fn check(section: &MediaSection, body: Value, want: Result<Vec<u32>, (u16, &str)>) {
    let media = llava(section);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let got = rt.block_on(fetch_all(&media, &body)).and_then(|fetched| resolve(&media, &body, &fetched));
    match (got, want) {
        (Ok(images), Ok(tokens)) => assert_eq!(images.iter().map(|i| i.tokens).collect::<Vec<_>>(), tokens),
        (Err(e), Err((status, code))) => assert_eq!((e.status.as_u16(), e.code), (status, code), "{}", e.message),
        (got, want) => panic!("got {got:?}, want {want:?}"),
    }
}

#[test]
fn image_parts_resolve_or_are_refused() {
    let d = MediaSection::default();
    let png = data_url(PNG);
    let img = |url: &str| json!({"type": "image_url", "image_url": {"url": url}});
    check(&d, chat(json!("no images")), Ok(vec![]));
    check(&d, chat(json!([{"type": "text", "text": "a"}, img(&png), {"image_url": png}])), Ok(vec![5, 5]));
    check(&d, chat(json!([{"type": "image_url", "uuid": "pic-1"}])), Ok(vec![5]));
    check(&d, chat(json!([{"type": "image_url", "image_url": {"url": png}, "uuid": 42}])), Ok(vec![5]));
    check(&d, chat(json!([{"type": "image_url", "uuid": true}])), Err((400, "invalid_request")));
    check(&d, chat(json!([{"type": "image_url"}])), Err((400, "invalid_request")));
    check(&d, chat(json!([img("data:image/png;base64,!!!!")])), Err((400, "invalid_image")));
    check(&d, chat(json!([img("data:image/png;base64,aGVsbG8=")])), Err((400, "invalid_image")));
    check(&d, chat(json!([img(&png[..png.len() - 1])])), Err((400, "invalid_image")));
    check(&d, chat(json!([img(&data_url(&PNG[..12]))])), Err((400, "invalid_image")));
    check(&d, chat(json!([img("http://169.254.169.254/latest/meta-data/")])), Err((400, "image_url_not_allowed")));
    check(&d, chat(json!([img("https://example.com/a.png")])), Err((400, "image_url_not_allowed")));
    check(&d, chat(json!([img("file:///etc/passwd")])), Err((400, "image_url_not_allowed")));
    let small = MediaSection { image_bytes_max: 64, ..MediaSection::default() };
    check(&small, chat(json!([img(&png)])), Err((413, "image_too_large")));
    let two = MediaSection { items_max: 2, ..MediaSection::default() };
    check(&two, chat(json!([img(&png), img(&png)])), Ok(vec![5, 5]));
    check(&two, chat(json!([img(&png), img(&png), img(&png)])), Err((400, "invalid_image")));
}

#[test]
fn placeholders_expand_into_media_items() {
    let media = llava(&MediaSection::default());
    let png = data_url(PNG);
    let body = chat(json!([{"type": "image_url", "image_url": {"url": png}}]));
    let images = resolve(&media, &body, &[None]).unwrap();
    let (tokens, items) = expand(&media, &[1, 7, 2], &images).expect("one placeholder, one image");
    assert_eq!(tokens, [1, 7, 7, 7, 7, 7, 2]);
    assert_eq!(items.items().iter().map(|i| (i.offset_tokens, i.len_tokens)).collect::<Vec<_>>(), [(1, 5)]);
    assert!(expand(&media, &[1, 2], &images).is_none(), "no placeholder for the image");
    assert!(expand(&media, &[7, 7], &images).is_none(), "two placeholders, one image");
    assert!(has_media_kwargs(&json!({"mm_processor_kwargs": {}})) && !has_media_kwargs(&json!({"x": 1})));
}

#[test]
fn allow_list_prefixes() {
    for bad in ["http://a", "https://a/x", "http://u@a/", "http://a/?q=1", "ftp://a/", "file:///a/", "a/"] {
        assert!(fetch::Prefix::parse(bad).is_err(), "{bad}");
    }
    let url_allow = vec!["http://img.local:8000/pub/".into(), "https://cdn.local/s/".into()];
    let section = MediaSection { url_allow, ..MediaSection::default() };
    assert_eq!(section.check(), Ok(()));
    let f = Fetcher::new(&section);
    for ok in ["http://img.local:8000/pub/a.png", "http://IMG.local:8000/pub/x/y.jpg?v=2", "https://cdn.local/s/a.png"]
    {
        assert!(f.allows(ok), "{ok}");
    }
    for no in [
        "http://img.local:8000/pubx/a.png",
        "http://img.local/pub/a.png",
        "http://img.local:8000.evil/pub/a.png",
        "http://img.local:8000@evil/pub/a.png",
        "https://img.local:8000/pub/a.png",
        "http://img.local:8000/pub/../admin",
        "http://cdn.local/s/a.png",
        "https://cdn.local:8443/s/a.png",
    ] {
        assert!(!f.allows(no), "{no}");
    }
    let bad = MediaSection { url_allow: vec!["http://a".into()], ..MediaSection::default() };
    assert_eq!(bad.check().unwrap_err().0, "media.url_allow[0]");
    assert!(MediaSection { items_max: 0, ..MediaSection::default() }.check().is_err());
    let no_ca = MediaSection { ca_path: Some("no/such/ca.pem".into()), ..MediaSection::default() };
    assert_eq!(no_ca.check().unwrap_err().0, "media.ca_path");
}

#[test]
fn the_identifier_is_the_configured_digest() {
    let body = chat(json!([{"type": "image_url", "image_url": {"url": data_url(PNG)}}]));
    let id = |name: &str| {
        let section = MediaSection { hasher_algorithm: name.into(), ..MediaSection::default() };
        section.check().map(|()| resolve(&llava(&section), &body, &[]).unwrap()[0].identifier.clone())
    };
    let (blake3, sha256, sha512) = (id("blake3").unwrap(), id("sha256").unwrap(), id("sha512").unwrap());
    assert_eq!(blake3, id(&MediaSection::default().hasher_algorithm).unwrap());
    assert!(blake3 != sha256 && sha256 != sha512, "{blake3} {sha256} {sha512}");
    assert_eq!(id("md5").unwrap_err().0, "media.hasher_algorithm");
}
