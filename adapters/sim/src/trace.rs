//! Mooncake-format JSONL traces: parsing with limits and typed, line-numbered errors,
//! and conversion into hashed [`SimRequest`]s.
//!
//! One JSON object per line: `timestamp` (ms), `input_length`, `output_length`,
//! `hash_ids` (one id per 512-token block; each id becomes 512 copies of token id `id`,
//! truncated to `input_length`), and optional `session_id` (string or integer),
//! `priority` (integer) and `delay` (ms). A record with a `delay` whose session has an
//! earlier record is a later turn: it is sent `delay` ms after that record finishes, as
//! a client that waits for each answer does (aiperf's multi-turn traces), and its
//! `timestamp` only orders the trace. Unknown fields are ignored. Bad input never
//! panics. Opening files is left to the caller.

use std::collections::HashMap;
use std::fmt;
use std::io::BufRead;
use std::sync::Arc;

use router_core::{BlockSize, HashSeed};
use serde::Deserialize;

use crate::prompt::{Prompt, OUTPUT_TOKEN_ID_BASE, PROMPT_TOKENS_MAX};
use crate::replay::{Follow, SimRequest};

/// Limits on one trace, all inclusive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceLimits {
    /// Longest line, in bytes; 1 MiB.
    pub line_bytes_max: usize,
    /// Most lines (requests); 10,000,000.
    pub lines_max: usize,
    /// Most `hash_ids` on one line; 65,536.
    pub hash_ids_max: usize,
    /// Longest prompt, in tokens; 2^24.
    pub input_tokens_max: u32,
    /// Longest output, in tokens; 2^20.
    pub output_tokens_max: u32,
    /// Longest session id, in bytes; 256.
    pub session_id_bytes_max: usize,
}

impl Default for TraceLimits {
    fn default() -> Self {
        TraceLimits {
            line_bytes_max: 1 << 20,
            lines_max: 10_000_000,
            hash_ids_max: 1 << 16,
            input_tokens_max: PROMPT_TOKENS_MAX,
            output_tokens_max: 1 << 20,
            session_id_bytes_max: 256,
        }
    }
}

/// One trace line, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRecord {
    /// Arrival, ms from the trace start.
    pub timestamp_ms: f64,
    /// Prompt length, tokens.
    pub input_length: u32,
    /// Tokens to generate.
    pub output_length: u32,
    /// The prompt's content.
    pub content: PromptContent,
    /// Conversation the request belongs to, if given.
    pub session_id: Option<String>,
    /// Caller priority, if given.
    pub priority: Option<i64>,
    /// Wait after the session's previous record finishes, ms, if given.
    pub delay_ms: Option<f64>,
}

/// How a record describes its prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptContent {
    /// Mooncake block ids, one per trace block; every id is below 2^31.
    HashIds(Vec<u32>),
    /// Token ids; every id is below 2^31.
    Tokens(Arc<[u32]>),
}

/// A bad trace line, with its 1-based line number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceError {
    /// 1-based line number (0 when the error is not tied to a line).
    pub line: usize,
    /// What was wrong.
    pub kind: TraceErrorKind,
}

/// What was wrong with a trace line.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TraceErrorKind {
    /// Reading failed.
    Io(String),
    /// The line is longer than `line_bytes_max`.
    LineTooLong {
        /// The limit, bytes.
        max: usize,
    },
    /// The trace has more than `lines_max` lines.
    TooManyLines {
        /// The limit.
        max: usize,
    },
    /// Not valid JSON (or not UTF-8).
    Syntax(String),
    /// Valid JSON with a missing or wrongly typed field.
    Schema(String),
    /// `timestamp` is negative or not finite.
    BadTimestamp,
    /// `delay` is negative or not finite.
    BadDelay,
    /// `input_length` is 0.
    EmptyPrompt,
    /// `input_length` is above `input_tokens_max`.
    InputTooLong {
        /// The value.
        tokens: u64,
        /// The limit.
        max: u32,
    },
    /// `output_length` is above `output_tokens_max`.
    OutputTooLong {
        /// The value.
        tokens: u64,
        /// The limit.
        max: u32,
    },
    /// More than `hash_ids_max` hash ids.
    HashIdsTooMany {
        /// How many.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A hash id is 2^31 or more (that range is reserved for generated tokens).
    HashIdOutOfRange {
        /// The id.
        id: u64,
    },
    /// The hash ids cover fewer tokens than `input_length`.
    HashIdsTooShort {
        /// How many ids.
        ids: usize,
        /// `input_length`.
        input_tokens: u32,
    },
    /// `session_id` is longer than `session_id_bytes_max`.
    SessionIdTooLong {
        /// Its length, bytes.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// Building the hashed prompt failed.
    Prompt(String),
}

impl fmt::Display for TraceErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use TraceErrorKind::*;
        match self {
            Io(e) => write!(f, "read error: {e}"),
            LineTooLong { max } => write!(f, "line longer than {max} bytes"),
            TooManyLines { max } => write!(f, "more than {max} lines"),
            Syntax(e) => write!(f, "invalid JSON: {e}"),
            Schema(e) => write!(f, "bad record: {e}"),
            BadTimestamp => f.write_str("timestamp must be a finite number >= 0"),
            BadDelay => f.write_str("delay must be a finite number of ms >= 0"),
            EmptyPrompt => f.write_str("input_length is 0"),
            InputTooLong { tokens, max } => write!(f, "input_length {tokens} above {max}"),
            OutputTooLong { tokens, max } => write!(f, "output_length {tokens} above {max}"),
            HashIdsTooMany { count, max } => write!(f, "{count} hash ids, more than {max}"),
            HashIdOutOfRange { id } => write!(f, "hash id {id} is not below 2^31"),
            HashIdsTooShort { ids, input_tokens } => {
                write!(f, "{ids} hash ids cannot cover input_length {input_tokens}")
            }
            SessionIdTooLong { bytes, max } => {
                write!(f, "session_id of {bytes} bytes, more than {max}")
            }
            Prompt(e) => write!(f, "prompt: {e}"),
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "trace line {}: {}", self.line, self.kind)
    }
}

impl std::error::Error for TraceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.kind)
    }
}

/// Reading, JSON and prompt failures keep their cause's text: trace errors are compared
/// in tests and cloned into reports, which the causes' types do not allow.
impl std::error::Error for TraceErrorKind {}

/// Tokens per Mooncake trace block.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

#[derive(Deserialize)]
struct RawLine {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
    #[serde(default)]
    session_id: Option<RawSession>,
    #[serde(default)]
    priority: Option<i64>,
    #[serde(default)]
    delay: Option<f64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawSession {
    Str(String),
    Int(i64),
}

/// Parses and validates one line (without its newline).
pub fn parse_line(line: &str, limits: &TraceLimits) -> Result<TraceRecord, TraceErrorKind> {
    if line.len() > limits.line_bytes_max {
        return Err(TraceErrorKind::LineTooLong { max: limits.line_bytes_max });
    }
    let raw: RawLine = serde_json::from_str(line).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => TraceErrorKind::Schema(e.to_string()),
        _ => TraceErrorKind::Syntax(e.to_string()),
    })?;
    if !(raw.timestamp.is_finite() && raw.timestamp >= 0.0) {
        return Err(TraceErrorKind::BadTimestamp);
    }
    if raw.delay.is_some_and(|d| !(d.is_finite() && d >= 0.0)) {
        return Err(TraceErrorKind::BadDelay);
    }
    if raw.input_length == 0 {
        return Err(TraceErrorKind::EmptyPrompt);
    }
    if raw.input_length > u64::from(limits.input_tokens_max) {
        return Err(TraceErrorKind::InputTooLong { tokens: raw.input_length, max: limits.input_tokens_max });
    }
    if raw.output_length > u64::from(limits.output_tokens_max) {
        return Err(TraceErrorKind::OutputTooLong { tokens: raw.output_length, max: limits.output_tokens_max });
    }
    if raw.hash_ids.len() > limits.hash_ids_max {
        return Err(TraceErrorKind::HashIdsTooMany { count: raw.hash_ids.len(), max: limits.hash_ids_max });
    }
    if let Some(&id) = raw.hash_ids.iter().find(|&&id| id >= u64::from(OUTPUT_TOKEN_ID_BASE)) {
        return Err(TraceErrorKind::HashIdOutOfRange { id });
    }
    // Both fit in u32 after the checks above.
    let input_tokens = raw.input_length as u32;
    if (raw.hash_ids.len() as u64) * u64::from(MOONCAKE_BLOCK_TOKENS) < raw.input_length {
        return Err(TraceErrorKind::HashIdsTooShort { ids: raw.hash_ids.len(), input_tokens });
    }
    let session_id = match raw.session_id {
        None => None,
        Some(RawSession::Int(i)) => Some(i.to_string()),
        Some(RawSession::Str(s)) => {
            if s.len() > limits.session_id_bytes_max {
                return Err(TraceErrorKind::SessionIdTooLong { bytes: s.len(), max: limits.session_id_bytes_max });
            }
            Some(s)
        }
    };
    Ok(TraceRecord {
        timestamp_ms: raw.timestamp,
        input_length: input_tokens,
        output_length: raw.output_length as u32,
        content: PromptContent::HashIds(raw.hash_ids.into_iter().map(|id| id as u32).collect()),
        session_id,
        priority: raw.priority,
        delay_ms: raw.delay,
    })
}

/// Parses a whole trace held in memory. Blank lines are skipped.
pub fn parse_str(text: &str, limits: &TraceLimits) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.split('\n').enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.trim().is_empty() {
            continue;
        }
        if out.len() >= limits.lines_max {
            return Err(TraceError { line: i + 1, kind: TraceErrorKind::TooManyLines { max: limits.lines_max } });
        }
        out.push(parse_line(line, limits).map_err(|kind| TraceError { line: i + 1, kind })?);
    }
    Ok(out)
}

/// Parses a trace from a reader, never buffering more than one line of
/// `line_bytes_max + 1` bytes.
pub fn read_trace<R: BufRead>(mut reader: R, limits: &TraceLimits) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut line_no = 0;
    loop {
        line_no += 1;
        buf.clear();
        let cap = limits.line_bytes_max as u64 + 2; // room for "\r\n"
        let n = std::io::Read::take(&mut reader, cap)
            .read_until(b'\n', &mut buf)
            .map_err(|e| TraceError { line: line_no, kind: TraceErrorKind::Io(e.to_string()) })?;
        if n == 0 {
            return Ok(out);
        }
        let ended = buf.last() == Some(&b'\n');
        if ended {
            buf.pop();
        }
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        if buf.len() > limits.line_bytes_max || (!ended && n as u64 == cap) {
            return Err(TraceError { line: line_no, kind: TraceErrorKind::LineTooLong { max: limits.line_bytes_max } });
        }
        let text = std::str::from_utf8(&buf)
            .map_err(|e| TraceError { line: line_no, kind: TraceErrorKind::Syntax(e.to_string()) })?;
        if text.trim().is_empty() {
            continue;
        }
        if out.len() >= limits.lines_max {
            return Err(TraceError { line: line_no, kind: TraceErrorKind::TooManyLines { max: limits.lines_max } });
        }
        out.push(parse_line(text, limits).map_err(|kind| TraceError { line: line_no, kind })?);
    }
}

/// How records become simulator requests.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadOptions {
    /// Timestamps are divided by this (k > 1 = faster arrivals); 1.0.
    pub speedup: f64,
    /// Keep only the first this many records; all when `None`.
    pub requests_max: Option<usize>,
    /// Engine block size the prompts are hashed at; 64.
    pub block_size: u32,
    /// Tokens per trace hash id; 512.
    pub trace_block_tokens: u32,
    /// Hash seed (LoRA / cache salt); unsalted.
    pub seed: HashSeed,
    /// Multiplies every record's `input_length` (rounded, at least 1): with fewer
    /// `trace_block_tokens` than the trace was made with, the same share of each id;
    /// 1.0.
    pub input_scale: f64,
    /// Multiplies every record's `output_length` (rounded, at least 1); 1.0.
    pub output_scale: f64,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            speedup: 1.0,
            requests_max: None,
            block_size: 64,
            trace_block_tokens: MOONCAKE_BLOCK_TOKENS,
            seed: HashSeed::DEFAULT,
            input_scale: 1.0,
            output_scale: 1.0,
        }
    }
}

/// `n × k`, rounded, at least 1 (`n` itself when `k` is not a positive number).
fn scaled(n: u32, k: f64) -> u32 {
    if !(k.is_finite() && k > 0.0) {
        return n;
    }
    (f64::from(n) * k).round().clamp(1.0, f64::from(u32::MAX)) as u32
}

/// Hashes every record once into a [`SimRequest`] (id = record index), sorted stably by
/// `timestamp`; a later turn with a `delay` [`Follow`]s its session's record before.
/// Errors name the 1-based record index. Linear in the total prompt tokens.
pub fn to_requests(records: &[TraceRecord], opts: &LoadOptions) -> Result<Vec<SimRequest>, TraceError> {
    let bs = BlockSize::new(opts.block_size)
        .map_err(|e| TraceError { line: 0, kind: TraceErrorKind::Prompt(e.to_string()) })?;
    let speedup = if opts.speedup.is_finite() && opts.speedup > 0.0 { opts.speedup } else { 1.0 };
    let take = opts.requests_max.unwrap_or(usize::MAX).min(records.len());
    let mut scratch = Vec::new();
    let mut out = Vec::with_capacity(take);
    let mut last_of_session: HashMap<&str, u64> = HashMap::new();
    for (i, rec) in records[..take].iter().enumerate() {
        let prompt = match &rec.content {
            PromptContent::HashIds(ids) => {
                let input = scaled(rec.input_length, opts.input_scale);
                Prompt::from_hash_ids(ids, input, opts.trace_block_tokens, bs, opts.seed, &mut scratch)
            }
            PromptContent::Tokens(t) => Prompt::from_tokens(t, bs, opts.seed),
        }
        .map_err(|e| TraceError { line: i + 1, kind: TraceErrorKind::Prompt(e.to_string()) })?;
        out.push(SimRequest {
            id: i as u64,
            arrival_ms: rec.timestamp_ms / speedup,
            prompt,
            output_len: scaled(rec.output_length, opts.output_scale),
            session_id: rec.session_id.as_deref().map(Arc::from),
            priority: rec.priority,
            follows: follows(rec, i as u64, &mut last_of_session, speedup),
        });
    }
    out.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
    Ok(out)
}

/// The record `rec` (id `id`) follows: its session's previous record, when it has a
/// `delay` and its session an earlier record (delays scale with arrivals).
fn follows<'a>(rec: &'a TraceRecord, id: u64, last: &mut HashMap<&'a str, u64>, speedup: f64) -> Option<Follow> {
    let session = rec.session_id.as_deref()?;
    let before = last.insert(session, id);
    Some(Follow { after: before?, delay_ms: rec.delay_ms? / speedup })
}

#[cfg(test)]
mod tests;
