use super::*;

const GOOD: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}"#;
/// A good line within every limit the bad-line cases use.
const SMALL: &str = r#"{"timestamp": 0, "input_length": 5, "output_length": 5, "hash_ids": [1]}"#;

#[track_caller]
fn check_bad(line: &str, limits: &TraceLimits, want: fn(&TraceErrorKind) -> bool) {
    // As the third line, after a good line and a blank one: the number must say 3.
    let text = format!("{SMALL}\n\n{line}\n{SMALL}\n");
    let err = parse_str(&text, limits).expect_err("bad line must fail");
    assert_eq!(err.line, 3, "{err}");
    assert!(want(&err.kind), "unexpected kind for {line:?}: {:?}", err.kind);
    let err = read_trace(text.as_bytes(), limits).expect_err("reader must fail too");
    assert_eq!(err.line, 3, "{err}");
    assert!(want(&err.kind), "reader: unexpected kind for {line:?}: {:?}", err.kind);
    assert!(!err.to_string().is_empty());
}

#[test]
fn good_lines() {
    let text = format!(
        "{GOOD}\r\n\n{}\n{}\n",
        r#"{"timestamp": 12.5, "input_length": 512, "output_length": 0, "hash_ids": [9], "session_id": "abc", "priority": -3, "extra": {"x": 1}}"#,
        r#"{"timestamp": 3000, "input_length": 1, "output_length": 1, "hash_ids": [2147483647, 5], "session_id": 42, "delay": 12.5}"#,
    );
    for recs in [
        parse_str(&text, &TraceLimits::default()).unwrap(),
        read_trace(text.as_bytes(), &TraceLimits::default()).unwrap(),
    ] {
        assert_eq!(recs.len(), 3);
        assert_eq!(recs[0].content, PromptContent::HashIds(vec![1, 2]));
        assert_eq!((recs[0].input_length, recs[0].output_length), (1000, 5));
        assert_eq!(recs[1].timestamp_ms, 12.5);
        assert_eq!(recs[1].session_id.as_deref(), Some("abc"));
        assert_eq!(recs[1].priority, Some(-3));
        assert_eq!(recs[2].session_id.as_deref(), Some("42"));
        assert_eq!(recs[2].priority, None);
        assert_eq!((recs[1].delay_ms, recs[2].delay_ms), (None, Some(12.5)));
    }
}

#[test]
fn bad_lines_name_their_kind_and_line() {
    use TraceErrorKind as K;
    let d = TraceLimits::default();
    let few_ids = TraceLimits { hash_ids_max: 2, ..TraceLimits::default() };
    let short_session = TraceLimits { session_id_bytes_max: 3, ..TraceLimits::default() };
    let short_io = TraceLimits { input_tokens_max: 100, output_tokens_max: 10, ..TraceLimits::default() };
    type Case<'a> = (&'a str, &'a TraceLimits, fn(&K) -> bool);
    let cases: Vec<Case> = vec![
        ("{not json", &d, |k| matches!(k, K::Syntax(_))),
        (
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1}"#,
            &d,
            |k| matches!(k, K::Schema(m) if m.contains("hash_ids")),
        ),
        (r#"{"timestamp": "0", "input_length": 1, "output_length": 1, "hash_ids": [1]}"#, &d, |k| {
            matches!(k, K::Schema(_))
        }),
        (r#"{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": [1]}"#, &d, |k| {
            matches!(k, K::Schema(_))
        }),
        (r#"[1, 2]"#, &d, |k| matches!(k, K::Schema(_))),
        (r#"{"timestamp": -5, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#, &d, |k| *k == K::BadTimestamp),
        (r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "delay": -1}"#, &d, |k| {
            *k == K::BadDelay
        }),
        (r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "delay": "5"}"#, &d, |k| {
            matches!(k, K::Schema(_))
        }),
        (r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}"#, &d, |k| *k == K::EmptyPrompt),
        (r#"{"timestamp": 0, "input_length": 101, "output_length": 1, "hash_ids": [1]}"#, &short_io, |k| {
            *k == K::InputTooLong { tokens: 101, max: 100 }
        }),
        (r#"{"timestamp": 0, "input_length": 1, "output_length": 11, "hash_ids": [1]}"#, &short_io, |k| {
            *k == K::OutputTooLong { tokens: 11, max: 10 }
        }),
        (r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, 2, 3]}"#, &few_ids, |k| {
            *k == K::HashIdsTooMany { count: 3, max: 2 }
        }),
        (r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [2147483648]}"#, &d, |k| {
            *k == K::HashIdOutOfRange { id: 1 << 31 }
        }),
        (r#"{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}"#, &d, |k| {
            *k == K::HashIdsTooShort { ids: 2, input_tokens: 1025 }
        }),
        (
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "session_id": "abcd"}"#,
            &short_session,
            |k| *k == K::SessionIdTooLong { bytes: 4, max: 3 },
        ),
        (r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "session_id": [1]}"#, &d, |k| {
            matches!(k, K::Schema(_))
        }),
        (r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "priority": 1.5}"#, &d, |k| {
            matches!(k, K::Schema(_))
        }),
    ];
    for (line, limits, want) in cases {
        check_bad(line, limits, want);
    }
}

#[test]
fn limits_on_line_length_and_count() {
    let tight = TraceLimits { line_bytes_max: GOOD.len(), ..TraceLimits::default() };
    assert_eq!(parse_str(GOOD, &tight).unwrap().len(), 1, "a line exactly at the limit passes");
    let long = format!("{GOOD} ");
    check_bad(&long, &tight, |k| *k == TraceErrorKind::LineTooLong { max: GOOD.len() });
    // A huge line without a newline is refused without reading it all.
    let huge = "x".repeat(10 << 20);
    let err = read_trace(huge.as_bytes(), &TraceLimits::default()).unwrap_err();
    assert_eq!((err.line, err.kind), (1, TraceErrorKind::LineTooLong { max: 1 << 20 }));
    let two = TraceLimits { lines_max: 2, ..TraceLimits::default() };
    let text = format!("{GOOD}\n{GOOD}\n{GOOD}\n");
    assert_eq!(parse_str(&text, &two).unwrap_err().kind, TraceErrorKind::TooManyLines { max: 2 });
    assert_eq!(read_trace(text.as_bytes(), &two).unwrap_err().line, 3);
    let bad_utf8: &[u8] = b"{\"timestamp\": 0\xff}\n";
    assert!(matches!(read_trace(bad_utf8, &TraceLimits::default()).unwrap_err().kind, TraceErrorKind::Syntax(_)));
}

#[test]
fn load_options_scale_take_and_sort() {
    let text = r#"{"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
{"timestamp": 1000, "input_length": 512, "output_length": 5, "hash_ids": [1]}
{"timestamp": 9000, "input_length": 100, "output_length": 5, "hash_ids": [3]}"#;
    let recs = parse_str(text, &TraceLimits::default()).unwrap();
    let opts = LoadOptions { speedup: 2.0, requests_max: Some(2), ..LoadOptions::default() };
    let reqs = to_requests(&recs, &opts).unwrap();
    let got: Vec<(u64, f64, u32, usize)> =
        reqs.iter().map(|r| (r.id, r.arrival_ms, r.prompt.len_tokens(), r.prompt.blocks().len())).collect();
    assert_eq!(got, vec![(1, 500.0, 512, 8), (0, 1500.0, 600, 9)]);
    // The shared first trace block hashes alike.
    assert_eq!(reqs[0].prompt.blocks()[..8], reqs[1].prompt.blocks()[..8]);
    let bad = LoadOptions { block_size: 3, ..LoadOptions::default() };
    assert!(matches!(to_requests(&recs, &bad).unwrap_err().kind, TraceErrorKind::Prompt(_)));
}

#[test]
fn a_delayed_turn_follows_its_sessions_record_before() {
    let line = |t: u32, s: &str, d: &str| {
        format!(r#"{{"timestamp": {t}, "input_length": 5, "output_length": 5, "hash_ids": [1]{s}{d}}}"#)
    };
    let (a, b, d) = (r#", "session_id": "a""#, r#", "session_id": 7"#, r#", "delay": 40"#);
    // Record 3 is b's first (nothing to follow); records 2 and 4 follow their sessions'.
    let text = [line(0, a, ""), line(1, "", d), line(2, a, d), line(3, b, d), line(4, b, d), line(5, a, "")].join("\n");
    let recs = parse_str(&text, &TraceLimits::default()).unwrap();
    let reqs = to_requests(&recs, &LoadOptions { speedup: 2.0, ..LoadOptions::default() }).unwrap();
    let got: Vec<Option<(u64, f64)>> = reqs.iter().map(|r| r.follows.map(|f| (f.after, f.delay_ms))).collect();
    assert_eq!(got, vec![None, None, Some((0, 20.0)), None, Some((3, 20.0)), None]);
}

#[test]
fn a_trace_error_chains_to_what_was_wrong_with_its_line() {
    use std::error::Error;
    let err = parse_str(&format!("{SMALL}\nnot json\n"), &TraceLimits::default()).expect_err("bad line");
    let kind = err.source().expect("the line's fault is the source");
    assert_eq!(kind.to_string(), err.kind.to_string());
    assert!(err.to_string().ends_with(&kind.to_string()), "{err}");
    let timing = crate::engine::ConfigError::Timing(
        crate::engine::EngineTiming::from_json("\"nope\"").expect_err("not an object"),
    );
    assert!(timing.source().is_some_and(|s| s.to_string() == timing.to_string()), "{timing:?}");
}
