//! Decides, from a tokenizer's own configuration, whether a prompt may also be cut inside
//! the text between added tokens, at a *word gap*: a byte index `p` with `text[p] == ' '`
//! and ASCII letters or digits at `p - 1` and `p + 1` (see `segment.rs`).
//!
//! A cut at `p` is exact when `encode(a ++ b) == encode(a) ++ encode(b)` for every `a` that
//! ends in an ASCII letter or digit and every `b` that starts with a space then one. The
//! tokenizer runs four stages on the text between added tokens; each must keep the gap:
//! - added tokens: no match may cover the gap, nor see across it (`rstrip` of a token ending
//!   at `p`, `single_word` of a token starting there) ([`added_tokens`]);
//! - the normalizer must map text character by character, or be a Unicode normal form (an
//!   ASCII character is a boundary for all four), so `N(a ++ b) == N(a) ++ N(b)` and the gap
//!   stays a space (or the one character a `Replace` puts for it) between ASCII letters or
//!   digits ([`normalizer`]);
//! - some pre-tokenizer must split at the gap, and nothing before that split may look
//!   across it or at where a stretch starts ([`step`]);
//! - the model then works on each pre-token alone (all four kinds do), unless BPE dropout
//!   makes it random. Without such a split (SentencePiece style: Metaspace without
//!   `split`, or a `Replace` of spaces and no pre-tokenizer), BPE still splits at the gap
//!   when no vocabulary entry runs across it ([`model`]).
//!
//! Anything not proven here refuses inner cuts: the prompt is then cut only before added
//! tokens, as before. The property tests in `tests/it/inner.rs` check the equality on
//! random text for each accepted family.

use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::pre_tokenizers::split::SplitPattern;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, ModelWrapper, NormalizedString, Normalizer, SplitDelimiterBehavior, Tokenizer};

/// Split regexes known to split before a word gap: in each, a space can only be the first
/// character of a match, or sit in a match of whitespace alone (which cannot start before
/// the gap, since a letter or digit precedes it), and the only lookaround is `(?!\S)` at a
/// match's end, which reads the same at the gap as at the end of the text.
const GAP_SPLITTING_REGEXES: &[&str] = &[
    // GPT-2 (also ByteLevel's built-in regex).
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    // cl100k / Llama 3: digits in runs of up to three.
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    // Qwen2: digits one by one.
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    // o200k: words split by case, contractions inside them.
    concat!(
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    // Tekken (Mistral): o200k without contractions, digits one by one.
    concat!(
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
];

/// Why a tokenizer's prompts are not cut inside text.
pub(crate) type Refusal = &'static str;

/// `Ok` if prompts of `tok` may be cut at word gaps; else why not.
pub(crate) fn check(tok: &Tokenizer) -> Result<(), Refusal> {
    let normalized = normalizer(SPACE, tok.get_normalizer())?;
    let gap = match tok.get_pre_tokenizer() {
        Some(pt) => step(normalized, pt)?,
        None => normalized,
    };
    model(gap, tok)?;
    let added: Vec<AddedToken> = tok.get_added_tokens_decoder().into_values().collect();
    added_tokens(&added, tok.get_normalizer(), normalized)
}

/// What the stages so far have made of the word gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gap {
    /// Inside one split, the gap's space now reads as this character, still between ASCII
    /// letters or digits.
    Char(char),
    /// A split starts at the gap; later stages act on each split alone.
    Split,
}

const SPACE: Gap = Gap::Char(' ');

fn normalizer(gap: Gap, n: Option<&NormalizerWrapper>) -> Result<Gap, Refusal> {
    use NormalizerWrapper as N;
    match n {
        None => Ok(gap),
        Some(N::Sequence(seq)) => seq.as_ref().iter().try_fold(gap, |gap, n| normalizer(gap, Some(n))),
        // Per character, and ASCII letters, digits and the space stay what they are
        // (lowercased); the Unicode forms treat an ASCII character as a boundary.
        Some(
            N::NFC(_)
            | N::NFD(_)
            | N::NFKC(_)
            | N::NFKD(_)
            | N::Lowercase(_)
            | N::StripAccents(_)
            | N::BertNormalizer(_)
            | N::Nmt(_),
        ) if gap == SPACE => Ok(gap),
        Some(N::Replace(r)) if gap == SPACE => space_replacement(r).map(Gap::Char),
        Some(N::Prepend(_)) => Err("Prepend normalizer: every piece would get the prefix"),
        Some(N::StripNormalizer(_)) => Err("Strip normalizer: a piece's edges would be stripped"),
        Some(_) => Err("normalizer not known to keep word gaps"),
    }
}

/// The one character a `Replace` of the plain string " " puts in its place (SentencePiece
/// style: `" "` to `"▁"`), a change per character.
fn space_replacement(r: &tokenizers::normalizers::replace::Replace) -> Result<char, Refusal> {
    let refusal = "Replace normalizer other than a space by one character";
    let json = serde_json::to_value(r).map_err(|_| refusal)?;
    let mut content = r.content.chars();
    match (json["pattern"]["String"].as_str(), content.next(), content.next()) {
        (Some(" "), Some(c), None) if c != ' ' && !c.is_ascii_alphanumeric() => Ok(c),
        _ => Err(refusal),
    }
}

/// The gap after stage `pt`, or why the stage may change the tokens across a cut.
fn step(gap: Gap, pt: &PreTokenizerWrapper) -> Result<Gap, Refusal> {
    use PreTokenizerWrapper as P;
    if let P::Sequence(seq) = pt {
        return seq.as_ref().iter().try_fold(gap, step);
    }
    if gap == Gap::Split {
        return after_split(pt);
    }
    if gap != SPACE {
        return Err("pre-tokenizer stage after the space was replaced");
    }
    match pt {
        // Split on whitespace (Bert also isolates punctuation): the gap's space goes.
        P::Whitespace(_) | P::WhitespaceSplit(_) | P::BertPreTokenizer(_) => Ok(Gap::Split),
        P::Delimiter(d) if d.delimiter == ' ' => Ok(Gap::Split),
        // Its prefix space goes before a split not starting with one; the piece after the
        // gap starts with one, the piece before starts where the whole did.
        P::ByteLevel(bl) if bl.use_regex => Ok(Gap::Split),
        P::ByteLevel(_) => Err("ByteLevel without its regex maps the gap's space before any split"),
        P::Split(s) => split(&s.pattern, s.behavior, s.invert),
        // The space becomes the replacement, which `split` splits before. The prepended
        // replacement goes only to a split not already starting with one, and the piece
        // after the gap starts with one.
        P::Metaspace(m) if m.get_split() => Ok(Gap::Split),
        P::Metaspace(m) => Ok(Gap::Char(m.get_replacement())),
        // Split by content only, and never inside a space between letters or digits.
        P::Digits(_) | P::Punctuation(_) => Ok(gap),
        P::UnicodeScripts(_) | P::Delimiter(_) | P::Sequence(_) => {
            Err("pre-tokenizer stage not known to keep word gaps")
        }
        P::FixedLength(_) => Err("FixedLength pre-tokenizer counts from each split's start"),
    }
}

/// Once a split starts at the gap, a stage acts on the split after it the same in the
/// piece as in the whole, unless it reads the split's offset in the whole input: Metaspace
/// `First` does, and the piece after the gap starts at offset 0.
fn after_split(pt: &PreTokenizerWrapper) -> Result<Gap, Refusal> {
    match pt {
        PreTokenizerWrapper::Metaspace(m) if m.get_prepend_scheme() == PrependScheme::First => {
            Err("Metaspace with prepend_scheme first after a split")
        }
        PreTokenizerWrapper::FixedLength(_) => Err("FixedLength pre-tokenizer counts from each split's start"),
        _ => Ok(Gap::Split),
    }
}

fn split(pattern: &SplitPattern, behavior: SplitDelimiterBehavior, invert: bool) -> Result<Gap, Refusal> {
    // Merging behaviours would glue the gap's space to the text before it.
    let keeps_edges = matches!(behavior, SplitDelimiterBehavior::Isolated | SplitDelimiterBehavior::Removed);
    let known = match pattern {
        SplitPattern::String(s) => s == " ",
        SplitPattern::Regex(r) => GAP_SPLITTING_REGEXES.contains(&r.as_str()),
    };
    if keeps_edges && known && !invert {
        Ok(Gap::Split)
    } else {
        Err("Split pattern not known to split at word gaps")
    }
}

/// Each model works on each pre-token alone. If nothing split at the gap, the model sees
/// `…x▁y…` whole; BPE still splits there if no vocabulary entry runs from another
/// character into the gap's character: merges join two symbols at a time, by rank alone,
/// and each result is in the vocabulary. Not with `ignore_merges` (a piece found whole in
/// the vocabulary skips the merges the whole text goes through), nor Unigram, whose best
/// path sums floating-point scores, so a near tie can round differently with the text
/// before the gap added in.
fn model(gap: Gap, tok: &Tokenizer) -> Result<(), Refusal> {
    if let ModelWrapper::BPE(bpe) = tok.get_model() {
        if bpe.dropout.is_some_and(|d| d > 0.0) {
            return Err("BPE dropout is random");
        }
    }
    let Gap::Char(c) = gap else {
        return Ok(());
    };
    match tok.get_model() {
        ModelWrapper::BPE(bpe)
            if !bpe.ignore_merges && bpe.continuing_subword_prefix.is_none() && bpe.end_of_word_suffix.is_none() => {}
        _ => return Err("no pre-tokenizer stage splits at word gaps"),
    }
    let vocab = tok.get_vocab(false);
    if !vocab.contains_key(c.encode_utf8(&mut [0; 4]) as &str) {
        return Err("the gap's character is not in the vocabulary");
    }
    let crosses = |t: &str| t.chars().zip(t.chars().skip(1)).any(|(a, b)| a != c && b == c);
    if vocab.keys().any(|t| crosses(t)) {
        return Err("a vocabulary entry runs across a word gap");
    }
    Ok(())
}

/// No added token may cover a gap (a non-space then a space inside its pattern), take the
/// gap's space with `rstrip`, or appear at the gap with `single_word`. Normalized tokens are
/// matched on normalized text, so their normalized content is what is checked, and the
/// space may read as what the normalizer made of it (`normalized`).
fn added_tokens(added: &[AddedToken], n: Option<&NormalizerWrapper>, normalized: Gap) -> Result<(), Refusal> {
    let spacy = |c: char| c.is_whitespace() || Gap::Char(c) == normalized;
    for t in added {
        let pattern = match n {
            Some(n) if t.normalized => {
                let mut s = NormalizedString::from(t.content.as_str());
                n.normalize(&mut s).map_err(|_| "an added token does not normalize")?;
                s.get().to_owned()
            }
            _ => t.content.clone(),
        };
        let chars: Vec<char> = pattern.chars().collect();
        if chars.windows(2).any(|w| !spacy(w[0]) && spacy(w[1])) {
            return Err("an added token contains a word then a space");
        }
        if t.rstrip && chars.last().is_some_and(|c| c.is_alphanumeric()) {
            return Err("an rstrip added token ends in a letter or digit");
        }
        if t.single_word && chars.first().is_some_and(|&c| spacy(c)) {
            return Err("a single_word added token starts with a space");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
