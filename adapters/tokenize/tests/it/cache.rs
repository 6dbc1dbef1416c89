//! The prefix cache never changes the answer: tokenizing a prompt piece by piece, with
//! pieces from the cache, equals tokenizing it in one go, and turn N+1 of a conversation
//! reuses turn N's pieces.

use kvroute_tokenize::{CacheConfig, ChatRequest, ModelTokenizer, TokenizerConfig};
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::json;

use crate::fixture::{self, Model};
use crate::parity::{Lcg, FRAGMENTS};

fn tokenizer(model: &Model, entries_max: usize, piece_bytes_min: usize) -> ModelTokenizer {
    let config = TokenizerConfig {
        cache: CacheConfig { entries_max, piece_bytes_min, ..CacheConfig::default() },
        ..TokenizerConfig::default()
    };
    ModelTokenizer::from_dir_with(&model.dir, config).expect("load fixture")
}

#[track_caller]
fn check_same_ids(tok: &ModelTokenizer, text: &str) {
    let whole = tok.encode_uncached(text, false).expect("encode");
    for pass in ["cold", "warm"] {
        assert_eq!(tok.encode_rendered(text).expect("encode"), whole, "{pass}: {text:?}");
    }
}

fn text_strategy() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..60).prop_map(|v| v.concat())
}

/// Tokenizers with a tiny cache (so entries are evicted and reused across cases) for
/// several piece sizes, loaded once: loading dominates the test's time otherwise.
fn shared() -> &'static [ModelTokenizer] {
    static TOKS: OnceLock<Vec<ModelTokenizer>> = OnceLock::new();
    TOKS.get_or_init(|| {
        let mut v = Vec::new();
        for model in [fixture::chatml(), fixture::llama3(), fixture::inst()] {
            for min in [0, 7, 33] {
                v.push(tokenizer(model, 8, min));
            }
        }
        v
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn cached_pieces_equal_whole_text(texts in prop::collection::vec(text_strategy(), 1..6)) {
        for tok in shared() {
            let mut prefix = String::new();
            for t in &texts {
                prefix.push_str(t);
                check_same_ids(tok, &prefix);
            }
            prop_assert!(tok.cache_stats().entries <= 8);
        }
    }
}

#[test]
fn every_added_token_of_the_fixtures_is_a_cut_point() {
    for (model, want) in [
        (fixture::chatml(), &["<|endoftext|>", "<|im_end|>", "<|im_start|>"][..]),
        (
            fixture::inst(),
            &[
                "</s>",
                "<s>",
                "<unk>",
                "[/AVAILABLE_TOOLS]",
                "[/INST]",
                "[/TOOL_RESULTS]",
                "[AVAILABLE_TOOLS]",
                "[INST]",
                "[TOOL_CALLS]",
                "[TOOL_RESULTS]",
            ][..],
        ),
    ] {
        let tok = tokenizer(model, 8, 0);
        // chatml's <tool_call>/<think> are plain added tokens: normalized, so not cut points.
        assert_eq!(tok.cut_tokens(), want);
    }
}

/// Turn N+1 of an agentic conversation tokenizes only what turn N did not have.
#[test]
fn next_turn_reuses_previous_pieces() {
    let tok = tokenizer(fixture::chatml(), 1024, 0);
    let mut rng = Lcg(42);
    let mut messages = vec![json!({"role": "system", "content": "You are an agent. ".repeat(20)})];
    let mut last = tok.cache_stats();
    for turn in 0..6 {
        messages.push(
            json!({"role": "user", "content": format!("turn {turn}: {}", crate::parity::random_text(&mut rng, 30))}),
        );
        let req = ChatRequest::new(messages.clone());
        let text = tok.render_chat(&req).expect("render");
        assert_eq!(tok.encode_chat(&req).expect("encode"), tok.encode_uncached(&text, false).expect("encode"));
        let now = tok.cache_stats();
        if turn > 0 {
            // Reused: system prompt and every earlier message; new: the last user message and
            // the generation prompt.
            assert!(
                now.tokens_reused - last.tokens_reused > now.tokens_encoded - last.tokens_encoded,
                "turn {turn}: {now:?}"
            );
            assert!(now.hits - last.hits > turn as u64, "turn {turn}: {now:?}");
        }
        last = now;
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
    }
}

/// A tokenizer file that pads batches: loading drops its padding, so the pieces of a
/// prompt, encoded as one batch, are never padded to the longest.
#[test]
fn a_padding_tokenizer_gets_unpadded_pieces() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tokenize-fixture-chatml-padded");
    std::fs::create_dir_all(&dir).expect("create dir");
    for f in ["tokenizer_config.json", "tokenizer.json"] {
        std::fs::copy(fixture::chatml().dir.join(f), dir.join(f)).expect("copy fixture");
    }
    let path = dir.join("tokenizer.json");
    let mut tj: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
    tj["padding"] = json!({"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": null,
                           "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"});
    std::fs::write(&path, tj.to_string()).expect("write");
    let tok = tokenizer(&Model { dir }, 64, 0);
    let text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n";
    check_same_ids(&tok, text);
    assert!(tok.cache_stats().entries >= 3, "the text was cut into pieces");
}
