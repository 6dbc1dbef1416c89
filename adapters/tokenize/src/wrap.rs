//! The ids a tokenizer's post-processor adds around one sequence when asked for special
//! tokens (a BOS, or `[CLS]` … `[SEP]`), found once at load so cached pieces serve
//! `encode_text(text, true)` too: its ids are then `prefix ++ encode(text, false) ++ suffix`.
//!
//! Only post-processors known to add the same ids around any sequence qualify (none,
//! ByteLevel, TemplateProcessing, Bert, Roberta, a Sequence of them); a probe then reads the
//! ids they add and checks that sequences of other lengths get the same. Anything else
//! leaves `encode_text(_, true)` uncached.

use tokenizers::{Encoding, PostProcessorWrapper, Token, Tokenizer};

/// The post-processor's fixed ids before and after a single sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Wrap {
    prefix: Vec<u32>,
    suffix: Vec<u32>,
}

impl Wrap {
    /// The wrap of `tok`'s post-processor, if it is known to be one.
    pub(crate) fn probe(tok: &Tokenizer) -> Option<Self> {
        if !tok.get_post_processor().is_none_or(only_wraps) {
            return None;
        }
        let one = processed(tok, 1)?;
        // The sentinel is an id no vocabulary reaches, so it is found exactly once.
        let at = one.iter().position(|&id| id == SENTINEL)?;
        let wrap = Self { prefix: one[..at].to_vec(), suffix: one[at + 1..].to_vec() };
        let ok = [0, 3].iter().all(|&n| processed(tok, n).is_some_and(|got| got == wrap.around(&sentinels(n))));
        ok.then_some(wrap)
    }

    /// `ids` with the prefix before and the suffix after.
    pub(crate) fn around(&self, ids: &[u32]) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.prefix.len() + ids.len() + self.suffix.len());
        out.extend_from_slice(&self.prefix);
        out.extend_from_slice(ids);
        out.extend_from_slice(&self.suffix);
        out
    }
}

const SENTINEL: u32 = u32::MAX;

fn sentinels(n: u32) -> Vec<u32> {
    (0..n).map(|i| SENTINEL - i).collect()
}

fn processed(tok: &Tokenizer, n: u32) -> Option<Vec<u32>> {
    let tokens = sentinels(n).into_iter().map(|id| Token::new(id, String::new(), (0, 0))).collect();
    let encoding = tok.post_process(Encoding::from_tokens(tokens, 0), None, true).ok()?;
    Some(encoding.get_ids().to_vec())
}

fn only_wraps(pp: &PostProcessorWrapper) -> bool {
    match pp {
        PostProcessorWrapper::Sequence(seq) => seq.as_ref().iter().all(only_wraps),
        PostProcessorWrapper::Roberta(_)
        | PostProcessorWrapper::Bert(_)
        | PostProcessorWrapper::ByteLevel(_)
        | PostProcessorWrapper::Template(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};
    use tokenizers::Tokenizer;

    use super::Wrap;

    fn tokenizer(post_processor: Value) -> Tokenizer {
        let file = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": post_processor,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[CLS]": 0, "[SEP]": 1, "a": 2, "b": 3}, "unk_token": "a"},
        });
        file.to_string().parse().expect("tokenizer json")
    }

    #[track_caller]
    fn check(post_processor: Value, prefix: &[u32], suffix: &[u32]) {
        let tok = tokenizer(post_processor);
        let wrap = Wrap::probe(&tok).expect("a wrap");
        assert_eq!(wrap, Wrap { prefix: prefix.to_vec(), suffix: suffix.to_vec() });
        for text in ["", "a", "a b b a"] {
            let plain = tok.encode_fast(text, false).expect("encode");
            let special = tok.encode_fast(text, true).expect("encode");
            assert_eq!(wrap.around(plain.get_ids()), special.get_ids(), "{text:?}");
        }
    }

    #[test]
    fn reads_what_the_post_processor_adds() {
        check(Value::Null, &[], &[]);
        check(json!({"type": "BertProcessing", "sep": ["[SEP]", 1], "cls": ["[CLS]", 0]}), &[0], &[1]);
        let template = json!({
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"[SEP]": {"id": "[SEP]", "ids": [1], "tokens": ["[SEP]"]}},
        });
        let byte_level =
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true});
        check(json!({"type": "Sequence", "processors": [byte_level, template]}), &[], &[1]);
    }
}
