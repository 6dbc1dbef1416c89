//! The real `kvroute` binary, `kvroute serve --config FILE`, in front of the engines.
//!
//! Cargo gives a binary's path (`CARGO_BIN_EXE_*`) only to its own crate's tests, so
//! the suite asks the cargo that built it to build (or confirm) `kvroute` in the same
//! target directory and profile, then runs it from there.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::engine::{Vllm, LORA, MODEL};
use crate::fleet::Preview;
use crate::http;
use crate::procs::{free_port, Proc};

/// A running kvroute.
pub struct Kvroute {
    pub port: u16,
    log: PathBuf,
    _proc: Proc,
}

/// The `kvroute` binary in this test binary's target directory and profile; returns
/// its path. Built there (a no-op for cargo when it is up to date) unless
/// `KVROUTE_BIN_BUILT=1` says the cargo run that built this test built it too, as the
/// test command's `cargo test --workspace` does.
pub fn build_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // <target>/<profile>/deps/real_vllm-<hash>
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>");
    if std::env::var_os("KVROUTE_BIN_BUILT").is_some_and(|v| v == "1") {
        let bin = profile_dir.join("kvroute");
        assert!(bin.is_file(), "KVROUTE_BIN_BUILT=1, but {} is not a file", bin.display());
        return bin;
    }
    let target_dir = profile_dir.parent().expect("target dir");
    let profile = profile_dir.file_name().and_then(|s| s.to_str()).expect("profile name");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let mut cmd = Command::new(env!("CARGO"));
    // What cargo set for this test binary would look like a changed environment to the
    // build and relink kvroute for nothing.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        let kept = matches!(&*k, "CARGO_HOME" | "CARGO_TARGET_DIR" | "CARGO_INCREMENTAL");
        if k.starts_with("CARGO_") && !kept || k == "OUT_DIR" {
            cmd.env_remove(&*k);
        }
    }
    cmd.args(["build", "--quiet", "-p", "kvroute", "--bin", "kvroute", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir);
    match profile {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    let status = cmd.status().expect("cargo runs");
    assert!(status.success(), "cargo build -p kvroute failed");
    let bin = profile_dir.join("kvroute");
    assert!(bin.exists(), "{} was not built", bin.display());
    bin
}

/// The TOML config: one model with the generated tokenizer and its LoRA adapter, kv
/// mode, every engine with its event and replay sockets, loopback trusted.
pub fn config(tokenizer: &Path, port: u16, engines: &[Vllm]) -> String {
    let mut s = format!(
        r#"listen = "127.0.0.1:{port}"
seed = 7

[trust]
cidrs = ["127.0.0.0/8"]

[health_check]
interval_ms = 500
timeout_ms = 1000

[ejection]
consecutive_failures = 2
base_ms = 500
max_ms = 2000

[router]
mode = "kv"
block_size = 64
approximate = false
# The engines queue internally; these tests compare placement, not shedding.
prefill_tokens_frac_of_batch = 0.0
decode_blocks_frac_of_kv = 0.0

[[models]]
name = "{MODEL}"
tokenizer = "{}"
lora_adapters = ["{LORA}"]
"#,
        tokenizer.display()
    );
    for e in engines {
        s.push_str(&format!(
            r#"
[[workers]]
id = {}
url = "{}"
model = "{MODEL}"
kv_events = "tcp://127.0.0.1:{}"
kv_events_replay = "tcp://127.0.0.1:{}"
"#,
            e.id,
            e.url(),
            e.events_port,
            e.replay_port
        ));
    }
    s
}

impl Kvroute {
    /// Writes the config into `dir`, starts `bin serve`, and waits until it answers and
    /// every KV-event stream is connected.
    pub fn start(bin: &Path, dir: &Path, tokenizer: &Path, engines: &[Vllm]) -> Kvroute {
        Self::start_with(bin, dir, "kvroute", |port| config(tokenizer, port, engines))
    }

    /// As [`Self::start`], with the config `config(port)` written as `<name>.toml`.
    pub fn start_with(bin: &Path, dir: &Path, name: &str, config: impl FnOnce(u16) -> String) -> Kvroute {
        let port = free_port();
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(&cfg, config(port)).expect("config written");
        let log = dir.join(format!("{name}.log"));
        let args = ["serve".to_string(), "--config".to_string(), cfg.display().to_string()];
        let envs = [("RUST_LOG", "info".to_string())];
        let proc = Proc::spawn("kvroute", bin, &args, &envs, &log);
        let k = Kvroute { port, log, _proc: proc };
        k.wait(Duration::from_secs(60), "kvroute follows every engine's KV events", |k| k.streams_connected());
        k
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr())
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Polls `ok` every 50 ms until it holds; panics naming `what` after `limit`.
    #[track_caller]
    pub fn wait(&self, limit: Duration, what: &str, mut ok: impl FnMut(&Kvroute) -> bool) {
        let t0 = Instant::now();
        while !ok(self) {
            assert!(
                t0.elapsed() < limit,
                "timed out after {limit:?} waiting until {what}; kvroute's log ends:\n{}",
                self.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `POST path` with `headers`; `Err` when the connection fails.
    pub fn try_post(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> std::io::Result<http::Response> {
        http::request(self.addr(), "POST", path, headers, Some(body), Duration::from_secs(120))
    }

    /// `POST path`, panicking on a connection failure.
    #[track_caller]
    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> http::Response {
        self.try_post(path, headers, body).unwrap_or_else(|e| panic!("POST {path} to kvroute: {e}"))
    }

    /// `POST /route/preview` for `body`: the decision it would make now.
    #[track_caller]
    pub fn preview(&self, body: &Value) -> Preview {
        let r = self.post("/route/preview", &[], body);
        assert_eq!(r.status, 200, "preview: {}", r.text());
        Preview(r.json())
    }

    /// Every worker's `tokenizer_check` from `/workers` (`null` before its first check).
    pub fn tokenizer_checks(&self) -> Vec<Value> {
        let Ok(r) = http::request(self.addr(), "GET", "/workers", &[], None, Duration::from_secs(2)) else {
            return Vec::new();
        };
        let listed: Value = serde_json::from_slice(&r.body).unwrap_or_default();
        listed["workers"].as_array().into_iter().flatten().map(|w| w["tokenizer_check"].clone()).collect()
    }

    /// Whether every KV-event stream `/workers` lists is connected (and there is one).
    pub fn streams_connected(&self) -> bool {
        let Ok(r) = http::request(self.addr(), "GET", "/workers", &[], None, Duration::from_secs(2)) else {
            return false;
        };
        let Ok(listed) = serde_json::from_slice::<Value>(&r.body) else { return false };
        let streams: Vec<&Value> = listed["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|w| w["kv_events"]["streams"].as_array())
            .flatten()
            .collect();
        !streams.is_empty() && streams.iter().all(|s| s["connected"] == true)
    }
}
