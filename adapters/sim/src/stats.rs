//! Per-request records and their summary: TTFT, ITL, end-to-end latency, throughput,
//! prefix reuse. Percentiles are nearest-rank. Rendering is left to the caller (the
//! types serialize with serde).

use serde::{Deserialize, Serialize};

/// What happened to one request in a replay.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Request id.
    pub id: u64,
    /// Arrival, ms.
    pub arrival_ms: f64,
    /// Worker it was sent to (the decode worker for split requests).
    pub worker: Option<u32>,
    /// Prompt length, tokens.
    pub prompt_tokens: u32,
    /// Time of first admission into a running batch.
    pub admitted_ms: Option<f64>,
    /// Prompt tokens served from cache at first admission (None if never admitted).
    pub cached_tokens: Option<u32>,
    /// Time of the first token.
    pub first_token_ms: Option<f64>,
    /// Time of the last token.
    pub last_token_ms: Option<f64>,
    /// Tokens produced.
    pub output_tokens: u32,
    /// Finished normally.
    pub completed: bool,
    /// Refused by the dispatcher or an engine.
    pub rejected: bool,
    /// Times preempted.
    pub preemptions: u32,
}

impl RequestRecord {
    /// Time to first token, ms.
    pub fn ttft_ms(&self) -> Option<f64> {
        self.first_token_ms.map(|t| t - self.arrival_ms)
    }

    /// Mean gap between consecutive tokens, ms (None with fewer than two tokens).
    pub fn itl_ms(&self) -> Option<f64> {
        match (self.first_token_ms, self.last_token_ms) {
            (Some(f), Some(l)) if self.output_tokens >= 2 => Some((l - f) / f64::from(self.output_tokens - 1)),
            _ => None,
        }
    }

    /// Arrival to last token, ms.
    pub fn e2e_ms(&self) -> Option<f64> {
        self.last_token_ms.map(|t| t - self.arrival_ms)
    }
}

/// Mean, nearest-rank percentiles and maximum of a sample.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

impl Dist {
    /// Summarizes `values` (sorted in place); all zero when empty.
    pub fn of(values: &mut [f64]) -> Dist {
        if values.is_empty() {
            return Dist::default();
        }
        values.sort_by(f64::total_cmp);
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        Dist {
            mean,
            p50: nearest_rank(values, 50.0),
            p90: nearest_rank(values, 90.0),
            p99: nearest_rank(values, 99.0),
            max: values[values.len() - 1],
        }
    }
}

/// The `pct`-th percentile of sorted `values` by nearest rank: the smallest value with
/// at least `pct`% of the sample at or below it.
pub fn nearest_rank(sorted: &[f64], pct: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let n = sorted.len();
    let rank = ((pct / 100.0) * n as f64).ceil() as usize;
    sorted[rank.clamp(1, n) - 1]
}

/// The replay's headline figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests that finished.
    pub completed: u64,
    /// Requests refused.
    pub rejected: u64,
    /// Requests neither finished nor refused when the replay stopped.
    pub unfinished: u64,
    /// Time to first token over requests that got one, ms.
    pub ttft_ms: Dist,
    /// Inter-token latency, ms: `mean` is token-weighted over all gaps; percentiles are
    /// over each completed request's own mean gap.
    pub itl_ms: Dist,
    /// Arrival to last token over completed requests, ms.
    pub e2e_ms: Dist,
    /// Output tokens of completed requests per second from the first arrival to the
    /// last token.
    pub output_tokens_per_s: f64,
    /// Prompt tokens served from cache at first admission ÷ prompt tokens, over every
    /// request an engine admitted.
    pub prefix_reuse_ratio: f64,
    /// Preemptions, all requests.
    pub preemptions: u64,
}

/// Summarizes `records`. Linear in their number (plus sorting).
pub fn summarize(records: &[RequestRecord]) -> Summary {
    let mut s = Summary::default();
    let mut ttft = Vec::new();
    let mut itl = Vec::new();
    let mut e2e = Vec::new();
    let (mut gap_ms, mut gaps) = (0.0, 0u64);
    let (mut cached, mut prompt) = (0u64, 0u64);
    let (mut out_tokens, mut first_arrival, mut last_token) = (0u64, f64::INFINITY, f64::NEG_INFINITY);
    for r in records {
        s.preemptions += u64::from(r.preemptions);
        first_arrival = first_arrival.min(r.arrival_ms);
        if r.rejected {
            s.rejected += 1;
            continue;
        }
        if let Some(c) = r.cached_tokens {
            cached += u64::from(c);
            prompt += u64::from(r.prompt_tokens);
        }
        if let Some(t) = r.ttft_ms() {
            ttft.push(t);
        }
        if !r.completed {
            s.unfinished += 1;
            continue;
        }
        s.completed += 1;
        out_tokens += u64::from(r.output_tokens);
        if let Some(l) = r.last_token_ms {
            last_token = last_token.max(l);
        }
        if let Some(e) = r.e2e_ms() {
            e2e.push(e);
        }
        if let Some(i) = r.itl_ms() {
            itl.push(i);
            gaps += u64::from(r.output_tokens - 1);
            gap_ms += i * f64::from(r.output_tokens - 1);
        }
    }
    s.ttft_ms = Dist::of(&mut ttft);
    s.itl_ms = Dist::of(&mut itl);
    s.itl_ms.mean = if gaps > 0 { gap_ms / gaps as f64 } else { 0.0 };
    s.e2e_ms = Dist::of(&mut e2e);
    let span_s = (last_token - first_arrival) / 1000.0;
    s.output_tokens_per_s = if span_s > 0.0 { out_tokens as f64 / span_s } else { 0.0 };
    s.prefix_reuse_ratio = if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 };
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check_rank(values: &[f64], pct: f64, want: f64) {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        assert_eq!(nearest_rank(&v, pct), want, "p{pct} of {values:?}");
    }

    #[test]
    fn nearest_rank_percentiles() {
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        check_rank(&ten, 50.0, 5.0);
        check_rank(&ten, 90.0, 9.0);
        check_rank(&ten, 99.0, 10.0);
        check_rank(&ten, 0.0, 1.0);
        check_rank(&[3.0], 99.0, 3.0);
        check_rank(&[], 50.0, 0.0);
        let hundred: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        check_rank(&hundred, 99.0, 99.0);
    }

    fn rec(id: u64, arrival: f64, first: f64, last: f64, tokens: u32, cached: u32, prompt: u32) -> RequestRecord {
        RequestRecord {
            id,
            arrival_ms: arrival,
            worker: Some(0),
            prompt_tokens: prompt,
            admitted_ms: Some(arrival),
            cached_tokens: Some(cached),
            first_token_ms: Some(first),
            last_token_ms: Some(last),
            output_tokens: tokens,
            completed: true,
            rejected: false,
            preemptions: 0,
        }
    }

    #[test]
    fn summary_figures() {
        let records = vec![
            rec(0, 0.0, 10.0, 100.0, 10, 0, 1000),
            rec(1, 0.0, 30.0, 40.0, 2, 500, 1000),
            RequestRecord { id: 2, arrival_ms: 5.0, rejected: true, prompt_tokens: 7, ..Default::default() },
        ];
        let s = summarize(&records);
        assert_eq!((s.completed, s.rejected, s.unfinished), (2, 1, 0));
        assert_eq!(s.ttft_ms.mean, 20.0);
        assert_eq!(s.ttft_ms.max, 30.0);
        // Gaps: 9 of 10 ms and 1 of 10 ms.
        assert_eq!(s.itl_ms.mean, 10.0);
        assert_eq!(s.e2e_ms.p50, 40.0);
        assert_eq!(s.prefix_reuse_ratio, 0.25);
        assert_eq!(s.output_tokens_per_s, 12.0 / 0.1);
    }
}
