//! Chat images on a worker that reads them as vLLM does: the same image hits its
//! cached blocks, another image (or none, or a client `uuid` in its place) misses from
//! the first block the image touches, bad images are refused, and every stored block
//! announces its images as `[identifier, offset]` extra keys from which router-core
//! recomputes the published hash.

use std::sync::Arc;

use base64::Engine as _;
use kvroute_media::{Limits, MediaConfig, PlaceholderRule};
use kvroute_sim_server::{fallback_text, PromptTokenizer, SimMedia, SimServerHandle, TokenizeError};
use rmpv::Value as Mp;
use router_core::{chain, local_hash, HashSeed, MediaKey, SeqHash};
use serde_json::{json, Value};

use crate::events::{decode, field, replay, u64s};
use crate::support::{fast_config, get, post, start};

const BS: u64 = 4;
/// The placeholder token and the tokens one image becomes.
const IMAGE: u32 = 7;
const IMAGE_TOKENS: u32 = 6;
const PNG: &[u8] = include_bytes!("../../../media/tests/images/rgb.png");
const OTHER_PNG: &[u8] = include_bytes!("../../../media/tests/images/gray.png");
/// 16 bytes, one block of fallback tokens, before the image; 32 after it.
const INTRO: &str = "look at this one";
const ASK: &str = "what is in it, and what colour?";

/// Text as fallback tokens, an image part as [`IMAGE`], as a template renders it.
struct Tokens;

impl PromptTokenizer for Tokens {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(fallback_text(text))
    }
    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        let mut out = Vec::new();
        for m in body["messages"].as_array().into_iter().flatten() {
            for part in m["content"].as_array().into_iter().flatten() {
                match part["type"].as_str() {
                    Some("image_url") => out.push(IMAGE),
                    _ => out.extend(fallback_text(part["text"].as_str().unwrap_or_default())),
                }
            }
            out.extend(m["content"].as_str().map(fallback_text).unwrap_or_default());
        }
        Ok(out)
    }
}

fn media() -> SimMedia {
    let config = MediaConfig {
        model_id: "engine-model".into(),
        algorithm: Default::default(),
        io: Default::default(),
        rule: PlaceholderRule::Fixed { tokens: IMAGE_TOKENS },
        limits: Limits { bytes_max: 4096, items_max: 2, ..Limits::default() },
    };
    SimMedia { config, token_id: IMAGE }
}

async fn worker() -> SimServerHandle {
    let mut cfg = fast_config();
    cfg.replay_port = Some(0);
    cfg.tokenizer = Arc::new(Tokens);
    cfg.media = Some(media());
    start(cfg).await
}

fn url(png: &[u8]) -> String {
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png))
}

fn image(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

fn text(t: &str) -> Value {
    json!({"type": "text", "text": t})
}

fn chat(parts: Vec<Value>) -> String {
    json!({"messages": [{"role": "user", "content": parts}], "max_tokens": 2}).to_string()
}

/// `body` answers with `want`: the prompt's cached tokens, or the refusal's status.
async fn check(w: &SimServerHandle, what: &str, body: &str, want: Result<u64, u16>) {
    let r = post(w.http_addr(), "/v1/chat/completions", body).await;
    let got = match r.status.as_u16() {
        200 => Ok(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("usage")),
        s => {
            assert_eq!(r.json()["error"]["type"], "invalid_request_error", "{what}");
            Err(s)
        }
    };
    assert_eq!(got, want, "{what}");
}

#[tokio::test]
async fn the_same_image_hits_and_another_misses_from_the_image_on() {
    let w = worker().await;
    let (x, y) = (url(PNG), url(OTHER_PNG));
    // 4 text tokens, 6 image tokens, 8 text tokens: blocks 1 and 2 hold the image.
    let first = chat(vec![text(INTRO), image(&x), text(ASK)]);
    check(&w, "the first turn", &first, Ok(0)).await;
    check(&w, "the same chat again", &first, Ok(4 * BS)).await;
    check(&w, "another image", &chat(vec![text(INTRO), image(&y), text(ASK)]), Ok(BS)).await;
    check(&w, "no image", &chat(vec![text(INTRO), text(ASK)]), Ok(BS)).await;
    let by_uuid = json!({"type": "image_url", "image_url": {"url": x}, "uuid": "pic-1"});
    check(&w, "a uuid names another item", &chat(vec![text(INTRO), by_uuid, text(ASK)]), Ok(BS)).await;
    let mut follow_up: Value = serde_json::from_str(&first).unwrap();
    follow_up["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "a picture of noise"}),
        json!({"role": "user", "content": "and its size??"}),
    ]);
    check(&w, "a follow-up turn", &follow_up.to_string(), Ok(4 * BS)).await;

    check(&w, "bad base64", &chat(vec![image("data:image/png;base64,!!!!")]), Err(400)).await;
    check(&w, "not an image", &chat(vec![image(&url(b"plain text, not a PNG"))]), Err(400)).await;
    check(&w, "an http URL", &chat(vec![image("http://169.254.169.254/x.png")]), Err(400)).await;
    check(&w, "over the size limit", &chat(vec![image(&url(&[0; 5000]))]), Err(413)).await;
    check(&w, "three images", &chat(vec![image(&x), image(&x), image(&x)]), Err(400)).await;

    let metrics = get(w.http_addr(), "/metrics").await;
    let text = std::str::from_utf8(&metrics.body).expect("utf-8");
    let hits = 4 * BS + BS + BS + BS + 4 * BS;
    assert!(text.lines().any(|l| l == format!("vllm:prefix_cache_hits_total {hits}")), "{hits} hits in {text}");
    w.shutdown().await;
}

#[tokio::test]
async fn stored_image_blocks_carry_their_identifier_and_offset() {
    let w = worker().await;
    let r = post(w.http_addr(), "/v1/chat/completions", &chat(vec![text(INTRO), image(&url(PNG)), text(ASK)])).await;
    assert_eq!(r.status, 200);
    let id = media().config.resolve_bytes(PNG, None).expect("the PNG resolves").identifier;
    let mut blocks = Vec::new();
    for f in replay(&w, 0).await {
        for e in decode(&f.payload)[1].as_array().expect("events") {
            let m = e.as_map().expect("a map");
            if field(m, "type").as_str() == Some("BlockStored") {
                blocks.extend(stored(m));
            }
        }
    }
    let keys: Vec<Keys> = blocks.iter().map(|(_, k)| k.clone()).collect();
    let image_keys = [vec![], vec![(id.clone(), 0)], vec![(id, -4)], vec![]];
    assert_eq!(keys[..4], image_keys, "blocks 1 and 2 hold the image, starting at token 4");
    w.shutdown().await;
}

/// A block's `[identifier, offset]` keys.
type Keys = Vec<(String, i64)>;

/// One `BlockStored`'s blocks as `(tokens, keys)`, each hash checked against
/// router-core's, with the keys folded in as a request's media items are.
fn stored(m: &[(Mp, Mp)]) -> Vec<(Vec<u32>, Keys)> {
    let hashes = u64s(field(m, "block_hashes"));
    let tokens: Vec<u32> = u64s(field(m, "token_ids")).into_iter().map(|t| t as u32).collect();
    let extra: Vec<Keys> = match m.iter().find(|(k, _)| k.as_str() == Some("extra_keys")) {
        None => vec![Vec::new(); hashes.len()],
        Some((_, v)) => v.as_array().expect("one entry per block").iter().map(block_keys).collect(),
    };
    assert_eq!(extra.len(), hashes.len());
    let mut parent = field(m, "parent_block_hash").as_u64().map(SeqHash);
    let mut out = Vec::new();
    for ((h, block), keys) in hashes.iter().zip(tokens.chunks(BS as usize)).zip(extra) {
        let words: Vec<u64> = keys.iter().flat_map(|(id, off)| MediaKey::of(id.as_bytes()).extra_keys(*off)).collect();
        let local = local_hash(block, &words, HashSeed::DEFAULT);
        let seq = parent.map_or(SeqHash(local.0), |p| chain(p, local));
        assert_eq!(seq.0, *h, "router-core recomputes the hash from token_ids and extra_keys");
        parent = Some(seq);
        out.push((block.to_vec(), keys));
    }
    out
}

/// A block's entry: nil, or `[identifier, offset]` pairs.
fn block_keys(v: &Mp) -> Keys {
    if v.is_nil() {
        return Vec::new();
    }
    let pair = |p: &Mp| {
        let p = p.as_array().expect("a pair");
        (p[0].as_str().expect("an identifier").to_owned(), p[1].as_i64().expect("an offset"))
    };
    v.as_array().expect("a list of keys").iter().map(pair).collect()
}
