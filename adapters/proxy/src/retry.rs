//! Retries before the first byte: which answers are retried, how long to wait before the
//! next try, and how long a try may take to produce its first byte.
//!
//! Nothing here sends anything or reads a clock or a random source: the handler passes
//! the attempt number, the worker's headers and a random draw in, and gets decisions
//! back. The rules:
//!
//! * A connect failure, a reset before the response head, a 5xx, a 429, or a try that
//!   produced no byte within its first-byte timeout is retried on another eligible worker,
//!   while `retries_max` and the shared retry budget allow. Any other 4xx is the client's
//!   and goes back as it is. Nothing is retried once a byte reached the client (a broken
//!   stream is migration's job, see [`crate::migrate`]).
//! * A try still waiting for its first byte when its worker is ejected (by the health
//!   checks or by outlier ejection) is given up and retried too: this bounds a try that
//!   has no timeout of its own on a wedged worker. A retry is counted, and taken from the
//!   budget, only when another worker takes it.
//! * The wait before retry `n` (from 1) is exponential with full jitter:
//!   `draw × min(backoff_max_ms, backoff_base_ms × 2^(n-1))`, and never less than the
//!   worker's `Retry-After` (capped at `retry_after_max_ms`).
//! * A try's first-byte timeout is `first_byte_timeout_base_ms` plus
//!   `first_byte_timeout_per_token_us` for each prompt token the worker does not hold in
//!   its cache, so long prefills get the time they need and a wedged worker is found in
//!   seconds. It counts against the worker, like a 5xx, so a wedged worker is ejected
//!   after `ejection.consecutive_failures` tries instead of after the health checks.
//!   A worker that sent another try its first byte (or finished a stream) while this
//!   one waited is busy, not wedged: the try waits another period there instead. The
//!   prefill and decode legs of a disaggregated request wait the same way.
//! * A non-streaming try sends its first byte only when the whole answer is done, so it
//!   gets the first-byte timeout plus `answer_timeout_per_output_token_ms` for each output
//!   token it asks for. One that names no limit could run as long as the engine allows:
//!   it waits until the request's own deadline, or until its worker is ejected.

use std::time::Duration;

use http::{HeaderMap, StatusCode};

use crate::config::RetryConfig;
use crate::prepared::BodyShape;

/// Why a try was given up and the request sent again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryReason {
    /// The worker refused the connection or could not be reached.
    Connect,
    /// The connection broke before the response head.
    Reset,
    /// The worker answered 5xx.
    Status5xx,
    /// The worker answered 429.
    Status429,
    /// No byte within the try's first-byte timeout.
    FirstByteTimeout,
    /// The worker was ejected (health checks or outlier ejection) while the try waited
    /// for its first byte.
    Ejected,
}

impl RetryReason {
    /// The `reason` label of `kvroute_retries_total`.
    pub const fn as_str(self) -> &'static str {
        match self {
            RetryReason::Connect => "connect",
            RetryReason::Reset => "reset",
            RetryReason::Status5xx => "status_5xx",
            RetryReason::Status429 => "status_429",
            RetryReason::FirstByteTimeout => "first_byte_timeout",
            RetryReason::Ejected => "ejected",
        }
    }

    /// Whether the failure is the worker's fault and counts towards its ejection. A 429
    /// is a worker saying it is full, which is not a fault; an ejected worker was already
    /// counted.
    pub const fn counts_against_worker(self) -> bool {
        !matches!(self, RetryReason::Status429 | RetryReason::Ejected)
    }
}

/// The retry reason for a response status, `None` when the answer goes to the client.
pub fn for_status(status: StatusCode) -> Option<RetryReason> {
    match status.as_u16() {
        429 => Some(RetryReason::Status429),
        500..=599 => Some(RetryReason::Status5xx),
        _ => None,
    }
}

/// The worker's `Retry-After` as a duration: delay-seconds, or an HTTP date relative to
/// `now_unix_s`. `None` when absent or unreadable. Capped at `cap_ms`.
pub fn retry_after(headers: &HeaderMap, now_unix_s: u64, cap_ms: u64) -> Option<Duration> {
    let v = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim();
    let ms = match v.parse::<u64>() {
        Ok(s) => s.saturating_mul(1000),
        Err(_) => {
            let at = httpdate::parse_http_date(v).ok()?;
            let at_s = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs();
            at_s.saturating_sub(now_unix_s).saturating_mul(1000)
        }
    };
    Some(Duration::from_millis(ms.min(cap_ms)))
}

/// The wait before retry `retry` (1 for the first), given a uniform random `draw` and
/// the worker's `Retry-After`, if any.
pub fn backoff(cfg: &RetryConfig, retry: u32, draw: u64, retry_after: Option<Duration>) -> Duration {
    let shift = retry.saturating_sub(1).min(30);
    let ceiling_ms = cfg.backoff_base_ms.saturating_mul(1 << shift).min(cfg.backoff_max_ms);
    // Full jitter: uniform in 0..=ceiling, from the top 53 bits of the draw.
    let unit = (draw >> 11) as f64 / (1u64 << 53) as f64;
    let jittered = Duration::from_millis((ceiling_ms as f64 * unit) as u64);
    jittered.max(retry_after.unwrap_or(Duration::ZERO))
}

/// A try's first-byte timeout for a prompt of which `uncached_tokens` must be prefilled.
pub fn first_byte_timeout(cfg: &RetryConfig, uncached_tokens: u32) -> Duration {
    let per_token = u64::from(uncached_tokens).saturating_mul(cfg.first_byte_timeout_per_token_us);
    Duration::from_millis(cfg.first_byte_timeout_base_ms).saturating_add(Duration::from_micros(per_token))
}

/// A non-streaming try's time to answer: its first-byte timeout plus the per-token
/// allowance for `max_output_tokens`. `None` (wait for the request's deadline) when the
/// request names no limit or the allowance is off.
pub fn answer_timeout(cfg: &RetryConfig, uncached_tokens: u32, max_output_tokens: Option<u64>) -> Option<Duration> {
    let per_token_ms = cfg.answer_timeout_per_output_token_ms;
    let out = max_output_tokens.filter(|_| per_token_ms > 0)?;
    let decode = Duration::from_millis(out.saturating_mul(per_token_ms));
    Some(first_byte_timeout(cfg, uncached_tokens).saturating_add(decode))
}

/// How long one try of a body of `shape` may take to produce its first byte: the
/// first-byte timeout for a stream, the answer timeout otherwise; `None` for the
/// request's deadline.
pub(crate) fn try_limit(cfg: &RetryConfig, shape: BodyShape, uncached_tokens: u32) -> Option<Duration> {
    if shape.stream {
        Some(first_byte_timeout(cfg, uncached_tokens))
    } else {
        answer_timeout(cfg, uncached_tokens, shape.max_output_tokens)
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn cfg() -> RetryConfig {
        RetryConfig { backoff_base_ms: 10, backoff_max_ms: 100, ..RetryConfig::default() }
    }

    #[track_caller]
    fn check_backoff(retry: u32, draw: u64, retry_after_ms: Option<u64>, want_ms: u64) {
        let got = backoff(&cfg(), retry, draw, retry_after_ms.map(Duration::from_millis));
        assert_eq!(
            got,
            Duration::from_millis(want_ms),
            "retry {retry}, draw {draw:#x}, retry-after {retry_after_ms:?}"
        );
    }

    #[test]
    fn backoff_doubles_with_full_jitter_and_honours_retry_after() {
        check_backoff(1, 0, None, 0);
        check_backoff(1, u64::MAX, None, 9);
        check_backoff(2, u64::MAX, None, 19);
        check_backoff(3, 1 << 63, None, 20);
        check_backoff(5, u64::MAX, None, 99);
        check_backoff(40, u64::MAX, None, 99);
        check_backoff(1, 0, Some(250), 250);
        check_backoff(1, u64::MAX, Some(3), 9);
    }

    #[track_caller]
    fn check_retry_after(value: &str, want_ms: Option<u64>) {
        let mut h = HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, HeaderValue::from_str(value).unwrap());
        // 2015-10-21 07:28:00 UTC.
        let now = 1_445_412_480;
        assert_eq!(retry_after(&h, now, 5_000), want_ms.map(Duration::from_millis), "{value:?}");
    }

    #[test]
    fn retry_after_reads_seconds_and_dates_and_is_capped() {
        check_retry_after("2", Some(2_000));
        check_retry_after(" 0 ", Some(0));
        check_retry_after("3600", Some(5_000));
        check_retry_after("Wed, 21 Oct 2015 07:28:03 GMT", Some(3_000));
        check_retry_after("Wed, 21 Oct 2015 07:27:00 GMT", Some(0));
        check_retry_after("soon", None);
        check_retry_after("-1", None);
        assert_eq!(retry_after(&HeaderMap::new(), 0, 5_000), None);
    }

    #[test]
    fn only_5xx_and_429_are_retried() {
        let cases = [(200, None), (400, None), (404, None), (413, None), (429, Some(RetryReason::Status429))];
        for (s, want) in
            cases.into_iter().chain([(500, Some(RetryReason::Status5xx)), (503, Some(RetryReason::Status5xx))])
        {
            assert_eq!(for_status(StatusCode::from_u16(s).unwrap()), want, "{s}");
        }
        assert!(!RetryReason::Status429.counts_against_worker());
        assert!(RetryReason::FirstByteTimeout.counts_against_worker());
        assert!(!RetryReason::Ejected.counts_against_worker(), "its ejection already counted");
    }

    #[test]
    fn first_byte_timeout_grows_with_the_uncached_prompt() {
        let c = RetryConfig { first_byte_timeout_base_ms: 1_000, first_byte_timeout_per_token_us: 500, ..cfg() };
        assert_eq!(first_byte_timeout(&c, 0), Duration::from_millis(1_000));
        assert_eq!(first_byte_timeout(&c, 10_000), Duration::from_millis(6_000));
        assert_eq!(first_byte_timeout(&c, u32::MAX), Duration::from_micros(1_000_000 + 4_294_967_295 * 500));
    }

    #[test]
    fn a_non_streaming_answer_gets_time_per_output_token_it_asks_for() {
        let c = RetryConfig {
            first_byte_timeout_base_ms: 1_000,
            first_byte_timeout_per_token_us: 500,
            answer_timeout_per_output_token_ms: 20,
            ..cfg()
        };
        assert_eq!(answer_timeout(&c, 2_000, Some(100)), Some(Duration::from_millis(4_000)));
        assert_eq!(answer_timeout(&c, 0, Some(0)), Some(Duration::from_millis(1_000)));
        assert_eq!(answer_timeout(&c, 0, None), None, "no limit named: the request's deadline");
        let off = RetryConfig { answer_timeout_per_output_token_ms: 0, ..c };
        assert_eq!(answer_timeout(&off, 0, Some(100)), None);
        let huge = Duration::from_millis(u64::MAX) + Duration::from_millis(1_000);
        assert_eq!(answer_timeout(&c, 0, Some(u64::MAX)), Some(huge), "no overflow");
    }
}
