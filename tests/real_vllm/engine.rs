//! One real vLLM server on loopback, started through `scripts/real-engine/serve.sh`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::http;
use crate::procs::{free_port, Proc};

/// Where the generated engine lives, from the environment `install.sh` prints.
#[derive(Clone, Debug)]
pub struct EngineEnv {
    pub python: PathBuf,
    pub model: PathBuf,
}

/// The served model name (`--served-model-name`) and the LoRA adapter's.
pub const MODEL: &str = "kvroute-test";
pub const LORA: &str = "sql-lora";
/// Tokens per KV block, on both sides.
pub const BLOCK_TOKENS: usize = 64;
/// The servers' `--dtype` unless `KVROUTE_ENGINE_DTYPE` names another. On vLLM's CPU
/// build, bf16 gives a prefix prefilled in one pass other logits than the same prefix
/// decoded token by token, and the generated model's near-ties then pick other tokens;
/// float32 continues a greedy generation exactly (see `migrate.rs`), at about 4× the
/// prefill time.
pub const DTYPE_DEFAULT: &str = "float32";

/// Longest wait for a server to answer `/health` after a (re)start. One server starts
/// in about 40 s alone on 2 cores; two at once on a machine busy with other work
/// have taken over 7 minutes.
const START_TIMEOUT: Duration = Duration::from_secs(900);

/// A running (or killed) vLLM server.
pub struct Vllm {
    pub id: u64,
    pub http_port: u16,
    pub events_port: u16,
    pub replay_port: u16,
    extra_args: Vec<String>,
    env: EngineEnv,
    log: PathBuf,
    /// The log's length when the current process started.
    log_from: usize,
    proc: Option<Proc>,
    /// Whether it has answered `/health` once, so others may know its ports.
    served: bool,
}

/// Starts in a row that may find a port taken before one is given up. The ports lie
/// below the ephemeral range (see [`free_port`]), so only a program that binds them by
/// number can take one. A first start then takes fresh ports; a restart must keep its
/// own, which kvroute already knows.
const PORT_TAKEN_STARTS_MAX: u32 = 4;

impl Vllm {
    /// Starts server `id` (not waiting for it); `extra_args` go to vLLM.
    pub fn start(id: u64, env: &EngineEnv, dir: &Path, extra_args: &[&str]) -> Vllm {
        let mut v = Vllm {
            id,
            http_port: free_port(),
            events_port: free_port(),
            replay_port: free_port(),
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            env: env.clone(),
            log: dir.join(format!("vllm-{id}.log")),
            log_from: 0,
            proc: None,
            served: false,
        };
        v.spawn();
        v
    }

    fn spawn(&mut self) {
        self.log_from = std::fs::metadata(&self.log).map_or(0, |m| m.len() as usize);
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/real-engine/serve.sh");
        let mut args = vec![
            script.display().to_string(),
            self.http_port.to_string(),
            self.events_port.to_string(),
            self.replay_port.to_string(),
        ];
        args.extend(self.extra_args.iter().cloned());
        let envs = [
            ("KVROUTE_VLLM_PYTHON", self.env.python.display().to_string()),
            ("KVROUTE_VLLM_MODEL", self.env.model.display().to_string()),
            ("KVROUTE_ENGINE_DTYPE", dtype()),
        ];
        self.proc = Some(Proc::spawn(&format!("vllm-{}", self.id), Path::new("bash"), &args, &envs, &self.log));
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.http_port))
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr())
    }

    /// Waits until `/health` answers 200; panics with the log's tail if the server
    /// exits or takes longer than [`START_TIMEOUT`]. Returns how long it waited.
    pub fn wait_ready(&mut self) -> Duration {
        let t0 = Instant::now();
        let mut starts = 1;
        loop {
            if let Ok(r) = http::request(self.addr(), "GET", "/health", &[], None, Duration::from_secs(2)) {
                if r.status == 200 {
                    self.served = true;
                    return t0.elapsed();
                }
            }
            let alive = self.proc.as_mut().is_some_and(Proc::alive);
            if !alive && starts < PORT_TAKEN_STARTS_MAX && self.port_was_taken() {
                starts += 1;
                eprintln!("real_vllm: vLLM server {} found a port taken; starting it again", self.id);
                if !self.served {
                    (self.http_port, self.events_port, self.replay_port) = (free_port(), free_port(), free_port());
                }
                std::thread::sleep(Duration::from_secs(1));
                self.spawn();
                continue;
            }
            if !alive || t0.elapsed() > START_TIMEOUT {
                panic!(
                    "vLLM server {} {} after {:?}; its log ends:\n{}",
                    self.id,
                    if alive { "did not become healthy" } else { "exited" },
                    t0.elapsed(),
                    self.log_tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Whether the current process's log says one of its ports was in use.
    fn port_was_taken(&self) -> bool {
        let text = std::fs::read(&self.log).unwrap_or_default();
        let new = text.get(self.log_from..).unwrap_or_default();
        // ZeroMQ says "Address already in use", uvicorn "address already in use".
        String::from_utf8_lossy(new).to_lowercase().contains("address already in use")
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Starts it again on the same ports (not waiting).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The sum of the Prometheus samples named `name` (all label sets).
    pub fn metric(&self, name: &str) -> f64 {
        let r = http::request(self.addr(), "GET", "/metrics", &[], None, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("GET /metrics from vLLM {}: {e}", self.id));
        sum_samples(&r.text(), name)
    }
}

/// The servers' dtype: `KVROUTE_ENGINE_DTYPE`, or [`DTYPE_DEFAULT`].
pub fn dtype() -> String {
    std::env::var("KVROUTE_ENGINE_DTYPE").ok().filter(|d| !d.is_empty()).unwrap_or_else(|| DTYPE_DEFAULT.into())
}

/// Sums the samples of metric `name` in Prometheus text.
pub fn sum_samples(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
