use super::*;

/// One scripted input; times are in ms.
#[derive(Clone, Copy, Debug)]
enum In {
    /// A live batch with its timestamp (the tests use ts = seq unless stated).
    Live(u64, f64),
    /// A live batch whose timestamp could not be read.
    LiveNoTs(u64),
    /// Replay `id` delivers `seq`.
    Replay(u64, u64),
    /// Replay `id` delivers `seq` with this timestamp.
    ReplayTs(u64, u64, f64),
    /// Replay `id` ended.
    End(u64),
    /// Replay `id` failed.
    Fail(u64),
    /// Time is now this many ms.
    At(u64),
    /// The transport connected.
    Up,
    /// The transport lost its connection.
    Down,
}

/// Outputs, with the payload being the batch's own sequence number.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Out {
    A(u64),
    C,
    T(bool),
    R(u64, u64),
}

use In::*;
use Out::*;

fn live(seqs: &[u64]) -> Vec<In> {
    seqs.iter().map(|&s| Live(s, s as f64)).collect()
}

#[track_caller]
fn check(cfg: SequencerConfig, has_replay: bool, script: &[In], want: &[Out]) {
    let mut s = Sequencer::new(cfg, has_replay);
    let mut now = Instant::ZERO;
    let mut got = Vec::new();
    for &i in script {
        match i {
            Live(seq, ts) => s.handle_live(now, seq, Some(ts), seq),
            LiveNoTs(seq) => s.handle_live(now, seq, None, seq),
            Replay(id, seq) => s.handle_replay(now, ReplayId(id), seq, Some(seq as f64), seq),
            ReplayTs(id, seq, ts) => s.handle_replay(now, ReplayId(id), seq, Some(ts), seq),
            End(id) => s.handle_replay_end(now, ReplayId(id)),
            Fail(id) => s.handle_replay_failed(now, ReplayId(id)),
            At(ms) => {
                now = Instant::from_millis(ms);
                s.handle_timeout(now);
            }
            Up => s.handle_connection(now, true),
            Down => s.handle_connection(now, false),
        }
        while let Some(o) = s.poll_output() {
            got.push(match o {
                SeqOutput::Apply { seq, payload } => {
                    assert_eq!(seq, payload);
                    A(seq)
                }
                SeqOutput::Clear => C,
                SeqOutput::Trusted(t) => T(t),
                SeqOutput::RequestReplay { id, from } => R(id.0, from),
            });
        }
    }
    assert_eq!(got, want);
}

fn cfg() -> SequencerConfig {
    SequencerConfig::default()
}

/// Joining mid-stream without asking for history.
fn no_join() -> SequencerConfig {
    SequencerConfig { join_replay_seqs_max: 0, ..cfg() }
}

#[test]
fn in_order_and_duplicates() {
    check(cfg(), true, &live(&[0, 1, 2]), &[A(0), A(1), A(2)]);
    check(no_join(), true, &live(&[5, 6, 6, 5, 7]), &[A(5), A(6), A(7)]);
    check(cfg(), false, &live(&[0, 1, 1, 2]), &[A(0), A(1), A(2)]);
}

#[test]
fn gap_filled_by_replay() {
    let mut script = live(&[0, 3]);
    script.extend([Replay(0, 1), Replay(0, 2), Replay(0, 3), End(0)]);
    check(cfg(), true, &script, &[A(0), T(false), R(0, 1), A(1), A(2), A(3), T(true)]);
}

#[test]
fn gap_filled_by_late_live_batches() {
    let mut script = live(&[0, 2, 1]);
    script.extend([Replay(0, 1), End(0)]);
    check(cfg(), true, &script, &[A(0), T(false), R(0, 1), A(1), A(2), T(true)]);
}

#[test]
fn live_batches_during_replay_are_applied_in_order() {
    let mut script = live(&[0, 3, 5, 4]);
    script.extend([Replay(0, 1), Replay(0, 2), Replay(0, 3), Replay(0, 4), Replay(0, 5), End(0)]);
    check(cfg(), true, &script, &[A(0), T(false), R(0, 1), A(1), A(2), A(3), A(4), A(5), T(true)]);
}

#[test]
fn incomplete_replay_resets_and_starts_over_from_live() {
    let mut ended_early = live(&[0, 3]);
    ended_early.extend([End(0)]);
    check(cfg(), true, &ended_early, &[A(0), T(false), R(0, 1), C, T(true), A(3)]);

    // Progress earns a follow-up replay, up to the attempt limit.
    let mut progressed = live(&[0, 3]);
    progressed.extend([Replay(0, 1), End(0), Replay(1, 2)]);
    let want = [A(0), T(false), R(0, 1), A(1), R(1, 2), A(2), A(3), T(true)];
    check(cfg(), true, &progressed, &want);
    let once = SequencerConfig { replay_attempts_max: 1, ..cfg() };
    let mut limited = live(&[0, 3]);
    limited.extend([Replay(0, 1), End(0)]);
    check(once, true, &limited, &[A(0), T(false), R(0, 1), A(1), C, T(true), A(3)]);

    // The publisher's buffer starts after the hole.
    let mut skipped = live(&[0, 5, 6]);
    skipped.push(Replay(0, 3));
    check(cfg(), true, &skipped, &[A(0), T(false), R(0, 1), C, T(true), A(5), A(6)]);

    let mut failed = live(&[0, 2]);
    failed.extend([Fail(0), Live(4, 4.0), Replay(0, 1), Replay(1, 3)]);
    check(cfg(), true, &failed, &[A(0), T(false), R(0, 1), C, T(true), A(2), T(false), R(1, 3), A(3), A(4), T(true)]);
}

#[test]
fn gap_without_replay_resets_at_once() {
    check(cfg(), false, &live(&[0, 1, 4, 5]), &[A(0), A(1), C, A(4), A(5)]);
}

#[test]
fn replay_timeout_resets() {
    let mut script = live(&[0, 3]);
    script.extend([At(1_999), At(2_000), Replay(0, 1)]);
    check(cfg(), true, &script, &[A(0), T(false), R(0, 1), C, T(true), A(3)]);
}

#[test]
fn pending_overflow_resets() {
    let small = SequencerConfig { pending_batches_max: 2, ..cfg() };
    check(small, true, &live(&[0, 3, 4, 5]), &[A(0), T(false), R(0, 1), C, T(true), A(3), A(4), A(5)]);
}

#[test]
fn restarts() {
    // A newer timestamp on an old number: the publisher started over.
    let mut newer = live(&[0, 1, 2]);
    newer.extend([Live(0, 10.0), Live(1, 11.0)]);
    check(cfg(), true, &newer, &[A(0), A(1), A(2), C, A(0), A(1)]);

    // No readable timestamp: 4 behind is a duplicate, 5 behind a restart.
    let near = SequencerConfig { restart_backstep_seqs: 5, ..cfg() };
    let mut far = live(&[0, 1, 2, 3, 4, 5, 6, 7]);
    far.extend([LiveNoTs(3), LiveNoTs(2)]);
    check(near, true, &far, &[A(0), A(1), A(2), A(3), A(4), A(5), A(6), A(7), C, T(false), R(0, 0)]);

    // A restart during a replay abandons it.
    let mut mid = live(&[4, 6]);
    mid.extend([Live(0, 100.0), Replay(0, 5)]);
    check(no_join(), true, &mid, &[A(4), T(false), R(0, 5), C, T(true), A(0)]);
}

/// Found by the whole-system soak (`tests/it/soak.rs`): a publisher restarted while a
/// gap was open, its new batch 0 filled the hole, and the old run's held batch 1 was
/// applied on top, announcing blocks the fresh engine did not hold. A timestamp newer
/// than a held batch numbered after it now means a restart.
#[test]
fn a_restart_while_a_gap_is_open_drops_the_held_batches() {
    // Joining: 0 lost, 1 held for a replay from 0; the restarted publisher's 0 arrives.
    check(cfg(), true, &[Live(1, 1.0), Live(0, 10.0)], &[T(false), R(0, 0), C, T(true), A(0)]);
    // Mid-stream: 1 lost, 2 held; the new run's 1 arrives by the replay, or live, when
    // the new run's 0 is asked for too.
    let by_replay = [A(0), T(false), R(0, 1), C, T(true), A(1)];
    check(cfg(), true, &[Live(0, 0.0), Live(2, 2.0), ReplayTs(0, 1, 11.0)], &by_replay);
    let live_too = [A(0), T(false), R(0, 1), C, T(true), T(false), R(1, 0)];
    check(cfg(), true, &[Live(0, 0.0), Live(2, 2.0), Live(1, 11.0)], &live_too);
    // The same run fills the hole with an older timestamp, and the held batch follows.
    let same = [A(0), T(false), R(0, 1), A(1), A(2), T(true)];
    check(cfg(), true, &[Live(0, 0.0), Live(2, 2.0), Live(1, 1.5)], &same);
    check(cfg(), true, &[Live(0, 0.0), Live(2, 2.0), ReplayTs(0, 1, 1.5)], &same);
}

/// A restarted engine whose first batches went out before the subscription reached it
/// (ZeroMQ's slow joiner after a reconnect): its first batch seen, numbered above 0,
/// asks for the new run from 0, and the new run's batches come back in order.
#[test]
fn a_restart_seen_late_asks_for_the_new_runs_start() {
    let mut script = live(&[0, 1, 2, 3]);
    script.extend([Live(2, 20.0), ReplayTs(0, 0, 18.0), ReplayTs(0, 1, 19.0), ReplayTs(0, 2, 20.0), End(0)]);
    check(cfg(), true, &script, &[A(0), A(1), A(2), A(3), C, T(false), R(0, 0), A(0), A(1), A(2), T(true)]);
    // Without a replay endpoint it starts from the batch seen.
    let mut script = live(&[0, 1, 2, 3]);
    script.push(Live(2, 20.0));
    check(cfg(), false, &script, &[A(0), A(1), A(2), A(3), C, A(2)]);
}

#[test]
fn stale_replays_are_ignored() {
    let mut script = live(&[0, 2]);
    script.extend([Fail(0), Live(4, 4.0), Replay(0, 3), End(0)]);
    check(cfg(), true, &script, &[A(0), T(false), R(0, 1), C, T(true), A(2), T(false), R(1, 3)]);
}

#[test]
fn timeouts_are_harmless_when_idle() {
    check(cfg(), true, &[At(0), At(u64::MAX / 1000), Live(0, 0.0), At(5)], &[A(0)]);
}

#[test]
fn first_batch_above_zero_asks_for_history() {
    let mut joined = live(&[3]);
    joined.extend([Replay(0, 0), Replay(0, 1), Replay(0, 2), Replay(0, 3), End(0)]);
    let want = [T(false), R(0, 0), A(0), A(1), A(2), A(3), T(true)];
    check(cfg(), true, &joined, &want);

    let mut too_late = live(&[3, 4]);
    too_late.push(Replay(0, 2));
    check(cfg(), true, &too_late, &[T(false), R(0, 0), C, T(true), A(3), A(4)]);

    check(cfg(), false, &live(&[3, 4]), &[A(3), A(4)]);
}

/// Connect replays: `check` with the script starting at a fresh connection.
#[track_caller]
fn check_connect(script: &[In], want: &[Out]) {
    let mut with_up = vec![Up];
    with_up.extend_from_slice(script);
    check(cfg(), true, &with_up, want);
}

#[test]
fn connect_with_nothing_published_changes_nothing() {
    check_connect(&[End(0), Live(0, 0.0), Live(1, 1.0), At(1_000)], &[R(0, 0), A(0), A(1)]);
    // One follow-up, an interval after the first: the subscription may have reached the
    // publisher only after it answered. It may bring the batch; then no more are asked.
    check_connect(&[End(0), At(999), At(1_000), End(1), At(9_000)], &[R(0, 0), R(1, 0)]);
    check_connect(&[End(0), At(1_000), Replay(1, 0), End(1)], &[R(0, 0), R(1, 0), A(0)]);
    // The first live batch above 0 then asks to join, as without the connect replay.
    let joined = [R(0, 0), T(false), R(1, 0), A(0), A(1), A(2), T(true)];
    check_connect(&[End(0), Live(2, 2.0), Replay(1, 0), Replay(1, 1), End(1)], &joined);
    // Nothing to ask without a replay endpoint, or with the knob off.
    check(cfg(), false, &[Up, Live(0, 0.0)], &[A(0)]);
    let off = SequencerConfig { connect_replay: false, ..cfg() };
    check(off, true, &[Up, Live(1, 1.0)], &[T(false), R(0, 0)]);
}

#[test]
fn connect_replay_brings_what_was_published_before() {
    check_connect(&[Replay(0, 0), Replay(0, 1), End(0)], &[R(0, 0), A(0), A(1)]);
    // Live batches that follow on are applied at once; either copy of a batch counts once.
    let follow = [Replay(0, 0), Live(1, 1.0), Replay(0, 1), Replay(0, 2), Live(2, 2.0), Live(3, 3.0), End(0)];
    check_connect(&follow, &[R(0, 0), A(0), A(1), A(2), A(3)]);
    // A live batch beyond the next one asks anew, as a join or a gap would: the connect
    // replay may have been answered before that batch was published.
    let ahead = [Live(3, 3.0), Replay(0, 0), Replay(1, 0), Replay(1, 1), Replay(1, 2), End(1)];
    check_connect(&ahead, &[R(0, 0), T(false), R(1, 0), A(0), A(1), A(2), A(3), T(true)]);
    // Found by the model test: answered empty before batch 0 was published, then 0 lost.
    let before = [Live(1, 1.0), End(0), Replay(1, 0), Replay(1, 1), End(1), Live(0, 0.0)];
    check_connect(&before, &[R(0, 0), T(false), R(1, 0), A(0), A(1), T(true)]);
    let midway = [Replay(0, 0), Live(2, 2.0), Live(3, 3.0), Replay(0, 1), Replay(1, 1), End(1)];
    check_connect(&midway, &[R(0, 0), A(0), T(false), R(1, 1), A(1), A(2), A(3), T(true)]);
    // The publisher's buffer no longer reaches back to 0: it starts where it starts.
    check_connect(&[Replay(0, 5), Replay(0, 6), End(0), Live(7, 7.0)], &[R(0, 0), A(5), A(6), A(7)]);
    // A restart during the replay: the worker was never marked untrusted.
    check_connect(&[Replay(0, 0), Replay(0, 1), Live(0, 100.0), Replay(0, 2)], &[R(0, 0), A(0), A(1), C, A(0)]);
}

#[test]
fn a_failed_connect_replay_does_no_harm() {
    check_connect(&[Fail(0), Live(0, 0.0)], &[R(0, 0), A(0)]);
    check_connect(&[At(1_999), At(2_000), Replay(0, 0), Live(0, 0.0)], &[R(0, 0), A(0)]);
    // What it brought stays; the next live batch shows whether anything is missing.
    let partial = [Replay(0, 0), Fail(0), Live(1, 1.0), Live(3, 3.0)];
    check_connect(&partial, &[R(0, 0), A(0), A(1), T(false), R(1, 2)]);
    // Once a live batch asked to join, that replay fails as it does without connecting.
    check_connect(&[Live(2, 2.0), Fail(0), Fail(1)], &[R(0, 0), T(false), R(1, 0), C, T(true), A(2)]);
}

#[test]
fn a_reconnect_asks_only_while_nothing_was_applied() {
    let applied = [Replay(0, 0), End(0), Down, At(5_000), Up, Down, At(9_000), Up];
    check_connect(&applied, &[R(0, 0), A(0)]);
    check(cfg(), true, &[Live(0, 0.0), Up], &[A(0)]);
    check_connect(&[End(0), Down, At(1_000), Up], &[R(0, 0), R(1, 0)]);
}

#[test]
fn a_flapping_connection_asks_at_most_once_per_interval() {
    // While one replay runs, connects ask nothing.
    check_connect(&[Down, Up, Down, Up], &[R(0, 0)]);
    // A connect within the interval asks once, when the interval ends.
    let soon = [End(0), At(10), Down, Up, At(500), Down, Up, At(999), At(1_000), At(1_500)];
    check_connect(&soon, &[R(0, 0), R(1, 0)]);
    // ... unless disconnected or no longer needed by then.
    check_connect(&[End(0), Up, Down, At(5_000)], &[R(0, 0)]);
    check_connect(&[End(0), Up, Live(0, 0.0), At(1_000)], &[R(0, 0), A(0)]);
    // Reconnecting every 50 ms for 10 s against a replay that never answers: one
    // replay per 2 s time-out.
    let flaps: Vec<In> = (0..200).flat_map(|i| [At(i * 50), Down, Up]).collect();
    check_connect(&flaps, &[R(0, 0), R(1, 0), R(2, 0), R(3, 0), R(4, 0)]);
}
