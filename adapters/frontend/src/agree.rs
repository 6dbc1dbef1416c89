//! Whether each worker tokenizes as the router does. A task asks every worker of a model
//! that has a `tokenizer`, when the worker publishes KV events or its model sends token
//! ids, to tokenize one fixed text ([`PROBE`], `POST` to `learn.tokenize_path`, vLLM's
//! `/tokenize`) and compares the ids with the router's.
//!
//! Three things hang on the answer. A worker that differs gets a warning naming it: the
//! block hashes the router makes of its prompts will never match its KV events, so its
//! cache is invisible (a wrong `tokenizer` folder does this silently otherwise). Its
//! model's router is told, and predicts that worker's cache from its own decisions until
//! it agrees again (`Router::handle_worker_tokens`), as it does for a model without a
//! tokenizer. And only a worker that agrees is sent a completion's prompt as token ids
//! (`forward_token_ids`); any other gets the text, which is always safe.
//!
//! Verdicts live in a table keyed by worker id, bounded by the fleet: a worker's entry
//! leaves with it. A worker with a verdict is asked again each `tokenizer_check_interval_ms`
//! (it may have restarted with another model); one that could not be asked, each
//! [`RETRY_MS`]. A worker that does not serve the endpoint (SGLang, TensorRT-LLM) stays
//! unknown and keeps getting text. The HTTP client is the server's ([`Fetch`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use router_core::WorkerId;
use serde::Deserialize;
use tokio::sync::watch;

use crate::fleet::Fleet;
use crate::learn::LearnSection;
use crate::scrape::{every, Fetch, ScrapeError};
use crate::tokenize::Tokenizers;

/// The text every worker is asked to tokenize: words, digits, punctuation, runs of
/// spaces and tabs, accents, CJK, an emoji and newlines, where tokenizers part ways.
pub const PROBE: &str = "kvroute tokenizer check: The quick brown fox jumps over 13 lazy dogs, \
    doesn't it?\n\tTabs,  two spaces,   three. Caf\u{e9} na\u{ef}ve \u{fc}ber \u{6771}\u{4eac} \
    \u{1f642} 3.14159 == pi; x_y-z/w\n";

/// How soon a worker that could not be asked is asked again.
pub const RETRY_MS: u64 = 5_000;

/// Largest answer read, in bytes: the probe is a few dozen tokens.
const ANSWER_BYTES_MAX: usize = 64 << 10;

/// What a worker's answer to the probe says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// Its ids for the probe are the router's.
    Agrees,
    /// Its ids differ from the router's, first at this index.
    Differs {
        /// The first index where they differ (the shorter one's length if one is a
        /// prefix of the other).
        at: usize,
    },
    /// It could not be asked, or did not answer in vLLM's shape.
    Unknown(Unasked),
}

/// Why a worker's tokenizer is not known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unasked {
    /// The request failed or timed out.
    Unreachable,
    /// The worker answered with a non-2xx status (404: it has no such endpoint).
    Status(u16),
    /// The answer was not JSON with a `tokens` list of ids, or was too large.
    BadAnswer,
}

impl Verdict {
    /// The metrics label and `/workers` word for it.
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Agrees => "agrees",
            Verdict::Differs { .. } => "differs",
            Verdict::Unknown(Unasked::Unreachable) => "unreachable",
            Verdict::Unknown(Unasked::Status(_)) => "status",
            Verdict::Unknown(Unasked::BadAnswer) => "bad_answer",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Agrees => f.write_str("tokenizes as the router does"),
            Verdict::Differs { at } => write!(f, "tokenizes differently from the router, from token {at}"),
            Verdict::Unknown(Unasked::Unreachable) => f.write_str("tokenize request failed"),
            Verdict::Unknown(Unasked::Status(s)) => write!(f, "tokenize answered status {s}"),
            Verdict::Unknown(Unasked::BadAnswer) => f.write_str("tokenize answer has no list of token ids"),
        }
    }
}

/// The verdict on `answer` (a `/tokenize` answer's body), given the router's `ids`.
pub fn judge(ids: &[u32], answer: &[u8]) -> Verdict {
    #[derive(Deserialize)]
    struct Answer {
        tokens: Vec<u32>,
    }
    let Ok(a) = serde_json::from_slice::<Answer>(answer) else {
        return Verdict::Unknown(Unasked::BadAnswer);
    };
    match ids.iter().zip(&a.tokens).position(|(x, y)| x != y) {
        Some(at) => Verdict::Differs { at },
        None if ids.len() == a.tokens.len() => Verdict::Agrees,
        None => Verdict::Differs { at: ids.len().min(a.tokens.len()) },
    }
}

/// Every worker's last verdict and when it was made, and how many checks ended each way.
#[derive(Debug, Default)]
pub struct Verdicts {
    table: RwLock<HashMap<u64, (Verdict, Instant)>>,
    counts: RwLock<BTreeMap<&'static str, u64>>,
}

impl Verdicts {
    /// Whether `worker`'s last answer agreed with the router.
    pub fn agrees(&self, worker: u64) -> bool {
        self.get(worker) == Some(Verdict::Agrees)
    }

    /// `worker`'s last verdict, `None` before its first check.
    pub fn get(&self, worker: u64) -> Option<Verdict> {
        self.table.read().unwrap_or_else(PoisonError::into_inner).get(&worker).map(|(v, _)| *v)
    }

    /// Forgets `worker` (it left, or was replaced by another at the same id).
    pub fn forget(&self, worker: u64) {
        self.table.write().unwrap_or_else(PoisonError::into_inner).remove(&worker);
    }

    /// Every worker's verdict.
    pub fn all(&self) -> Vec<(u64, Verdict)> {
        self.table.read().unwrap_or_else(PoisonError::into_inner).iter().map(|(w, (v, _))| (*w, *v)).collect()
    }

    /// Checks made so far, by [`Verdict::label`].
    pub fn counts(&self) -> BTreeMap<&'static str, u64> {
        self.counts.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Counts a check that ended in `v`.
    pub(crate) fn count(&self, v: Verdict) {
        *self.counts.write().unwrap_or_else(PoisonError::into_inner).entry(v.label()).or_default() += 1;
    }

    /// Records `v` for `worker` at `now`; returns the verdict it replaces.
    pub(crate) fn record(&self, worker: u64, v: Verdict, now: Instant) -> Option<Verdict> {
        self.table.write().unwrap_or_else(PoisonError::into_inner).insert(worker, (v, now)).map(|(old, _)| old)
    }

    /// Whether `worker` is due a check at `now`.
    fn due(&self, worker: u64, now: Instant, interval: Duration) -> bool {
        match self.table.read().unwrap_or_else(PoisonError::into_inner).get(&worker) {
            None => true,
            Some((Verdict::Unknown(_), at)) => now.duration_since(*at) >= interval.min(Duration::from_millis(RETRY_MS)),
            Some((_, at)) => now.duration_since(*at) >= interval,
        }
    }
}

/// The router's ids for [`PROBE`], per model with a tokenizer; a model whose tokenizer
/// fails on it is not checked.
pub fn probes(tokenizers: &Tokenizers) -> BTreeMap<String, Vec<u32>> {
    tokenizers.iter().filter_map(|(m, t)| Some((m.to_owned(), t.encode_text(PROBE).ok()?))).collect()
}

/// Checks every worker of a model in `probes` when due, until `shutdown` turns true or
/// the fleet is gone. Returns at once when checks are off or no model has a tokenizer.
pub async fn check_loop<F: Fetch>(
    client: F,
    cfg: LearnSection,
    probes: BTreeMap<String, Vec<u32>>,
    fleet: Weak<Fleet>,
    shutdown: watch::Receiver<bool>,
) {
    let Some(interval) = cfg.tokenizer_check_interval() else { return };
    if probes.is_empty() {
        return;
    }
    let probes = Arc::new(probes);
    let round = |fleet: Arc<Fleet>| {
        let (client, cfg, probes) = (client.clone(), cfg.clone(), probes.clone());
        async move { check_due(&client, &cfg, &probes, &fleet, interval).await }
    };
    every(Duration::from_millis(1_000).min(interval), fleet, shutdown, round).await;
}

/// Asks every worker that is due, at once, and records what each answered.
async fn check_due<F: Fetch>(
    client: &F,
    cfg: &LearnSection,
    probes: &BTreeMap<String, Vec<u32>>,
    fleet: &Fleet,
    interval: Duration,
) {
    let now = Instant::now();
    let mut checks = tokio::task::JoinSet::new();
    for w in fleet.workers() {
        let Some(ids) = probes.get(&w.model) else { continue };
        // The answer matters only to a worker whose events the router reads, or which it
        // would send ids.
        let matters = w.kv_events.is_some() || fleet.pool(&w.model).is_some_and(|p| p.forward_token_ids);
        if !matters || !fleet.verdicts().due(w.id, now, interval) {
            continue;
        }
        let body = Bytes::from(serde_json::json!({"model": w.model, "prompt": PROBE}).to_string());
        let (client, cfg, ids) = (client.clone(), cfg.clone(), ids.clone());
        checks.spawn(async move {
            let v = ask(&client, &cfg, &w.url, body).await.map_or_else(Verdict::Unknown, |a| judge(&ids, &a));
            (w, v)
        });
    }
    while let Some(done) = checks.join_next().await {
        let Ok((w, v)) = done else { continue };
        fleet.verdicts().count(v);
        // A worker removed or replaced meanwhile keeps no entry.
        if fleet.worker(w.id).is_some_and(|cur| cur.url == w.url && cur.model == w.model) {
            let old = fleet.verdicts().record(w.id, v, Instant::now());
            report(w.id, &w.model, old, v);
            // A worker that could not be asked keeps what it last said.
            if let (Some(p), Verdict::Agrees | Verdict::Differs { .. }) = (fleet.pool(&w.model), v) {
                p.driver.set_worker_tokens(WorkerId(w.id), v == Verdict::Agrees);
            }
        }
    }
}

/// `POST`s the probe to `url`'s tokenize path within the scrape timeout.
async fn ask<F: Fetch>(
    client: &F,
    cfg: &LearnSection,
    url: &crate::config::WorkerUrl,
    body: Bytes,
) -> Result<Bytes, Unasked> {
    let uri = url.join(&cfg.tokenize_path).map_err(|_| Unasked::Unreachable)?;
    let timeout = Duration::from_millis(cfg.scrape_timeout_ms);
    let answer = tokio::time::timeout(timeout, client.post(uri, body, ANSWER_BYTES_MAX)).await;
    match answer.unwrap_or(Err(ScrapeError::Unreachable)) {
        Ok(b) => Ok(b),
        Err(ScrapeError::Status(s)) => Err(Unasked::Status(s)),
        Err(ScrapeError::TooLarge) => Err(Unasked::BadAnswer),
        Err(_) => Err(Unasked::Unreachable),
    }
}

/// Logs a verdict that changed: a difference loudly, since it costs every cache hit.
fn report(worker: u64, model: &str, old: Option<Verdict>, v: Verdict) {
    if old == Some(v) {
        return;
    }
    match v {
        Verdict::Differs { at } => tracing::warn!(
            worker,
            model,
            first_difference_at = at,
            "the worker tokenizes differently from the router: its KV events will not match the router's \
             block hashes, and prompts go to it as text; check the model's `tokenizer` folder"
        ),
        Verdict::Agrees => tracing::info!(worker, model, "the worker tokenizes as the router does"),
        Verdict::Unknown(_) => {
            tracing::debug!(worker, model, verdict = %v, "the worker's tokenizer could not be checked")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(ids: &[u32], answer: &str, want: Verdict) {
        assert_eq!(judge(ids, answer.as_bytes()), want, "{ids:?} {answer}");
    }

    #[test]
    fn answers_of_every_shape() {
        let vllm = r#"{"count":3,"max_model_len":4096,"tokens":[1,20,300],"token_strs":null}"#;
        check(&[1, 20, 300], vllm, Verdict::Agrees);
        check(&[1, 20, 301], vllm, Verdict::Differs { at: 2 });
        // The router adds a BOS the worker does not, or the other way round.
        check(&[20, 300], vllm, Verdict::Differs { at: 0 });
        check(&[1, 20], vllm, Verdict::Differs { at: 2 });
        check(&[1, 20, 300, 7], vllm, Verdict::Differs { at: 3 });
        check(&[], r#"{"tokens":[]}"#, Verdict::Agrees);
        let bad = Verdict::Unknown(Unasked::BadAnswer);
        check(&[1], r#"{"count":1}"#, bad);
        check(&[1], r#"{"tokens":[-1]}"#, bad);
        check(&[1], r#"{"tokens":["a"]}"#, bad);
        check(&[1], r#"{"tokens":[1.5]}"#, bad);
        check(&[1], "[1]", bad);
        check(&[1], "", bad);
        check(&[1], "\u{fffd}", bad);
    }

    #[test]
    fn a_worker_is_due_when_new_after_the_interval_and_sooner_when_unknown() {
        let (v, t0, interval) = (Verdicts::default(), Instant::now(), Duration::from_secs(60));
        let later = |ms| t0 + Duration::from_millis(ms);
        assert!(v.due(1, t0, interval));
        v.record(1, Verdict::Agrees, t0);
        v.record(2, Verdict::Unknown(Unasked::Status(404)), t0);
        assert!(v.agrees(1) && !v.agrees(2) && !v.agrees(3));
        assert!(!v.due(1, later(RETRY_MS), interval) && v.due(1, later(60_000), interval));
        assert!(!v.due(2, later(RETRY_MS - 1), interval) && v.due(2, later(RETRY_MS), interval));
        // A short interval applies to unknown workers too.
        assert!(v.due(2, later(1_000), Duration::from_secs(1)));
        assert_eq!(v.record(1, Verdict::Differs { at: 0 }, t0), Some(Verdict::Agrees));
        assert!(!v.agrees(1));
        v.forget(1);
        assert_eq!(v.get(1), None);
    }
}
