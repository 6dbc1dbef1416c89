//! Images on a real vision-language model: the block hashes vLLM publishes for an image
//! chat are the ones kvroute computes from the request alone (the chat template, the
//! tokenizer, kvroute-media's identifier and placeholder expansion, and the core's
//! `hash_tokens_with_media`), and vLLM's prefix-cache hits are the overlap those hashes
//! predict: a follow-up turn with the same image hits through the image's blocks, the
//! same text with another image diverges at the image's first block, two images in a
//! prompt key the block they share with both, a client's `uuid` stands for the image's
//! bytes, and a `cache_salt` keeps tenants apart with images too. vLLM's own expanded
//! prompt (`/tokenize` with the messages) is checked against kvroute's expansion, and
//! every stored block's published `(identifier, offset)` keys against kvroute-media's.
//!
//! One server per generated model family (see `vlm_engine.rs`), not the fleet's,
//! 32-token blocks: LLaVA (CLIP 112 px, patch 14: 64 placeholder tokens per image) and
//! Qwen2-VL (tokens by the image's size).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use kvroute_media::{expand, ImagePart, MediaConfig, PlaceholderRule};
use router_core::{hash_tokens_with_media, BlockHash, BlockSize, HashSeed};
use serde_json::{json, Value};

use crate::vlm_engine::{vlm_model, EventLog, VlmServer, VLM, VLM_BLOCK_TOKENS};

mod route;

const BS: usize = VLM_BLOCK_TOKENS as usize;
const HITS: &str = "vllm:prefix_cache_hits_total";

/// A generated model family (`gen_vlm.py --family`) and the images its test sends.
struct Family {
    name: &'static str,
    /// What the chat template renders for an image part.
    image_text: &'static str,
    /// The token vLLM's processor expands.
    image_token: &'static str,
    /// Two images of different bytes (for Qwen2-VL, of different token counts).
    images: [&'static [u8]; 2],
}

const LLAVA: Family = Family {
    name: "llava",
    image_text: "<image>",
    image_token: "<image>",
    // RGBA: vLLM converts it to RGB, which its identifier records.
    images: [
        include_bytes!("../../adapters/media/tests/images/rgb.png"),
        include_bytes!("../../adapters/media/tests/images/rgba.png"),
    ],
};

const QWEN2_VL: Family = Family {
    name: "qwen2_vl",
    image_text: "<|vision_start|><|image_pad|><|vision_end|>",
    image_token: "<|image_pad|>",
    // 640 x 480 and 1000 x 40: 54 and 36 placeholder tokens.
    images: [
        include_bytes!("../../adapters/media/tests/images/rgb.jpg"),
        include_bytes!("../../adapters/media/tests/images/wide.png"),
    ],
};

/// Two images of the same size and other bytes, for a client's uuid.
const SAME_SIZE: [&[u8]; 2] = [
    include_bytes!("../../adapters/media/tests/images/alpha.webp"),
    include_bytes!("../../adapters/media/tests/images/alpha-lossy.webp"),
];

/// One part of a message: text, or an image as a data URL with the client's `uuid`.
#[derive(Clone)]
enum Part {
    Text(&'static str),
    Image(String, Option<&'static str>),
}

type Turns = Vec<(&'static str, Vec<Part>)>;

/// kvroute's view of a prompt: its tokens with the images expanded, its block hashes,
/// and each image's identifier and placeholder span (offset, length).
struct Prompt {
    tokens: Vec<u32>,
    hashes: Vec<BlockHash>,
    images: Vec<(String, usize, usize)>,
}

/// What one request showed.
struct Seen {
    prompt: Prompt,
    predicted_blocks: usize,
    cached_tokens: u64,
}

struct Ctx {
    family: &'static Family,
    server: VlmServer,
    log: EventLog,
    media: MediaConfig,
    image_token_id: u32,
    model: PathBuf,
    dir: PathBuf,
    /// kvroute in front of the server, once [`route::through_kvroute`] started it:
    /// requests then go through it, and its preview is checked first.
    front: Option<route::Front>,
}

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/x;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// The generated model's chat template (`gen_vlm.py`), rendered by hand as kvroute's
/// tokenizer adapter renders it: `<|user|>text<image>text<|end|>...<|assistant|>`.
fn render(turns: &Turns, image_text: &str) -> String {
    let mut s = String::new();
    for (role, parts) in turns {
        s.push_str(&format!("<|{role}|>"));
        for p in parts {
            s.push_str(match p {
                Part::Text(t) => t,
                Part::Image(..) => image_text,
            });
        }
        s.push_str("<|end|>");
    }
    s + "<|assistant|>"
}

fn chat_body(turns: &Turns, salt: Option<&str>) -> Value {
    let messages: Vec<Value> = turns
        .iter()
        .map(|(role, parts)| {
            let content: Vec<Value> = parts
                .iter()
                .map(|p| match p {
                    Part::Text(t) => json!({"type": "text", "text": t}),
                    Part::Image(url, None) => json!({"type": "image_url", "image_url": {"url": url}}),
                    Part::Image(url, Some(uuid)) => {
                        json!({"type": "image_url", "image_url": {"url": url}, "uuid": uuid})
                    }
                })
                .collect();
            json!({"role": role, "content": content})
        })
        .collect();
    let mut body = json!({"model": VLM, "messages": messages, "max_tokens": 1, "temperature": 0});
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    body
}

impl Ctx {
    fn tokenize(&self, text: &str) -> Vec<u32> {
        let r = self.server.post("/tokenize", &json!({"model": VLM, "prompt": text, "add_special_tokens": false}));
        r["tokens"].as_array().expect("tokens").iter().map(|t| t.as_u64().expect("a token id") as u32).collect()
    }

    /// kvroute's view of a request, from the request alone.
    fn prompt(&self, turns: &Turns, salt: Option<&str>) -> Prompt {
        let prompt = self.tokenize(&render(turns, self.family.image_text));
        let parts: Vec<ImagePart<'_>> = turns
            .iter()
            .flat_map(|(_, ps)| ps)
            .filter_map(|p| match p {
                Part::Image(url, uuid) => Some(ImagePart { url: Some(url), uuid: *uuid }),
                Part::Text(_) => None,
            })
            .collect();
        let resolved = self.media.resolve_all(&parts).expect("the images resolve");
        let ex = expand(&prompt, self.image_token_id, &resolved, 4096).expect("the prompt expands");
        let mut hashes = Vec::new();
        let bs = BlockSize::new(VLM_BLOCK_TOKENS).expect("block size");
        hash_tokens_with_media(&ex.tokens, bs, HashSeed::salted(None, salt), &ex.media, &mut hashes);
        // `expand` keeps the images' order, which is the prompt's.
        let images = resolved
            .iter()
            .zip(ex.media.items())
            .map(|(r, it)| (r.identifier.clone(), it.offset_tokens as usize, it.len_tokens as usize))
            .collect();
        Prompt { tokens: ex.tokens, hashes, images }
    }

    /// Sends `turns`; checks vLLM's prompt, cache hit and newly stored blocks against
    /// kvroute's tokens, hashes and the overlap they predict.
    #[track_caller]
    fn ask(&mut self, what: &str, turns: &Turns, salt: Option<&str>) -> Seen {
        let p = self.prompt(turns, salt);
        let body = chat_body(turns, salt);
        let theirs = self.server.post("/tokenize", &json!({"model": VLM, "messages": body["messages"]}));
        assert_eq!(theirs["tokens"], json!(p.tokens), "{what}: vLLM's own prompt, images expanded, is kvroute's");
        self.log.poll(&self.server);
        let predicted = self.log.overlap(&p.hashes);
        // vLLM never counts a prompt's last token as a hit.
        let hit_blocks = predicted.min((p.tokens.len() - 1) / BS);
        let stored_before = self.log.stored.len();
        let hits_before = self.server.metric(HITS);
        let r = match &self.front {
            None => self.server.post("/v1/chat/completions", &body),
            Some(front) => front.chat(what, &body, &p, predicted),
        };
        assert_eq!(r["usage"]["prompt_tokens"], p.tokens.len(), "{what}: vLLM's prompt length");
        let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        assert_eq!(cached, (hit_blocks * BS) as u64, "{what}: vLLM's cached tokens, {predicted} blocks predicted");
        let hits = self.wait_metric(HITS, hits_before + cached as f64);
        assert_eq!(hits - hits_before, cached as f64, "{what}: vllm:prefix_cache_hits_total's increase");
        // The blocks vLLM stores now are the ones it did not hold, hashed as kvroute does.
        let fresh = &p.hashes[hit_blocks..];
        self.log.wait_stored(&self.server, stored_before + fresh.len());
        let stored = &self.log.stored[stored_before..stored_before + fresh.len()];
        let got: Vec<BlockHash> = stored.iter().map(|s| s.hash).collect();
        assert_eq!(got, fresh, "{what}: the blocks vLLM stored, in kvroute's hashes");
        for (i, s) in stored.iter().enumerate() {
            let b = hit_blocks + i;
            assert_eq!(s.media, media_keys(&p, b), "{what}: block {b}'s media keys as published");
            // vLLM keys a salt on the prompt's first block only.
            let salt_keys: Vec<String> = salt.filter(|_| b == 0).map(String::from).into_iter().collect();
            assert_eq!(s.strings, salt_keys, "{what}: block {b}'s string keys as published");
        }
        let spans: Vec<(&str, usize, usize)> =
            p.images.iter().map(|(id, o, l)| (id.get(..16).unwrap_or(id), *o, *l)).collect();
        eprintln!(
            "real_vllm: {} {what}: {} tokens, images (identifier, offset, length) {spans:?}, \
             {} full blocks, predicted {predicted}, cached {cached} tokens; hashes {:016x?}",
            self.family.name,
            p.tokens.len(),
            p.hashes.len(),
            p.hashes.iter().map(|h| h.seq.0).collect::<Vec<_>>()
        );
        Seen { prompt: p, predicted_blocks: predicted, cached_tokens: cached }
    }

    /// Polls metric `name` for up to 5 s until it reaches `want`; its last value.
    fn wait_metric(&self, name: &str, want: f64) -> f64 {
        let t0 = Instant::now();
        loop {
            let v = self.server.metric(name);
            if v >= want || t0.elapsed() > Duration::from_secs(5) {
                return v;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The `(identifier, offset)` keys block `b` should carry: one per image it overlaps.
fn media_keys(p: &Prompt, b: usize) -> Vec<(String, i64)> {
    let (start, end) = (b * BS, (b + 1) * BS);
    p.images
        .iter()
        .filter(|(_, off, len)| *off < end && start < off + len)
        .map(|(id, off, _)| (id.clone(), *off as i64 - start as i64))
        .collect()
}

/// The engine's python, or `None` when the suite is skipped.
fn engine_python() -> Option<PathBuf> {
    if std::env::var("KVROUTE_REAL_VLLM").is_ok_and(|v| v == "skip") {
        eprintln!("real_vllm: skipped (KVROUTE_REAL_VLLM=skip)");
        return None;
    }
    let python = std::env::var_os("KVROUTE_VLLM_PYTHON").filter(|v| !v.is_empty()).unwrap_or_else(|| {
        panic!("KVROUTE_VLLM_PYTHON is not set: run scripts/real-engine/install.sh and export what it prints")
    });
    Some(PathBuf::from(python))
}

fn read_json(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// kvroute-media's settings for the model, from its `config.json` and processor config.
fn media_config(model: &Path) -> MediaConfig {
    let config = read_json(&model.join("config.json"));
    let processor = read_json(&model.join("processor_config.json"));
    let rule =
        PlaceholderRule::from_hf_config(&config, Some(&processor["image_processor"])).expect("a placeholder rule");
    MediaConfig {
        model_id: model.display().to_string(),
        algorithm: Default::default(),
        io: Default::default(),
        rule,
        limits: Default::default(),
    }
}

fn start(family: &'static Family) -> Option<Ctx> {
    let python = engine_python()?;
    let dir = crate::procs::scratch_dir("kvroute-real-vllm-vlm");
    let model = vlm_model(&python, family.name);
    let media = media_config(&model);
    eprintln!("real_vllm: {}'s placeholder rule {:?}", family.name, media.rule);
    let server = VlmServer::start(&python, &model, &dir, family.name);
    let log = EventLog::new();
    let mut ctx = Ctx { family, server, log, media, image_token_id: 0, model, dir, front: None };
    let id = ctx.tokenize(family.image_token);
    assert_eq!(id.len(), 1, "{} is one token: {id:?}", family.image_token);
    ctx.image_token_id = id[0];
    Some(ctx)
}

/// Long enough that the image starts in the second block.
const INTRO: &str = "Here is a picture from the test suite of the router, which checks \
    that image requests find their cached blocks on the engine: ";
const ASK: &str = "\nDescribe what you see in it, in one short sentence, and then list its colours in order.";

fn first_turn(parts: Vec<Part>) -> Turns {
    vec![("user", parts)]
}

fn with_image(url: &str) -> Turns {
    first_turn(vec![Part::Text(INTRO), Part::Image(url.into(), None), Part::Text(ASK)])
}

fn follow_up(url: &str) -> Turns {
    let mut t = with_image(url);
    t.push(("assistant", vec![Part::Text("It is a small square of coloured noise.")]));
    t.push(("user", vec![Part::Text("Which colour covers the most of it?")]));
    t
}

#[test]
fn llava_image_blocks_hash_and_hit_as_vllm_publishes_them() {
    check(&LLAVA);
}

#[test]
fn qwen2_vl_image_blocks_hash_and_hit_as_vllm_publishes_them() {
    check(&QWEN2_VL);
}

/// The whole story on one family's server; each request checked by [`Ctx::ask`].
fn check(family: &'static Family) {
    let Some(mut c) = start(family) else { return };
    let (x, y) = (data_url(family.images[0]), data_url(family.images[1]));

    let first = c.ask("first turn", &with_image(&x), None);
    assert_eq!(first.predicted_blocks, 0, "a fresh engine holds nothing");
    let (_, x_off, x_len) = first.prompt.images[0].clone();
    assert!(x_off >= BS, "the image starts after the first block");

    let again = c.ask("follow-up, same image", &follow_up(&x), None);
    assert!(again.cached_tokens as usize >= x_off + x_len, "the follow-up's hit covers the image's blocks");
    assert_eq!(again.prompt.hashes[..first.prompt.hashes.len()], first.prompt.hashes[..]);

    let other = c.ask("follow-up, another image", &follow_up(&y), None);
    let image_block = x_off / BS;
    assert_eq!(other.predicted_blocks, image_block, "another image diverges at the image's first block");
    assert_eq!(other.cached_tokens as usize, image_block * BS);
    assert_ne!(other.prompt.hashes[image_block], again.prompt.hashes[image_block]);

    // Two images, the first as before: the hit runs through the shared image's blocks
    // up to the block where the second one's placeholder (or text) starts to differ.
    let two = first_turn(vec![
        Part::Text(INTRO),
        Part::Image(x.clone(), None),
        Part::Text(" and "),
        Part::Image(y.clone(), None),
        Part::Text(ASK),
    ]);
    let both = c.ask("two images", &two, None);
    assert_eq!(both.predicted_blocks, (x_off + x_len) / BS, "shared through the first image");

    // A client's uuid stands for the image: the same uuid with other bytes (of the
    // same size) is a hit.
    let uuid =
        |img: &[u8]| first_turn(vec![Part::Text(INTRO), Part::Image(data_url(img), Some("pic-1")), Part::Text(ASK)]);
    c.ask("uuid pic-1", &uuid(SAME_SIZE[0]), None);
    let by_uuid = c.ask("uuid pic-1, other bytes", &uuid(SAME_SIZE[1]), None);
    let (_, u_off, u_len) = by_uuid.prompt.images[0].clone();
    assert!(by_uuid.cached_tokens as usize >= u_off + u_len, "the uuid's blocks hit whatever the bytes");

    let salted = c.ask("first turn, tenant-a", &with_image(&x), Some("tenant-a"));
    assert_eq!(salted.predicted_blocks, 0, "a salt keeps unsalted image blocks apart");
    let salted_again = c.ask("follow-up, tenant-a", &follow_up(&x), Some("tenant-a"));
    assert!(salted_again.cached_tokens as usize >= x_off + x_len, "the tenant's follow-up hits through the image");
    let other_tenant = c.ask("follow-up, tenant-b", &follow_up(&x), Some("tenant-b"));
    assert_eq!(other_tenant.predicted_blocks, 0, "another tenant's image blocks are not shared");

    route::through_kvroute(&mut c);
}
