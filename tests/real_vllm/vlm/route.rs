//! The image story again, now through the real `kvroute serve` in front of the VLM
//! server: kvroute renders, expands and hashes each image chat itself (the model's
//! folder is its `tokenizer`), follows the server's KV events, and its `/route/preview`
//! must show, before each request, exactly the overlap the test's own reading of the
//! events predicts, which vLLM's `cached_tokens` and `vllm:prefix_cache_hits` then
//! confirm ([`Ctx::ask`]). A simulated worker beside it holds none of these blocks, so
//! a request with a cached image goes to the VLM server.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{data_url, first_turn, Ctx, Part, Prompt, Turns, ASK, BS};
use crate::procs::{free_port, Proc};
use crate::router::{build_binary, Kvroute};
use crate::vlm_engine::{VLM, VLM_BLOCK_TOKENS};

/// The VLM server's worker id; the simulated worker is 2.
const ENGINE: u64 = 1;

/// kvroute and the simulated worker beside the VLM server.
pub(super) struct Front {
    kvroute: Kvroute,
    _sim: Proc,
}

fn config(port: u16, c: &Ctx, sim_port: u16) -> String {
    format!(
        r#"listen = "127.0.0.1:{port}"
seed = 7

[trust]
cidrs = ["127.0.0.0/8"]

[health_check]
interval_ms = 500
timeout_ms = 1000

[router]
mode = "kv"
block_size = {VLM_BLOCK_TOKENS}
approximate = false
prefill_tokens_frac_of_batch = 0.0
decode_blocks_frac_of_kv = 0.0

[[models]]
name = "{VLM}"
tokenizer = "{model}"

[[workers]]
id = {ENGINE}
url = "http://127.0.0.1:{http}"
model = "{VLM}"
kv_events = "tcp://127.0.0.1:{events}"
kv_events_replay = "tcp://127.0.0.1:{replay}"

[[workers]]
id = 2
url = "http://127.0.0.1:{sim_port}"
model = "{VLM}"
"#,
        model = c.model.display(),
        http = c.server.http_port,
        events = c.server.events_port,
        replay = c.server.replay_port,
    )
}

impl Front {
    fn start(c: &Ctx) -> Front {
        let bin = build_binary();
        let sim_port = free_port();
        let sim_args: Vec<String> = ["sim-worker", "--port", &sim_port.to_string(), "--events-port"]
            .iter()
            .map(|s| s.to_string())
            .chain([free_port().to_string(), "--block-size".into(), VLM_BLOCK_TOKENS.to_string()])
            .collect();
        let name = format!("sim-{}", c.family.name);
        let sim = Proc::spawn(&name, &bin, &sim_args, &[], &c.dir.join(format!("{name}.log")));
        let name = format!("kvroute-{}", c.family.name);
        let kvroute = Kvroute::start_with(&bin, &c.dir, &name, |port| config(port, c, sim_port));
        Front { kvroute, _sim: sim }
    }

    /// kvroute's preview of `body`, once its overlap on the VLM server is `want` blocks
    /// (the events reach it asynchronously; up to 10 s).
    #[track_caller]
    fn preview(&self, what: &str, body: &Value, want: usize) -> Value {
        let t0 = Instant::now();
        loop {
            let r = self.kvroute.post("/route/preview", &[], body);
            assert_eq!(r.status, 200, "{what}: preview: {}", r.text());
            let v = r.json();
            let row = v["explanation"].as_array().and_then(|rows| rows.iter().find(|w| w["worker"] == ENGINE));
            let got = row.map_or(0, |w| w["overlap"]["device"].as_u64().unwrap_or(0));
            if got == want as u64 || t0.elapsed() > Duration::from_secs(10) {
                assert_eq!(got, want as u64, "{what}: kvroute's overlap on the VLM server: {v}");
                return v;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends `body` through kvroute after checking its preview against kvroute's view
    /// `p` and the `predicted` overlap; returns vLLM's answer. With nothing cached the
    /// request is pinned to the VLM server (the simulated one would do as well).
    #[track_caller]
    pub(super) fn chat(&self, what: &str, body: &Value, p: &Prompt, predicted: usize) -> Value {
        let v = self.preview(what, body, predicted);
        assert_eq!(v["isl_tokens"], p.tokens.len(), "{what}: kvroute's prompt, images expanded, is vLLM's");
        assert_eq!(v["request_blocks"], p.hashes.len(), "{what}: kvroute's full blocks");
        let pin = ENGINE.to_string();
        let headers: Vec<(&str, &str)> = if predicted == 0 { vec![("x-worker-id", &pin)] } else { vec![] };
        if predicted > 0 {
            assert_eq!(v["worker"], ENGINE, "{what}: kvroute picks the server holding the image: {v}");
        }
        let r = self.kvroute.post("/v1/chat/completions", &headers, body);
        assert_eq!(r.status, 200, "{what} through kvroute: {}", r.text());
        assert_eq!(r.header("x-kvroute-worker"), Some(pin.as_str()), "{what}: served by the VLM server");
        eprintln!("real_vllm: {what}: kvroute's preview overlap {predicted} of {} blocks", p.hashes.len());
        r.json()
    }

    /// `body` answered as a client error with `status` and OpenAI error `code`.
    #[track_caller]
    fn refused(&self, what: &str, body: &Value, status: u16, code: &str) {
        for path in ["/v1/chat/completions", "/route/preview"] {
            let r = self.kvroute.post(path, &[], body);
            assert_eq!(r.status, status, "{what} at {path}: {}", r.text());
            assert_eq!(r.json()["error"]["code"], code, "{what} at {path}: {}", r.text());
        }
    }
}

/// Long enough that the image starts in the second block, and unlike the direct
/// story's intro, so the blocks are new to the server.
const INTRO: &str = "Through the router this time: a picture from the test suite, which checks \
    that kvroute finds the blocks the engine cached for it: ";

fn with_image(url: &str) -> Turns {
    first_turn(vec![Part::Text(INTRO), Part::Image(url.into(), None), Part::Text(ASK)])
}

fn follow_up(url: &str) -> Turns {
    let mut t = with_image(url);
    t.push(("assistant", vec![Part::Text("A small square of coloured noise.")]));
    t.push(("user", vec![Part::Text("Which colour covers the most of it?")]));
    t
}

/// A chat body with the image parts of `turns` left out.
fn text_only(turns: &Turns) -> Turns {
    let keep = |p: &&Part| matches!(p, Part::Text(_));
    turns.iter().map(|(role, parts)| (*role, parts.iter().filter(keep).cloned().collect())).collect()
}

pub(super) fn through_kvroute(c: &mut Ctx) {
    c.front = Some(Front::start(c));
    let (x, y) = (data_url(c.family.images[0]), data_url(c.family.images[1]));

    let first = c.ask("kvroute: first turn", &with_image(&x), None);
    assert_eq!(first.predicted_blocks, 0, "new text, nothing cached");
    let (_, x_off, x_len) = first.prompt.images[0].clone();
    let image_block = x_off / BS;

    let again = c.ask("kvroute: follow-up, same image", &follow_up(&x), None);
    assert!(again.predicted_blocks * BS >= x_off + x_len, "the preview's overlap covers the image's blocks");

    let other = c.ask("kvroute: follow-up, another image", &follow_up(&y), None);
    assert_eq!(other.predicted_blocks, image_block, "another image diverges at the image's first block");

    // The same text without the image matches the blocks before it, never the image's.
    let text = text_only(&follow_up(&x));
    let plain = c.ask("kvroute: the follow-up's text, no image", &text, None);
    assert!(plain.predicted_blocks <= image_block, "text never matches an image block");

    let salted = c.ask("kvroute: first turn, tenant-a", &with_image(&x), Some("tenant-a"));
    assert_eq!(salted.predicted_blocks, 0, "a salt keeps unsalted image blocks apart");
    let salted_again = c.ask("kvroute: follow-up, tenant-a", &follow_up(&x), Some("tenant-a"));
    assert!(salted_again.predicted_blocks * BS >= x_off + x_len, "the tenant's follow-up hits through the image");
    let other_tenant = c.ask("kvroute: follow-up, tenant-b", &follow_up(&x), Some("tenant-b"));
    assert_eq!(other_tenant.predicted_blocks, 0, "another tenant's image blocks are not shared");

    let front = c.front.as_ref().expect("started");
    let img = |url: &str| {
        json!({"model": VLM, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    };
    front.refused("bad base64", &img("data:image/png;base64,@@@@"), 400, "invalid_image");
    front.refused("not an image", &img("data:image/png;base64,aGVsbG8gd29ybGQh"), 400, "invalid_image");
    front.refused("an http URL", &img("http://127.0.0.1:1/a.png"), 400, "image_url_not_allowed");
    let seventeen = json!({"model": VLM, "messages": [{"role": "user", "content": vec![
        json!({"type": "image_url", "image_url": {"url": x}}); 17]}]});
    front.refused("17 images", &seventeen, 400, "invalid_image");
}
