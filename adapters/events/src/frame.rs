//! ZeroMQ multipart framing of the event stream and of replies to replay requests.
//!
//! Live (SUB): `[topic, seq as 8 bytes big-endian, payload]`.
//! Replay request (DEALER → ROUTER): `[empty, start seq as 8 bytes big-endian]`; the
//! ROUTER sees `[identity, empty, start]`.
//! Replay reply (ROUTER → DEALER): `[empty, seq, payload]` (vLLM) or
//! `[empty, topic, seq, payload]` (later publishers), ending with seq −1 (eight 0xff
//! bytes) and an empty payload. Both are accepted, with or without the empty
//! delimiter (a REQ socket strips it). Parsing borrows; it never copies a payload.

use core::fmt;

/// Why a multipart message is not a stream frame.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum FrameError {
    /// The message has a frame count no form allows.
    FrameCount {
        /// Frames received.
        got: usize,
    },
    /// The sequence frame is not 8 bytes.
    SeqLength {
        /// Its length.
        got: usize,
    },
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::FrameCount { got } => write!(f, "unexpected frame count {got}"),
            FrameError::SeqLength { got } => write!(f, "sequence frame of {got} bytes, not 8"),
        }
    }
}

impl std::error::Error for FrameError {}

/// One replay reply.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ReplayFrame<'a> {
    /// A buffered batch.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// Its payload.
        payload: &'a [u8],
    },
    /// The end marker: nothing more will come for this request.
    End,
}

/// The end-of-replay sequence value, −1 as signed 8 bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Parses a live message into its sequence number and the payload's frame index.
pub fn parse_live<B: AsRef<[u8]>>(frames: &[B]) -> Result<(u64, usize), FrameError> {
    if frames.len() != 3 {
        return Err(FrameError::FrameCount { got: frames.len() });
    }
    Ok((seq_of(frames[1].as_ref())?, 2))
}

/// Parses a replay reply into a batch or the end marker, with the payload's frame index.
pub fn parse_replay<B: AsRef<[u8]>>(frames: &[B]) -> Result<(ReplayFrame<'_>, usize), FrameError> {
    let skip = usize::from(frames.len() >= 3 && frames[0].as_ref().is_empty());
    let rest = &frames[skip..];
    let seq_at = match rest.len() {
        2 => 0,
        3 => 1,
        got => return Err(FrameError::FrameCount { got: frames.len().max(got) }),
    };
    let seq_raw = rest[seq_at].as_ref();
    let payload = rest[seq_at + 1].as_ref();
    if seq_raw == END_SEQ && payload.is_empty() {
        return Ok((ReplayFrame::End, skip + seq_at + 1));
    }
    let seq = seq_of(seq_raw)?;
    Ok((ReplayFrame::Batch { seq, payload }, skip + seq_at + 1))
}

fn seq_of(b: &[u8]) -> Result<u64, FrameError> {
    let arr: [u8; 8] = b.try_into().map_err(|_| FrameError::SeqLength { got: b.len() })?;
    Ok(u64::from_be_bytes(arr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check_replay(frames: &[&[u8]], want: Result<ReplayFrame<'_>, FrameError>) {
        assert_eq!(parse_replay(frames).map(|(f, _)| f), want);
    }

    #[test]
    fn replay_forms() {
        let seq = 7u64.to_be_bytes();
        let batch = Ok(ReplayFrame::Batch { seq: 7, payload: b"p" });
        check_replay(&[b"", &seq, b"p"], batch);
        check_replay(&[b"", b"topic", &seq, b"p"], batch);
        check_replay(&[b"", b"", &seq, b"p"], batch);
        check_replay(&[&seq, b"p"], batch);
        check_replay(&[b"topic", &seq, b"p"], batch);
        check_replay(&[b"", &END_SEQ, b""], Ok(ReplayFrame::End));
        check_replay(&[b"", b"", &END_SEQ, b""], Ok(ReplayFrame::End));
        check_replay(&[b"", b"x"], Err(FrameError::SeqLength { got: 0 }));
        check_replay(&[b"", b"", b"", &seq, b"p"], Err(FrameError::FrameCount { got: 5 }));
        check_replay(&[b"only"], Err(FrameError::FrameCount { got: 1 }));
    }

    #[test]
    fn live_forms() {
        let seq = 3u64.to_be_bytes();
        assert_eq!(parse_live(&[&b""[..], &seq, b"p"]), Ok((3, 2)));
        assert_eq!(parse_live(&[&b""[..], b"abc", b"p"]), Err(FrameError::SeqLength { got: 3 }));
        assert_eq!(parse_live(&[&b""[..], &seq]), Err(FrameError::FrameCount { got: 2 }));
    }
}
