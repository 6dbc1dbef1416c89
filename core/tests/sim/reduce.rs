//! Shrinking a failing run to the operations that still fail the same way, so a bug the
//! simulation or the fuzzer finds can be read, and turned into a named test.

use super::driver::Driver;
use super::ops::{Knobs, Op};

/// Runs `ops` from a fresh driver, then settles; the failure, if any.
pub fn run(knobs: Knobs, ops: &[Op]) -> Option<String> {
    let mut d = Driver::new(knobs);
    ops.iter().try_for_each(|&op| d.step(op)).and_then(|()| d.settle()).err()
}

/// Removes operations from `ops` (halves, then smaller chunks, down to single ones)
/// while the run still fails the same way: the same message once digits and the step
/// that failed are set aside. `None` when `ops` passes.
pub fn reduce(knobs: Knobs, mut ops: Vec<Op>) -> Option<(Vec<Op>, String)> {
    let shape = |msg: &str| -> String {
        let tail = msg.rsplit_once("): ").map_or(msg, |(_, t)| t);
        tail.chars().filter(|c| !c.is_ascii_digit()).take(60).collect()
    };
    let want = shape(&run(knobs, &ops)?);
    let mut chunk = ops.len().div_ceil(2).max(1);
    loop {
        let mut i = 0;
        while i < ops.len() {
            let mut fewer = ops.clone();
            fewer.drain(i..(i + chunk).min(ops.len()));
            match run(knobs, &fewer) {
                Some(msg) if shape(&msg) == want => ops = fewer,
                _ => i += chunk,
            }
        }
        if chunk == 1 {
            break;
        }
        chunk = chunk.div_ceil(2);
    }
    let failure = run(knobs, &ops).unwrap_or_default();
    Some((ops, failure))
}

/// `reduce`'s answer as text, ready to turn into a test.
pub fn report(knobs: Knobs, ops: &[Op], failure: &str) -> String {
    format!("knobs: {knobs:?}\nconfig: {:?}\nops ({}):\n{ops:#?}\nfailure: {failure}", knobs.config(), ops.len())
}
