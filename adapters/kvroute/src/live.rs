//! The live demo: simulated workers on loopback, one real routing proxy per policy in
//! front of its own fleet, and the bundled trace sent to both over HTTP at once.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use kvroute_proxy::{ProxyConfig, ServeHandle, Tokenize, TokenizeError, Tokenizers};
use kvroute_sim::trace::{read_trace, TraceLimits, TraceRecord};
use kvroute_sim_server::{EngineConfig, FallbackTokenizer, PromptTokenizer, SimServerConfig, SimServerHandle};

use crate::load::{replay_http, LiveStats, Target};
use crate::replay_cmd::BUNDLED_TRACE;

const MODEL: &str = "demo";
/// The config's name for [`DemoTokenizer`], which the demo hands the router in code.
const TOKENIZER: &str = "built-in: the simulated workers' byte tokenizer";

/// The demo model's tokenizer: the one its simulated workers run
/// ([`FallbackTokenizer`]), so the ids the router hashes are those the workers' KV
/// events name, and the router needs no predictions.
struct DemoTokenizer(FallbackTokenizer);

impl Tokenize for DemoTokenizer {
    fn encode_chat(&self, body: &serde_json::Value) -> Result<Vec<u32>, TokenizeError> {
        self.0.encode_chat(body).map_err(TokenizeError::new)
    }

    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.0.encode_text(text).map_err(TokenizeError::new)
    }
}

/// How the live demo runs.
#[derive(Clone, Copy, Debug)]
pub struct LiveOptions {
    /// Workers behind each router.
    pub workers: u32,
    /// Wall-clock budget, seconds.
    pub duration_s: f64,
    /// Arrival compression over engine speedup: 2 means twice the trace's load.
    pub load_factor: f64,
    /// Send only the first this many requests.
    pub requests: Option<usize>,
    /// Print the live table (off for `--json`).
    pub table: bool,
}

/// One policy's fleet and router.
struct Stack {
    policy: &'static str,
    workers: Vec<SimServerHandle>,
    proxy: ServeHandle,
    stats: Arc<Mutex<LiveStats>>,
}

/// Final figures per policy, in model milliseconds.
pub struct LiveResult {
    pub policy: &'static str,
    pub stats: LiveStats,
    pub speedup: f64,
}

async fn stack(policy: &'static str, o: &LiveOptions, speedup: f64) -> Result<Stack, String> {
    let mut workers = Vec::new();
    for _ in 0..o.workers {
        let cfg = SimServerConfig {
            model: MODEL.into(),
            tokenizer: Arc::new(FallbackTokenizer),
            replay_port: Some(0),
            engine: EngineConfig { speedup, ..EngineConfig::default() },
            ..SimServerConfig::default()
        };
        workers.push(kvroute_sim_server::spawn(cfg).await.map_err(|e| format!("simulated worker: {e}"))?);
    }
    let worker_cfgs: Vec<_> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| {
            json!({
                "id": i, "url": w.base_url(), "model": MODEL,
                "kv_events": w.events_endpoint(), "kv_events_replay": w.replay_endpoint(),
            })
        })
        .collect();
    let cfg: ProxyConfig = serde_json::from_value(json!({
        "listen": "127.0.0.1:0",
        "seed": 1,
        "models": [{ "name": MODEL, "block_size": 64, "tokenizer": TOKENIZER }],
        "workers": worker_cfgs,
        "router": {
            "mode": policy,
            // The router tokenizes as the workers do, so their KV events match exactly:
            // no predictions.
            "approximate": false,
            // The engines queue internally; the demo compares placement, not shedding.
            "prefill_tokens_frac_of_batch": 0.0,
            "decode_blocks_frac_of_kv": 0.0,
        },
        "limits": { "body_bytes_max": 16 << 20 },
        "health_check": { "interval_ms": 0 },
    }))
    .map_err(|e| format!("demo configuration: {e}"))?;
    let mut tokenizers = Tokenizers::new();
    tokenizers.insert(MODEL, Arc::new(DemoTokenizer(FallbackTokenizer)));
    let proxy = kvroute_proxy::serve(cfg.clone(), tokenizers).await.map_err(|e| format!("router: {e}"))?;
    Ok(Stack { policy, workers, proxy, stats: Arc::new(Mutex::new(LiveStats::default())) })
}

fn snapshot(s: &Mutex<LiveStats>) -> LiveStats {
    s.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Runs the live demo and returns each policy's figures.
pub async fn run(o: LiveOptions) -> Result<Vec<LiveResult>, String> {
    let mut records: Vec<TraceRecord> =
        read_trace(BUNDLED_TRACE.as_bytes(), &TraceLimits::default()).map_err(|e| format!("bundled trace: {e}"))?;
    if let Some(n) = o.requests {
        records.truncate(n);
    }
    let span_s = records.last().map_or(1.0, |r| r.timestamp_ms / 1000.0).max(1.0);
    // Arrivals finish at 80% of the budget, leaving time for the last streams.
    let compress = (span_s / (o.duration_s * 0.8).max(1.0)).max(1.0);
    let speedup = (compress / o.load_factor).max(1.0);
    let mut stacks = Vec::new();
    for policy in ["kv", "round-robin"] {
        stacks.push(stack(policy, &o, speedup).await?);
    }
    // Let every subscription connect before the first request produces events.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let targets: Vec<Target> = stacks
        .iter()
        .map(|s| Target {
            name: s.policy.into(),
            base_url: format!("http://{}", s.proxy.local_addr()),
            stats: s.stats.clone(),
        })
        .collect();
    if o.table {
        println!("kvroute demo: {} simulated workers per router, engines at {speedup:.1}x real time,", o.workers);
        println!("trace arrivals {compress:.1}x faster");
        println!("(TTFT in model milliseconds: wall time x {speedup:.1})\n");
    }
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(o.duration_s);
    let printer = o.table.then(|| {
        let targets = targets.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                print_row(start, &targets, speedup);
            }
        })
    });
    let load = replay_http(&records, compress, MODEL, &targets, deadline);
    // The budget is a promise: streams still open at the deadline are abandoned.
    let _ = tokio::time::timeout_at(tokio::time::Instant::from_std(deadline + Duration::from_secs(5)), load).await;
    if let Some(p) = printer {
        p.abort();
    }
    let results = stacks.iter().map(|s| LiveResult { policy: s.policy, stats: snapshot(&s.stats), speedup }).collect();
    for s in stacks {
        let _ = s.proxy.shutdown().await;
        for w in s.workers {
            w.shutdown().await;
        }
    }
    Ok(results)
}

/// Prints one line per policy, each well inside 100 columns.
fn print_row(start: Instant, targets: &[Target], speedup: f64) {
    let t = start.elapsed().as_secs_f64();
    for tg in targets {
        println!("{}", row(t, &tg.name, &snapshot(&tg.stats), speedup));
    }
}

/// One policy's live line: elapsed time, progress, TTFT in model ms and reuse.
fn row(t: f64, policy: &str, s: &LiveStats, speedup: f64) -> String {
    format!(
        "{t:>5.0}s  {policy:<11} {:>5} done {:>6.1} req/s  TTFT p50 {:>6.0} p99 {:>6.0} ms  reuse {:.3}",
        s.done,
        s.done as f64 / t.max(1e-9),
        s.ttft_pct(50.0) * speedup,
        s.ttft_pct(99.0) * speedup,
        s.reuse()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_lines_fit_in_100_columns() {
        // The widest figures a long, overloaded demo prints: hours, 99,999 requests,
        // TTFT near 1,000 model seconds.
        let s = LiveStats {
            done: 99_999,
            ttft_ms: vec![999_999.0],
            prompt_tokens: 1,
            cached_tokens: 1,
            ..Default::default()
        };
        for policy in ["kv", "round-robin"] {
            let line = row(9_999.0, policy, &s, 1.0);
            assert!(line.chars().count() <= 100, "{} columns: {line}", line.chars().count());
            assert!(line.contains(policy), "{line}");
        }
    }
}
