//! A bounded memo from words to their token ids, so text the prefix cache has never seen
//! costs a lookup per word rather than a run of the tokenizer's whole pipeline. A word is
//! the text between two word gaps (`segment.rs`); cutting at every gap is exact for the
//! tokenizers `inner.rs` accepts, the only ones this serves. Prompts repeat their words,
//! so after a few requests most words are found.
//!
//! A word is remembered the second time it is seen: learning one costs a call of the
//! pipeline on it alone, which only pays if it comes back. A fixed table of hashes (the
//! doorkeeper) says whether a word was seen before; a clash only delays learning.
//!
//! Two generations bound the memo without a recency list: a lookup tries the young map,
//! then the old one, and a word found old moves young. When the young map is full it
//! becomes the old one and the old one is dropped, so words in use survive and at most
//! `words_max` entries are held, each of at most [`WORD_BYTES_MAX`] bytes. It holds no
//! lock; `lib.rs` wraps it in one.

mod encode;

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub(crate) use encode::encode;

/// Longer words are tokenized every time, unremembered: long stretches without a gap
/// (code, numbers, other scripts) rarely repeat exactly.
pub(crate) const WORD_BYTES_MAX: usize = 64;

/// Slots of the doorkeeper (8 bytes each).
const SEEN_SLOTS: usize = 1 << 16;

/// hashbrown's default hasher (foldhash, seeded per process), faster than SipHash on short
/// keys: every word of a new prompt is looked up.
type Map = HashMap<Box<str>, Box<[u32]>>;

pub(crate) struct WordMemo {
    young: Map,
    old: Map,
    /// Entries of one generation; zero turns the memo off.
    generation_max: usize,
    /// Marks of words seen, each in the slot its hash names.
    seen: Box<[u64]>,
    hits: u64,
    misses: u64,
}

impl WordMemo {
    /// A memo of at most `words_max` words; below 2 it remembers nothing.
    pub(crate) fn new(words_max: usize) -> Self {
        let generation_max = words_max / 2;
        let seen = vec![0; if generation_max > 0 { SEEN_SLOTS } else { 0 }].into_boxed_slice();
        Self { young: Map::new(), old: Map::new(), generation_max, seen, hits: 0, misses: 0 }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.generation_max > 0
    }

    /// Appends the ids of `word` to `out` and says true, if it is known. A word too long
    /// to remember counts as a miss.
    pub(crate) fn get_into(&mut self, word: &str, out: &mut Vec<u32>) -> bool {
        if word.len() > WORD_BYTES_MAX {
            self.misses += 1;
            return false;
        }
        if let Some(ids) = self.young.get(word) {
            out.extend_from_slice(ids);
            self.hits += 1;
            return true;
        }
        if let Some((word, ids)) = self.old.remove_entry(word) {
            out.extend_from_slice(&ids);
            self.put(word, ids);
            self.hits += 1;
            return true;
        }
        self.misses += 1;
        false
    }

    /// Whether an unknown `word` is worth learning: short enough, and seen before. Marks
    /// it seen.
    pub(crate) fn seen_before(&mut self, word: &str) -> bool {
        if !self.enabled() || word.len() > WORD_BYTES_MAX {
            return false;
        }
        // Zero marks an empty slot, so no mark is zero.
        let mark = xxh3_64_with_seed(word.as_bytes(), 0x776f_7264) | 1;
        let slot = &mut self.seen[(mark >> 1) as usize % SEEN_SLOTS];
        let seen = *slot == mark;
        *slot = mark;
        seen
    }

    /// Remembers `ids` for `word`, unless it is too long or the memo is off.
    pub(crate) fn insert(&mut self, word: &str, ids: &[u32]) {
        if !self.enabled() || word.len() > WORD_BYTES_MAX || self.young.contains_key(word) {
            return;
        }
        self.old.remove(word);
        self.put(word.into(), ids.into());
    }

    fn put(&mut self, word: Box<str>, ids: Box<[u32]>) {
        if self.young.len() >= self.generation_max {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert(word, ids);
    }

    /// `(hits, misses, entries held)`.
    pub(crate) fn stats(&self) -> (u64, u64, usize) {
        (self.hits, self.misses, self.young.len() + self.old.len())
    }
}

#[cfg(test)]
mod tests {
    use super::{WordMemo, WORD_BYTES_MAX};

    /// Runs `ops` (`+word` inserts the word with ids `[len]`, `?word` looks it up) on a memo
    /// of `words_max`, and compares what each lookup found and the entries held at the end.
    #[track_caller]
    fn check(words_max: usize, ops: &[&str], found: &[bool], entries: usize) {
        let mut memo = WordMemo::new(words_max);
        let mut got = Vec::new();
        for op in ops {
            let (kind, word) = op.split_at(1);
            if kind == "+" {
                memo.insert(word, &[word.len() as u32]);
            } else {
                let mut out = Vec::new();
                let hit = memo.get_into(word, &mut out);
                assert_eq!(out, if hit { vec![word.len() as u32] } else { vec![] }, "{op}");
                got.push(hit);
            }
        }
        assert_eq!(got, found, "{ops:?}");
        assert_eq!(memo.stats().2, entries);
        assert!(entries <= words_max);
    }

    #[test]
    fn a_word_used_again_survives_the_turnover() {
        // Generations of 2: "a" is looked up after "b" fills the young one, so it moves up.
        check(4, &["+a", "+b", "+c", "?a", "+d", "+e", "?a", "?b"], &[true, true, false], 3);
        // Not looked up, "a" is gone two turnovers later.
        check(4, &["+a", "+b", "+c", "+d", "+e", "?a", "?e"], &[false, true], 3);
    }

    #[test]
    fn remembers_nothing_when_off_or_too_long() {
        check(1, &["+a", "?a"], &[false], 0);
        let long = format!("+{}", "x".repeat(WORD_BYTES_MAX + 1));
        check(8, &[&long, &long.replacen('+', "?", 1), "+x", "?x"], &[false, true], 1);
    }

    #[test]
    fn a_word_is_worth_learning_the_second_time() {
        let mut memo = WordMemo::new(8);
        let long = "y".repeat(WORD_BYTES_MAX + 1);
        let seen: Vec<bool> = ["a", "b", "a", "a", &long, &long].iter().map(|w| memo.seen_before(w)).collect();
        assert_eq!(seen, [false, false, true, true, false, false]);
        let mut off = WordMemo::new(1);
        assert!(!off.seen_before("a") && !off.seen_before("a"));
    }
}
