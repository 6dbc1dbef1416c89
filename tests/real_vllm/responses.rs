//! The Responses API on real vLLM: kvroute renders a request's `instructions` and
//! `input` as the chat vLLM builds from them, so it counts the prompt's tokens as vLLM
//! does, its index holds the blocks vLLM's events announce, and a conversation resent
//! with another turn goes where its prefix is cached and hits exactly the predicted
//! blocks there.

use serde_json::{json, Value};

use crate::engine::{BLOCK_TOKENS, MODEL};
use crate::fleet::{blocks, fleet};
use crate::prompts::prose;

/// `usage.input_tokens` and `usage.input_tokens_details.cached_tokens` of a response.
fn usage(v: &Value) -> (u64, u64) {
    let u = &v["usage"];
    (
        u["input_tokens"].as_u64().expect("usage.input_tokens"),
        u["input_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
    )
}

#[test]
fn a_responses_conversation_routes_on_the_prefix_vllm_caches() {
    let Some(f) = fleet() else { return };
    let first = json!({
        "model": MODEL,
        "instructions": prose(41, 220),
        "input": [{"role": "user", "content": [{"type": "input_text", "text": prose(42, 40)}]}],
        "max_output_tokens": 4,
        "temperature": 0,
    });
    let isl = f.preview(&first).isl_tokens();
    assert!(isl > 3 * BLOCK_TOKENS as u64, "several blocks: {isl} tokens");
    let a = f.send("/v1/responses", &first, None);
    assert_eq!(a.body["object"], "response", "{}", a.body);
    assert_eq!(usage(&a.body).0, isl, "kvroute tokenized the Responses request as vLLM did");
    f.wait_overlap(&first, a.worker, blocks(isl));

    let mut follow = first.clone();
    let turns = follow["input"].as_array_mut().unwrap();
    turns.push(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Noted."}]}));
    turns.push(json!({"role": "user", "content": prose(43, 30)}));
    let p = f.preview(&follow);
    let predicted = p.overlap(a.worker);
    assert_eq!(p.worker(), a.worker, "the follow-up goes where its prefix is: {}", p.0);
    assert!(predicted >= 3, "predicted overlap {predicted} blocks: {}", p.0);
    let b = f.send("/v1/responses", &follow, None);
    assert_eq!(b.worker, a.worker, "served where the preview said");
    let (input_tokens, cached) = usage(&b.body);
    assert_eq!(input_tokens, p.isl_tokens(), "kvroute tokenized the follow-up as vLLM did");
    assert_eq!(cached, predicted * BLOCK_TOKENS as u64, "vLLM's prefix-cache hit is the predicted overlap");
    eprintln!("real_vllm: responses: {isl} then {input_tokens} input tokens, {predicted} blocks predicted and hit on worker {}", a.worker);
}

#[test]
fn the_openai_client_gets_whole_and_streamed_responses_through_kvroute() {
    let Some(f) = fleet() else { return };
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("real_vllm/openai_responses.py");
    let out = std::process::Command::new(&f.env.python)
        .arg(&script)
        .arg(f.router.base_url())
        .arg(MODEL)
        .output()
        .expect("python runs");
    assert!(out.status.success(), "openai_responses.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let got: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let (whole, stream) = (&got["whole"], &got["stream"]);
    assert_eq!(whole["output_tokens"], 12, "{got}");
    assert_eq!(stream["first"], "response.created", "{got}");
    assert_eq!(stream["last"], "response.completed", "{got}");
    assert!(stream["deltas"].as_u64().unwrap_or(0) >= 4, "streamed in many events: {got}");
    assert_eq!(stream["text"], stream["final_text"], "{got}");
    assert_eq!(stream["text"], whole["text"], "greedy: the stream says what the whole answer says: {got}");
}

/// `/tokenize` and `/detokenize` pass through to vLLM (routed by load): its count is
/// the one kvroute's preview of the same completion prompt gives, and its tokens read
/// back as the prompt.
#[test]
fn tokenize_and_detokenize_pass_through_to_vllm() {
    let Some(f) = fleet() else { return };
    let prompt = prose(44, 60);
    let isl = f.preview(&json!({"model": MODEL, "prompt": prompt})).isl_tokens();
    let t = f.send("/tokenize", &json!({"model": MODEL, "prompt": prompt}), None);
    assert_eq!(t.body["count"], isl, "vLLM's count is kvroute's: {}", t.body);
    let d = f.send("/detokenize", &json!({"model": MODEL, "tokens": t.body["tokens"]}), None);
    // A special token the tokenizer adds may read back too.
    assert!(d.body["prompt"].as_str().is_some_and(|p| p.contains(prompt.as_str())), "{}", d.body);
}
