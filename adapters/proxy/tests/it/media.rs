//! Image chats through the proxy: blocks hashed with their images' keys (seen in
//! `/route/preview` after a request was routed, from the router's own predictions),
//! bad images answered with OpenAI-style errors, and `http://` images fetched only
//! under `[media] url_allow`, hashed from the same bytes as a `data:` URL's.
//!
//! The model's tokenizer here renders text with the byte fallback and each image part
//! as one placeholder token, as a real template does; the proxy's media path (parts,
//! identifiers, limits, fetches, expansion, hashing) is the real one.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvroute_media::{ImageModel, PlaceholderRule};
use kvroute_proxy::config::ProxyConfig;
use kvroute_proxy::media::{ChatMedia, MediaSection};
use kvroute_proxy::tokenize::{fallback_text, Tokenize, TokenizeError};
use kvroute_proxy::{serve, ServeHandle, Tokenizers};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::{config, post, Fake, MODEL};

pub(crate) const PNG: &[u8] = include_bytes!("../../../media/tests/images/rgb.png");
pub(crate) const OTHER_PNG: &[u8] = include_bytes!("../../../media/tests/images/gray.png");
/// The placeholder token, and the tokens one image becomes.
pub(crate) const IMAGE: u32 = 7;
pub(crate) const IMAGE_TOKENS: u32 = 20;
const BLOCK: usize = 16;

/// Text as fallback tokens, each image part as [`IMAGE`]; for the proxy and, with the
/// same rendering, for sim-workers (`media_fleet`).
pub(crate) struct ImageTokenizer(pub(crate) ChatMedia);

impl Tokenize for ImageTokenizer {
    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        let mut out = Vec::new();
        for m in body["messages"].as_array().into_iter().flatten() {
            match &m["content"] {
                Value::String(s) => out.extend(fallback_text(s)),
                Value::Array(parts) => {
                    for p in parts {
                        match p.as_object() {
                            Some(o) if kvroute_tokenize::is_image_part(o) => out.push(IMAGE),
                            _ => out.extend(fallback_text(p["text"].as_str().unwrap_or_default())),
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(out)
    }
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(fallback_text(text))
    }
    fn media(&self) -> Option<&ChatMedia> {
        Some(&self.0)
    }
}

async fn start(mut cfg: ProxyConfig, section: MediaSection) -> ServeHandle {
    cfg.models[0].block_size = Some(BLOCK as u32);
    cfg.router.mode = router_core::RouterMode::Kv;
    cfg.media = section.clone();
    let model = ImageModel { rule: PlaceholderRule::Fixed { tokens: IMAGE_TOKENS }, token_id: IMAGE, prompt_text: "" };
    let mut t = Tokenizers::new();
    t.insert(MODEL, Arc::new(ImageTokenizer(ChatMedia::new(&model, "engine-model", &section))));
    serve(cfg, t).await.expect("proxy starts")
}

pub(crate) fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// 64 bytes of text (16 tokens, one block) before the image.
const INTRO: &str = "Here is the picture the whole conversation is about, look at it: ";
const ASK: &str = "What colours does it have, from the top left to the bottom right?";

pub(crate) fn image_chat(url: &str, follow_up: bool) -> Value {
    let mut messages = vec![json!({"role": "user", "content": [
        {"type": "text", "text": INTRO},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": ASK}]})];
    if follow_up {
        messages.push(json!({"role": "assistant", "content": "Red, green and blue noise, mostly."}));
        messages.push(json!({"role": "user", "content": "Which one covers the most of it, roughly?"}));
    }
    json!({"model": MODEL, "messages": messages, "max_tokens": 4})
}

/// The preview's (worker, overlap on `worker`, request blocks, prompt tokens).
async fn preview(addr: SocketAddr, body: &Value, worker: u64) -> (u64, u64, u64, u64) {
    let a = post(addr, "/route/preview", &[], body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let j = a.json();
    let row = j["explanation"].as_array().unwrap().iter().find(|r| r["worker"] == worker).cloned().unwrap();
    let n = |v: &Value| v.as_u64().unwrap();
    (n(&j["worker"]), n(&row["overlap"]["device"]), n(&j["request_blocks"]), n(&j["isl_tokens"]))
}

#[tokio::test]
async fn image_chats_route_by_their_images_blocks() {
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    let p = start(config(&[(1, fakes[0].addr), (2, fakes[1].addr)]), MediaSection::default()).await;
    let addr = p.local_addr();
    let (x, y) = (data_url(PNG), data_url(OTHER_PNG));
    let first = image_chat(&x, false);
    let text_tokens = fallback_text(INTRO).len() + fallback_text(ASK).len();
    let (_, _, blocks, isl) = preview(addr, &first, 2).await;
    assert_eq!(isl as usize, text_tokens + IMAGE_TOKENS as usize, "the image's placeholder expanded");
    assert_eq!(blocks as usize, isl as usize / BLOCK);
    let served = post(addr, "/v1/chat/completions", &[("x-worker-id", "2")], &first).await;
    assert_eq!(served.status, 200, "{}", served.text());

    // The image starts at token 16: block 1 onwards holds it.
    let (worker, same, ..) = preview(addr, &image_chat(&x, true), 2).await;
    assert_eq!((worker, same), (2, blocks), "the follow-up holds every block of the first turn");
    let (_, other, ..) = preview(addr, &image_chat(&y, true), 2).await;
    assert_eq!(other, 1, "another image diverges at the image's first block");
    let mut text_only = image_chat(&x, true);
    text_only["messages"][0]["content"].as_array_mut().unwrap().remove(1);
    let (_, text, ..) = preview(addr, &text_only, 2).await;
    assert!(text <= 1, "the text alone never matches an image block");
    let mut by_uuid = image_chat(&x, true);
    by_uuid["messages"][0]["content"][1]["uuid"] = json!("pic-1");
    assert_eq!(preview(addr, &by_uuid, 2).await.1, 1, "a uuid is another identifier than the bytes");
}

/// `body` is refused with `status` and `code`, at the proxy and at the preview alike,
/// and nothing reaches a worker.
async fn check_refused(addr: SocketAddr, fake: &Fake, body: &Value, status: u16, code: &str) {
    let before = fake.seen().len();
    for path in ["/v1/chat/completions", "/route/preview"] {
        let a = post(addr, path, &[], body).await;
        assert_eq!(a.status.as_u16(), status, "{path}: {}", a.text());
        let e = &a.json()["error"];
        assert_eq!((e["code"].as_str(), e["type"].as_str()), (Some(code), Some("invalid_request_error")), "{e}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    assert_eq!(fake.seen().len(), before, "a refused request is not forwarded");
}

#[tokio::test]
async fn bad_images_are_client_errors() {
    let fake = Fake::start(&[MODEL]).await;
    let section = MediaSection { items_max: 2, image_bytes_max: 4096, ..MediaSection::default() };
    let p = start(config(&[(1, fake.addr)]), section).await;
    let addr = p.local_addr();
    let one = |url: &str| image_chat(url, false);
    check_refused(addr, &fake, &one("data:image/png;base64,aGk"), 400, "invalid_image").await;
    check_refused(addr, &fake, &one("data:image/png,rawbytes"), 400, "invalid_image").await;
    check_refused(addr, &fake, &one(&data_url(b"GIF89a not supported here")), 400, "invalid_image").await;
    check_refused(addr, &fake, &one(&data_url(&PNG[..20])), 400, "invalid_image").await;
    check_refused(addr, &fake, &one(&data_url(&[0; 5000])), 413, "image_too_large").await;
    check_refused(addr, &fake, &one("http://169.254.169.254/latest/meta-data/"), 400, "image_url_not_allowed").await;
    check_refused(addr, &fake, &one("file:///etc/passwd"), 400, "image_url_not_allowed").await;
    let mut three = one(&data_url(PNG));
    let part = three["messages"][0]["content"][1].clone();
    three["messages"][0]["content"].as_array_mut().unwrap().extend([part.clone(), part]);
    check_refused(addr, &fake, &three, 400, "invalid_image").await;
}

/// An image server: `/pub/a.png` (the PNG), `/pub/big.png` (too large), `/pub/moved`
/// (a redirect to the PNG), anything else 404.
async fn image_server() -> SocketAddr {
    serve_images(None).await
}

/// [`image_server`] over TLS, with a certificate for 127.0.0.1: its address and the
/// certificate's PEM.
async fn tls_image_server() -> (SocketAddr, String) {
    let c = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
    let key = rustls::pki_types::PrivateKeyDer::try_from(c.signing_key.serialize_der()).unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![c.cert.der().clone()], key)
        .unwrap();
    (serve_images(Some(tokio_rustls::TlsAcceptor::from(Arc::new(cfg)))).await, c.cert.pem())
}

async fn serve_images(tls: Option<tokio_rustls::TlsAcceptor>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let svc = service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                let (status, body): (u16, Bytes) = match req.uri().path() {
                    "/pub/a.png" => (200, Bytes::from_static(PNG)),
                    "/pub/big.png" => (200, Bytes::from(vec![0u8; 100_000])),
                    "/pub/moved" => (302, Bytes::new()),
                    _ => (404, Bytes::new()),
                };
                let resp = http::Response::builder().status(status).header("location", "/pub/a.png");
                Ok::<_, Infallible>(resp.body(Full::new(body)).unwrap())
            });
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let tls = tls.clone();
            tokio::spawn(async move {
                match tls {
                    None => builder.serve_connection(TokioIo::new(stream), svc).await,
                    Some(tls) => match tls.accept(stream).await {
                        Ok(s) => builder.serve_connection(TokioIo::new(s), svc).await,
                        Err(e) => Err(e.into()),
                    },
                }
            });
        }
    });
    addr
}

/// The PNG sent inline goes to worker 1; the follow-up naming it by `url` then
/// previews every block of the first turn there, since the fetched bytes hash as the
/// inline ones. Returns that follow-up.
async fn check_fetched_hashes_as_inline(addr: SocketAddr, url: &str) -> Value {
    let first = image_chat(&data_url(PNG), false);
    let (_, _, first_blocks, _) = preview(addr, &first, 1).await;
    let served = post(addr, "/v1/chat/completions", &[("x-worker-id", "1")], &first).await;
    assert_eq!(served.status, 200, "{}", served.text());
    let fetched = image_chat(url, true);
    let (_, overlap, ..) = preview(addr, &fetched, 1).await;
    assert_eq!(overlap, first_blocks, "the fetched image's bytes hash as the data URL's");
    fetched
}

#[tokio::test]
async fn allowed_http_images_are_fetched_and_hash_as_their_bytes() {
    let images = image_server().await;
    let fake = Fake::start(&[MODEL]).await;
    let section = MediaSection {
        url_allow: vec![format!("http://{images}/pub/")],
        fetch_bytes_max: 50_000,
        ..MediaSection::default()
    };
    let p = start(config(&[(1, fake.addr)]), section).await;
    let addr = p.local_addr();
    check_fetched_hashes_as_inline(addr, &format!("http://{images}/pub/a.png")).await;
    let url = |path: &str| image_chat(&format!("http://{images}{path}"), false);
    check_refused(addr, &fake, &url("/pub/big.png"), 413, "image_too_large").await;
    check_refused(addr, &fake, &url("/pub/missing.png"), 400, "image_fetch_failed").await;
    check_refused(addr, &fake, &url("/pub/moved"), 400, "image_fetch_failed").await;
    check_refused(addr, &fake, &url("/private/a.png"), 400, "image_url_not_allowed").await;
}

/// An allowed `https` image is fetched from a host verified against `[media] ca_path`,
/// and hashes as the same bytes sent inline; a host that the roots do not vouch for is
/// a fetch failure, never a fetch.
#[tokio::test]
async fn allowed_https_images_are_fetched_from_verified_hosts() {
    let (images, cert_pem) = tls_image_server().await;
    let ca = std::env::temp_dir().join(format!("kvroute-media-ca-{}-{}.pem", std::process::id(), images.port()));
    std::fs::write(&ca, cert_pem).unwrap();
    let fake = Fake::start(&[MODEL]).await;
    let url_allow = vec![format!("https://{images}/pub/")];
    let section = MediaSection { url_allow: url_allow.clone(), ca_path: Some(ca.clone()), ..MediaSection::default() };
    assert_eq!(section.check(), Ok(()));
    let p = start(config(&[(1, fake.addr)]), section).await;
    let addr = p.local_addr();
    let fetched = check_fetched_hashes_as_inline(addr, &format!("https://{images}/pub/a.png")).await;
    check_refused(addr, &fake, &image_chat(&format!("http://{images}/pub/a.png"), false), 400, "image_url_not_allowed")
        .await;
    // The system's roots do not vouch for the test's certificate.
    let untrusted = start(config(&[(1, fake.addr)]), MediaSection { url_allow, ..MediaSection::default() }).await;
    check_refused(untrusted.local_addr(), &fake, &fetched, 400, "image_fetch_failed").await;
    let _ = std::fs::remove_file(ca);
}
