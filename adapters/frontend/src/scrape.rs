//! Engine load from the workers' own Prometheus metrics: one task polls every worker's
//! metrics page each `learn.scrape_interval_ms`, reads vLLM's scheduler gauges and hands
//! them to the pool's router (`Router::handle_engine_load`), so traffic that reached a
//! worker some other way is seen.
//!
//! Read: `vllm:num_requests_waiting`, `vllm:num_requests_running` and
//! `vllm:kv_cache_usage_perc` (the simulated worker exports the same names). vLLM labels
//! each sample with its `engine` index, one per data-parallel rank: a multi-rank worker's
//! engine `i` is rank `i`; a single-rank worker sums its engines' requests and takes the
//! highest usage. Everything else on the page is skipped unparsed.
//!
//! A page that is not UTF-8, too large, has none of the gauges, or carries a value that
//! is not a finite count or share is a counted drop (`dropped`), never a panic. Work per
//! scrape is linear in the page.
//!
//! Shared by `kvroute serve` and `kvroute epp`; each brings its own HTTP client as a
//! [`Fetch`] (the proxy its upstream pool, the picker a plain client), and
//! [`read_page`] reads an answer within `learn.metrics_bytes_max`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use router_core::EngineLoad;
use router_core::WorkerKey;

use tokio::sync::watch;

use crate::config::WorkerConfig;
use crate::fleet::Fleet;
use crate::learn::LearnSection;

const WAITING: &str = "vllm:num_requests_waiting";
const RUNNING: &str = "vllm:num_requests_running";
const KV_USAGE: &str = "vllm:kv_cache_usage_perc";

/// Why a scrape gave no load.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ScrapeError {
    /// The request failed or timed out.
    Unreachable,
    /// The worker answered with a non-2xx status.
    Status(u16),
    /// The page was larger than `learn.metrics_bytes_max`.
    TooLarge,
    /// The page is not UTF-8.
    NotUtf8,
    /// A sample of a gauge read here has no parsable value, or one that is negative or
    /// not finite (or a usage above 1); `line` counts from 1.
    BadSample {
        /// The line.
        line: usize,
    },
    /// The page has none of the three gauges.
    NoEngineGauges,
}

impl fmt::Display for ScrapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScrapeError::Unreachable => f.write_str("metrics request failed"),
            ScrapeError::Status(s) => write!(f, "metrics answered status {s}"),
            ScrapeError::TooLarge => f.write_str("metrics page too large"),
            ScrapeError::NotUtf8 => f.write_str("metrics page is not UTF-8"),
            ScrapeError::BadSample { line } => write!(f, "bad engine gauge sample on line {line}"),
            ScrapeError::NoEngineGauges => f.write_str("no vLLM scheduler gauges on the metrics page"),
        }
    }
}

impl std::error::Error for ScrapeError {}

/// Scrape counters, shown in `/workers`.
#[derive(Debug, Default)]
pub struct ScrapeStats {
    /// Pages read and fed to the router.
    pub ok: AtomicU64,
    /// Pages dropped (any [`ScrapeError`]).
    pub dropped: AtomicU64,
}

/// The engine load per dp rank on a metrics page, for a worker of `dp_ranks` ranks.
pub fn parse(page: &[u8], dp_ranks: u32) -> Result<BTreeMap<u32, EngineLoad>, ScrapeError> {
    let text = std::str::from_utf8(page).map_err(|_| ScrapeError::NotUtf8)?;
    let mut out: BTreeMap<u32, EngineLoad> = BTreeMap::new();
    let mut seen = false;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(|c: char| c == '{' || c.is_ascii_whitespace()).unwrap_or(line.len());
        let name = &line[..name_end];
        if name != WAITING && name != RUNNING && name != KV_USAGE {
            continue;
        }
        let bad = ScrapeError::BadSample { line: i + 1 };
        let (labels, rest) = split_labels(&line[name_end..]).ok_or(bad.clone())?;
        let value: f64 = rest.split_ascii_whitespace().next().and_then(|v| v.parse().ok()).ok_or(bad.clone())?;
        let limit = if name == KV_USAGE { 1.0 } else { f64::from(u32::MAX) };
        if !(0.0..=limit).contains(&value) {
            return Err(bad);
        }
        let engine = label(labels, "engine").and_then(|e| e.parse::<u32>().ok()).unwrap_or(0);
        let rank = if dp_ranks > 1 { engine } else { 0 };
        if rank >= dp_ranks.max(1) {
            continue;
        }
        seen = true;
        let l = out.entry(rank).or_default();
        match name {
            WAITING => l.waiting = l.waiting.saturating_add(value as u32),
            RUNNING => l.running = l.running.saturating_add(value as u32),
            _ => l.kv_usage = l.kv_usage.max(value),
        }
    }
    if seen {
        Ok(out)
    } else {
        Err(ScrapeError::NoEngineGauges)
    }
}

/// `{labels} rest` into the label text and the rest; no labels gives an empty label text.
fn split_labels(s: &str) -> Option<(&str, &str)> {
    let Some(body) = s.strip_prefix('{') else { return Some(("", s)) };
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in body.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some((&body[..i], &body[i + 1..])),
            _ => {}
        }
    }
    None
}

/// The value of label `key` in `a="x",b="y"` text (escapes left as they are; engine
/// indices have none).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let (k, after) = rest.trim_start_matches([',', ' ']).split_once('=')?;
        let after = after.strip_prefix('"')?;
        let end = after.find('"')?;
        if k.trim() == key {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
}

/// How a server fetches a worker's metrics page and asks it to tokenize.
pub trait Fetch: Clone + Send + Sync + 'static {
    /// `GET uri`, its body read whole up to `bytes_max` bytes (see [`read_page`]).
    fn get(&self, uri: http::Uri, bytes_max: usize) -> impl Future<Output = Result<Bytes, ScrapeError>> + Send;
    /// `POST`s the JSON `body` to `uri`, the answer read whole up to `bytes_max` bytes
    /// (the tokenizer check, [`crate::agree`]).
    fn post(
        &self,
        uri: http::Uri,
        body: Bytes,
        bytes_max: usize,
    ) -> impl Future<Output = Result<Bytes, ScrapeError>> + Send;
}

/// The request [`Fetch::post`] sends: `body` as JSON to `uri`.
pub fn post_request(uri: http::Uri, body: Bytes) -> Result<http::Request<http_body_util::Full<Bytes>>, ScrapeError> {
    http::Request::post(uri)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(body))
        .map_err(|_| ScrapeError::Unreachable)
}

/// The body of `resp` if its status is 2xx and it is at most `bytes_max` bytes.
pub async fn read_page<B>(resp: http::Response<B>, bytes_max: usize) -> Result<Bytes, ScrapeError>
where
    B: http_body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if !resp.status().is_success() {
        return Err(ScrapeError::Status(resp.status().as_u16()));
    }
    match Limited::new(resp.into_body(), bytes_max).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(ScrapeError::TooLarge),
        Err(_) => Err(ScrapeError::Unreachable),
    }
}

/// What the scrape task needs: the settings, a client and the counters.
#[derive(Clone)]
pub struct Scraper<F> {
    /// The `[learn]` settings.
    pub cfg: LearnSection,
    /// The HTTP client to workers.
    pub client: F,
    /// The counters it bumps.
    pub stats: Arc<ScrapeStats>,
}

/// Scrapes every worker of `fleet` each interval until `shutdown` turns true or the
/// fleet is gone. Returns at once when scraping is off.
pub async fn scrape_loop<F: Fetch>(s: Scraper<F>, fleet: Weak<Fleet>, shutdown: watch::Receiver<bool>) {
    let Some(interval) = s.cfg.scrape_interval() else { return };
    let round = |fleet: Arc<Fleet>| {
        let s = s.clone();
        async move {
            let mut scrapes = tokio::task::JoinSet::new();
            for w in fleet.workers() {
                let (s, fleet) = (s.clone(), fleet.clone());
                scrapes.spawn(async move { scrape_one(&s, &fleet, &w).await });
            }
            while scrapes.join_next().await.is_some() {}
        }
    };
    every(interval, fleet, shutdown, round).await;
}

/// Runs `round` over the fleet every `period` (a late round delays the next) until
/// `shutdown` turns true or the fleet is gone: the workers' scrapes and tokenizer checks.
pub(crate) async fn every<R, Fut>(
    period: Duration,
    fleet: Weak<Fleet>,
    mut shutdown: watch::Receiver<bool>,
    mut round: R,
) where
    R: FnMut(Arc<Fleet>) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let Some(fleet) = fleet.upgrade() else { return };
        round(fleet).await;
    }
}

/// One scrape of `w`, fed to its pool's router; failures are counted.
async fn scrape_one<F: Fetch>(s: &Scraper<F>, fleet: &Fleet, w: &WorkerConfig) {
    let stats = &s.stats;
    let loads = match fetch(s, w).await.and_then(|page| parse(&page, w.dp_ranks)) {
        Ok(l) => l,
        Err(e) => {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(worker = w.id, error = %e, "engine metrics scrape dropped");
            return;
        }
    };
    let Some(pool) = fleet.pool(&w.model) else { return };
    for (rank, load) in loads {
        let _ = pool.driver.engine_load(WorkerKey::new(w.id, rank), load);
    }
    stats.ok.fetch_add(1, Ordering::Relaxed);
}

async fn fetch<F: Fetch>(s: &Scraper<F>, w: &WorkerConfig) -> Result<Bytes, ScrapeError> {
    let cfg = &s.cfg;
    let uri = w.url.join(&cfg.metrics_path).map_err(|_| ScrapeError::Unreachable)?;
    let timeout = std::time::Duration::from_millis(cfg.scrape_timeout_ms);
    let read = s.client.get(uri, cfg.metrics_bytes_max);
    tokio::time::timeout(timeout, read).await.unwrap_or(Err(ScrapeError::Unreachable))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page of vLLM's shape for two engines.
    const PAGE: &str = "# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5
vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 1234.0
";

    fn load(waiting: u32, running: u32, kv_usage: f64) -> EngineLoad {
        EngineLoad { waiting, running, kv_usage }
    }

    #[track_caller]
    fn check(page: &str, dp_ranks: u32, want: Result<Vec<(u32, EngineLoad)>, ScrapeError>) {
        let got = parse(page.as_bytes(), dp_ranks).map(|m| m.into_iter().collect::<Vec<_>>());
        assert_eq!(got, want, "{page:?}");
    }

    #[test]
    fn pages_of_every_shape() {
        check(PAGE, 1, Ok(vec![(0, load(2, 4, 0.5))]));
        check(PAGE, 2, Ok(vec![(0, load(2, 3, 0.25)), (1, load(0, 1, 0.5))]));
        // Engines beyond the worker's ranks are not its.
        check(&PAGE.replace("engine=\"1\"", "engine=\"7\""), 2, Ok(vec![(0, load(2, 3, 0.25))]));
        // No labels, a timestamp, exponent notation, the sim-worker's OpenMetrics form.
        check(
            "vllm:num_requests_waiting 5 1700000000\nvllm:kv_cache_usage_perc 1e-1\n# EOF\n",
            1,
            Ok(vec![(0, load(5, 0, 0.1))]),
        );
        // Quotes and escapes inside other labels do not end the label set early.
        check("vllm:num_requests_running{a=\"}\\\"x\",engine=\"0\"} 2\n", 1, Ok(vec![(0, load(0, 2, 0.0))]));
        check("vllm:num_requests_waiting{engine=\"0\" 5\n", 1, Err(ScrapeError::BadSample { line: 1 }));
        check("x 1\nvllm:num_requests_waiting{} NaN\n", 1, Err(ScrapeError::BadSample { line: 2 }));
        check("vllm:num_requests_running -1\n", 1, Err(ScrapeError::BadSample { line: 1 }));
        check("vllm:kv_cache_usage_perc 1.5\n", 1, Err(ScrapeError::BadSample { line: 1 }));
        check("vllm:num_requests_waiting\n", 1, Err(ScrapeError::BadSample { line: 1 }));
        check("process_cpu_seconds_total 3\n", 1, Err(ScrapeError::NoEngineGauges));
        check("", 1, Err(ScrapeError::NoEngineGauges));
        assert_eq!(parse(b"vllm:num_requests_waiting \xff", 1), Err(ScrapeError::NotUtf8));
    }
}
