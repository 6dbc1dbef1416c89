//! What a response used, read from its bytes as they pass, for the `tokens_per_minute`
//! true-up (`quota.rs`): the engine's own `usage` object when the response has one
//! (the last `"prompt_tokens"` and `"completion_tokens"` numbers), else, for a stream,
//! one output token per `data: {` event.
//!
//! The usage object comes at the end of a body (last in a completion's JSON, the last
//! chunk of a stream before `[DONE]`), so only the last [`TAIL_BYTES`] are kept. A key
//! quoted inside generated text is escaped (`\"completion_tokens\"`), so it never
//! matches. Work per frame: one `memchr` pass and a copy of at most `TAIL_BYTES`
//! (amortized: the frame's bytes, once more).

use std::sync::LazyLock;

use memchr::memmem;

/// Bytes of the body's end kept for its usage object.
pub(crate) const TAIL_BYTES: usize = 2048;

const EVENT: &[u8] = b"data: {";
const PROMPT_KEY: &[u8] = b"\"prompt_tokens\":";
const COMPLETION_KEY: &[u8] = b"\"completion_tokens\":";

/// A response's bytes, as far as its usage goes.
#[derive(Debug, Default)]
pub(crate) struct UsageScan {
    tail: Vec<u8>,
    events: u64,
}

/// Tokens a response used, as far as its bytes tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Used {
    /// The engine's prompt tokens, if it said.
    pub(crate) prompt: Option<u64>,
    /// The engine's completion tokens, else the stream's events; `None` when neither.
    pub(crate) output: Option<u64>,
}

impl UsageScan {
    /// Reads one frame of the body. The tail grows to twice [`TAIL_BYTES`] before its
    /// front is dropped, so a stream of small frames moves each byte at most once more.
    pub(crate) fn observe(&mut self, data: &[u8]) {
        static EVENTS: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(EVENT));
        self.events += EVENTS.find_iter(data).count() as u64;
        let data = &data[data.len().saturating_sub(TAIL_BYTES)..];
        if self.tail.len() + data.len() > 2 * TAIL_BYTES {
            let keep = TAIL_BYTES - data.len();
            self.tail.drain(..self.tail.len() - keep);
        }
        self.tail.extend_from_slice(data);
    }

    /// What the bytes read so far say was used.
    pub(crate) fn used(&self) -> Used {
        let tail = &self.tail[self.tail.len().saturating_sub(TAIL_BYTES)..];
        // Built once: building a finder costs more than searching a tail.
        static PROMPT: LazyLock<memmem::FinderRev<'static>> = LazyLock::new(|| memmem::FinderRev::new(PROMPT_KEY));
        static COMPLETION: LazyLock<memmem::FinderRev<'static>> =
            LazyLock::new(|| memmem::FinderRev::new(COMPLETION_KEY));
        let prompt = last_number(tail, &PROMPT);
        let output = last_number(tail, &COMPLETION).or((self.events > 0).then_some(self.events));
        Used { prompt, output }
    }
}

/// The number after the last `key` in `text` (JSON whitespace allowed before it).
fn last_number(text: &[u8], key: &memmem::FinderRev<'static>) -> Option<u64> {
    let at = key.rfind(text)? + key.needle().len();
    let rest = &text[at..];
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let digits = rest[start..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[start..start + digits]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `frames` read in order give `want` (prompt, output).
    #[track_caller]
    fn check(frames: &[&[u8]], want: (Option<u64>, Option<u64>)) {
        let mut s = UsageScan::default();
        for f in frames {
            s.observe(f);
        }
        assert_eq!((s.used().prompt, s.used().output), want);
    }

    #[test]
    fn the_usage_object_or_the_streams_events() {
        let body = br#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":12,"total_tokens":19,"completion_tokens":7,"prompt_tokens_details":null}}"#;
        check(&[body], (Some(12), Some(7)));
        let (a, b) = body.split_at(body.len() - 60);
        check(&[a, b], (Some(12), Some(7)));
        check(&[b"{\"usage\": {\"prompt_tokens\" : 3, \"completion_tokens\":\n 4}}"], (None, Some(4)));
        check(&[b"{\"usage\": {\"prompt_tokens\": 3, \"completion_tokens\":\n 4}}"], (Some(3), Some(4)));
        let sse: &[&[u8]] = &[
            b"data: {\"choices\":[{\"delta\":{}}]}\n\n",
            b"data: {\"c\":1}\n\ndata: {\"c\":2}\n\n",
            b"data: [DONE]\n\n",
        ];
        check(sse, (None, Some(3)));
        let with_usage: &[&[u8]] = &[
            b"data: {\"c\":1}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\n",
        ];
        check(with_usage, (Some(5), Some(1)));
        check(&[br#"{"text":"say \"completion_tokens\":99"}"#], (None, None));
        check(&[br#"{"completion_tokens":99999999999999999999999}"#], (None, None));
        check(&[], (None, None));
    }

    #[test]
    fn only_the_tail_is_kept() {
        let mut s = UsageScan::default();
        s.observe(br#"{"usage":{"completion_tokens":5}}"#);
        for _ in 0..3 {
            s.observe(&[b' '; TAIL_BYTES / 2]);
        }
        assert!(s.tail.len() <= 2 * TAIL_BYTES);
        assert_eq!(s.used().output, None, "the usage scrolled out");
        s.observe(br#"{"usage":{"completion_tokens":6}}"#);
        for n in [1, 7, TAIL_BYTES - 40, 3 * TAIL_BYTES] {
            s.observe(&vec![b'x'; n]);
            assert!(s.tail.len() <= 2 * TAIL_BYTES, "{n}: {}", s.tail.len());
        }
        assert_eq!(s.used().output, None);
        s.observe(br#"{"usage":{"completion_tokens":7}}"#);
        s.observe(&[b' '; TAIL_BYTES - 40]);
        assert_eq!(s.used().output, Some(7), "within the last TAIL_BYTES");
    }
}
