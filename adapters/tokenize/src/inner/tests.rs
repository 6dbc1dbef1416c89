use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::{check, GAP_SPLITTING_REGEXES};

const LLAMA3: &str = GAP_SPLITTING_REGEXES[1];

fn tokenizer(normalizer: Value, pre_tokenizer: Value, added: Value, dropout: Value) -> Tokenizer {
    tokenizer_with_vocab(normalizer, pre_tokenizer, added, dropout, json!({"a": 0, "b": 1}))
}

fn tokenizer_with_vocab(
    normalizer: Value,
    pre_tokenizer: Value,
    added: Value,
    dropout: Value,
    vocab: Value,
) -> Tokenizer {
    let file = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": dropout, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []},
    });
    file.to_string().parse().expect("tokenizer json")
}

fn added(content: &str, normalized: bool, rstrip: bool, single_word: bool) -> Value {
    // Distinct ids for the few tokens each case adds.
    json!({"id": 10 + content.len(), "content": content, "single_word": single_word, "lstrip": false, "rstrip": rstrip,
           "normalized": normalized, "special": !normalized})
}

fn split(regex: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": use_regex})
}

fn metaspace(prepend: &str, split: bool) -> Value {
    json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": prepend, "split": split})
}

fn seq(pts: &[Value]) -> Value {
    json!({"type": "Sequence", "pretokenizers": pts})
}

#[track_caller]
fn check_pre(pre_tokenizer: Value, want: Result<(), &str>) {
    let tok = tokenizer(Value::Null, pre_tokenizer.clone(), json!([]), Value::Null);
    assert_eq!(check(&tok), want, "{pre_tokenizer}");
}

#[test]
fn pre_tokenizers_that_split_at_word_gaps() {
    check_pre(json!({"type": "Whitespace"}), Ok(()));
    check_pre(json!({"type": "WhitespaceSplit"}), Ok(()));
    check_pre(json!({"type": "BertPreTokenizer"}), Ok(()));
    check_pre(json!({"type": "CharDelimiterSplit", "delimiter": " "}), Ok(()));
    check_pre(byte_level(true), Ok(()));
    for regex in GAP_SPLITTING_REGEXES {
        check_pre(seq(&[split(regex), byte_level(false)]), Ok(()));
    }
    check_pre(metaspace("first", true), Ok(()));
    check_pre(metaspace("always", true), Ok(()));
    check_pre(seq(&[json!({"type": "Digits", "individual_digits": true}), metaspace("first", true)]), Ok(()));
    check_pre(seq(&[json!({"type": "Whitespace"}), json!({"type": "UnicodeScripts"})]), Ok(()));
    check_pre(json!({"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": false}), Ok(()));
}

#[test]
fn pre_tokenizers_not_known_to_split_at_word_gaps() {
    check_pre(Value::Null, Err("the gap's character is not in the vocabulary"));
    check_pre(metaspace("first", false), Err("the gap's character is not in the vocabulary"));
    check_pre(
        seq(&[metaspace("first", false), byte_level(true)]),
        Err("pre-tokenizer stage after the space was replaced"),
    );
    check_pre(byte_level(false), Err("ByteLevel without its regex maps the gap's space before any split"));
    check_pre(
        seq(&[byte_level(false), split(LLAMA3)]),
        Err("ByteLevel without its regex maps the gap's space before any split"),
    );
    check_pre(split(r"\w+|\s+"), Err("Split pattern not known to split at word gaps"));
    check_pre(
        json!({"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "MergedWithPrevious", "invert": false}),
        Err("Split pattern not known to split at word gaps"),
    );
    check_pre(
        json!({"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated", "invert": true}),
        Err("Split pattern not known to split at word gaps"),
    );
    check_pre(
        seq(&[byte_level(true), metaspace("first", true)]),
        Err("Metaspace with prepend_scheme first after a split"),
    );
    check_pre(json!({"type": "UnicodeScripts"}), Err("pre-tokenizer stage not known to keep word gaps"));
    check_pre(
        json!({"type": "Digits", "individual_digits": false}),
        Err("the gap's character is not in the vocabulary"),
    );
    check_pre(
        json!({"type": "FixedLength", "length": 5}),
        Err("FixedLength pre-tokenizer counts from each split's start"),
    );
}

#[track_caller]
fn check_rest(normalizer: Value, added: Value, dropout: Value, want: Result<(), &str>) {
    let tok = tokenizer(normalizer.clone(), json!({"type": "Whitespace"}), added.clone(), dropout);
    assert_eq!(check(&tok), want, "{normalizer} {added}");
}

#[test]
fn normalizers_models_and_added_tokens() {
    let none = Value::Null;
    check_rest(json!({"type": "NFKC"}), json!([]), none.clone(), Ok(()));
    let lower_nfc = json!({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]});
    check_rest(lower_nfc, json!([]), none.clone(), Ok(()));
    check_rest(
        json!({"type": "Prepend", "prepend": "▁"}),
        json!([]),
        none.clone(),
        Err("Prepend normalizer: every piece would get the prefix"),
    );
    check_rest(json!({"type": "ByteLevel"}), json!([]), none.clone(), Err("normalizer not known to keep word gaps"));
    check_rest(none.clone(), json!([]), json!(0.1), Err("BPE dropout is random"));
    let ok_tokens = json!([
        added("<|im_start|>", false, true, false),
        added("  ", false, false, false),
        added("x", true, false, true)
    ]);
    check_rest(none.clone(), ok_tokens, none.clone(), Ok(()));
    let spaced = json!([added("hello world", false, false, false)]);
    check_rest(none.clone(), spaced, none.clone(), Err("an added token contains a word then a space"));
    // Matched after normalization: NFKC turns a diaeresis into a space and a combining mark.
    let diaeresis = json!([added("a\u{a8}", true, false, false)]);
    let nfkc = json!({"type": "NFKC"});
    check_rest(nfkc, diaeresis.clone(), none.clone(), Err("an added token contains a word then a space"));
    check_rest(none.clone(), diaeresis, none.clone(), Ok(()));
    let rstrip = json!([added("<tool>x", false, true, false)]);
    check_rest(none.clone(), rstrip, none.clone(), Err("an rstrip added token ends in a letter or digit"));
    let single = json!([added(" x", false, false, true)]);
    check_rest(none, single, Value::Null, Err("a single_word added token starts with a space"));
}

#[track_caller]
fn check_whole(normalizer: Value, pre_tokenizer: Value, vocab: Value, want: Result<(), &str>) {
    let tok = tokenizer_with_vocab(normalizer, pre_tokenizer.clone(), json!([]), Value::Null, vocab.clone());
    assert_eq!(check(&tok), want, "{pre_tokenizer} {vocab}");
}

/// SentencePiece style: nothing splits, so the vocabulary decides.
#[test]
fn models_that_see_whole_stretches() {
    let none = Value::Null;
    let ok_vocab = json!({"a": 0, "b": 1, "▁": 2, "▁a": 3, "▁▁": 4, "ab": 5});
    check_whole(none.clone(), metaspace("first", false), ok_vocab.clone(), Ok(()));
    check_whole(none.clone(), metaspace("always", false), ok_vocab.clone(), Ok(()));
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
    check_whole(replace.clone(), none.clone(), ok_vocab.clone(), Ok(()));
    check_whole(
        replace,
        json!({"type": "Whitespace"}),
        ok_vocab.clone(),
        Err("pre-tokenizer stage after the space was replaced"),
    );
    let crossing = json!({"a": 0, "▁": 1, "a▁": 2});
    check_whole(none.clone(), metaspace("first", false), crossing, Err("a vocabulary entry runs across a word gap"));
    check_whole(none.clone(), none.clone(), json!({"a": 0, " ": 1, " a": 2}), Ok(()));
    check_whole(
        json!({"type": "Replace", "pattern": {"String": " "}, "content": "__"}),
        none.clone(),
        ok_vocab.clone(),
        Err("Replace normalizer other than a space by one character"),
    );
    check_whole(
        json!({"type": "Replace", "pattern": {"Regex": " +"}, "content": "▁"}),
        none.clone(),
        ok_vocab,
        Err("Replace normalizer other than a space by one character"),
    );
    let word_level = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"a": 0, " ": 1}, "unk_token": "a"},
    });
    let tok: Tokenizer = word_level.to_string().parse().expect("tokenizer json");
    assert_eq!(check(&tok), Err("no pre-tokenizer stage splits at word gaps"));
    let mut ignore_merges = word_level;
    ignore_merges["model"] = bpe(json!({"a": 0, " ": 1}), json!([]));
    ignore_merges["model"]["ignore_merges"] = json!(true);
    let tok: Tokenizer = ignore_merges.to_string().parse().expect("tokenizer json");
    assert_eq!(check(&tok), Err("no pre-tokenizer stage splits at word gaps"));
}

fn ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode_fast(text, false).expect("encode").get_ids().to_vec()
}

/// A refused configuration, and a cut where it really changes the ids: the refusals are
/// needed, not only cautious.
#[track_caller]
fn check_refusal_needed(normalizer: Value, pre_tokenizer: Value, model: Value, added: Value, want: &str) {
    let file = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": null, "decoder": null,
        "model": model,
    });
    let tok: Tokenizer = file.to_string().parse().expect("tokenizer json");
    assert_eq!(check(&tok), Err(want));
    let (a, b) = ("ax", " b");
    let pieces = [ids(&tok, a), ids(&tok, b)].concat();
    assert_ne!(ids(&tok, &format!("{a}{b}")), pieces, "{want}");
}

fn bpe(vocab: Value, merges: Value) -> Value {
    json!({"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
           "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
           "ignore_merges": false, "vocab": vocab, "merges": merges})
}

#[test]
fn refused_configs_do_change_ids_at_a_gap() {
    let none = Value::Null;
    let chars = json!({"▁": 0, "a": 1, "x": 2, "b": 3, "Ġ": 4, "x▁": 5});
    check_refusal_needed(
        none.clone(),
        metaspace("first", false),
        bpe(chars.clone(), json!([["x", "▁"]])),
        json!([]),
        "a vocabulary entry runs across a word gap",
    );
    check_refusal_needed(
        json!({"type": "Prepend", "prepend": "▁"}),
        json!({"type": "Whitespace"}),
        bpe(chars.clone(), json!([])),
        json!([]),
        "Prepend normalizer: every piece would get the prefix",
    );
    check_refusal_needed(
        none.clone(),
        seq(&[byte_level(true), metaspace("first", true)]),
        bpe(chars.clone(), json!([])),
        json!([]),
        "Metaspace with prepend_scheme first after a split",
    );
    check_refusal_needed(
        none,
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true}),
        bpe(chars, json!([])),
        json!([{"id": 2, "content": "x", "single_word": false, "lstrip": false, "rstrip": true,
                "normalized": false, "special": true}]),
        "an rstrip added token ends in a letter or digit",
    );
}
