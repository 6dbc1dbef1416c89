//! Golden identifiers printed by vLLM 0.32's own `MultiModalHasher.hash_kwargs`
//! (for `MediaWithBytes(<image>, b"not really an image", io_config)` and
//! `model_id="org/model"`), and the framing spelled out byte by byte.

use super::*;

const DATA: &[u8] = b"not really an image";
const MODEL: &str = "org/model";

#[track_caller]
fn check(algorithm: Algorithm, mode: &str, io: &ImageIo, want: &str) {
    let got = identifier(algorithm, MODEL, ImageItem::Bytes { bytes: DATA, mode }, io);
    assert_eq!(got, want, "{algorithm:?} mode {mode} io {io:?}");
}

#[test]
fn matches_vllms_hasher() {
    let rgb = ImageIo::default();
    let black = ImageIo { rgba_background: [0; 3], ..ImageIo::default() };
    let keep = ImageIo { image_mode: None, ..ImageIo::default() };
    let plain_b3 = "bb20992fa0ba47007bdb0aa12b757ec79ed516570e941b8bcc2650e3efc06799";
    let io_b3 = "7dd6d069f4ff00a95f8506f349cee5c7b25722faa8cd8c41d5f295f31c2cefec";
    check(Algorithm::Blake3, "RGB", &rgb, plain_b3);
    check(Algorithm::Blake3, "RGBA", &keep, plain_b3);
    check(Algorithm::Blake3, "RGBA", &rgb, io_b3);
    check(Algorithm::Blake3, "P", &rgb, io_b3);
    check(Algorithm::Blake3, "L", &black, "3ee67c4fcd28888c61c32f5834bbfba69dcb1144bd8e83ca5dbad7d47f80d8e3");
    check(Algorithm::Sha256, "RGB", &rgb, "8da0c34d3e55b27487b1d25e5e30daa4a0211329321207843ae67284abd87eb7");
    check(Algorithm::Sha256, "RGBA", &rgb, "d39148aad2b6468fad19d9bdc756574141f1b99408e96e414699e33d7bc14da9");
    check(
        Algorithm::Sha512,
        "RGB",
        &rgb,
        "3532e738f8aea1105f1b7844e8b466b38e2b44ea9c00d646e8a9c3211790b7e8\
         c7f27531620f72d09d8a26f11cb02db8cd7717a40544af1fbe51bf4f4fe755fc",
    );
    check(
        Algorithm::Sha512,
        "CMYK",
        &rgb,
        "d89bd2f57eb5658f7cb9bcf20cdf8b846c26977481ea56e26e2d9331b669b326\
         930201cde3dfdfe3c14cbf37f7bf096d298cb9a99cef47f67895282085dcf059",
    );
}

#[test]
fn the_framing_spelled_out() {
    let framed = |b: &[u8]| [&(b.len() as u64).to_le_bytes()[..], b].concat();
    let stream = [
        framed(b"image"),
        vec![3],
        framed(b"image"),
        vec![3],
        framed(DATA),
        framed(b"model_id"),
        vec![3],
        framed(MODEL.as_bytes()),
    ]
    .concat();
    let want = blake3::hash(&stream).to_hex().to_string();
    check(Algorithm::Blake3, "RGB", &ImageIo::default(), &want);
}

#[test]
fn a_uuid_stands_in_as_is() {
    let got = identifier(Algorithm::Sha256, MODEL, ImageItem::Uuid("my-uuid"), &ImageIo::default());
    assert_eq!(got, "my-uuid");
}

#[test]
fn algorithm_names() {
    assert_eq!(Algorithm::from_name("blake3"), Some(Algorithm::Blake3));
    assert_eq!(Algorithm::from_name("sha512"), Some(Algorithm::Sha512));
    assert_eq!(Algorithm::from_name("md5"), None);
}
