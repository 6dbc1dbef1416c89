//! Where recent prompts ended: the last `prompt_end_blocks` full blocks of each routed
//! request, the most recent `prompt_ends_max` such blocks kept.
//!
//! A request whose cached prefix covers one of these blocks continues an earlier
//! prompt (a conversation's next turn, a retry); a prefix that covers none is text
//! that requests share but that no request stopped at (a system prompt, a header).
//! The keep term follows a conversation, not shared text (see
//! [`TtftWeights::keep_needs_prompt_end`](crate::TtftWeights::keep_needs_prompt_end)).

use alloc::collections::VecDeque;

use hashbrown::HashSet;

use crate::hash::SeqHash;
use crate::load::hasher::SeededState;

/// A bounded record of prompts' last blocks, oldest forgotten first.
#[derive(Debug)]
pub(super) struct PromptEnds {
    order: VecDeque<SeqHash>,
    ends: HashSet<SeqHash, SeededState>,
    max: usize,
}

impl PromptEnds {
    pub(super) fn new(max: usize, hash_seed: u64) -> Self {
        PromptEnds { order: VecDeque::new(), ends: HashSet::with_hasher(SeededState(hash_seed)), max }
    }

    /// Records the last `tail` full blocks of a prompt of `blocks`. A block already
    /// recorded keeps its place.
    pub(super) fn record(&mut self, blocks: &[SeqHash], tail: usize) {
        for &h in &blocks[blocks.len().saturating_sub(tail)..] {
            self.record_one(h);
        }
    }

    fn record_one(&mut self, h: SeqHash) {
        if self.max == 0 || !self.ends.insert(h) {
            return;
        }
        if self.order.len() == self.max {
            if let Some(old) = self.order.pop_front() {
                self.ends.remove(&old);
            }
        }
        self.order.push_back(h);
    }

    /// Whether `prefix` continues an earlier prompt: one ended within it (looked for from
    /// the end, where a conversation's last prompt ended), or no record is kept
    /// (`prompt_ends_max` 0), which reads every prefix as a conversation's.
    pub(super) fn continued(&self, prefix: &[SeqHash]) -> bool {
        self.max == 0 || prefix.iter().rev().any(|h| self.ends.contains(h))
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        debug_assert_eq!(self.order.len(), self.ends.len());
        self.order.len()
    }
}

#[cfg(test)]
mod tests {
    use alloc::vec::Vec;

    use super::*;

    fn hashes(xs: &[u64]) -> Vec<SeqHash> {
        xs.iter().map(|&x| SeqHash(x)).collect()
    }

    /// Records `prompts` (each a list of block hashes) with `tail` and a bound of `max`,
    /// then asks whether each of `asks` continues one.
    #[track_caller]
    fn check(max: usize, tail: usize, prompts: &[&[u64]], asks: &[(&[u64], bool)], len: usize) {
        let mut e = PromptEnds::new(max, 7);
        for p in prompts {
            e.record(&hashes(p), tail);
        }
        for (prefix, want) in asks {
            assert_eq!(e.continued(&hashes(prefix)), *want, "{prefix:?} after {prompts:?}, tail {tail}, max {max}");
        }
        assert_eq!(e.len(), len, "entries kept");
        assert!(e.len() <= max);
    }

    #[test]
    fn a_prefix_continues_a_prompt_that_ended_inside_it() {
        // A prefix through the last block, or (with a tail of 2) the one before it.
        check(8, 1, &[&[1, 2, 3]], &[(&[1, 2, 3], true), (&[1, 2], false), (&[], false)], 1);
        check(8, 2, &[&[1, 2, 3]], &[(&[1, 2], true), (&[1], false)], 2);
        // A prompt shorter than the tail records all it has; an empty one nothing.
        check(8, 2, &[&[5], &[]], &[(&[5], true)], 1);
        // The same end twice is kept once.
        check(8, 1, &[&[1, 2], &[1, 2]], &[(&[1, 2], true)], 1);
    }

    #[test]
    fn the_oldest_end_is_forgotten_first_and_at_zero_every_prefix_continues() {
        check(2, 1, &[&[1], &[2], &[3]], &[(&[1], false), (&[2], true), (&[3], true)], 2);
        check(0, 2, &[&[1, 2]], &[(&[1, 2], true), (&[3], true)], 0);
    }
}
