//! Text, chat and token-id prompts: after one request, `/route/preview` of a follow-up
//! shows on the worker that served it the overlap vLLM then really finds in its prefix
//! cache (`usage.prompt_tokens_details.cached_tokens`), and routes there.

use serde_json::{json, Value};

use crate::engine::{BLOCK_TOKENS, MODEL};
use crate::fleet::{blocks, fleet, token_prompt, tokens, Fleet};

/// Sends `first`, waits until kvroute's index holds its blocks on the worker that
/// served it, then checks the follow-up: the preview routes it there with at least
/// `min_blocks` of overlap, kvroute tokenized both prompts as vLLM did, and vLLM's
/// cache hit equals the predicted overlap exactly. Returns that overlap in blocks.
#[track_caller]
pub fn check_follow_up(f: &Fleet, path: &str, first: &Value, follow: &Value, min_blocks: u64) -> u64 {
    let isl = f.preview(first).isl_tokens();
    let a = f.send(path, first, None);
    assert_eq!(a.prompt_tokens(), isl, "kvroute tokenized the first prompt as vLLM did");
    f.wait_overlap(first, a.worker, blocks(isl));
    let p = f.preview(follow);
    let predicted = p.overlap(a.worker);
    assert_eq!(p.worker(), a.worker, "the follow-up goes where its prefix is: {}", p.0);
    assert!(predicted >= min_blocks, "predicted overlap {predicted} blocks, want at least {min_blocks}: {}", p.0);
    let b = f.send(path, follow, None);
    assert_eq!(b.worker, a.worker, "served where the preview said");
    assert_eq!(b.prompt_tokens(), p.isl_tokens(), "kvroute tokenized the follow-up as vLLM did");
    assert_eq!(b.cached_tokens(), predicted * BLOCK_TOKENS as u64, "vLLM's prefix-cache hit is the predicted overlap");
    predicted
}

/// Deterministic prose of `words` words from `seed`.
pub fn prose(seed: u64, words: usize) -> String {
    const VOCAB: [&str; 24] = [
        "router", "cache", "block", "prefix", "worker", "engine", "token", "request", "stream", "event", "queue",
        "load", "session", "batch", "model", "index", "latency", "decode", "prefill", "replica", "salt", "adapter",
        "fleet", "policy",
    ];
    tokens(seed, words).iter().map(|t| VOCAB[*t as usize % VOCAB.len()]).collect::<Vec<_>>().join(" ")
}

#[test]
fn token_id_prompts_overlap_as_vllm_caches_them() {
    let Some(f) = fleet() else { return };
    let ids = tokens(1, 330);
    // 200 tokens hold 3 full blocks; the follow-up extends them.
    let got = check_follow_up(&f, "/v1/completions", &token_prompt(MODEL, &ids[..200]), &token_prompt(MODEL, &ids), 3);
    assert_eq!(got, 3);
}

#[test]
fn text_prompts_overlap_as_vllm_caches_them() {
    let Some(f) = fleet() else { return };
    let first = format!("Notes on routing.\n{}\n", prose(2, 180));
    let follow = format!("{first}Question: {}?", prose(3, 40));
    let body = |p: &str| json!({"model": MODEL, "prompt": p, "max_tokens": 2, "temperature": 0});
    check_follow_up(&f, "/v1/completions", &body(&first), &body(&follow), 2);
}

#[test]
fn chat_prompts_with_system_and_turns_overlap_as_vllm_caches_them() {
    let Some(f) = fleet() else { return };
    let system = json!({"role": "system", "content": format!("You answer in one line. {}", prose(4, 150))});
    let turn1 = json!({"role": "user", "content": prose(5, 30)});
    let first = json!({"model": MODEL, "messages": [system, turn1], "max_tokens": 4, "temperature": 0});
    // The follow-up carries the first answer as vLLM gave it, then a second question.
    let answer = f.send("/v1/chat/completions", &first, None);
    let reply = json!({"role": "assistant", "content": answer.text()});
    let turn2 = json!({"role": "user", "content": prose(6, 30)});
    let follow = json!({"model": MODEL, "messages": [system, turn1, reply, turn2], "max_tokens": 4, "temperature": 0});
    check_follow_up(&f, "/v1/chat/completions", &first, &follow, 3);
}

/// Tools reach the template as vLLM dumps them: an unset `strict` is not printed (it once
/// cost kvroute 8 extra tokens here, 325 vs 317).
#[test]
fn chat_prompts_with_tools_overlap_as_vllm_caches_them() {
    let Some(f) = fleet() else { return };
    let tool = |name: &str, seed| {
        json!({"type": "function", "function": {
            "name": name, "description": prose(seed, 40),
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "où"}}, "required": ["city"]}}})
    };
    let tools = json!([tool("get_weather", 7), tool("get_time", 8)]);
    let ask = |text: String| json!({"role": "user", "content": text});
    // vLLM refuses the default `tool_choice: auto` without a tool-call parser; with
    // `none` it still renders the tools into the prompt.
    let first = json!({"model": MODEL, "tools": tools, "tool_choice": "none", "messages": [ask(prose(9, 20))],
        "max_tokens": 2, "temperature": 0});
    let follow = json!({"model": MODEL, "tools": tools, "tool_choice": "none", "messages": [
        ask(prose(9, 20)),
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        ask(prose(10, 10)),
    ], "max_tokens": 2, "temperature": 0});
    check_follow_up(&f, "/v1/chat/completions", &first, &follow, 2);
}
