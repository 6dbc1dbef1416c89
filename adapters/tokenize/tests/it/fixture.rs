//! Builds small model folders for the tests: a BPE tokenizer trained here on a short
//! corpus, written as `tokenizer.json`, plus a `tokenizer_config.json` with a realistic chat
//! template. Nothing is downloaded. Each folder is built once per test run.

use std::path::PathBuf;
use std::sync::OnceLock;

use serde_json::{json, Value};
use tokenizers::models::bpe::BpeTrainerBuilder;
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// The pre-tokenizer regex of the Qwen2 family (digits one by one).
const QWEN_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The pre-tokenizer regex of the Llama 3 family (digits in runs of up to three).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const CORPUS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces.",
    "You are a helpful assistant. Answer the user's question about the weather in Paris.",
    "def get_weather(city: str, unit: str = \"celsius\") -> dict:\n    return {\"city\": city}\n",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
    "Routers send requests to the worker with the longest cached prefix of the prompt.",
    "Überprüfe die Datei — naïve café, 東京の天気は晴れです。 Emoji: 🚀✨ and tabs\tand\r\nlines.",
    "  leading spaces, trailing spaces   \n\n\nblank lines, 12345 67890 3.14159 1e-5",
    "I'll check: it's, we're, they've, I'm, you'd. SHOUTING AND MiXeD cAsE words.",
    "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"rust tokenizers\"}}\n</tool_call>",
    "The function returned 42 results; the top one is titled 'Prefix caching in vLLM'.",
];

/// A generated model folder.
pub struct Model {
    pub dir: PathBuf,
}

/// ChatML special tokens, a Qwen-style byte-level BPE, and the ChatML-with-tools template.
pub fn chatml() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        build(Spec {
            name: "chatml",
            pipeline: byte_level_pipeline(QWEN_REGEX, true),
            special: &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            plain: &["<tool_call>", "</tool_call>", "<think>", "</think>"],
            bos_post_processor: None,
            config: json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true},
                "bos_token": null,
                "chat_template": include_str!("templates/chatml_tools.jinja"),
            }),
        })
    })
}

/// Llama-3-style header tokens, a BOS post-processor, and the Llama-3.1-style template.
pub fn llama3() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        build(Spec {
            name: "llama3",
            pipeline: byte_level_pipeline(LLAMA3_REGEX, false),
            special: &[
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ],
            plain: &[],
            bos_post_processor: Some("<|begin_of_text|>"),
            config: json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "chat_template": include_str!("templates/llama3_tools.jinja"),
            }),
        })
    })
}

/// SentencePiece-style Metaspace (`prepend_scheme: first`), `[INST]` markers, and two named
/// templates: `default` and a `tool_use` one that loops over content parts.
pub fn inst() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        build(Spec {
            name: "inst",
            pipeline: json!({
                "normalizer": null,
                "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
                "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
                "byte_fallback": false,
            }),
            special: &[
                "<unk>",
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[TOOL_CALLS]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ],
            plain: &[],
            bos_post_processor: Some("<s>"),
            config: json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": [
                    {"name": "default", "template": include_str!("templates/inst_default.jinja")},
                    {"name": "tool_use", "template": include_str!("templates/inst_tool_use.jinja")},
                ],
            }),
        })
    })
}

fn byte_level_pipeline(regex: &str, nfc: bool) -> Value {
    json!({
        "normalizer": if nfc { json!({"type": "NFC"}) } else { Value::Null },
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        ]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "byte_fallback": false,
        "byte_level": true,
    })
}

struct Spec {
    name: &'static str,
    pipeline: Value,
    special: &'static [&'static str],
    plain: &'static [&'static str],
    bos_post_processor: Option<&'static str>,
    config: Value,
}

fn build(spec: Spec) -> Model {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("tokenize-fixture-{}", spec.name));
    std::fs::create_dir_all(&dir).expect("create fixture dir");
    let skeleton = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": spec.pipeline["normalizer"],
        "pre_tokenizer": spec.pipeline["pre_tokenizer"],
        "post_processor": null,
        "decoder": spec.pipeline["decoder"],
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": spec.pipeline["byte_fallback"],
                  "ignore_merges": false, "vocab": {}, "merges": []},
    });
    let mut tok: Tokenizer = skeleton.to_string().parse().expect("skeleton tokenizer");
    let specials: Vec<AddedToken> = spec.special.iter().map(|s| AddedToken::from(*s, true)).collect();
    let mut builder =
        BpeTrainerBuilder::new().vocab_size(700).min_frequency(1).show_progress(false).special_tokens(specials.clone());
    if spec.pipeline["byte_level"] == json!(true) {
        builder = builder.initial_alphabet(ByteLevel::alphabet().into_iter().collect());
    }
    let mut trainer = TrainerWrapper::from(builder.build());
    tok.train(&mut trainer, CORPUS.iter().copied()).expect("train");
    tok.add_special_tokens(specials.clone()).expect("add special tokens");
    let plain: Vec<AddedToken> = spec.plain.iter().map(|s| AddedToken::from(*s, false)).collect();
    tok.add_tokens(plain).expect("add tokens");
    let mut file: Value = serde_json::from_str(&tok.to_string(false).expect("serialize")).expect("json");
    if let Some(bos) = spec.bos_post_processor {
        let id = tok.token_to_id(bos).expect("bos id");
        file["post_processor"] = json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [id], "tokens": [bos]}},
        });
    }
    write(&dir.join("tokenizer.json"), &file);
    write(&dir.join("tokenizer_config.json"), &spec.config);
    Model { dir }
}

fn write(path: &std::path::Path, value: &Value) {
    std::fs::write(path, serde_json::to_vec_pretty(value).expect("json")).expect("write fixture");
}
