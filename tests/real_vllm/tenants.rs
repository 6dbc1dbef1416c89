//! Cache isolation between tenants on real vLLM. A second `kvroute serve`, with two
//! isolated tenants, runs in front of the shared fleet's engines (the shared router's
//! config has no tenants, which every other test relies on). vLLM keys its blocks by
//! `cache_salt`, so tenant B's copy of tenant A's prompt must find nothing cached, on
//! the engine (`usage.prompt_tokens_details.cached_tokens`) and in kvroute's index (the
//! preview's overlap), while A's follow-up finds A's blocks. A client's own
//! `cache_salt` is combined with the tenant's, never put in its place: two tenants
//! naming the same salt still share nothing.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::engine::{Vllm, BLOCK_TOKENS, MODEL};
use crate::fleet::{blocks, fleet, token_prompt, tokens};
use crate::router::{build_binary, config, Kvroute};

const KEYS: [&str; 2] = ["sk-real-tenant-a-0123456789", "sk-real-tenant-b-0123456789"];

/// The shared config with tenants `a` and `b` (isolated, the default), their plain keys
/// in files next to it.
fn tenants_config(dir: &Path, tokenizer: &Path, port: u16, engines: &[Vllm]) -> String {
    let mut text = config(tokenizer, port, engines);
    for (name, key) in ["a", "b"].iter().zip(KEYS) {
        let file = dir.join(format!("tenant-{name}.keys"));
        std::fs::write(&file, format!("{key}\n")).expect("key file written");
        text.push_str(&format!("\n[[tenants]]\nname = \"{name}\"\napi_key_file = {:?}\n", file.display().to_string()));
    }
    text
}

/// The tenants' router on the fleet's engines.
struct Gateway(Kvroute);

impl Gateway {
    /// `POST path` as tenant `t` (0 is `a`, 1 is `b`), pinned to `worker` (loopback is
    /// trusted); answers 200.
    #[track_caller]
    fn post(&self, t: usize, path: &str, body: &Value, worker: Option<u64>) -> Value {
        let auth = format!("Bearer {}", KEYS[t]);
        let pin = worker.map(|w| w.to_string());
        let mut headers = vec![("authorization", auth.as_str())];
        headers.extend(pin.iter().map(|p| ("x-worker-id", p.as_str())));
        let r = self.0.post(path, &headers, body);
        assert_eq!(r.status, 200, "{path} as tenant {t}: {}", r.text());
        r.json()
    }

    /// Blocks of `body` kvroute's index holds on `worker` for tenant `t`.
    fn overlap(&self, t: usize, body: &Value, worker: u64) -> u64 {
        let p = self.post(t, "/route/preview", body, None);
        let row = p["explanation"].as_array().and_then(|rows| rows.iter().find(|r| r["worker"] == worker)).cloned();
        row.and_then(|r| r["overlap"]["device"].as_u64()).unwrap_or_else(|| panic!("no overlap in {p}"))
    }

    /// vLLM's cache hit, in tokens, for `body` sent as tenant `t` to `worker`.
    fn cached(&self, t: usize, body: &Value, worker: u64) -> u64 {
        let served = self.post(t, "/v1/completions", body, Some(worker));
        served["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
    }

    /// Waits until the index holds `want` blocks of `body` on `worker` for tenant `t`.
    fn wait_overlap(&self, t: usize, body: &Value, worker: u64, want: u64) -> bool {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            if self.overlap(t, body, worker) == want {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

fn salted(ids: &[u32], salt: Option<&str>) -> Value {
    let mut b = token_prompt(MODEL, ids);
    if let Some(s) = salt {
        b["cache_salt"] = json!(s);
    }
    b
}

/// Tenant `a` stores the first prompt of `stored(k)` on `worker` (with fresh prompts,
/// `k` = 1, 2, ..., until kvroute's own subscription shows it, as the fleet's warm-up
/// does); then each probe, `(what, tenant, the follow-up rather than the stored prompt,
/// blocks)`, finds exactly that many blocks in the index and on the engine.
#[track_caller]
fn check(g: &Gateway, worker: u64, stored: impl Fn(u64) -> (Value, Value), probes: &[(&str, usize, bool, u64)]) {
    let mut tries = 0;
    let (store, follow_up) = loop {
        tries += 1;
        let (store, follow_up) = stored(tries);
        g.post(0, "/v1/completions", &store, Some(worker));
        let want = blocks(store["prompt"].as_array().map_or(0, Vec::len) as u64);
        if g.wait_overlap(0, &store, worker, want) {
            break (store, follow_up);
        }
        assert!(tries < 5, "tenant a's blocks never reached the tenants' router's index");
    };
    for &(what, t, follow, want) in probes {
        let body = if follow { &follow_up } else { &store };
        let predicted = g.overlap(t, body, worker);
        assert_eq!(predicted, want, "{what}: kvroute's predicted overlap on worker {worker}");
        let hit = g.cached(t, body, worker);
        assert_eq!(hit, want * BLOCK_TOKENS as u64, "{what}: vLLM's cache hit on worker {worker}");
    }
}

#[test]
fn tenants_never_share_a_cached_block_and_each_keeps_its_own() {
    let Some(f) = fleet() else { return };
    let dir = crate::procs::scratch_dir("kvroute-real-vllm-tenants");
    let g = Gateway(Kvroute::start_with(&build_binary(), &dir, "kvroute-tenants", |port| {
        tenants_config(&dir, &f.env.model, port, &f.engines)
    }));
    // 200 tokens: 3 full blocks. The follow-up's first 200 tokens are the same
    // (`tokens` is one sequence per seed).
    let prompt = |seed: u64, salt: Option<&'static str>| {
        move |k: u64| (salted(&tokens(seed * 10 + k, 200), salt), salted(&tokens(seed * 10 + k, 300), salt))
    };
    check(&g, 1, prompt(30, None), &[("tenant b's copy of a's prompt", 1, false, 0), ("a's follow-up", 0, true, 3)]);
    // Both name the same client salt: each is combined with its tenant's.
    check(
        &g,
        2,
        prompt(31, Some("team-x")),
        &[("b with a's client salt", 1, false, 0), ("a's follow-up with its client salt", 0, true, 3)],
    );
}
