//! vLLM's preprocessing endpoints: render and `/tokenize` answer exactly the ids whose
//! block hashes the worker publishes; their shapes, as vllm-router reads them; refusals.

use std::net::SocketAddr;
use std::time::Duration;

use hyper::StatusCode;
use router_core::{seq_hashes, BlockSize, HashSeed};
use serde_json::{json, Value};

use crate::events::stored_blocks;
use crate::support::{bounded, fast_config, post, request, start};

const BS: usize = 4;

/// POSTs `body` and returns the JSON answer, which must be a 200.
async fn ok(a: SocketAddr, path: &str, body: &Value) -> Value {
    let r = post(a, path, &body.to_string()).await;
    assert_eq!(r.status, StatusCode::OK, "{path} {body}: {:?}", r.body);
    assert_eq!(r.content_type, "application/json");
    r.json()
}

fn ids(v: &Value) -> Vec<u32> {
    let items = v.as_array().unwrap_or_else(|| panic!("not an id array: {v}"));
    items.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()).expect("a u32 id")).collect()
}

/// Checks one vLLM `GenerateRequest` and returns its token ids.
#[track_caller]
fn check_generate_request(g: &Value, prefix: &str, max_tokens: u64) -> Vec<u32> {
    assert!(g["request_id"].as_str().is_some_and(|id| id.starts_with(prefix)), "{g}");
    assert!(g["features"].is_null(), "text prompts have no multimodal features: {g}");
    assert_eq!(g["sampling_params"]["max_tokens"], max_tokens, "{g}");
    assert_eq!(g["sampling_params"]["n"], 1, "{g}");
    assert_eq!((&g["priority"], &g["kv_transfer_params"]), (&json!(0), &Value::Null), "{g}");
    let got = ids(&g["token_ids"]);
    assert!(!got.is_empty(), "{g}");
    got
}

/// The ids of a prompt's full blocks, the ones a worker stores.
fn full_blocks(ids: &[u32]) -> &[u32] {
    &ids[..ids.len() / BS * BS]
}

#[tokio::test]
async fn render_and_tokenize_give_the_ids_whose_blocks_the_worker_publishes() {
    let mut cfg = fast_config();
    cfg.replay_port = Some(0);
    let w = start(cfg).await;
    let a = w.http_addr();
    let prompt = "a prompt whose blocks the worker publishes, héllo";
    let chat = json!({"model": "sim-test", "messages": [{"role": "user", "content": "and a chat of its own"}]});

    let rendered = ok(a, "/v1/completions/render", &json!({"model": "sim-test", "prompt": prompt})).await;
    let list = rendered.as_array().expect("completion render answers a list");
    assert_eq!(list.len(), 1);
    let text_ids = check_generate_request(&list[0], "cmpl-", 16);
    assert_eq!(list[0]["model"], "sim-test");
    let chat_ids = check_generate_request(&ok(a, "/v1/chat/completions/render", &chat).await, "chatcmpl-", 16);

    let tokenized = ok(a, "/tokenize", &json!({"prompt": prompt, "add_special_tokens": true})).await;
    assert_eq!(ids(&tokenized["tokens"]), text_ids);
    assert_eq!(tokenized["count"], text_ids.len());
    assert_eq!(tokenized["max_model_len"], 4096 * BS);
    assert!(tokenized["token_strs"].is_null());
    assert_eq!(ids(&ok(a, "/tokenize", &chat).await["tokens"]), chat_ids);

    // Generation counts the same prompt tokens, and its KV events carry them.
    for (body, n) in [(json!({"prompt": prompt}), text_ids.len()), (chat.clone(), chat_ids.len())] {
        let path = if body.get("messages").is_some() { "/v1/chat/completions" } else { "/v1/completions" };
        let mut body = body;
        body["max_tokens"] = json!(1);
        assert_eq!(ok(a, path, &body).await["usage"]["prompt_tokens"], n);
    }
    let want: Vec<u32> = [full_blocks(&text_ids), full_blocks(&chat_ids)].concat();
    let bs = BlockSize::new(BS as u32).expect("a block size");
    let want_hashes: Vec<u64> = [full_blocks(&text_ids), full_blocks(&chat_ids)]
        .iter()
        .flat_map(|p| seq_hashes(p, bs, HashSeed::DEFAULT))
        .map(|h| h.0)
        .collect();
    // The publisher may still be sending the last batch: wait for every block.
    let stored = bounded(async {
        loop {
            let stored = stored_blocks(&w).await;
            if stored.len() >= want.len() / BS {
                return stored;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let (hashes, blocks): (Vec<u64>, Vec<Vec<u32>>) = stored.into_iter().unzip();
    assert_eq!(blocks.concat(), want, "the stored blocks hold the rendered ids");
    assert_eq!(hashes, want_hashes, "and hash as router-core hashes the rendered ids");
    w.shutdown().await;
}

#[tokio::test]
async fn render_takes_a_batch_and_echoes_what_the_worker_models() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    let body = json!({"prompt": ["first prompt", [7, 8, 9]], "max_tokens": 5, "stream": true,
        "stream_options": {"include_usage": true}, "cache_salt": "s", "priority": 0, "temperature": 0.5});
    let rendered = ok(a, "/v1/completions/render", &body).await;
    let list = rendered.as_array().expect("a list");
    assert_eq!(list.len(), 2, "one GenerateRequest per prompt");
    let first = check_generate_request(&list[0], "cmpl-", 5);
    assert_eq!(first, ids(&ok(a, "/tokenize", &json!({"prompt": "first prompt"})).await["tokens"]));
    assert_eq!(check_generate_request(&list[1], "cmpl-", 5), [7, 8, 9], "id prompts pass through");
    assert_ne!(list[0]["request_id"], list[1]["request_id"]);
    for g in list {
        assert_eq!((&g["stream"], &g["cache_salt"]), (&json!(true), &json!("s")));
        assert_eq!(g["stream_options"], json!({"include_usage": true}));
    }
    w.shutdown().await;
}

#[tokio::test]
async fn detokenize_inverts_tokenize() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    for text in ["héllo wörld", "x€ and 😀 too", "plain"] {
        let t = ok(a, "/tokenize", &json!({"prompt": text, "return_token_strs": true})).await;
        let strs = t["token_strs"].as_array().expect("token_strs when asked");
        assert_eq!(strs.len(), ids(&t["tokens"]).len());
        let back = ok(a, "/detokenize", &json!({"model": "sim-test", "tokens": t["tokens"]})).await;
        assert_eq!(back, json!({"prompt": text}));
    }
    w.shutdown().await;
}

#[track_caller]
fn check_refusal(path: &str, body: &str, status: StatusCode, param: Option<&str>, r: &crate::support::Reply) {
    assert_eq!(r.status, status, "{path} {body}: {:?}", r.body);
    let v = r.json();
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{path} {body}: {v}");
    assert_eq!(v["error"]["code"], status.as_u16(), "{v}");
    assert_eq!(v["error"]["param"].as_str(), param, "{path} {body}: {v}");
}

#[tokio::test]
async fn bad_bodies_get_json_errors() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    let bad = StatusCode::BAD_REQUEST;
    let (render, chat) = ("/v1/completions/render", "/v1/chat/completions/render");
    for (path, body, param) in [
        (render, "{", None),
        (render, "[]", None),
        (render, "", None),
        (render, r#"{"max_tokens":1}"#, Some("prompt")),
        (render, r#"{"prompt":""}"#, Some("prompt")),
        (render, r#"{"prompt":["a",""]}"#, Some("prompt")),
        (render, r#"{"prompt":["a",{}]}"#, Some("prompt")),
        (render, r#"{"prompt":[2147483648]}"#, Some("prompt")),
        (render, r#"{"prompt":"x","max_tokens":0}"#, Some("max_tokens")),
        (render, r#"{"prompt":"x","stream":"yes"}"#, Some("stream")),
        (chat, r#"{"messages":[]}"#, Some("messages")),
        (chat, r#"{"prompt":"x"}"#, Some("messages")),
        ("/tokenize", "{", None),
        ("/tokenize", r#"{"prompt":5}"#, Some("prompt")),
        ("/tokenize", r#"{"prompt":""}"#, Some("prompt")),
        ("/tokenize", r#"{"prompt":"x","add_special_tokens":"yes"}"#, Some("add_special_tokens")),
        ("/tokenize", r#"{"messages":"x"}"#, Some("messages")),
        ("/detokenize", "nope", None),
        ("/detokenize", "{}", Some("tokens")),
        ("/detokenize", r#"{"tokens":[-1]}"#, Some("tokens")),
        ("/detokenize", r#"{"tokens":[1.5]}"#, Some("tokens")),
    ] {
        check_refusal(path, body, bad, param, &post(a, path, body).await);
    }
    for path in [render, chat, "/tokenize", "/detokenize"] {
        let r = request(a, "GET", path, "").await;
        check_refusal(path, "", StatusCode::METHOD_NOT_ALLOWED, None, &r);
    }
    // The worker still serves after all of that.
    assert_eq!(ok(a, "/tokenize", &json!({"prompt": "still here"})).await["count"], 3);
    w.shutdown().await;
}
