//! The simulated model's greedy decoding: each generated token is a function of every
//! token before it (prompt and output alike), so a generation continued from a prefix
//! of prompt plus output produces exactly what the uninterrupted one would have. That
//! is what a real engine does at `temperature: 0` on fixed weights, and it lets tests
//! check that a stream moved to another worker mid-way loses or doubles nothing.
//!
//! Generated ids are [`TOKEN_ID_BASE`] plus an index into a fixed word list; a word is
//! the text of its token.

/// The first generated token id; ids `TOKEN_ID_BASE..TOKEN_ID_BASE + 32` are words.
pub(crate) const TOKEN_ID_BASE: u32 = 1_000_000;

const WORDS: [&str; 32] = [
    "the ",
    "cache ",
    "holds ",
    "every ",
    "prefix ",
    "block ",
    "and ",
    "routes ",
    "tokens ",
    "to ",
    "a ",
    "worker ",
    "that ",
    "already ",
    "knows ",
    "them ",
    "so ",
    "prefill ",
    "stays ",
    "short ",
    "while ",
    "decode ",
    "keeps ",
    "pace ",
    "with ",
    "load ",
    "across ",
    "the ",
    "fleet ",
    "of ",
    "simulated ",
    "GPUs ",
];

/// The decoding state after a sequence of tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Greedy(u64);

impl Greedy {
    /// The state after `tokens`. Linear in their number.
    pub(crate) fn after(tokens: &[u32]) -> Self {
        let mut g = Greedy(0xCBF2_9CE4_8422_2325);
        for &t in tokens {
            g.push(t);
        }
        g
    }

    fn push(&mut self, token: u32) {
        self.0 = (self.0 ^ u64::from(token)).wrapping_mul(0x0100_0000_01B3);
    }

    /// The next token (the most likely one), which then joins the sequence.
    pub(crate) fn next_token(&mut self) -> u32 {
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        let id = TOKEN_ID_BASE + ((x ^ (x >> 31)) % WORDS.len() as u64) as u32;
        self.push(id);
        id
    }
}

/// The text of a generated token; an id the model never generates has none.
pub(crate) fn word(id: u32) -> &'static str {
    id.checked_sub(TOKEN_ID_BASE).and_then(|i| WORDS.get(i as usize)).copied().unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(prompt: &[u32], n: usize) -> Vec<u32> {
        let mut g = Greedy::after(prompt);
        (0..n).map(|_| g.next_token()).collect()
    }

    #[test]
    fn a_continuation_from_any_prefix_of_the_output_is_exact() {
        let prompt = [5, 6, 7, 8];
        let whole = run(&prompt, 24);
        for cut in 0..whole.len() {
            let mut resumed: Vec<u32> = prompt.to_vec();
            resumed.extend_from_slice(&whole[..cut]);
            assert_eq!(run(&resumed, whole.len() - cut), whole[cut..], "cut after {cut} tokens");
        }
    }

    #[test]
    fn output_depends_on_the_prompt_and_varies() {
        let (a, b) = (run(&[1, 2], 16), run(&[2, 1], 16));
        assert_ne!(a, b);
        assert!(a.iter().collect::<std::collections::BTreeSet<_>>().len() > 1);
        assert!(a.iter().all(|&t| !word(t).is_empty()));
        assert_eq!(word(7), "");
    }
}
