//! Sim-workers with fault injection behind a proxy, and a client that reads a stream
//! event by event, for the failover and migration tests.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use kvroute_proxy::{ProxyConfig, ServeHandle};
use kvroute_sim_server::{EngineConfig, Faults, SimServerConfig, SimServerHandle};
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::*;

/// A fleet of sim-workers (ids 1, 2, ...) and their fault switches.
pub struct Sims {
    pub workers: Vec<SimServerHandle>,
    pub faults: Vec<Faults>,
}

impl Sims {
    pub async fn start(n: usize) -> Sims {
        Sims::start_with(n, EngineConfig { speedup: 1000.0, block_size: 16, ..EngineConfig::default() }).await
    }

    /// `n` workers running `engine`.
    pub async fn start_with(n: usize, engine: EngineConfig) -> Sims {
        let (mut workers, mut faults) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let f = Faults::default();
            let cfg = SimServerConfig {
                model: MODEL.into(),
                engine: engine.clone(),
                faults: f.clone(),
                shutdown_grace_ms: 100,
                ..SimServerConfig::default()
            };
            workers.push(kvroute_sim_server::spawn(cfg).await.expect("sim worker starts"));
            faults.push(f);
        }
        Sims { workers, faults }
    }

    /// The faults of worker `id` (1-based).
    pub fn of(&self, id: u64) -> &Faults {
        &self.faults[id as usize - 1]
    }

    /// The test baseline ([`config`]) over these workers, ids from 1.
    pub fn config(&self) -> ProxyConfig {
        let addrs: Vec<(u64, SocketAddr)> =
            self.workers.iter().enumerate().map(|(i, w)| (i as u64 + 1, w.http_addr())).collect();
        let mut c = config(&addrs);
        c.retry.backoff_base_ms = 1;
        c.retry.backoff_max_ms = 5;
        c.ejection.base_ms = 60_000; // no readmission probe while a test runs
        c
    }

    pub async fn stop(self) {
        for w in self.workers {
            w.shutdown().await;
        }
    }
}

/// A streamed completion of `prompt` (text), greedy, `max_tokens` long, with usage.
pub fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// A streamed chat of one user message, greedy, `max_tokens` long, with usage.
pub fn greedy_chat(text: &str, max_tokens: u32) -> Value {
    json!({
        "model": MODEL, "messages": [{"role": "user", "content": text}], "max_completion_tokens": max_tokens,
        "temperature": 0, "stream": true, "stream_options": {"include_usage": true},
    })
}

/// A stream read event by event, with when each arrived.
pub struct Events {
    pub status: StatusCode,
    pub worker: Option<u64>,
    body: Incoming,
    buf: String,
}

impl Events {
    pub async fn open(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> Events {
        let resp = send(addr, Method::POST, path, headers, Some(body)).await;
        let worker = resp.headers().get("x-kvroute-worker").map(|v| v.to_str().unwrap().parse().unwrap());
        Events { status: resp.status(), worker, body: resp.into_body(), buf: String::new() }
    }

    /// The next whole event, `None` at the end of the body.
    pub async fn next(&mut self) -> Option<(String, Instant)> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event = self.buf[..end].to_string();
                self.buf.drain(..end + 2);
                return Some((event, Instant::now()));
            }
            match within(10_000, self.body.frame()).await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.push_str(std::str::from_utf8(&d).expect("UTF-8"));
                    }
                }
                _ => return None,
            }
        }
    }

    /// Every remaining event.
    pub async fn rest(&mut self) -> Vec<(String, Instant)> {
        let mut v = Vec::new();
        while let Some(e) = self.next().await {
            v.push(e);
        }
        v
    }
}

/// What a client makes of a stream's events: the text, the chunks' JSON, whether it
/// ended with `[DONE]`, and the error event if one came.
#[derive(Debug, Default)]
pub struct Read {
    pub text: String,
    pub chunks: Vec<Value>,
    pub done: bool,
    pub error: Option<Value>,
}

pub fn read(events: &[(String, Instant)]) -> Read {
    let mut r = Read::default();
    for (e, _) in events {
        if let Some(data) = e.strip_prefix("event: error\ndata: ") {
            r.error = Some(serde_json::from_str(data).expect("error JSON"));
            continue;
        }
        let Some(data) = e.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            r.done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).expect("chunk JSON");
        if let Some(c) = v["choices"].get(0) {
            r.text.push_str(c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or(""));
        }
        r.chunks.push(v);
    }
    r
}

/// The whole stream of `body` at `path`, read through the proxy.
pub async fn stream_all(addr: SocketAddr, path: &str, body: &Value) -> Read {
    let mut ev = Events::open(addr, path, &[], body).await;
    let events = ev.rest().await;
    assert_eq!(ev.status, 200, "{path}: {events:?} {}", ev.buf);
    read(&events)
}

/// `POST` with no body.
pub async fn post_empty(addr: SocketAddr, path: &str) -> Answer {
    let req = http::Request::post(format!("http://{addr}{path}")).body(Full::new(Bytes::new())).unwrap();
    let resp = within(10_000, client().request(req)).await.expect("the proxy answers");
    let (parts, body) = resp.into_parts();
    let body = within(10_000, body.collect()).await.map(|c| c.to_bytes()).unwrap_or_default();
    Answer { status: parts.status, headers: parts.headers, body }
}

/// The sum of `kvroute_<name>_total` samples whose labels hold all of `labels`.
pub fn counted(metrics: &str, name: &str, labels: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, ""));
            (n == name && labels.iter().all(|lab| rest.contains(lab))).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// Starts the proxy and waits for nothing else.
pub async fn proxy(cfg: ProxyConfig) -> ServeHandle {
    start(cfg).await
}

/// A duration in ms, for messages.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
