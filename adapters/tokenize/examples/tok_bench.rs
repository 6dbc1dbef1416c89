//! Measures what tokenization costs the router, printing one JSON object per case:
//! - chat: a long multi-turn agentic prompt (about 8k and 32k tokens) rendered and
//!   tokenized cold, against turn N+1 of the same conversation with turn N already cached;
//! - plain: a conversation of growing plain-text `/v1/completions` prompts (2k to 8k
//!   tokens, each turn's prompt extending the last), tokenized per request as the proxy
//!   does (`encode_text(text, true)`) with the cache off, with cuts only before added
//!   tokens (`gap_stride_bytes = 0`), and with word-gap cuts (the default);
//! - fresh: prompts of about 3,500 tokens that no earlier request had, with the word memo
//!   (`words_max`) off and on: what text the prefix cache cannot serve costs.
//!
//! Run: `cargo run --release -p kvroute-tokenize --example tok_bench`
//!
//! The model folders are built here: a byte-level BPE with the Qwen2 pre-tokenizer regex,
//! trained on generated text to an 8k vocabulary, with a ChatML-with-tools template; and an
//! 8k-word word-level vocabulary with a Whitespace pre-tokenizer, like the fleet
//! benchmark's workers. Figures are indicative of models of those shapes, not of any one.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvroute_tokenize::{CacheConfig, ChatRequest, ModelTokenizer, TokenizerConfig};
use serde_json::{json, Value};
use tokenizers::models::bpe::BpeTrainerBuilder;
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

const REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const WORDS: &[&str] = &[
    "the",
    "router",
    "request",
    "worker",
    "cache",
    "prefix",
    "token",
    "model",
    "tool",
    "call",
    "result",
    "error",
    "file",
    "function",
    "return",
    "value",
    "string",
    "number",
    "list",
    "user",
    "assistant",
    "system",
    "search",
    "weather",
    "Paris",
    "Tokyo",
    "because",
    "therefore",
    "and",
    "with",
    "from",
    "into",
    "over",
    "under",
    "latency",
    "throughput",
    "memory",
    "block",
    "hash",
    "schedule",
    "queue",
    "deadline",
    "retry",
    "timeout",
    "config",
    "deploy",
    "cluster",
    "node",
];
const TURNS_MAX: usize = 2000;

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
    fn sentence(&mut self, words: usize) -> String {
        let mut s = String::new();
        for i in 0..words {
            if i > 0 {
                s.push(' ');
            }
            s.push_str(WORDS[self.below(WORDS.len())]);
            if self.below(9) == 0 {
                s.push_str(&format!(" {}", self.below(100_000)));
            }
        }
        s.push('.');
        s
    }
}

fn build_model() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-tok-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let skeleton = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": REGEX}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": {}, "merges": []},
    });
    let mut tok: Tokenizer = skeleton.to_string().parse().expect("skeleton");
    let specials: Vec<AddedToken> =
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].iter().map(|s| AddedToken::from(*s, true)).collect();
    let mut trainer = TrainerWrapper::from(
        BpeTrainerBuilder::new()
            .vocab_size(8000)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(specials.clone())
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build(),
    );
    let mut rng = Rng(7);
    let corpus: Vec<String> = (0..4000).map(|_| rng.sentence(30)).collect();
    tok.train(&mut trainer, corpus.iter()).expect("train");
    tok.add_special_tokens(specials).expect("specials");
    tok.save(dir.join("tokenizer.json"), false).expect("save");
    let config = json!({
        "eos_token": "<|im_end|>",
        "chat_template": include_str!("../tests/it/templates/chatml_tools.jinja"),
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("config");
    dir
}

fn tools() -> Vec<Value> {
    (0..8)
        .map(|i| {
            json!({"type": "function", "function": {
                "name": format!("tool_{i}"),
                "description": format!("Tool number {i} that does useful work on files and returns JSON."),
                "parameters": {"type": "object", "properties": {
                    "path": {"type": "string", "description": "A file path"},
                    "limit": {"type": "integer", "minimum": 1}
                }, "required": ["path"]}
            }})
        })
        .collect()
}

/// An agentic conversation: user asks, assistant calls a tool, tool answers at length.
fn conversation(rng: &mut Rng, turns: usize) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content": rng.sentence(200)})];
    for t in 0..turns {
        m.push(json!({"role": "user", "content": rng.sentence(40)}));
        m.push(json!({"role": "assistant", "content": rng.sentence(20), "tool_calls": [
            {"id": format!("call_{t}"), "type": "function", "function": {"name": "tool_1", "arguments": {"path": format!("/src/{t}.rs"), "limit": t}}}
        ]}));
        m.push(json!({"role": "tool", "content": rng.sentence(250)}));
    }
    m
}

fn request(messages: Vec<Value>) -> ChatRequest {
    let mut req = ChatRequest::new(messages);
    req.tools = Some(tools());
    req
}

fn median_us(mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    samples[samples.len() / 2].as_secs_f64() * 1e6
}

fn time<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed())
}

fn bench(dir: &PathBuf, target_tokens: usize) -> Value {
    const REPEATS: usize = 7;
    let probe = ModelTokenizer::from_dir(dir).expect("load");
    // Grow the conversation until its prompt reaches the target size.
    let mut turns = 1;
    let mut rng = Rng(1);
    let base = loop {
        let msgs = conversation(&mut Rng(1), turns);
        let n = probe.encode_chat(&request(msgs.clone())).expect("encode").len();
        if n >= target_tokens || turns >= TURNS_MAX {
            break msgs;
        }
        turns += 1;
    };
    let mut next = base.clone();
    next.push(json!({"role": "user", "content": rng.sentence(40)}));
    let (req_n, req_next) = (request(base), request(next));

    let (mut render, mut encode_plain, mut cold, mut warm) = (vec![], vec![], vec![], vec![]);
    let mut tokens = 0;
    for _ in 0..REPEATS {
        // Fresh tokenizers each round, so neither the prefix cache nor the BPE word cache
        // inside `tokenizers` carries over between the cold measurements.
        let plain = ModelTokenizer::from_dir(dir).expect("load");
        let text = plain.render_chat(&req_n).expect("render");
        let (ids, d) = time(|| plain.encode_uncached(&text, false).expect("encode"));
        encode_plain.push(d);
        tokens = ids.len();
        let tok = ModelTokenizer::from_dir(dir).expect("load");
        let (_, d) = time(|| tok.render_chat(&req_n).expect("render"));
        render.push(d);
        let (cold_ids, d) = time(|| tok.encode_chat(&req_n).expect("encode"));
        cold.push(d);
        assert_eq!(cold_ids, ids);
        let (next_ids, d) = time(|| tok.encode_chat(&req_next).expect("encode"));
        warm.push(d);
        let text_next = tok.render_chat(&req_next).expect("render");
        assert_eq!(next_ids, tok.encode_uncached(&text_next, false).expect("encode"));
    }
    let cold_us = median_us(cold);
    let warm_us = median_us(warm);
    json!({
        "target_tokens": target_tokens,
        "prompt_tokens": tokens,
        "messages": req_n.messages.len(),
        "render_us": median_us(render),
        "encode_uncached_us": median_us(encode_plain),
        "cold_render_and_encode_us": cold_us,
        "next_turn_cached_us": warm_us,
        "speedup": cold_us / warm_us,
        "repeats": REPEATS,
    })
}

/// A word-level tokenizer over `w0` … `w7999`, split on whitespace.
fn build_words_model() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-tok-bench-words-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), json!(0));
    for i in 0..WORDS_VOCAB {
        vocab.insert(format!("w{i}"), json!(i + 1));
    }
    let file = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    });
    std::fs::write(dir.join("tokenizer.json"), file.to_string()).expect("tokenizer.json");
    dir
}

const WORDS_VOCAB: usize = 8000;

/// Prompts of a plain-text conversation: each extends the last by about `step_tokens`,
/// from `first_tokens` to `last_tokens` (counted with `tok`).
fn plain_turns(
    tok: &ModelTokenizer,
    words: bool,
    first_tokens: usize,
    step_tokens: usize,
    last_tokens: usize,
) -> Vec<String> {
    let mut rng = Rng(5);
    let mut text = String::new();
    let mut turns = Vec::new();
    let mut target = first_tokens;
    while target <= last_tokens {
        grow(tok, &mut rng, words, &mut text, target);
        turns.push(text.clone());
        target += step_tokens;
    }
    turns
}

/// Appends generated text (64 vocabulary words, or a sentence) to `text` until `tok`
/// makes at least `tokens` of it.
fn grow(tok: &ModelTokenizer, rng: &mut Rng, words: bool, text: &mut String, tokens: usize) {
    while tok.encode_uncached(text, true).expect("encode").len() < tokens {
        let chunk = if words {
            (0..64).map(|_| format!("w{} ", rng.below(WORDS_VOCAB))).collect::<String>()
        } else {
            format!("{} ", rng.sentence(40))
        };
        text.push_str(&chunk);
    }
}

fn with_cache(dir: &PathBuf, cache: CacheConfig) -> ModelTokenizer {
    ModelTokenizer::from_dir_with(dir, TokenizerConfig { cache, ..TokenizerConfig::default() }).expect("load")
}

/// Per-request times of the conversation's turns in order, through a fresh tokenizer in
/// each of three modes, repeated; medians over repeats, per turn, then over turns.
fn bench_plain(dir: &PathBuf, model: &str, words: bool) -> Value {
    const REPEATS: usize = 15;
    let probe = ModelTokenizer::from_dir(dir).expect("load");
    let turns = plain_turns(&probe, words, 2_048, 256, 8_192);
    let tokens: Vec<usize> = turns.iter().map(|t| probe.encode_uncached(t, true).expect("encode").len()).collect();
    let modes: [(&str, usize, usize); 3] =
        [("cache_off", 0, 0), ("cuts_before_added_tokens", 65_536, 0), ("word_gap_cuts", 65_536, 1024)];
    // The word memo serves none of the pieces here but the novel ones; off, so that
    // `cache_off` stays the pipeline itself.
    let load = |entries_max, gap_stride_bytes| {
        with_cache(dir, CacheConfig { entries_max, gap_stride_bytes, words_max: 0, ..CacheConfig::default() })
    };
    let mut out = serde_json::Map::new();
    out.insert("case".into(), json!("plain"));
    out.insert("model".into(), json!(model));
    out.insert("turns".into(), json!(turns.len()));
    out.insert("prompt_tokens_first_last".into(), json!([tokens[0], tokens[tokens.len() - 1]]));
    // Modes take turns request by request, so load from elsewhere on the machine hits all.
    let mut per_turn: Vec<Vec<Vec<Duration>>> = vec![vec![Vec::new(); turns.len()]; modes.len()];
    let mut reused = vec![0; modes.len()];
    for _ in 0..REPEATS {
        let toks: Vec<ModelTokenizer> = modes.iter().map(|&(_, entries, stride)| load(entries, stride)).collect();
        for (i, text) in turns.iter().enumerate() {
            for (m, tok) in toks.iter().enumerate() {
                let (ids, d) = time(|| tok.encode_text(text, true).expect("encode"));
                assert_eq!(ids.len(), tokens[i]);
                per_turn[m][i].push(d);
            }
        }
        for (m, tok) in toks.iter().enumerate() {
            reused[m] = tok.cache_stats().tokens_reused;
        }
    }
    for (m, (name, _, _)) in modes.iter().enumerate() {
        let medians: Vec<f64> = per_turn[m].iter().map(|d| median_us(d.clone())).collect();
        let mut sorted = medians.clone();
        sorted.sort_by(f64::total_cmp);
        out.insert(
            (*name).into(),
            json!({
                "request_median_us": sorted[sorted.len() / 2],
                "first_turn_us": medians[0],
                "last_turn_us": medians[medians.len() - 1],
                "tokens_reused_per_run": reused[m],
            }),
        );
    }
    out.insert("repeats".into(), json!(REPEATS));
    Value::Object(out)
}

/// Prompts no earlier request had (about `tokens` each, new words in a new order every
/// time), each tokenized once with the word memo off and on, alternately; medians per
/// request, the first prompt (cold memo) apart.
fn bench_fresh(dir: &PathBuf, model: &str, words: bool, tokens: usize) -> Value {
    const PROMPTS: usize = 40;
    let probe = ModelTokenizer::from_dir(dir).expect("load");
    let mut rng = Rng(17);
    let mut prompt = || {
        let mut text = String::new();
        grow(&probe, &mut rng, words, &mut text, tokens);
        text
    };
    let prompts: Vec<String> = (0..PROMPTS).map(|_| prompt()).collect();
    let off = with_cache(dir, CacheConfig { words_max: 0, ..CacheConfig::default() });
    let on = with_cache(dir, CacheConfig::default());
    let (mut t_off, mut t_on) = (Vec::new(), Vec::new());
    for text in &prompts {
        let (a, d_off) = time(|| off.encode_text(text, true).expect("encode"));
        let (b, d_on) = time(|| on.encode_text(text, true).expect("encode"));
        assert_eq!(a, b);
        t_off.push(d_off);
        t_on.push(d_on);
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let (first_off, first_on) = (us(t_off[0]), us(t_on[0]));
    let (off_us, on_us) = (median_us(t_off[1..].to_vec()), median_us(t_on[1..].to_vec()));
    let s = on.cache_stats();
    json!({
        "case": "fresh", "model": model, "prompt_tokens": tokens, "prompts": PROMPTS,
        "memo_off_request_median_us": off_us, "memo_on_request_median_us": on_us,
        "memo_on_over_off": on_us / off_us,
        "first_prompt_us": {"memo_off": first_off, "memo_on": first_on},
        "word_hits": s.word_hits, "word_misses": s.word_misses, "word_entries": s.word_entries,
    })
}

fn main() {
    let dir = build_model();
    for target in [8_192, 32_768] {
        println!("{}", bench(&dir, target));
    }
    println!("{}", bench_plain(&dir, "bpe_qwen2_regex", false));
    let words = build_words_model();
    println!("{}", bench_plain(&words, "word_level_whitespace", true));
    println!("{}", bench_fresh(&dir, "bpe_qwen2_regex", false, 3_500));
    println!("{}", bench_fresh(&words, "word_level_whitespace", true, 3_500));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&words);
}
