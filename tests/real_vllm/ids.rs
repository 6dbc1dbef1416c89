//! `forward_token_ids`: kvroute sends a completion's text prompt to vLLM as the token
//! ids it made of it, and vLLM answers as it answers the text (the same greedy tokens,
//! the same prompt length, the same stream). A prompt that must stay text stays text.

use std::time::Duration;

use serde_json::{json, Value};

use crate::engine::{LORA, MODEL};
use crate::fleet::{fleet, Fleet};
use crate::http;
use crate::prompts::prose;
use crate::router::{build_binary, config, Kvroute};

const COUNTER: &str = "kvroute_prompts_sent_as_token_ids_total";

/// A second kvroute over the fleet's engines, with `forward_token_ids` on, once every
/// engine's tokenizer check is in. Each must agree: vLLM's `/tokenize` gives kvroute's ids
/// for the probe text, so kvroute sends ids to it.
fn start(f: &Fleet) -> Kvroute {
    let dir = crate::procs::scratch_dir("kvroute-real-vllm-ids");
    let g = Kvroute::start_with(&build_binary(), &dir, "kvroute-ids", |port| {
        let adapters = format!("lora_adapters = [\"{LORA}\"]\n");
        let text = config(&f.env.model, port, &f.engines);
        assert!(text.contains(&adapters), "the model's section is where the key goes: {text}");
        text.replacen(&adapters, &format!("{adapters}forward_token_ids = true\n"), 1)
    });
    let checked = |g: &Kvroute| {
        let v = g.tokenizer_checks();
        v.len() == f.engines.len() && v.iter().all(|c| c == "agrees" || c == "differs")
    };
    g.wait(Duration::from_secs(60), "every engine's tokenizer is checked", checked);
    assert!(
        g.tokenizer_checks().iter().all(|c| c == "agrees"),
        "vLLM tokenizes as kvroute: {:?}",
        g.tokenizer_checks()
    );
    g
}

/// The greedy text of a body, whole or streamed, and its usage's prompt tokens (whole: with
/// the prompt's ids when the body asked for them).
fn answer(r: &http::Response, stream: bool) -> (String, Value) {
    assert_eq!(r.status, 200, "{}", r.text());
    if !stream {
        let v = r.json();
        let prompt = json!([v["usage"]["prompt_tokens"], v["choices"][0]["prompt_token_ids"]]);
        return (v["choices"][0]["text"].as_str().expect("text").to_string(), prompt);
    }
    let chunks: Vec<Value> = r
        .text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    let text = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    let usage = chunks.iter().rev().find_map(|c| c.get("usage").filter(|u| !u.is_null())).cloned();
    (text, usage.map_or(Value::Null, |u| u["prompt_tokens"].clone()))
}

fn sent_as_ids(g: &Kvroute) -> f64 {
    counter(g, &format!("{COUNTER}{{model=\"{MODEL}\"}} "))
}

/// The value of the series `line` (its name and labels) on `g`'s `/metrics`, 0 if absent.
fn counter(g: &Kvroute, line: &str) -> f64 {
    let r = http::request(g.addr(), "GET", "/metrics", &[], None, Duration::from_secs(5)).expect("metrics");
    r.text().lines().find_map(|l| l.strip_prefix(line)?.parse().ok()).unwrap_or(0.0)
}

/// Sends `body` to worker 1 straight and through `g` (pinned there): the answers must
/// agree, and `g` counts it as sent as ids exactly when `as_ids`.
#[track_caller]
fn check(f: &Fleet, g: &Kvroute, what: &str, body: Value, as_ids: bool) {
    let stream = body["stream"] == true;
    let direct =
        http::request(f.engines[0].addr(), "POST", "/v1/completions", &[], Some(&body), Duration::from_secs(120))
            .expect("straight to vLLM");
    let before = sent_as_ids(g);
    let through = g.post("/v1/completions", &[("x-worker-id", "1")], &body);
    assert_eq!(through.header("x-kvroute-worker"), Some("1"), "{what}: pinned");
    let (got, want) = (answer(&through, stream), answer(&direct, stream));
    assert_eq!(got, want, "{what}: vLLM answers the ids as the text");
    if body["return_token_ids"] == true {
        assert!(got.1[1].as_array().is_some_and(|ids| !ids.is_empty()), "{what}: the prompt's ids: {got:?}");
    }
    assert_eq!(sent_as_ids(g) - before, f64::from(u8::from(as_ids)), "{what}: sent as ids");
}

#[test]
fn text_prompts_sent_as_token_ids_are_answered_as_their_text_is() {
    let Some(f) = fleet() else { return };
    let g = start(&f);
    let prompt = format!("Notes on routing.\n{}\n", prose(40, 150));
    let body = |extra: Value| {
        let mut b = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0});
        b.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        b
    };
    check(&f, &g, "whole", body(json!({})), true);
    check(&f, &g, "streamed", body(json!({"stream": true, "stream_options": {"include_usage": true}})), true);
    let odd = "Tabs\tand  doubled spaces, naïve café, 数字 12345 — and a trailing newline\n";
    check(
        &f,
        &g,
        "unicode and spacing",
        json!({"model": MODEL, "prompt": odd, "max_tokens": 8, "temperature": 0}),
        true,
    );
    // New text of the words above: kvroute's tokenizer reads it from its memo of words,
    // and the ids it sends are the ones vLLM makes of the text.
    let words = format!("kvroute_tokenizer_cache_words_total{{model=\"{MODEL}\",result=\"hit\"}} ");
    let before = counter(&g, &words);
    let known = format!("Notes on routing.\n{}\n", prose(41, 150));
    let ids = json!({"model": MODEL, "prompt": known, "max_tokens": 8, "temperature": 0, "return_token_ids": true});
    check(&f, &g, "new text of known words", ids, true);
    assert!(counter(&g, &words) - before >= 100.0, "the words came from the memo");
    // Echo returns the prompt as text, which only the text gives back exactly.
    check(&f, &g, "echo", body(json!({"echo": true})), false);
    check(&f, &g, "without special tokens", body(json!({"add_special_tokens": false})), false);
}
