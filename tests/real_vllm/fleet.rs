//! The shared fixture: two vLLM servers and one kvroute, started once per test binary
//! and handed to one test at a time (the tests read and change the engines' caches).

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::engine::{EngineEnv, Vllm, BLOCK_TOKENS};
use crate::http;
use crate::router::{build_binary, Kvroute};

/// Warm-up requests sent to a worker before its events are declared lost.
const FOLLOW_TRIES_MAX: u64 = 8;

/// KV blocks of the small-cache server (worker 2), so a dozen prompts evict.
pub const SMALL_CACHE_BLOCKS: usize = 96;

/// What the env must name, and how to get it.
const HOW: &str = "run `scripts/real-engine/install.sh` (the README's test command does) and export the \
    KVROUTE_VLLM_PYTHON and KVROUTE_VLLM_MODEL it prints, or set KVROUTE_REAL_VLLM=skip to skip this suite";

pub struct Fleet {
    pub engines: Vec<Vllm>,
    pub router: Kvroute,
    pub env: EngineEnv,
}

static FLEET: OnceLock<Result<Mutex<Fleet>, String>> = OnceLock::new();

/// The fleet, locked for the calling test; `None` when the suite is skipped.
pub fn fleet() -> Option<MutexGuard<'static, Fleet>> {
    let env = engine_env()?;
    let fleet = FLEET.get_or_init(|| {
        std::panic::catch_unwind(|| Mutex::new(Fleet::start(env))).map_err(|e| {
            match (e.downcast_ref::<String>(), e.downcast_ref::<&str>()) {
                (Some(s), _) => s.clone(),
                (None, Some(s)) => s.to_string(),
                (None, None) => "its start panicked".into(),
            }
        })
    });
    match fleet {
        Ok(m) => Some(m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())),
        Err(e) => panic!("the real-vLLM fleet did not start: {e}"),
    }
}

/// The engine's paths from the environment; `None` (with a line saying so) when
/// `KVROUTE_REAL_VLLM=skip`; a panic that says what to run when they are missing.
fn engine_env() -> Option<EngineEnv> {
    if std::env::var("KVROUTE_REAL_VLLM").is_ok_and(|v| v == "skip") {
        eprintln!("real_vllm: skipped (KVROUTE_REAL_VLLM=skip)");
        return None;
    }
    let var = |name: &str| match std::env::var_os(name) {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => panic!("{name} is not set: {HOW}"),
    };
    let env = EngineEnv { python: var("KVROUTE_VLLM_PYTHON"), model: var("KVROUTE_VLLM_MODEL") };
    for p in [&env.python, &env.model.join("config.json"), &env.model.join("tokenizer.json")] {
        assert!(p.exists(), "{} does not exist: {HOW}", p.display());
    }
    Some(env)
}

impl Fleet {
    fn start(env: EngineEnv) -> Fleet {
        let dir = crate::procs::scratch_dir("kvroute-real-vllm");
        let bin = build_binary();
        let t0 = Instant::now();
        let small = SMALL_CACHE_BLOCKS.to_string();
        let mut engines =
            vec![Vllm::start(1, &env, &dir, &[]), Vllm::start(2, &env, &dir, &["--num-gpu-blocks-override", &small])];
        for e in &mut engines {
            let waited = e.wait_ready();
            eprintln!("real_vllm: vLLM server {} healthy {:?} after the start of both", e.id, waited.max(t0.elapsed()));
        }
        let router = Kvroute::start(&bin, &dir, &env.model, &engines);
        let fleet = Fleet { engines, router, env };
        fleet.warm_up();
        eprintln!("real_vllm: fleet up in {:?}", t0.elapsed());
        eprintln!("real_vllm: logs in {}", dir.display());
        fleet
    }

    /// A connected ZeroMQ subscription can still miss a fresh publisher's first batches
    /// (the slow joiner), and an idle engine sends no later batch to reveal the gap. So
    /// before any test, each engine serves a request until its blocks show in the index;
    /// how many tries that took is printed.
    fn warm_up(&self) {
        for e in &self.engines {
            self.follow_events(e.id, 1_000 + 10 * e.id);
        }
    }

    /// Waits until worker `id`'s KV events reach kvroute's index: sends it fresh prompts
    /// (seeded from `seed`) until one shows as cached there. Called after an engine
    /// (re)starts, since what it publishes before kvroute's subscription reaches it is
    /// lost, and a later test would find the worker's index empty.
    #[track_caller]
    pub fn follow_events(&self, id: u64, seed: u64) {
        self.router.wait(Duration::from_secs(60), "kvroute's event streams connect", |r| r.streams_connected());
        let mut served_by = Vec::new();
        for tries in 1..=FOLLOW_TRIES_MAX {
            let body = token_prompt(crate::engine::MODEL, &tokens(seed + tries, 130));
            let served = self.send("/v1/completions", &body, Some(id)).worker;
            served_by.push(served);
            assert_eq!(served, id, "a request pinned to worker {id} was served by {served}");
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(15) && self.preview(&body).overlap(id) < 2 {
                std::thread::sleep(Duration::from_millis(100));
            }
            if self.preview(&body).overlap(id) >= 2 {
                eprintln!("real_vllm: worker {id}'s events reach the index (after {tries} request(s))");
                return;
            }
        }
        panic!(
            "worker {id}'s KV events never reached kvroute's index after {FOLLOW_TRIES_MAX} requests \
             (served by workers {served_by:?}).\nkvroute's view of the worker: {}\nkvroute's log ends:\n{}\n\
             vLLM {id}'s log ends:\n{}",
            self.worker_status(id),
            self.router.log_tail(40),
            self.engines.iter().find(|e| e.id == id).map(|e| e.log_tail(30)).unwrap_or_default()
        );
    }

    /// Worker `id`'s entry in kvroute's `/workers` (its event streams' counters), for
    /// failure messages.
    fn worker_status(&self, id: u64) -> String {
        match http::request(self.router.addr(), "GET", "/workers", &[], None, Duration::from_secs(5)) {
            Ok(r) => serde_json::from_slice::<Value>(&r.body)
                .ok()
                .and_then(|v| v["workers"].as_array()?.iter().find(|w| w["id"] == id).cloned())
                .map_or_else(|| r.text(), |w| w.to_string()),
            Err(e) => format!("GET /workers failed: {e}"),
        }
    }

    pub fn engine_mut(&mut self, id: u64) -> &mut Vllm {
        self.engines.iter_mut().find(|e| e.id == id).expect("engine id")
    }

    /// `POST /route/preview` for `body`: the decision kvroute would make now.
    #[track_caller]
    pub fn preview(&self, body: &Value) -> Preview {
        self.router.preview(body)
    }

    /// Sends `body` to `path` through kvroute (pinned to `pin` if given); answers 200.
    #[track_caller]
    pub fn send(&self, path: &str, body: &Value, pin: Option<u64>) -> Served {
        let pin_s = pin.map(|p| p.to_string());
        let headers: Vec<(&str, &str)> = pin_s.iter().map(|p| ("x-worker-id", p.as_str())).collect();
        let r = self.router.post(path, &headers, body);
        assert_eq!(r.status, 200, "{path} through kvroute: {}", r.text());
        let worker = r.header("x-kvroute-worker").and_then(|w| w.parse().ok()).expect("x-kvroute-worker");
        Served { worker, body: r.json() }
    }

    /// Polls the preview of `body` until `worker`'s overlap is `want` blocks.
    #[track_caller]
    pub fn wait_overlap(&self, body: &Value, worker: u64, want: u64) {
        let t0 = Instant::now();
        loop {
            let got = self.preview(body).overlap(worker);
            if got == want {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "worker {worker} should hold {want} blocks of the prompt in kvroute's index, still {got} after 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A preview's answer.
pub struct Preview(pub Value);

impl Preview {
    /// The worker it would route to.
    pub fn worker(&self) -> u64 {
        self.0["worker"].as_u64().expect("worker")
    }

    /// `worker`'s device overlap, in blocks.
    #[track_caller]
    pub fn overlap(&self, worker: u64) -> u64 {
        self.row(worker)["overlap"]["device"].as_u64().expect("overlap.device")
    }

    /// `worker`'s prompt blocks to compute in the kv cost: the queued tokens kvroute
    /// believes in plus the prompt's own, over the block size.
    #[track_caller]
    pub fn prefill_blocks(&self, worker: u64) -> f64 {
        self.row(worker)["prefill_blocks"].as_f64().expect("prefill_blocks")
    }

    /// `worker`'s cost (the kv cost with its charges, model ms).
    #[track_caller]
    pub fn cost(&self, worker: u64) -> f64 {
        self.row(worker)["cost"].as_f64().expect("cost")
    }

    /// Whether `worker` may be chosen.
    pub fn eligible(&self, worker: u64) -> bool {
        self.row(worker)["eligible"] == true
    }

    /// The prompt's length in tokens, as kvroute tokenized it.
    pub fn isl_tokens(&self) -> u64 {
        self.0["isl_tokens"].as_u64().expect("isl_tokens")
    }

    #[track_caller]
    fn row(&self, worker: u64) -> &Value {
        self.0["explanation"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["worker"] == worker))
            .unwrap_or_else(|| panic!("no row for worker {worker} in {}", self.0))
    }
}

/// A request kvroute served.
pub struct Served {
    pub worker: u64,
    pub body: Value,
}

impl Served {
    /// Prompt tokens vLLM found in its prefix cache (`usage.prompt_tokens_details`).
    pub fn cached_tokens(&self) -> u64 {
        self.body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
    }

    /// Prompt tokens vLLM counted.
    pub fn prompt_tokens(&self) -> u64 {
        self.body["usage"]["prompt_tokens"].as_u64().expect("usage.prompt_tokens")
    }

    /// The generated text (completion or chat).
    pub fn text(&self) -> &str {
        let c = &self.body["choices"][0];
        c["text"].as_str().or_else(|| c["message"]["content"].as_str()).unwrap_or("")
    }
}

/// `n` deterministic token ids from `seed`, clear of the special tokens.
pub fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            300 + (x % 7000) as u32
        })
        .collect()
}

/// A completion body for token ids, greedy, `max_tokens` 2.
pub fn token_prompt(model: &str, ids: &[u32]) -> Value {
    json!({"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0})
}

/// Full blocks in `tokens` tokens.
pub fn blocks(tokens: u64) -> u64 {
    tokens / BLOCK_TOKENS as u64
}
