//! The demo's client: replays trace requests over real HTTP against a router and keeps
//! live statistics (throughput, time to first token, prefix reuse).

use std::collections::BTreeMap;
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
    /// The same failures by what each was (`HTTP 429 queue_full`, `stream broke`, ...).
    pub error_kinds: BTreeMap<String, u64>,
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
    /// Requests sent that neither finished nor failed (still open).
    pub fn unfinished(&self) -> u64 {
        self.sent.saturating_sub(self.done + self.errors)
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
    if let Err(kind) = stream_once(client, t, body).await {
        let mut s = lock(&t.stats);
        s.errors += 1;
        *s.error_kinds.entry(kind).or_default() += 1;
    }
}

/// The most of an error answer's body read for its code.
const ERROR_BODY_BYTES_MAX: usize = 64 << 10;

/// What a refused request was: its status and the OpenAI-style error code, if any.
async fn status_kind(resp: hyper::Response<hyper::body::Incoming>) -> String {
    let status = resp.status().as_u16();
    let body = http_body_util::Limited::new(resp.into_body(), ERROR_BODY_BYTES_MAX).collect().await;
    let code = body.ok().and_then(|b| error_code(&b.to_bytes()));
    match code {
        Some(code) => format!("HTTP {status} {code}"),
        None => format!("HTTP {status}"),
    }
}

/// `error.code`, else `error.type`, of an OpenAI-style error object.
fn error_code(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let e = v.get("error")?;
    let code = e.get("code").and_then(|c| c.as_str()).or_else(|| e.get("type").and_then(|c| c.as_str()))?;
    Some(code.to_string())
}

fn lock(m: &Mutex<LiveStats>) -> std::sync::MutexGuard<'_, LiveStats> {
    // A panicking stats writer cannot leave the counters half-updated in a way that
    // matters for a demo table, so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Streams one completion; on failure, what went wrong.
async fn stream_once(client: &Client<HttpConnector, Full<Bytes>>, t: &Target, body: Bytes) -> Result<(), String> {
    let req = hyper::Request::post(format!("{}/v1/completions", t.base_url))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .map_err(|e| format!("request not built: {e}"))?;
    let sent = Instant::now();
    let resp = client.request(req).await.map_err(|e| {
        if e.is_connect() {
            "connect failed".to_string()
        } else {
            "no answer (connection closed)".to_string()
        }
    })?;
    if !resp.status().is_success() {
        return Err(status_kind(resp).await);
    }
    let mut body = resp.into_body();
    let mut first: Option<f64> = None;
    let mut buf = Vec::new();
    let mut usage = None;
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| "stream broke".to_string())?;
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
                    let code = error_code(payload.as_bytes()).unwrap_or_else(|| "unnamed".into());
                    return Err(format!("error event {code}"));
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    usage = Some(u.clone());
                }
            }
        }
    }
    if !done {
        return Err("stream ended without [DONE]".into());
    }
    let mut s = lock(&t.stats);
    s.done += 1;
    s.ttft_ms.push(first.unwrap_or(0.0));
    if let Some(u) = usage {
        s.prompt_tokens += u["prompt_tokens"].as_u64().unwrap_or(0);
        s.cached_tokens += u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[track_caller]
    fn check(body: &str, want: Option<&str>) {
        assert_eq!(super::error_code(body.as_bytes()).as_deref(), want, "{body}");
    }

    #[test]
    fn an_error_body_names_its_code_else_its_type() {
        check(r#"{"error":{"message":"m","type":"overloaded","code":"queue_full"}}"#, Some("queue_full"));
        check(r#"{"error":{"message":"m","type":"invalid_request_error","code":null}}"#, Some("invalid_request_error"));
        check(r#"{"error":"plain"}"#, None);
        check("not json", None);
        check(r#"{"choices":[]}"#, None);
    }
}
