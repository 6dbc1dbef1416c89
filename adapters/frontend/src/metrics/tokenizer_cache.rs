//! The tokenizers' prefix caches, read at each scrape: whether a shared prefix is really
//! tokenized once (`kvroute_tokenize::CacheStats`).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use kvroute_tokenize::CacheStats;

use crate::tokenize::Tokenizers;

/// Reads one gauge's value from a cache's counters.
type Get = fn(&CacheStats) -> usize;
/// Splits one counter of a cache by a label's two values.
type Split = fn(&CacheStats) -> [(&'static str, u64); 2];

#[derive(Debug)]
pub(super) struct TokenizerCacheCollector(pub(super) Tokenizers);

impl Collector for TokenizerCacheCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats: Vec<(String, CacheStats)> =
            self.0.iter().filter_map(|(m, t)| Some((m.to_owned(), t.cache_stats()?))).collect();
        if stats.is_empty() {
            return Ok(());
        }
        let split: [(&str, &str, &str, Split); 3] = [
            (
                "kvroute_tokenizer_cache_pieces",
                "Prompt pieces looked up in the tokenizer's prefix cache, by result",
                "result",
                |s| [("hit", s.hits), ("miss", s.misses)],
            ),
            (
                "kvroute_tokenizer_cache_tokens",
                "Prompt tokens taken from the tokenizer's prefix cache (reused) or computed (encoded)",
                "source",
                |s| [("reused", s.tokens_reused), ("encoded", s.tokens_encoded)],
            ),
            (
                "kvroute_tokenizer_cache_words",
                "Words of text not in the prefix cache, found in the tokenizer's word memo (hit) or tokenized (miss)",
                "result",
                |s| [("hit", s.word_hits), ("miss", s.word_misses)],
            ),
        ];
        for (name, help, label, parts) in split {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (model, s) in &stats {
                for (value, n) in parts(s) {
                    ConstCounter::new(n).encode(m.encode_family(&[("model", model.as_str()), (label, value)])?)?;
                }
            }
        }
        let mut m = enc.encode_descriptor(
            "kvroute_tokenizer_cache_evictions",
            "Pieces dropped from the tokenizer's prefix cache to stay within its limits",
            None,
            MetricType::Counter,
        )?;
        for (model, s) in &stats {
            ConstCounter::new(s.evictions).encode(m.encode_family(&[("model", model.as_str())])?)?;
        }
        let gauges: [(&str, &str, Get); 3] = [
            ("kvroute_tokenizer_cache_entries", "Pieces held in the tokenizer's prefix cache", |s| s.entries),
            ("kvroute_tokenizer_cache_words_held", "Words held in the tokenizer's word memo", |s| s.word_entries),
            (
                "kvroute_tokenizer_cache_bytes",
                "Bytes held in the tokenizer's prefix cache, as counted against its limit",
                |s| s.bytes,
            ),
        ];
        for (name, help, get) in gauges {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (model, s) in &stats {
                let v = i64::try_from(get(s)).unwrap_or(i64::MAX);
                ConstGauge::new(v).encode(m.encode_family(&[("model", model.as_str())])?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvroute_tokenize::ModelTokenizer;
    use prometheus_client::registry::Registry;
    use serde_json::{json, Value};

    use super::TokenizerCacheCollector;
    use crate::tokenize::{Tokenize, TokenizeError, Tokenizers};

    /// A real word-level tokenizer, through the trait the binary implements the same way.
    struct Words(ModelTokenizer);

    impl Tokenize for Words {
        fn encode_chat(&self, _body: &Value) -> Result<Vec<u32>, TokenizeError> {
            Err(TokenizeError::new("text only"))
        }
        fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
            self.0.encode_text(text, false).map_err(TokenizeError::new)
        }
        fn cache_stats(&self) -> Option<kvroute_tokenize::CacheStats> {
            Some(self.0.cache_stats())
        }
    }

    fn words_tokenizer() -> ModelTokenizer {
        let dir = std::env::temp_dir().join(format!("kvroute-tokcache-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vocab: serde_json::Map<String, Value> = ["[UNK]", "alpha", "beta", "gamma", "delta"]
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), json!(i)))
            .collect();
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        let tok = ModelTokenizer::from_dir(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        tok
    }

    fn scrape(tokenizers: &Tokenizers) -> String {
        let mut r = Registry::default();
        r.register_collector(Box::new(TokenizerCacheCollector(tokenizers.clone())));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        out
    }

    /// The value of the series `line` (name and labels) in `text`.
    fn value(text: &str, line: &str) -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {line} in {text}"))
    }

    #[test]
    fn a_shared_prefix_shows_as_reused_tokens() {
        let tok = Arc::new(Words(words_tokenizer()));
        let mut tokenizers = Tokenizers::new();
        tokenizers.insert("m", tok.clone());
        let before = scrape(&tokenizers);
        assert_eq!(value(&before, r#"kvroute_tokenizer_cache_tokens_total{model="m",source="reused"}"#), 0);
        let shared = "alpha beta gamma delta ".repeat(200);
        // New text of known words: the second question's words come from the word memo.
        for question in ["alpha alpha", "beta beta", "gamma alpha beta delta beta"] {
            tok.encode_text(&format!("{shared}{question}")).unwrap();
        }
        let after = scrape(&tokenizers);
        let s = tok.0.cache_stats();
        assert!(s.tokens_reused >= 600, "the second prompt reused most of the first: {s:?}");
        assert!(s.word_hits > 0 && s.word_entries > 0, "{s:?}");
        for (series, want) in [
            (r#"kvroute_tokenizer_cache_tokens_total{model="m",source="reused"}"#, s.tokens_reused),
            (r#"kvroute_tokenizer_cache_tokens_total{model="m",source="encoded"}"#, s.tokens_encoded),
            (r#"kvroute_tokenizer_cache_pieces_total{model="m",result="hit"}"#, s.hits),
            (r#"kvroute_tokenizer_cache_pieces_total{model="m",result="miss"}"#, s.misses),
            (r#"kvroute_tokenizer_cache_entries{model="m"}"#, s.entries as u64),
            (r#"kvroute_tokenizer_cache_words_total{model="m",result="hit"}"#, s.word_hits),
            (r#"kvroute_tokenizer_cache_words_total{model="m",result="miss"}"#, s.word_misses),
            (r#"kvroute_tokenizer_cache_words_held{model="m"}"#, s.word_entries as u64),
        ] {
            assert_eq!(value(&after, series), want, "{series}");
        }
    }

    #[test]
    fn tokenizers_without_a_cache_add_nothing() {
        assert_eq!(scrape(&Tokenizers::new()).trim(), "# EOF");
    }
}
