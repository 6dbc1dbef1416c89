//! The fallback tokenization for models without a tokenizer folder: the proxy routes on
//! it and `kvroute sim-worker` serves with it by default, so a router in front of
//! simulated workers sees exactly the blocks they cache.
//!
//! It packs the UTF-8 bytes of the prompt, four to a `u32` "token" (little-endian, the
//! last one zero-padded), so a block of 64 such tokens covers 256 bytes, about the text of
//! 64 real tokens. Each token's top bit is cleared, keeping ids below 2^31, the range
//! prompts own (the simulator gives generated tokens the ids above). For valid UTF-8,
//! which every input here is, clearing it loses nothing: a byte's top bit says whether
//! it is ASCII, and its neighbours in the same token already tell that (the proptest
//! below checks it).
//!
//! A chat body renders canonically, then packs the same way: `tools` (if present) as
//! JSON with sorted keys and a newline, then each message the same way. Appending a
//! message keeps every earlier whole block. Work is linear in the body's size.
//!
//! A real engine tokenizes differently, so against real workers these ids only estimate
//! prefix sharing; their KV events never match them.

use serde_json::Value;

/// The fallback tokens of a text prompt.
pub fn fallback_text(text: &str) -> Vec<u32> {
    pack_bytes(text.as_bytes())
}

/// The fallback tokens of a chat body: canonical tools, then each message. `messages`
/// that is absent or not an array renders as nothing; callers that must refuse such a
/// body check it first.
pub fn fallback_chat(body: &Value) -> Vec<u32> {
    let mut out = Vec::new();
    if let Some(tools) = body.get("tools") {
        write_canonical(tools, &mut out);
        out.push(b'\n');
    }
    if let Some(Value::Array(messages)) = body.get("messages") {
        for m in messages {
            write_canonical(m, &mut out);
            out.push(b'\n');
        }
    }
    pack_bytes(&out)
}

/// Four bytes per token, little-endian, the last one zero-padded, top bit cleared.
fn pack_bytes(bytes: &[u8]) -> Vec<u32> {
    const TOP_BIT_CLEAR: u32 = 0x7fff_ffff;
    let words = bytes.chunks_exact(4);
    let tail = words.remainder();
    let mut out: Vec<u32> = Vec::with_capacity(bytes.len().div_ceil(4));
    out.extend(words.map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & TOP_BIT_CLEAR));
    if !tail.is_empty() {
        let mut b = [0u8; 4];
        b[..tail.len()].copy_from_slice(tail);
        out.push(u32::from_le_bytes(b) & TOP_BIT_CLEAR);
    }
    out
}

/// JSON with object keys sorted at every level and no whitespace, whatever order the
/// input had (and whether or not serde_json keeps insertion order).
pub fn write_canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                // Writing into a Vec cannot fail.
                let _ = serde_json::to_writer(&mut *out, k.as_str());
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        scalar => {
            let _ = serde_json::to_writer(&mut *out, scalar);
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    #[track_caller]
    fn check_text(text: &str, want: &[u32]) {
        assert_eq!(fallback_text(text), want, "{text:?}");
        assert!(want.iter().all(|&t| t < 1 << 31));
    }

    #[test]
    fn bytes_pack_four_to_a_token_below_2_pow_31() {
        check_text("", &[]);
        check_text("abcde", &[u32::from_le_bytes(*b"abcd"), u32::from(b'e')]);
        // "abc" then the lead byte of "é" (0xc3) on top: its top bit goes.
        check_text("abcé", &[u32::from_le_bytes([b'a', b'b', b'c', 0x43]), 0xa9]);
        check_text("€€", &[u32::from_le_bytes([0xe2, 0x82, 0xac, 0x62]), u32::from_le_bytes([0x82, 0xac, 0, 0])]);
    }

    #[test]
    fn canonical_rendering_ignores_key_order() {
        let a: Value = serde_json::from_str(r#"{"role":"user","content":"hi","x":{"b":1,"a":[2]}}"#).expect("json");
        let b: Value = serde_json::from_str(r#"{"x":{"a":[2],"b":1},"content":"hi","role":"user"}"#).expect("json");
        assert_eq!(fallback_chat(&json!({"messages": [a]})), fallback_chat(&json!({"messages": [b]})));
        let mut out = Vec::new();
        write_canonical(&json!({"b": [1, {"d": null, "c": "x"}], "a": true}), &mut out);
        assert_eq!(String::from_utf8(out).expect("utf-8"), r#"{"a":true,"b":[1,{"c":"x","d":null}]}"#);
    }

    #[test]
    fn appending_a_message_keeps_the_prefix() {
        let m1 = json!({"role": "system", "content": "x".repeat(600)});
        let m2 = json!({"role": "user", "content": "hello"});
        let one = fallback_chat(&json!({"messages": [m1.clone()]}));
        let two = fallback_chat(&json!({"messages": [m1, m2]}));
        let whole = one.len() - 1; // the last token may be zero-padded
        assert_eq!(one[..whole], two[..whole]);
        assert!(two.len() > one.len());
    }

    #[test]
    fn tools_count_and_change_the_tokens() {
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let plain = fallback_chat(&json!({"messages": msgs}));
        let tooled = fallback_chat(&json!({"messages": msgs, "tools": [{"type": "function"}]}));
        assert_ne!(plain, tooled);
    }

    proptest! {
        /// Clearing the top bit never makes two valid UTF-8 texts tokenize alike (texts
        /// without NUL, which the zero padding could imitate).
        #[test]
        fn distinct_texts_keep_distinct_tokens(
            a in proptest::collection::vec(prop::sample::select(vec!['a', 'C', ')', 'é', 'ß', '€', '𝄞', '\u{80}']), 0..12),
            b in proptest::collection::vec(prop::sample::select(vec!['a', 'C', ')', 'é', 'ß', '€', '𝄞', '\u{80}']), 0..12),
        ) {
            let (a, b): (String, String) = (a.into_iter().collect(), b.into_iter().collect());
            prop_assume!(a != b);
            prop_assert_ne!(fallback_text(&a), fallback_text(&b));
        }
    }
}
