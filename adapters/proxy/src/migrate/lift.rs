//! Lifts a chunk's `prompt_token_ids` array out of its bytes before the chunk is parsed.
//!
//! A worker's first chunk carries the whole prompt's ids, and it is on the path to the
//! client's first token: parsing thousands of ids into `serde_json::Value`s cost about
//! as much as the rest of the request's routing. Here they are read straight into `u32`s
//! and the array left empty, so the parse that follows sees a short chunk. Anything
//! unexpected gives `None`, and the caller parses the chunk whole as before.

const KEY: &[u8] = b"\"prompt_token_ids\"";

/// The chunk `data` with its one `"prompt_token_ids"` array emptied (`[]`), and the ids
/// that array held. `None` when the key is absent or appears more than once, or when
/// its value is not an array of integers that fit `u32`.
pub(crate) fn prompt_ids(data: &[u8]) -> Option<(Vec<u8>, Vec<u32>)> {
    let (_, open) = only_array(data, KEY)?;
    let (ids, close) = ids_until_close(data, open)?;
    let mut rest = Vec::with_capacity(data.len() - (close - open) + 1);
    rest.extend_from_slice(&data[..=open]);
    rest.extend_from_slice(&data[close..]);
    Some((rest, ids))
}

/// A token's chunk without its one `"token_ids"` member (and no `prompt_token_ids`), and
/// the ids it held: the common chunk of a stream, which then needs no parse at all.
/// `None` as [`prompt_ids`] gives it, or when the key names more than one choice's ids.
pub(crate) fn token_ids(data: &[u8]) -> Option<(Vec<u8>, Vec<u32>)> {
    if memchr::memmem::find(data, KEY).is_some() {
        return None;
    }
    let (at, open) = only_array(data, b"\"token_ids\"")?;
    let (ids, close) = ids_until_close(data, open)?;
    let before = data[..at].trim_ascii_end();
    let after = &data[close + 1..];
    let (cut_from, cut_to) = match (before.last(), after.trim_ascii_start().first()) {
        (Some(b','), _) => (before.len() - 1, close + 1),
        (Some(b'{'), Some(b',')) => (at, data.len() - after.trim_ascii_start().len() + 1),
        (Some(b'{'), Some(b'}')) => (at, close + 1),
        _ => return None,
    };
    let mut rest = Vec::with_capacity(data.len() - (cut_to - cut_from));
    rest.extend_from_slice(&data[..cut_from]);
    rest.extend_from_slice(&data[cut_to..]);
    Some((rest, ids))
}

/// Where `key` (quoted) is, and where its array value opens, if it occurs once in `data`
/// as a key.
fn only_array(data: &[u8], key: &[u8]) -> Option<(usize, usize)> {
    let mut found = memchr::memmem::find_iter(data, key);
    let at = found.next()?;
    if found.next().is_some() || escaped(data, at) {
        return None;
    }
    let mut i = skip_ws(data, at + key.len());
    if data.get(i) != Some(&b':') {
        return None;
    }
    i = skip_ws(data, i + 1);
    (data.get(i) == Some(&b'[')).then_some((at, i))
}

/// The `u32`s of the array that opens at `open`, read by serde_json straight into
/// integers (no `Value`s), and where its `]` is.
fn ids_until_close(data: &[u8], open: usize) -> Option<(Vec<u32>, usize)> {
    let mut arrays = serde_json::Deserializer::from_slice(&data[open..]).into_iter::<Vec<u32>>();
    let ids = arrays.next()?.ok()?;
    Some((ids, open + arrays.byte_offset() - 1))
}

/// Whether the quote at `at` is escaped: an odd run of backslashes before it, so it sits
/// inside a string rather than opening a key.
fn escaped(data: &[u8], at: usize) -> bool {
    data[..at].iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1
}

fn skip_ws(data: &[u8], i: usize) -> usize {
    i + data.get(i..).map_or(0, |rest| rest.iter().take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r')).count())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `data` lifts to `want`: the chunk left and the ids, or `None`.
    fn check(data: &str, want: Option<(&str, &[u32])>) {
        let got = prompt_ids(data.as_bytes());
        let got = got.as_ref().map(|(rest, ids)| (std::str::from_utf8(rest).unwrap(), ids.as_slice()));
        assert_eq!(got, want, "lifting {data}");
    }

    #[test]
    fn ids_are_lifted_wherever_the_key_is() {
        check(
            r#"{"id":"a","choices":[{"text":"","prompt_token_ids":[1,2,30],"token_ids":[7]}]}"#,
            Some((r#"{"id":"a","choices":[{"text":"","prompt_token_ids":[],"token_ids":[7]}]}"#, &[1, 2, 30])),
        );
        check(r#"{"prompt_token_ids" : [ 4 , 5 ] }"#, Some((r#"{"prompt_token_ids" : [] }"#, &[4, 5])));
        check(r#"{"prompt_token_ids":[]}"#, Some((r#"{"prompt_token_ids":[]}"#, &[])));
        check(r#"{"prompt_token_ids":[4294967295]}"#, Some((r#"{"prompt_token_ids":[]}"#, &[u32::MAX])));
        check(r#"{"prompt_token_ids":[0]}"#, Some((r#"{"prompt_token_ids":[]}"#, &[0])));
    }

    #[test]
    fn anything_unexpected_is_left_to_the_full_parse() {
        for data in [
            r#"{"text":"x"}"#,
            r#"{"prompt_token_ids":null}"#,
            r#"{"prompt_token_ids":[1,2}"#,
            r#"{"prompt_token_ids":[1,2"#,
            r#"{"prompt_token_ids":[1,,2]}"#,
            r#"{"prompt_token_ids":[1,]}"#,
            r#"{"prompt_token_ids":[-1]}"#,
            r#"{"prompt_token_ids":[1.5]}"#,
            r#"{"prompt_token_ids":[1e3]}"#,
            r#"{"prompt_token_ids":[01]}"#,
            r#"{"prompt_token_ids":[4294967296]}"#,
            r#"{"prompt_token_ids":[99999999999999999999]}"#,
            r#"{"prompt_token_ids":["1"]}"#,
            r#"{"prompt_token_ids"}"#,
            r#"{"prompt_token_ids":"#,
            r#"{"choices":[{"prompt_token_ids":[1]},{"prompt_token_ids":[1]}]}"#,
            // In a string: the quotes are escaped, so it is text, not a key.
            r#"{"text":"say \"prompt_token_ids\": [1]"}"#,
            // A key that only ends with the name, after an escaped quote.
            r#"{"x\"prompt_token_ids":[1]}"#,
        ] {
            check(data, None);
        }
    }

    /// `data` loses its token ids as `want` says: the chunk left and the ids, or `None`.
    fn check_token(data: &str, want: Option<(&str, &[u32])>) {
        let got = token_ids(data.as_bytes());
        let got = got.as_ref().map(|(rest, ids)| (std::str::from_utf8(rest).unwrap(), ids.as_slice()));
        assert_eq!(got, want, "stripping {data}");
    }

    #[test]
    fn a_tokens_ids_leave_with_their_comma() {
        check_token(
            r#"{"id":"a","choices":[{"index":0,"text":"x","token_ids":[7]}]}"#,
            Some((r#"{"id":"a","choices":[{"index":0,"text":"x"}]}"#, &[7])),
        );
        check_token(
            r#"{"choices":[{"token_ids":[7, 8] ,"text":"x"}]}"#,
            Some((r#"{"choices":[{"text":"x"}]}"#, &[7, 8])),
        );
        check_token(r#"{"choices":[{ "token_ids":[] }]}"#, Some((r#"{"choices":[{  }]}"#, &[])));
        check_token(r#"{"choices":[{"text":"x" , "token_ids":[1]}]}"#, Some((r#"{"choices":[{"text":"x" }]}"#, &[1])));
    }

    #[test]
    fn a_chunk_the_token_path_cannot_read_is_parsed_whole() {
        for data in [
            r#"{"choices":[{"text":"x"}]}"#,
            r#"{"choices":[{"token_ids":[1]},{"token_ids":[2]}]}"#,
            r#"{"choices":[{"prompt_token_ids":[1],"token_ids":[2]}]}"#,
            r#"{"choices":[{"token_ids":null}]}"#,
            r#"{"choices":[{"token_ids":[1.0]}]}"#,
            r#"["token_ids":[1]]"#,
            r#"{"text":"a "token_ids":[1]"}"#,
        ] {
            check_token(data, None);
        }
    }

    #[test]
    fn an_escaped_backslash_before_the_key_does_not_hide_it() {
        check(r#"{"text":"a\\","prompt_token_ids":[3]}"#, Some((r#"{"text":"a\\","prompt_token_ids":[]}"#, &[3])));
    }
}
