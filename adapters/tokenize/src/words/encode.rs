//! Tokenizing a text word by word through the memo (see `mod.rs`).

use std::ops::Range;
use std::sync::Mutex;

use super::WordMemo;
use crate::lock;
use crate::segment;

/// Most words of one text tokenized alone to be learned: a word alone costs about twice
/// its share of a long call, so this bounds what learning adds to one text.
const LEARN_PER_TEXT: usize = 64;

/// What a word of the text gets.
enum Word {
    /// Its ids, at this range of the ids found.
    Known(Range<usize>),
    /// Tokenized alone, then remembered.
    Learn,
    /// Tokenized with the unknown words around it in one call.
    Bulk,
}

/// Tokenizes `text` with `tokenize` as it would in one call, through the memo: known
/// words are looked up, words seen before are tokenized alone and learned, and each run
/// of other words goes in one call. When the known words are too few to pay for the calls
/// the runs would take, the whole text goes in one call instead (the words to learn still
/// alone besides). The lock is held for lookups and inserts, never while tokenizing.
pub(crate) fn encode<E>(
    memo: &Mutex<WordMemo>,
    text: &str,
    tokenize: impl Fn(&str) -> Result<Vec<u32>, E>,
) -> Result<Vec<u32>, E> {
    if text.is_empty() {
        return tokenize(text);
    }
    let words: Vec<Range<usize>> = segment::words(text).collect();
    let mut known = Vec::with_capacity(text.len() / 4);
    let kinds = classify(memo, text, &words, &mut known);
    let hits = kinds.iter().filter(|k| matches!(k, Word::Known(_))).count();
    let bulk = |i: usize| matches!(kinds[i], Word::Bulk);
    let bulk_runs = (0..words.len()).filter(|&i| bulk(i) && (i == 0 || !bulk(i - 1))).count();
    let mut fresh: Vec<(&str, Vec<u32>)> = Vec::new();
    let out = if hits >= 2 * bulk_runs {
        in_order(text, &words, &kinds, &known, &tokenize, &mut fresh)?
    } else {
        for (w, _) in words.iter().zip(&kinds).filter(|(_, k)| matches!(k, Word::Learn)) {
            fresh.push((&text[w.clone()], tokenize(&text[w.clone()])?));
        }
        tokenize(text)?
    };
    if !fresh.is_empty() {
        let mut memo = lock(memo);
        for (w, ids) in fresh {
            memo.insert(w, &ids);
        }
    }
    Ok(out)
}

/// The text's ids word by word: known words' from `known`, each word to learn alone (and
/// into `fresh`), each run of other words in one call.
fn in_order<'t, E>(
    text: &'t str,
    words: &[Range<usize>],
    kinds: &[Word],
    known: &[u32],
    tokenize: impl Fn(&str) -> Result<Vec<u32>, E>,
    fresh: &mut Vec<(&'t str, Vec<u32>)>,
) -> Result<Vec<u32>, E> {
    let mut out = Vec::with_capacity(known.len() + text.len() / 8);
    let mut i = 0;
    while i < words.len() {
        match &kinds[i] {
            Word::Known(r) => out.extend_from_slice(&known[r.clone()]),
            Word::Learn => {
                let ids = tokenize(&text[words[i].clone()])?;
                out.extend_from_slice(&ids);
                fresh.push((&text[words[i].clone()], ids));
            }
            Word::Bulk => {
                let first = words[i].start;
                while i + 1 < words.len() && matches!(kinds[i + 1], Word::Bulk) {
                    i += 1;
                }
                out.extend(tokenize(&text[first..words[i].end])?);
            }
        }
        i += 1;
    }
    Ok(out)
}

/// Each word's kind, the known ones' ids appended to `known`.
fn classify(memo: &Mutex<WordMemo>, text: &str, words: &[Range<usize>], known: &mut Vec<u32>) -> Vec<Word> {
    let mut memo = lock(memo);
    let mut learn = 0;
    let mut kind = |w: &str| {
        let from = known.len();
        if memo.get_into(w, known) {
            Word::Known(from..known.len())
        } else if memo.seen_before(w) && learn < LEARN_PER_TEXT {
            learn += 1;
            Word::Learn
        } else {
            Word::Bulk
        }
    };
    words.iter().map(|w| kind(&text[w.clone()])).collect()
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::sync::Mutex;

    use super::{encode, LEARN_PER_TEXT};
    use crate::words::WordMemo;

    /// Encodes each of `before`, then `text`, with a tokenizer of one id per byte (exact at
    /// any cut), and compares the texts it ran on for `text` and the words then held.
    #[track_caller]
    fn check(before: &[&str], text: &str, ran_want: &[&str], entries_want: usize) {
        let memo = Mutex::new(WordMemo::new(1 << 10));
        let ran = RefCell::new(Vec::new());
        let bytes = |t: &str| -> Result<Vec<u32>, ()> {
            ran.borrow_mut().push(t.to_owned());
            Ok(t.bytes().map(u32::from).collect())
        };
        for b in before {
            encode(&memo, b, bytes).unwrap();
        }
        ran.borrow_mut().clear();
        assert_eq!(encode(&memo, text, bytes).unwrap(), text.bytes().map(u32::from).collect::<Vec<_>>());
        assert_eq!(*ran.borrow(), ran_want, "{text:?}");
        assert_eq!(memo.lock().unwrap().stats().2, entries_want);
    }

    fn words(n: usize, prefix: &str) -> Vec<String> {
        (0..n).map(|i| format!(" {prefix}{i}")).collect()
    }

    #[test]
    fn words_are_learned_the_second_time_and_then_not_tokenized() {
        let twice = ["x", "x", " a", " a", " b", " b"];
        check(&twice, "x b a c a d", &[" c", " d"], 3);
        check(&[], "x. y", &["x. y"], 0);
        check(&["x. y"], "x. y", &["x. y"], 1);
        check(&["x. y", "x. y"], "x. y", &[], 1);
    }

    #[test]
    fn mostly_new_text_goes_in_one_call() {
        let new = words(LEARN_PER_TEXT + 3, "w").concat();
        let learned = words(LEARN_PER_TEXT, "w");
        // Seen once: the first words are learned alone, the whole text in one call besides.
        let mut ran: Vec<&str> = learned.iter().map(String::as_str).collect();
        ran.push(&new);
        check(&[&new], &new, &ran, LEARN_PER_TEXT);
        // Mostly known: the new words' run in one call of its own.
        let old = words(40, "k");
        let before: Vec<&str> = old.iter().chain(&old).map(String::as_str).collect();
        let run = words(5, "n").concat();
        check(&before, &format!("{}{run}", old.concat()), &[&run], 40);
    }
}
