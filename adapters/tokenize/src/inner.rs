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
//!   stays a space between ASCII letters or digits ([`normalizer`]);
//! - some pre-tokenizer must split at the gap, and nothing before that split may look
//!   across it or at where a stretch starts ([`pre_tokenizer`]);
//! - the model then works on each pre-token alone (all four kinds do), unless BPE dropout
//!   makes it random.
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
];

/// Why a tokenizer's prompts are not cut inside text.
pub(crate) type Refusal = &'static str;

/// `Ok` if prompts of `tok` may be cut at word gaps; else why not.
pub(crate) fn check(tok: &Tokenizer) -> Result<(), Refusal> {
    normalizer(tok.get_normalizer())?;
    match tok.get_pre_tokenizer() {
        Some(pt) => pre_tokenizer(pt)?,
        None => return Err("no pre-tokenizer: the model sees whole stretches"),
    }
    model(tok.get_model())?;
    let added: Vec<AddedToken> = tok.get_added_tokens_decoder().into_values().collect();
    added_tokens(&added, tok.get_normalizer())
}

fn normalizer(n: Option<&NormalizerWrapper>) -> Result<(), Refusal> {
    use NormalizerWrapper as N;
    match n {
        None => Ok(()),
        Some(N::Sequence(seq)) => seq.as_ref().iter().try_for_each(|n| normalizer(Some(n))),
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
        ) => Ok(()),
        Some(N::Prepend(_)) => Err("Prepend normalizer: every piece would get the prefix"),
        Some(N::StripNormalizer(_)) => Err("Strip normalizer: a piece's edges would be stripped"),
        Some(_) => Err("normalizer not known to keep word gaps"),
    }
}

/// What a pre-tokenizer stage has made of the word gap so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gap {
    /// Still a space between ASCII letters or digits, inside one split.
    Space,
    /// A split starts at the gap; later stages act on each split alone.
    Split,
}

fn pre_tokenizer(pt: &PreTokenizerWrapper) -> Result<(), Refusal> {
    match step(Gap::Space, pt)? {
        Gap::Split => Ok(()),
        Gap::Space => Err("no pre-tokenizer stage splits at word gaps"),
    }
}

/// The gap after stage `pt`, or why the stage may change the tokens across a cut.
fn step(gap: Gap, pt: &PreTokenizerWrapper) -> Result<Gap, Refusal> {
    use PreTokenizerWrapper as P;
    match pt {
        P::Sequence(seq) => seq.as_ref().iter().try_fold(gap, step),
        // Split on whitespace (Bert also isolates punctuation): the gap's space goes.
        P::Whitespace(_) | P::WhitespaceSplit(_) | P::BertPreTokenizer(_) => Ok(Gap::Split),
        P::Delimiter(d) if d.delimiter == ' ' => Ok(Gap::Split),
        // Its prefix space goes before a split not starting with one; the piece after the
        // gap starts with one, the piece before starts where the whole did.
        P::ByteLevel(bl) if bl.use_regex => Ok(Gap::Split),
        P::ByteLevel(_) => match gap {
            Gap::Split => Ok(Gap::Split),
            Gap::Space => Err("ByteLevel without its regex maps the gap's space before any split"),
        },
        P::Split(s) => split(gap, &s.pattern, s.behavior, s.invert),
        P::Metaspace(m) => metaspace(gap, m.get_prepend_scheme(), m.get_split()),
        // Split by content only, and never inside a space between letters or digits.
        P::Digits(_) | P::Punctuation(_) => Ok(gap),
        P::UnicodeScripts(_) | P::Delimiter(_) => match gap {
            Gap::Split => Ok(Gap::Split),
            Gap::Space => Err("pre-tokenizer stage not known to keep word gaps"),
        },
        P::FixedLength(_) => Err("FixedLength pre-tokenizer counts from each split's start"),
    }
}

fn split(gap: Gap, pattern: &SplitPattern, behavior: SplitDelimiterBehavior, invert: bool) -> Result<Gap, Refusal> {
    if gap == Gap::Split {
        return Ok(Gap::Split);
    }
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

/// Metaspace turns the gap's space into its replacement; with `split` it splits before it.
/// The prepended replacement goes only to a split not already starting with one (the piece
/// after the gap always does), and `First` reads the split's offset in the whole input,
/// which differs between a piece and the whole once some earlier stage has split there.
fn metaspace(gap: Gap, prepend: PrependScheme, splits: bool) -> Result<Gap, Refusal> {
    match (gap, prepend) {
        (Gap::Split, PrependScheme::First) => Err("Metaspace with prepend_scheme first after a split"),
        (Gap::Split, _) => Ok(Gap::Split),
        (Gap::Space, _) if splits => Ok(Gap::Split),
        (Gap::Space, _) => Err("Metaspace without split: the model sees whole stretches"),
    }
}

fn model(m: &ModelWrapper) -> Result<(), Refusal> {
    match m {
        ModelWrapper::BPE(bpe) if bpe.dropout.is_some_and(|d| d > 0.0) => Err("BPE dropout is random"),
        _ => Ok(()),
    }
}

/// No added token may cover a gap (a non-space then a space inside its pattern), take the
/// gap's space with `rstrip`, or appear at the gap with `single_word`. Normalized tokens are
/// matched on normalized text, so their normalized content is what is checked.
fn added_tokens(added: &[AddedToken], n: Option<&NormalizerWrapper>) -> Result<(), Refusal> {
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
        if chars.windows(2).any(|w| !w[0].is_whitespace() && w[1].is_whitespace()) {
            return Err("an added token contains a word then a space");
        }
        if t.rstrip && chars.last().is_some_and(|c| c.is_alphanumeric()) {
            return Err("an rstrip added token ends in a letter or digit");
        }
        if t.single_word && chars.first().is_some_and(|c| c.is_whitespace()) {
            return Err("a single_word added token starts with a space");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
