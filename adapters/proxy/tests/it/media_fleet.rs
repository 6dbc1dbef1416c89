//! Image chats over real parts: sim-workers that read images as vLLM does publish
//! their image blocks over ZeroMQ (with `[identifier, offset]` extra keys), the proxy's
//! index follows them, and its predictions are what the workers really hold: a
//! follow-up turn with the same image goes where the image is, another image diverges
//! at the image's first block, and each worker's own prefix-cache hits agree with the
//! overlap the preview showed.
//!
//! The proxy and the workers render a chat with the same tokenizer (text as fallback
//! tokens, one placeholder per image) and read images with the same settings (model
//! id, placeholder count), as a `[media]`-configured kvroute and `kvroute sim-worker`
//! over one model folder do.

use std::net::SocketAddr;
use std::sync::Arc;

use http::Method;
use kvroute_media::{ImageModel, MediaConfig, PlaceholderRule};
use kvroute_proxy::media::{ChatMedia, MediaSection};
use kvroute_proxy::tokenize::Tokenize;
use kvroute_proxy::{serve, ServeHandle, Tokenizers};
use kvroute_sim_server::{EngineConfig, PromptTokenizer, SimMedia, SimServerConfig, SimServerHandle};
use serde_json::Value;

use super::media::{data_url, image_chat, ImageTokenizer, IMAGE, IMAGE_TOKENS, OTHER_PNG, PNG};
use super::*;

const BLOCK: u64 = 16;
const ENGINE_MODEL: &str = "engine-model";

fn chat_media() -> ChatMedia {
    let model = ImageModel { rule: PlaceholderRule::Fixed { tokens: IMAGE_TOKENS }, token_id: IMAGE, prompt_text: "" };
    ChatMedia::new(&model, ENGINE_MODEL, &MediaSection::default())
}

/// The proxy's test tokenizer, serving a sim-worker.
struct SimTokenizer(ImageTokenizer);

impl PromptTokenizer for SimTokenizer {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, kvroute_sim_server::TokenizeError> {
        self.0.encode_text(text).map_err(|e| kvroute_sim_server::TokenizeError::BadInput(e.to_string()))
    }
    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, kvroute_sim_server::TokenizeError> {
        self.0.encode_chat(body).map_err(|e| kvroute_sim_server::TokenizeError::BadInput(e.to_string()))
    }
}

async fn sim_worker() -> SimServerHandle {
    let media = chat_media();
    let config = MediaConfig { model_id: ENGINE_MODEL.into(), ..media.config.clone() };
    let cfg = SimServerConfig {
        model: MODEL.into(),
        replay_port: Some(0),
        engine: EngineConfig { speedup: 1000.0, block_size: BLOCK as u32, ..EngineConfig::default() },
        tokenizer: Arc::new(SimTokenizer(ImageTokenizer(media))),
        media: Some(SimMedia { config, token_id: IMAGE }),
        ..SimServerConfig::default()
    };
    kvroute_sim_server::spawn(cfg).await.expect("sim worker starts")
}

async fn proxy(workers: &[SimServerHandle]) -> ServeHandle {
    let mut cfg = config(&[]);
    cfg.models[0].block_size = Some(BLOCK as u32);
    // The engines' own tokens (a tokenizer is named; the test's is given in code): the
    // workers' events are the only source of overlap, nothing is predicted.
    cfg.models[0].tokenizer = Some("the-test-tokenizer".into());
    cfg.router.mode = router_core::RouterMode::Kv;
    // No predictions: only the workers' events tell the router where images are.
    cfg.router.approximate = false;
    cfg.workers = super::fleet::sim_worker_configs(workers, 1);
    let mut t = Tokenizers::new();
    t.insert(MODEL, Arc::new(ImageTokenizer(chat_media())));
    serve(cfg, t).await.expect("proxy starts")
}

/// A preview of `body`: (chosen worker, each worker's device overlap by id, prompt tokens).
async fn preview(addr: SocketAddr, body: &Value) -> (u64, Vec<(u64, u64)>, u64) {
    let a = post(addr, "/route/preview", &[], body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let j = a.json();
    let rows = j["explanation"].as_array().cloned().unwrap_or_default();
    let overlaps = rows.iter().map(|r| (r["worker"].as_u64().unwrap(), r["overlap"]["device"].as_u64().unwrap()));
    (j["worker"].as_u64().unwrap(), overlaps.collect(), j["isl_tokens"].as_u64().unwrap())
}

fn overlap_at(overlaps: &[(u64, u64)], id: u64) -> u64 {
    overlaps.iter().find(|(w, _)| *w == id).map_or(0, |(_, o)| *o)
}

/// Waits until the index holds every full block of `body`'s prompt at worker `id`
/// (its events arrived) and no request is in flight.
async fn indexed(addr: SocketAddr, body: &Value, id: u64) {
    eventually(30_000, "the worker's image blocks indexed", || async {
        let (_, overlaps, isl) = preview(addr, body).await;
        released(addr).await && overlap_at(&overlaps, id) >= isl / BLOCK
    })
    .await;
}

/// `body` previews with `want` blocks of overlap on worker `at` (and, when
/// `routed_to_at`, is routed there, preview and request alike; otherwise equal costs
/// leave the choice to the draw); then served, the worker it lands on reports the
/// cached tokens its overlap predicts (its last token is always computed).
async fn check(addr: SocketAddr, body: &Value, at: u64, want: u64, routed_to_at: bool) -> u64 {
    let (chosen, overlaps, isl) = preview(addr, body).await;
    assert_eq!(overlap_at(&overlaps, at), want, "overlap on worker {at}: {overlaps:?}");
    let served = call(addr, Method::POST, "/v1/chat/completions", &[], Some(body)).await;
    assert_eq!(served.status, 200, "{}", served.text());
    let worker = served.worker().expect("x-kvroute-worker");
    if routed_to_at {
        assert_eq!((chosen, worker), (at, at), "routed where the image is: {overlaps:?}");
    }
    let cached = served.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let predicted = overlap_at(&overlaps, worker).min((isl - 1) / BLOCK) * BLOCK;
    assert_eq!(cached, predicted, "worker {worker}'s hits agree with the prediction ({overlaps:?})");
    indexed(addr, body, worker).await;
    worker
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_turns_follow_the_worker_that_holds_the_image() {
    let workers = [sim_worker().await, sim_worker().await];
    let p = proxy(&workers).await;
    let addr = p.local_addr();
    eventually(30_000, "both streams connect", || async {
        let listed = get(addr, "/workers").await.json();
        let rows = listed["workers"].as_array().cloned().unwrap_or_default();
        rows.iter().filter(|w| w["kv_events"]["streams"][0]["connected"] == true).count() == 2
    })
    .await;
    let (x, y) = (data_url(PNG), data_url(OTHER_PNG));

    // The first turn, placed on worker 2; the image starts at token 16 (block 1).
    let first = image_chat(&x, false);
    let pinned = call(addr, Method::POST, "/v1/chat/completions", &[("x-worker-id", "2")], Some(&first)).await;
    assert_eq!((pinned.status.as_u16(), pinned.worker()), (200, Some(2)), "{}", pinned.text());
    let nudge = image_chat(&y, false);
    // A stream connected before the first batch may have missed it: a second request
    // elsewhere shows the gap and the replay fills it.
    let other = call(addr, Method::POST, "/v1/chat/completions", &[("x-worker-id", "1")], Some(&nudge)).await;
    assert_eq!(other.status, 200, "{}", other.text());
    indexed(addr, &first, 2).await;
    let (_, _, isl) = preview(addr, &first).await;
    let first_blocks = isl / BLOCK;
    assert!(first_blocks >= 3, "the image fills blocks 1 and 2");

    // The follow-up with the same image goes to worker 2 and hits every first-turn block.
    check(addr, &image_chat(&x, true), 2, first_blocks, true).await;
    // Worker 1 holds image y; the same follow-up text with y goes there and hits it all.
    check(addr, &image_chat(&y, true), 1, first_blocks, true).await;
    // A third image: both workers hold only the text before the image (block 0).
    let third = data_url(include_bytes!("../../../media/tests/images/palette.png"));
    let chosen = check(addr, &image_chat(&third, true), 2, 1, false).await;
    assert!(chosen == 1 || chosen == 2);
    // The text alone matches the text block before the image and nothing after it.
    let mut text_only = image_chat(&x, true);
    text_only["messages"][0]["content"].as_array_mut().unwrap().remove(1);
    check(addr, &text_only, 2, 1, false).await;
    let _ = p.shutdown().await;
    for w in workers {
        w.shutdown().await;
    }
}
