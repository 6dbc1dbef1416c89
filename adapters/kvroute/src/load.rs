//! The demo's client: replays trace requests over real HTTP against a router and keeps
//! live statistics (throughput, time to first token, prefix reuse).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::json;

use kvroute_sim::trace::{PromptContent, TraceRecord};

/// Outputs longer than this are cut, so a demo run stays short.
const OUTPUT_TOKENS_MAX: u32 = 256;

/// Running statistics for one target.
#[derive(Debug, Default, Clone)]
pub struct LiveStats {
    /// Requests sent.
    pub sent: u64,
    /// Requests that streamed to `[DONE]`.
    pub done: u64,
    /// Requests that failed (status, transport or a broken stream).
    pub errors: u64,
    /// Time to first token of each finished request, ms.
    pub ttft_ms: Vec<f64>,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: u64,
    /// Of which the worker served from its prefix cache.
    pub cached_tokens: u64,
}

impl LiveStats {
    /// Nearest-rank percentile of the TTFTs seen so far.
    pub fn ttft_pct(&self, pct: f64) -> f64 {
        let mut v = self.ttft_ms.clone();
        v.sort_by(f64::total_cmp);
        kvroute_sim::stats::nearest_rank(&v, pct)
    }
    /// Mean TTFT so far.
    pub fn ttft_mean(&self) -> f64 {
        if self.ttft_ms.is_empty() {
            0.0
        } else {
            self.ttft_ms.iter().sum::<f64>() / self.ttft_ms.len() as f64
        }
    }
    /// Cached ÷ prompt tokens so far.
    pub fn reuse(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// Where one stream of requests goes.
#[derive(Clone)]
pub struct Target {
    /// Policy name shown in the table.
    pub name: String,
    /// The router's base URL, `http://127.0.0.1:PORT`.
    pub base_url: String,
    /// Its statistics.
    pub stats: Arc<Mutex<LiveStats>>,
}

/// The token ids a record stands for: Mooncake ids become 512 copies each, cut to length.
pub fn record_tokens(r: &TraceRecord) -> Vec<u32> {
    match &r.content {
        PromptContent::HashIds(ids) => {
            ids.iter().flat_map(|&h| std::iter::repeat_n(h, 512)).take(r.input_length as usize).collect()
        }
        PromptContent::Tokens(t) => t.to_vec(),
    }
}

/// Sends every record to every target at `timestamp / compress` after the start, until
/// `deadline`. Returns when every sent request has ended.
pub async fn replay_http(records: &[TraceRecord], compress: f64, model: &str, targets: &[Target], deadline: Instant) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for r in records {
        let at = start + Duration::from_secs_f64(r.timestamp_ms.max(0.0) / 1000.0 / compress);
        if at.into_std() >= deadline {
            break;
        }
        tokio::time::sleep_until(at).await;
        let body = json!({
            "model": model,
            "prompt": record_tokens(r),
            "max_tokens": r.output_length.clamp(1, OUTPUT_TOKENS_MAX),
            "stream": true,
            "stream_options": { "include_usage": true },
        });
        let body = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
        for t in targets {
            let client = client.clone();
            let t = t.clone();
            let body = body.clone();
            tasks.spawn(async move { one_request(&client, &t, body).await });
        }
    }
    while tasks.join_next().await.is_some() {}
}

async fn one_request(client: &Client<HttpConnector, Full<Bytes>>, t: &Target, body: Bytes) {
    lock(&t.stats).sent += 1;
    let ok = stream_once(client, t, body).await;
    if ok.is_none() {
        lock(&t.stats).errors += 1;
    }
}

fn lock(m: &Mutex<LiveStats>) -> std::sync::MutexGuard<'_, LiveStats> {
    // A panicking stats writer cannot leave the counters half-updated in a way that
    // matters for a demo table, so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Streams one completion; `None` on any failure.
async fn stream_once(client: &Client<HttpConnector, Full<Bytes>>, t: &Target, body: Bytes) -> Option<()> {
    let req = hyper::Request::post(format!("{}/v1/completions", t.base_url))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .ok()?;
    let sent = Instant::now();
    let resp = client.request(req).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let mut body = resp.into_body();
    let mut first: Option<f64> = None;
    let mut buf = Vec::new();
    let mut usage = None;
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.ok()?;
        let Some(data) = frame.data_ref() else { continue };
        if first.is_none() {
            first = Some(sent.elapsed().as_secs_f64() * 1000.0);
        }
        buf.extend_from_slice(data);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let line = String::from_utf8_lossy(&event);
            let payload = line.trim().strip_prefix("data:").map(str::trim).unwrap_or("");
            if payload == "[DONE]" {
                done = true;
            } else if let Ok(v) = serde_json::from_str::<serde_json::Value>(payload) {
                if v.get("error").is_some() {
                    return None;
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    usage = Some(u.clone());
                }
            }
        }
    }
    if !done {
        return None;
    }
    let mut s = lock(&t.stats);
    s.done += 1;
    s.ttft_ms.push(first.unwrap_or(0.0));
    if let Some(u) = usage {
        s.prompt_tokens += u["prompt_tokens"].as_u64().unwrap_or(0);
        s.cached_tokens += u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    }
    Some(())
}
