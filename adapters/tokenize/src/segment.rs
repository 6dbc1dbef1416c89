//! Cuts rendered prompts at places where tokenization is known to split: just before an
//! added token such as `<|im_start|>`, and, for tokenizers whose configuration allows it
//! (`inner.rs`), at word gaps inside the text between them. It leaves caching the pieces to
//! `cache.rs`.
//!
//! Why a cut there is safe: the tokenizer first finds added tokens in the raw text (leftmost
//! longest match) and then normalizes and pre-tokenizes each stretch between them on its
//! own. If the text after position `p` starts with an added token `T` that is certainly
//! matched at `p`, then `encode(text) == encode(text[..p]) ++ encode(text[p..])`, provided
//! nothing looks across `p`. A token `T` qualifies as a cut point when:
//! - `normalized` is false (it is matched in the raw text, before any normalizer),
//! - `lstrip` is false (else it would swallow whitespace before `p`),
//! - no added token (`T` included) has a proper suffix equal to a proper prefix of `T`, and
//!   no other added token contains `T` (else a match could start before `p` and run into
//!   `T`, so `T` would not be matched at `p`),
//! - if any added token is `single_word`, `T` starts with a non-word character (else the
//!   character after such a token at the end of `text[..p]` would change).
//!
//! Position-dependent steps stay correct because `text[p..]` starts with `T` itself: a
//! Metaspace `prepend_scheme: first` only acts on a stretch at offset 0, and after `T` no
//! stretch is. The property test in `tests/it/cache.rs` checks the equality on random text.
//!
//! Word gaps (a space between ASCII letters or digits) are cut at the first one at or after
//! every `stride_bytes` counted from the prompt's start. Cuts depend only on the text before
//! them (and one byte after), so when turn N+1's prompt extends turn N's, both are cut at
//! the same places up to turn N's last piece, and those pieces are cache hits.

use tokenizers::AddedToken;

/// The added tokens of one tokenizer before which a prompt may be cut.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cutter {
    tokens: Vec<String>,
    /// Whether word gaps are safe cut points for this tokenizer (see `inner.rs`).
    word_gaps: bool,
}

impl Cutter {
    pub(crate) fn new(added: &[AddedToken], word_gaps: bool) -> Self {
        let any_single_word = added.iter().any(|t| t.single_word);
        let mut tokens: Vec<String> =
            added.iter().filter(|t| eligible(t, added, any_single_word)).map(|t| t.content.clone()).collect();
        tokens.sort();
        tokens.dedup();
        Self { tokens, word_gaps }
    }

    /// The cut-point tokens, sorted.
    pub(crate) fn tokens(&self) -> &[String] {
        &self.tokens
    }

    /// Splits `text` into pieces that tokenize independently, each (but the first) starting
    /// with a cut-point token or, if `stride_bytes` is not zero and the tokenizer allows it,
    /// at a word gap; adjacent pieces are merged until each is at least `piece_bytes_min`
    /// long. Work is O(len × cut-point tokens).
    pub(crate) fn split<'t>(&self, text: &'t str, piece_bytes_min: usize, stride_bytes: usize) -> Vec<&'t str> {
        let mut cuts: Vec<usize> = Vec::new();
        for token in &self.tokens {
            cuts.extend(text.match_indices(token.as_str()).map(|(i, _)| i));
        }
        if self.word_gaps && stride_bytes > 0 {
            word_gaps(text.as_bytes(), stride_bytes, &mut cuts);
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut pieces = Vec::new();
        let mut start = 0;
        for cut in cuts {
            if cut > start && cut - start >= piece_bytes_min {
                pieces.push(&text[start..cut]);
                start = cut;
            }
        }
        if start < text.len() || pieces.is_empty() {
            pieces.push(&text[start..]);
        }
        pieces
    }
}

/// Pushes the first word gap at or after each multiple of `stride_bytes`. O(len).
fn word_gaps(bytes: &[u8], stride_bytes: usize, cuts: &mut Vec<usize>) {
    let mut from = stride_bytes;
    while from + 1 < bytes.len() {
        let Some(p) = (from..bytes.len() - 1).find(|&p| is_word_gap(bytes, p)) else {
            return;
        };
        cuts.push(p);
        from = (p / stride_bytes + 1) * stride_bytes;
    }
}

/// The byte ranges of the words of `text`: it is cut at every word gap. O(len).
pub(crate) fn words(text: &str) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let bytes = text.as_bytes();
    let gaps = (1..bytes.len().saturating_sub(1)).filter(move |&p| is_word_gap(bytes, p));
    let mut start = 0;
    gaps.chain(std::iter::once(bytes.len())).map(move |end| std::mem::replace(&mut start, end)..end)
}

/// A space between ASCII letters or digits; `p` is at least 1 and below `len - 1`.
fn is_word_gap(bytes: &[u8], p: usize) -> bool {
    bytes[p] == b' ' && bytes[p - 1].is_ascii_alphanumeric() && bytes[p + 1].is_ascii_alphanumeric()
}

fn eligible(t: &AddedToken, all: &[AddedToken], any_single_word: bool) -> bool {
    let c = t.content.as_str();
    if c.is_empty() || t.normalized || t.lstrip {
        return false;
    }
    if any_single_word && c.starts_with(|ch: char| ch.is_alphanumeric() || ch == '_') {
        return false;
    }
    all.iter().all(|u| {
        let u = u.content.as_str();
        let contains = u != c && u.contains(c);
        !contains && !suffix_meets_prefix(u, c)
    })
}

/// True if a proper, non-empty suffix of `u` equals a proper prefix of `t`.
fn suffix_meets_prefix(u: &str, t: &str) -> bool {
    (1..t.len())
        .any(|n| t.is_char_boundary(n) && u.len() > n && u.is_char_boundary(u.len() - n) && u.ends_with(&t[..n]))
}

#[cfg(test)]
mod tests {
    use super::Cutter;
    use tokenizers::AddedToken;

    fn special(s: &str) -> AddedToken {
        AddedToken::from(s.to_owned(), true)
    }

    #[track_caller]
    fn check_eligible(added: &[AddedToken], want: &[&str]) {
        assert_eq!(Cutter::new(added, false).tokens(), want);
    }

    #[test]
    fn picks_cut_tokens_that_cannot_be_straddled() {
        check_eligible(&[special("<|im_start|>"), special("<|im_end|>")], &["<|im_end|>", "<|im_start|>"]);
        // "x<s>y" contains "<s>", which is harmless; "<s>" inside "x<s>y" is not a safe cut.
        check_eligible(&[special("<s>"), special("x<s>y")], &["x<s>y"]);
        check_eligible(&[special("<a>"), special("q<")], &["q<"]);
        check_eligible(&[special("abab")], &[]);
        check_eligible(&[special("<a>").lstrip(true), special("<b>")], &["<b>"]);
        check_eligible(&[AddedToken::from("<n>", false).normalized(true), special("<b>")], &["<b>"]);
        check_eligible(&[special("tok").single_word(true), special("<b>")], &["<b>"]);
    }

    #[track_caller]
    fn check_split(text: &str, min: usize, stride: usize, want: &[&str]) {
        let cutter = Cutter::new(&[special("<s>"), special("</s>")], true);
        let got = cutter.split(text, min, stride);
        assert_eq!(got, want, "{text:?}");
        assert_eq!(got.concat(), text);
    }

    #[test]
    fn splits_before_cut_tokens() {
        check_split("", 0, 0, &[""]);
        check_split("abc", 0, 0, &["abc"]);
        check_split("<s>a</s><s>b", 0, 0, &["<s>a", "</s>", "<s>b"]);
        check_split("x<s>a</s><s>b", 5, 0, &["x<s>a", "</s><s>b"]);
        check_split("<s><s>", 0, 0, &["<s>", "<s>"]);
    }

    #[test]
    fn splits_at_word_gaps_after_each_stride() {
        check_split("aa bb cc dd", 0, 4, &["aa bb", " cc", " dd"]);
        check_split("aa bb cc dd", 0, 1, &["aa", " bb", " cc", " dd"]);
        check_split("aa bb cc dd", 4, 1, &["aa bb", " cc dd"]);
        // Not gaps: a space next to punctuation or another space, or at either end.
        check_split("a. b  c d ", 0, 1, &["a. b  c", " d "]);
        check_split(" ab", 0, 1, &[" ab"]);
        check_split("ab <s>cd ef", 0, 1, &["ab ", "<s>cd", " ef"]);
        check_split("é d", 0, 1, &["é d"]);
    }

    #[track_caller]
    fn check_words(text: &str, want: &[&str]) {
        let got: Vec<&str> = super::words(text).map(|w| &text[w]).collect();
        assert_eq!(got, want, "{text:?}");
    }

    #[test]
    fn words_end_at_every_word_gap() {
        check_words("", &[""]);
        check_words("aa bb  cc. dd e9 f", &["aa", " bb  cc. dd", " e9", " f"]);
        check_words(" a b ", &[" a", " b "]);
    }

    #[test]
    fn word_gaps_are_off_unless_allowed() {
        let cutter = Cutter::new(&[special("<s>")], false);
        assert_eq!(cutter.split("aa bb<s>cc dd", 0, 1), ["aa bb", "<s>cc dd"]);
    }
}
