//! Shared helpers for the bench binaries: trace loading and hashing, percentiles, and
//! process counters (CPU time, resident memory) read from `/proc`.
//!
//! The helpers do no timing policy of their own; each binary decides what it times.

use router_core::{chain, local_hash, BlockHash, HashSeed, LocalHash, SeqHash};
use std::collections::BTreeMap;
use std::fmt;

/// Tokens per trace hash id (the Mooncake traces' unit).
pub const TRACE_TOKENS_PER_HASH_ID: usize = 512;
/// Tokens per KV block in the index workload.
pub const BLOCK_TOKENS: usize = 64;

/// One trace request: only what the index workload uses.
#[derive(Clone, Debug)]
pub struct TraceRequest {
    /// Prompt length in tokens.
    pub input_length: usize,
    /// The trace's 512-token hash ids, in order.
    pub hash_ids: Vec<u32>,
}

/// Why a trace could not be loaded.
#[derive(Debug)]
pub enum TraceError {
    /// The file could not be read.
    Io {
        /// The path given.
        path: String,
        /// The OS error.
        err: std::io::Error,
    },
    /// A line is not a JSON object with `input_length` and `hash_ids`.
    Line {
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        what: String,
    },
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Io { path, err } => write!(f, "cannot read trace file {path:?}: {err}"),
            TraceError::Line { line, what } => write!(f, "trace line {line}: {what}"),
        }
    }
}

impl std::error::Error for TraceError {}

/// Reads a JSON-lines trace, keeping file order. Blank lines are skipped.
pub fn load_trace(path: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|err| TraceError::Io { path: path.to_string(), err })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        out.push(parse_line(line).map_err(|what| TraceError::Line { line: i + 1, what })?);
    }
    Ok(out)
}

fn parse_line(line: &str) -> Result<TraceRequest, String> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let input_length = v.get("input_length").and_then(|x| x.as_u64()).ok_or("missing or non-integer input_length")?;
    let ids = v.get("hash_ids").and_then(|x| x.as_array()).ok_or("missing hash_ids array")?;
    let mut hash_ids = Vec::with_capacity(ids.len());
    for id in ids {
        let id = id.as_u64().filter(|&x| x <= u64::from(u32::MAX)).ok_or("bad hash id")?;
        hash_ids.push(id as u32);
    }
    let input_length = usize::try_from(input_length).map_err(|_| "input_length too large")?;
    if hash_ids.len() * TRACE_TOKENS_PER_HASH_ID < input_length {
        return Err("hash_ids too short for input_length".into());
    }
    Ok(TraceRequest { input_length, hash_ids })
}

/// Hashes every request into its block chain (workload section 2): full 64-token blocks,
/// block `k` is 64 copies of `hash_ids[k / 8]`, unsalted seed.
///
/// Local hashes are memoised per hash id, since every block of one id hashes alike.
pub fn hash_requests(reqs: &[TraceRequest]) -> Vec<Vec<BlockHash>> {
    let mut memo: BTreeMap<u32, LocalHash> = BTreeMap::new();
    let per_id = TRACE_TOKENS_PER_HASH_ID / BLOCK_TOKENS;
    reqs.iter()
        .map(|r| {
            let n = r.input_length / BLOCK_TOKENS;
            let mut out = Vec::with_capacity(n);
            let mut prev: Option<SeqHash> = None;
            for k in 0..n {
                let id = r.hash_ids[k / per_id];
                let local = *memo.entry(id).or_insert_with(|| local_hash(&[id; BLOCK_TOKENS], &[], HashSeed::DEFAULT));
                let seq = match prev {
                    None => SeqHash(local.0),
                    Some(p) => chain(p, local),
                };
                out.push(BlockHash { seq, local });
                prev = Some(seq);
            }
            out
        })
        .collect()
}

/// Percentile by nearest rank of an ascending-sorted slice (`p` in 0..=100); 0 if empty.
pub fn nearest_rank(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// CPU time this process's main thread has used, in nanoseconds
/// (`/proc/self/schedstat`, first field); `None` where unavailable.
///
/// The bench binaries are single-threaded, so this equals the process CPU time.
pub fn cpu_time_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// Resident set size in bytes (`VmRSS` of `/proc/self/status`); `None` where unavailable.
pub fn vm_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The 1-minute load average (how busy the machine was); `None` where unavailable.
pub fn load_average_1m() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(sorted: &[u64], p: f64, want: u64) {
        assert_eq!(nearest_rank(sorted, p), want, "p{p} of {sorted:?}");
    }

    #[test]
    fn nearest_rank_cases() {
        check(&[], 50.0, 0);
        check(&[7], 99.0, 7);
        check(&[1, 2, 3, 4], 50.0, 2);
        check(&[1, 2, 3, 4], 51.0, 3);
        check(&[1, 2, 3, 4], 100.0, 4);
        check(&[1, 2, 3, 4], 0.0, 1);
    }

    #[test]
    fn trace_line_hashes_match_workload_vectors() {
        let req =
            parse_line(r#"{"input_length": 6758, "hash_ids": [0,1,2,3,4,5,6,7,8,9,10,11,12,13]}"#).expect("valid line");
        let blocks = &hash_requests(&[req])[0];
        assert_eq!(blocks.len(), 105);
        assert_eq!(blocks[0].local.0, 0xd6d5_0d0c_a847_8ea1);
        assert_eq!(blocks[8].local.0, 0xeb3f_05a0_fab1_2018);
        let seq = |i: usize| blocks[i].seq.0;
        assert_eq!(
            [seq(0), seq(1), seq(7), seq(8), seq(104)],
            [
                0xd6d5_0d0c_a847_8ea1,
                0x527e_f613_7acb_e067,
                0x23b0_42c4_b5b3_f6cc,
                0x821a_8ebc_d2ef_c8ac,
                0x7c82_7f49_1ad0_101e
            ]
        );
    }

    #[test]
    fn bad_lines_are_errors() {
        assert!(parse_line("{}").is_err());
        assert!(parse_line(r#"{"input_length": 2000, "hash_ids": [1]}"#).is_err());
        assert!(parse_line("not json").is_err());
    }
}
