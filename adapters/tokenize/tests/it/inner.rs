//! Cuts inside plain text never change the answer: for each pre-tokenizer family that
//! allows them (word-level Whitespace, byte-level BPE with the GPT-2, Llama 3, Qwen2, o200k
//! and Tekken regexes, Metaspace, and SentencePiece-style BPE that sees whole stretches), tokenizing through the cache equals tokenizing in one go on random text, and
//! turn N+1 of a plain-text conversation reuses turn N's pieces. Configurations not known
//! to be safe keep cutting only before added tokens.

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_tokenize::{CacheConfig, CacheStats, ModelTokenizer, TokenizerConfig};
use proptest::prelude::*;
use serde_json::{json, Value};
use tokenizers::models::bpe::BpeTrainerBuilder;
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::fixture;
use crate::parity::{Lcg, FRAGMENTS};

/// Words and gaps, so most random texts have many word gaps to cut at.
const WORDS: &[&str] =
    &["alpha", "beta", "Gamma", "delta", "x1", "42", "route", "cache", "it", "I", "é", "naïve", "tool", "hash"];
const SPECIAL: &[&str] = &["<s>", "</s>", "<|endoftext|>", "<|im_start|>"];

/// Word-level vocabulary over `WORDS` (lowercased), NFC + Lowercase, Whitespace, a BOS.
fn words() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let mut vocab = serde_json::Map::new();
        for (i, t) in SPECIAL.iter().chain(&["[UNK]", "."]).enumerate() {
            vocab.insert((*t).into(), json!(i));
        }
        for w in WORDS {
            let n = vocab.len();
            vocab.entry(w.to_lowercase()).or_insert(json!(n));
        }
        let file = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added_tokens(&vocab),
            "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]},
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": bos_processor(0),
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        write_model("words", &file)
    })
}

fn added_tokens(vocab: &serde_json::Map<String, Value>) -> Value {
    SPECIAL
        .iter()
        .map(|t| {
            json!({"id": vocab[*t], "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect()
}

fn bos_processor(id: u32) -> Value {
    json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [id], "tokens": ["<s>"]}},
    })
}

/// GPT-2 style: ByteLevel with its own regex and a prefix space, BPE trained here.
fn gpt2() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let pre = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
        trained_bpe("gpt2", pre, true, None)
    })
}

/// A Split with one of the regexes of the o200k family, then ByteLevel (GPT-4o, Mistral's
/// Tekken).
fn cased_regex(name: &str, regex: &str) -> PathBuf {
    let pre = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]});
    trained_bpe(name, pre, true, None)
}

fn o200k() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        cased_regex(
            "o200k",
            concat!(
                r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ),
        )
    })
}

fn tekken() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        cased_regex(
            "tekken",
            concat!(
                r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ),
        )
    })
}

/// SentencePiece style: Metaspace that splits, `prepend_scheme: first`, a BOS.
fn metaspace() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| trained_bpe("metaspace", metaspace_pre(true), false, None))
}

fn metaspace_pre(split: bool) -> Value {
    json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": split})
}

/// SentencePiece as converted for Llama 2 and Mistral: trained on words, then run with a
/// Metaspace that does not split, so BPE sees whole stretches.
fn sp_whole() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| trained_bpe("sp-whole", metaspace_pre(true), false, Some((Value::Null, metaspace_pre(false)))))
}

/// Gemma style: spaces replaced by the normalizer, no pre-tokenizer.
fn sp_replace() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
        trained_bpe("sp-replace", metaspace_pre(true), false, Some((replace, Value::Null)))
    })
}

/// A BPE trained with `pre_tokenizer`, then saved with `serve`'s normalizer and
/// pre-tokenizer if given.
fn trained_bpe(name: &str, pre_tokenizer: Value, byte_level: bool, serve: Option<(Value, Value)>) -> PathBuf {
    let skeleton = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": {}, "merges": []},
    });
    let mut tok: Tokenizer = skeleton.to_string().parse().expect("skeleton");
    let specials: Vec<AddedToken> = SPECIAL.iter().map(|s| AddedToken::from(*s, true)).collect();
    let mut builder =
        BpeTrainerBuilder::new().vocab_size(400).min_frequency(1).show_progress(false).special_tokens(specials.clone());
    if byte_level {
        builder = builder.initial_alphabet(ByteLevel::alphabet().into_iter().collect());
    }
    let mut rng = Lcg(3);
    let corpus: Vec<String> = (0..200).map(|_| words_text(&mut rng, 12)).collect();
    tok.train(&mut TrainerWrapper::from(builder.build()), corpus.iter()).expect("train");
    tok.add_special_tokens(specials).expect("specials");
    // A normalized added token: matched after the (absent) normalizer, never a cut point.
    tok.add_tokens(vec![AddedToken::from("<tool_call>", false)]).expect("tokens");
    let mut file: Value = serde_json::from_str(&tok.to_string(false).expect("serialize")).expect("json");
    file["post_processor"] = bos_processor(tok.token_to_id("<s>").expect("bos"));
    if let Some((normalizer, pre_tokenizer)) = serve {
        file["normalizer"] = normalizer;
        file["pre_tokenizer"] = pre_tokenizer;
    }
    write_model(name, &file)
}

fn write_model(name: &str, file: &Value) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("tokenize-inner-{name}"));
    std::fs::create_dir_all(&dir).expect("model dir");
    std::fs::write(dir.join("tokenizer.json"), file.to_string()).expect("write tokenizer.json");
    dir
}

/// Space-separated words with some punctuation, newlines and double spaces.
fn words_text(rng: &mut Lcg, n: usize) -> String {
    let mut s = String::new();
    for _ in 0..n {
        s.push_str(WORDS[rng.below(WORDS.len())]);
        s.push_str([" ", " ", " ", "  ", ". ", "\n", ""][rng.below(7)]);
    }
    s
}

/// Small caches, so that pieces are evicted and the word memo turns over within a test.
fn load(dir: &PathBuf, stride: usize, min: usize) -> ModelTokenizer {
    let cache = CacheConfig {
        entries_max: 64,
        piece_bytes_min: min,
        gap_stride_bytes: stride,
        words_max: 64,
        ..CacheConfig::default()
    };
    ModelTokenizer::from_dir_with(dir, TokenizerConfig { cache, ..TokenizerConfig::default() }).expect("load")
}

/// Every supported family at several strides and piece sizes, loaded once.
fn shared() -> &'static [ModelTokenizer] {
    static TOKS: OnceLock<Vec<ModelTokenizer>> = OnceLock::new();
    TOKS.get_or_init(|| {
        let dirs = [
            words(),
            gpt2(),
            o200k(),
            tekken(),
            metaspace(),
            sp_whole(),
            sp_replace(),
            &fixture::chatml().dir,
            &fixture::llama3().dir,
        ];
        let mut v = Vec::new();
        for dir in dirs {
            for (stride, min) in [(1, 0), (5, 3), (64, 16)] {
                let tok = load(dir, stride, min);
                assert_eq!(tok.cuts_word_gaps(), Ok(()), "{dir:?}");
                v.push(tok);
            }
        }
        v
    })
}

fn text_strategy() -> impl Strategy<Value = String> {
    let fragment = prop_oneof![
        3 => prop::sample::select(WORDS).prop_map(str::to_owned),
        3 => prop::sample::select(&[" ", " ", "  ", "\n", ". ", " 7"][..]).prop_map(str::to_owned),
        1 => prop::sample::select(FRAGMENTS).prop_map(str::to_owned),
    ];
    prop::collection::vec(fragment, 0..80).prop_map(|v| v.concat())
}

#[track_caller]
fn check_same_ids(tok: &ModelTokenizer, text: &str) {
    for specials in [false, true] {
        let whole = tok.encode_uncached(text, specials).expect("encode");
        for pass in ["cold", "warm"] {
            assert_eq!(tok.encode_text(text, specials).expect("encode"), whole, "{pass} {specials}: {text:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn cuts_inside_text_keep_ids(texts in prop::collection::vec(text_strategy(), 1..5)) {
        for tok in shared() {
            let mut prefix = String::new();
            for t in &texts {
                prefix.push_str(t);
                check_same_ids(tok, &prefix);
            }
        }
    }
}

/// Tokens reused and encoded by one call.
fn delta(tok: &ModelTokenizer, text: &str) -> (u64, u64, usize) {
    let before: CacheStats = tok.cache_stats();
    let ids = tok.encode_text(text, true).expect("encode");
    assert_eq!(ids, tok.encode_uncached(text, true).expect("encode"));
    let after = tok.cache_stats();
    (after.tokens_reused - before.tokens_reused, after.tokens_encoded - before.tokens_encoded, ids.len())
}

/// Turn N+1 of a growing plain-text prompt tokenizes only turn N's last piece (at most a
/// stride plus a word) and the new text.
#[test]
fn next_turn_reuses_previous_text() {
    const STRIDE_BYTES: usize = 64;
    for dir in [words(), gpt2(), metaspace(), sp_whole(), sp_replace(), &fixture::chatml().dir] {
        let tok = load(dir, STRIDE_BYTES, 16);
        let mut rng = Lcg(11);
        let mut text = String::new();
        let mut last_len = 0;
        for turn in 0..12 {
            text.push_str(&words_text(&mut rng, 60));
            let (reused, encoded, len) = delta(&tok, &text);
            if turn > 0 {
                // BOS is in neither count; each token covers at least one byte.
                let old = (last_len - 1) as u64;
                let slack = (STRIDE_BYTES + 16) as u64;
                assert!(reused + slack >= old, "{dir:?} turn {turn}: reused {reused} of {old}");
                assert!(encoded <= (len - last_len) as u64 + slack, "{dir:?} turn {turn}: encoded {encoded}");
            }
            last_len = len;
        }
    }
}

/// A BPE trained on whole stretches (merges across spaces) is not known to split at gaps:
/// plain text is one piece, still tokenized exactly.
#[test]
fn unsupported_configs_do_not_cut_inside_text() {
    let tok = load(&fixture::inst().dir, 1, 0);
    assert_eq!(tok.cuts_word_gaps(), Err("a vocabulary entry runs across a word gap"));
    let mut rng = Lcg(5);
    let mut text = String::new();
    for _ in 0..4 {
        text.push_str(&words_text(&mut rng, 40));
        let (reused, _, _) = delta(&tok, &text);
        assert_eq!(reused, 0);
    }
}

/// Text no earlier prompt had, made of words the memo has seen, runs the tokenizer on
/// nothing but the words too long to remember (`long`), and keeps the whole text's ids.
#[track_caller]
fn check_memo(dir: &PathBuf, long: &str, misses_want: u64) {
    let tok = load(dir, 64, 16);
    let ascii: Vec<&str> = WORDS.iter().copied().filter(|w| w.is_ascii()).collect();
    // Words are learned the second time they are seen (in other text: the prefix cache
    // would serve the same text).
    tok.encode_text(&format!(" {}", ascii.join(" ")), false).expect("encode");
    let backwards: Vec<&str> = ascii.iter().rev().copied().collect();
    tok.encode_text(&format!(" {}", backwards.join(" ")), false).expect("encode");
    let mut rng = Lcg(21);
    let mut some = |n: usize| (0..n).map(|_| format!(" {}", ascii[rng.below(ascii.len())])).collect::<String>();
    let fresh = format!("{}{long}{}", some(200), some(20));
    let before = tok.cache_stats();
    delta(&tok, &fresh);
    let after = tok.cache_stats();
    assert_eq!(after.word_hits - before.word_hits, 220, "{dir:?}: {after:?}");
    assert_eq!(after.word_misses - before.word_misses, misses_want, "{dir:?}: {after:?}");
}

#[test]
fn new_text_of_known_words_is_read_from_the_memo() {
    let long = format!(" x{}", "-y".repeat(40));
    for dir in [words(), gpt2(), metaspace(), &fixture::chatml().dir] {
        check_memo(dir, "", 0);
        check_memo(dir, &long, 1);
    }
    let off = load(&fixture::inst().dir, 64, 16);
    delta(&off, &WORDS.join(" "));
    assert_eq!((off.cache_stats().word_hits, off.cache_stats().word_misses), (0, 0));
}
