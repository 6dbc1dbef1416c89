//! Later turns that wait for the turn before (`session_id` + `delay`): they arrive
//! `delay` ms after it ends, whatever their `timestamp` says, as a client that waits
//! for each answer sends them.

use kvroute_sim::replay::{replay, Dispatch, Dispatcher, ReplayConfig, RoundRobin, SimRequest};

use crate::common::requests;

/// When a record should arrive.
#[derive(Clone, Copy, Debug)]
enum Arrival {
    /// At its timestamp, ms.
    On(f64),
    /// This many ms after request `.0` ended (its last token, or its refusal).
    After(usize, f64),
}
use Arrival::{After, On};

/// Round robin that refuses the listed ids.
struct Refusing {
    inner: RoundRobin,
    refuse: &'static [u64],
}

impl Dispatcher for Refusing {
    fn on_arrival(&mut self, now_ms: f64, req: &SimRequest) -> Dispatch {
        if self.refuse.contains(&req.id) {
            return Dispatch::Reject;
        }
        self.inner.on_arrival(now_ms, req)
    }
}

/// A trace line's `(timestamp, session_id, delay)`.
type Line<'a> = (f64, Option<&'a str>, Option<f64>);

/// One trace line: `(timestamp, session, delay)`, 600 prompt tokens, 20 output tokens.
fn line(t: f64, session: Option<&str>, delay: Option<f64>) -> String {
    let mut s = format!(r#"{{"timestamp": {t}, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]"#);
    if let Some(id) = session {
        s += &format!(r#", "session_id": "{id}""#);
    }
    if let Some(d) = delay {
        s += &format!(r#", "delay": {d}"#);
    }
    s + "}\n"
}

#[track_caller]
fn check(lines: &[Line], refuse: &'static [u64], want: &[Arrival]) {
    let text: String = lines.iter().map(|&(t, s, d)| line(t, s, d)).collect();
    let reqs = requests(&text);
    let cfg = ReplayConfig { workers: 2, ..ReplayConfig::default() };
    let report = replay(&cfg, &reqs, &mut Refusing { inner: RoundRobin::new(2), refuse }).expect("valid config");
    let recs = &report.records;
    let ended = |i: usize| {
        let r = &recs[i];
        if r.rejected {
            r.arrival_ms
        } else {
            r.last_token_ms.unwrap_or_else(|| panic!("request {i} has no last token: {r:?}"))
        }
    };
    for (i, w) in want.iter().enumerate() {
        let at = match *w {
            On(t) => t,
            After(j, ms) => ended(j) + ms,
        };
        assert_eq!(recs[i].arrival_ms, at, "request {i} ({w:?}): {:?}", recs[i]);
        assert!(recs[i].completed || recs[i].rejected, "request {i} never ended: {:?}", recs[i]);
    }
}

#[test]
fn a_later_turn_waits_for_the_turn_before_and_its_delay() {
    // Turn 2's timestamp (5 ms) comes before turn 1 can have finished; turn 3's long after.
    let (a, d) = (Some("a"), Some(250.0));
    check(&[(0.0, a, None), (5.0, a, d), (90_000.0, a, Some(0.0))], &[], &[On(0.0), After(0, 250.0), After(1, 0.0)]);
}

#[test]
fn a_first_turn_or_a_turn_without_delay_keeps_its_timestamp() {
    let cases: &[(&[Line], &[Arrival])] = &[
        // A delay on a session's first record: nothing to wait for.
        (&[(7.0, Some("a"), Some(100.0))], &[On(7.0)]),
        // No delay: open loop, as a Mooncake trace.
        (&[(0.0, Some("a"), None), (3.0, Some("a"), None)], &[On(0.0), On(3.0)]),
        // No session: nothing to follow.
        (&[(0.0, None, None), (3.0, None, Some(100.0))], &[On(0.0), On(3.0)]),
        // Two sessions interleaved: each turn waits for its own session's.
        (
            &[
                (0.0, Some("a"), None),
                (1.0, Some("b"), None),
                (2.0, Some("a"), Some(10.0)),
                (3.0, Some("b"), Some(40.0)),
            ],
            &[On(0.0), On(1.0), After(0, 10.0), After(1, 40.0)],
        ),
    ];
    for (lines, want) in cases {
        check(lines, &[], want);
    }
}

#[test]
fn a_refused_turn_still_releases_the_next() {
    let a = Some("a");
    check(
        &[(0.0, a, None), (1.0, a, Some(30.0)), (2.0, a, Some(30.0))],
        &[0],
        &[On(0.0), After(0, 30.0), After(1, 30.0)],
    );
}
