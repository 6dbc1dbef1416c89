//! One vLLM CPU server on the generated vision-language model, and its KV events read
//! through kvroute-events.
//!
//! The model comes from `scripts/real-engine/gen_vlm.py` (a no-op when present), into
//! `KVROUTE_VLLM_VLM_MODEL` or else a `vlm` folder beside `KVROUTE_VLLM_MODEL`. The
//! events are taken off the socket by `zmq_frames.py` (pyzmq, in the engine's venv),
//! which prints each message's frames undecoded; the frames then go through
//! kvroute-events' own frame parser, decoder and translator, as kvroute's ingestion does.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute_events::decode::{decode_batch, Batch, DecodeConfig, EventRef, ExtraKey};
use kvroute_events::frame::parse_live;
use kvroute_events::translate::{TranslateConfig, Translator};
use kvroute_events::RouterEvent;
use router_core::{BlockHash, BlockSize};
use serde_json::Value;

use crate::http;
use crate::procs::{free_port, Proc};

/// The served model name.
pub const VLM: &str = "kvroute-vlm";
/// Tokens per KV block (a multiple of 32, as the CPU build needs; smaller than the
/// image's 64 tokens so an image spans blocks).
pub const VLM_BLOCK_TOKENS: u32 = 32;
/// vLLM's flags besides the ports, the model, its events and its image limit: as
/// `serve.sh` gives the text model, without LoRA.
const FLAGS: &str = "-m vllm.entrypoints.openai.api_server --host 127.0.0.1 \
    --dtype float32 --enable-prefix-caching --enforce-eager --max-model-len 1024 --max-num-seqs 4 \
    --enable-prompt-tokens-details";
/// Longest wait for `/health`, as for the text servers.
const START_TIMEOUT: Duration = Duration::from_secs(900);

/// The generated model of `family` (`gen_vlm.py --family`), made or found present: in
/// `KVROUTE_VLLM_VLM_DIR/<family>`, else in `vlm/<family>` beside `KVROUTE_VLLM_MODEL`.
pub fn vlm_model(python: &Path, family: &str) -> PathBuf {
    let root = match std::env::var_os("KVROUTE_VLLM_VLM_DIR").filter(|v| !v.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => {
            let text = std::env::var_os("KVROUTE_VLLM_MODEL").expect("KVROUTE_VLLM_MODEL is set");
            PathBuf::from(text).parent().expect("the model folder has a parent").join("vlm")
        }
    };
    let dir = root.join(family);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/real-engine/gen_vlm.py");
    let out = std::process::Command::new(python)
        .arg(&script)
        .args(["--family", family, "--out"])
        .arg(&dir)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run gen_vlm.py");
    assert!(out.status.success(), "gen_vlm.py --family {family} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    dir
}

/// A running VLM server and the subscriber to its events.
pub struct VlmServer {
    pub http_port: u16,
    /// Its KV-event PUB and replay ports (a router subscribes beside the test's own).
    pub events_port: u16,
    pub replay_port: u16,
    log: PathBuf,
    frames: PathBuf,
    proc: Proc,
    _sub: Proc,
}

impl VlmServer {
    /// Starts the server and the subscriber (which connects before the server binds,
    /// and ZeroMQ retries, so the first batch is not missed); waits for `/health`.
    pub fn start(python: &Path, model: &Path, dir: &Path, name: &str) -> VlmServer {
        let (http_port, events_port, replay_port) = (free_port(), free_port(), free_port());
        let events = format!(
            r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{events_port}", "replay_endpoint": "tcp://*:{replay_port}", "topic": ""}}"#
        );
        let mut args: Vec<String> = FLAGS.split_whitespace().map(String::from).collect();
        let flags = [
            ("--port", http_port.to_string()),
            ("--block-size", VLM_BLOCK_TOKENS.to_string()),
            ("--served-model-name", VLM.to_string()),
        ];
        for (flag, value) in flags {
            args.extend([flag.to_string(), value]);
        }
        args.extend(["--model".into(), model.display().to_string(), "--kv-events-config".into(), events]);
        args.extend(["--limit-mm-per-prompt".into(), r#"{"image": 2}"#.into()]);
        let envs = [
            ("VLLM_TARGET_DEVICE", "cpu"),
            ("VLLM_CPU_KVCACHE_SPACE", "1"),
            ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            ("OMP_NUM_THREADS", "1"),
            ("HF_HUB_OFFLINE", "1"),
            ("TRANSFORMERS_OFFLINE", "1"),
            ("VLLM_NO_USAGE_STATS", "1"),
            ("DO_NOT_TRACK", "1"),
            ("PYTHONHASHSEED", "0"),
        ]
        .map(|(k, v)| (k, v.to_string()));
        let log = dir.join(format!("vllm-{name}.log"));
        let frames = dir.join(format!("{name}-events.txt"));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("real_vllm/zmq_frames.py");
        let sub_args = [script.display().to_string(), format!("tcp://127.0.0.1:{events_port}")];
        let sub = Proc::spawn("zmq_frames.py", python, &sub_args, &[], &frames);
        let proc = Proc::spawn(name, python, &args, &envs, &log);
        let mut s = VlmServer { http_port, events_port, replay_port, log, frames, proc, _sub: sub };
        s.wait_ready();
        s
    }

    fn wait_ready(&mut self) {
        let t0 = Instant::now();
        loop {
            if self.get("/health").is_some_and(|r| r.status == 200) {
                eprintln!("real_vllm: {} is healthy after {:?}", self.log.display(), t0.elapsed());
                return;
            }
            let alive = self.proc.alive();
            if !alive || t0.elapsed() > START_TIMEOUT {
                let text = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                panic!("{} did not start ({:?}); its log ends:\n{}", self.log.display(), t0.elapsed(), tail.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn get(&self, path: &str) -> Option<http::Response> {
        let addr = ([127, 0, 0, 1], self.http_port).into();
        http::request(addr, "GET", path, &[], None, Duration::from_secs(10)).ok()
    }

    /// POSTs `body` to `path`; panics unless 200.
    #[track_caller]
    pub fn post(&self, path: &str, body: &Value) -> Value {
        let addr = ([127, 0, 0, 1], self.http_port).into();
        let r = http::request(addr, "POST", path, &[], Some(body), Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        assert_eq!(r.status, 200, "POST {path}: {}", r.text());
        r.json()
    }

    /// The sum of the Prometheus samples named `name`.
    pub fn metric(&self, name: &str) -> f64 {
        let r = self.get("/metrics").expect("GET /metrics");
        crate::engine::sum_samples(&r.text(), name)
    }

    /// The subscriber's whole lines so far (after its `ready`): a long line reaches the
    /// file in several writes, so a last line without its newline is left for later.
    fn frame_lines(&self) -> Vec<String> {
        let text = std::fs::read_to_string(&self.frames).unwrap_or_default();
        let whole = text.rfind('\n').map_or("", |end| &text[..end]);
        whole.lines().skip_while(|l| *l != "ready").skip(1).map(String::from).collect()
    }
}

/// One stored block as the engine announced it, in router terms and raw.
#[derive(Clone, Debug)]
pub struct StoredBlock {
    pub hash: BlockHash,
    /// The block's media keys as published: (identifier, offset).
    pub media: Vec<(String, i64)>,
    /// The block's string keys (a cache salt).
    pub strings: Vec<String>,
}

/// The engine's events so far, decoded and translated in order.
pub struct EventLog {
    translator: Translator,
    lines_read: usize,
    pub stored: Vec<StoredBlock>,
}

impl EventLog {
    pub fn new() -> EventLog {
        let block_size = BlockSize::new(VLM_BLOCK_TOKENS).expect("block size");
        let cfg = TranslateConfig { block_size, ..TranslateConfig::default() };
        EventLog { translator: Translator::new(cfg), lines_read: 0, stored: Vec::new() }
    }

    /// Reads what the subscriber printed since the last call.
    pub fn poll(&mut self, server: &VlmServer) {
        let lines = server.frame_lines();
        for line in &lines[self.lines_read..] {
            // The subscriber's stderr shares the file; its lines are not frames.
            if line.bytes().all(|b| b == b' ' || b.is_ascii_hexdigit()) {
                self.take(line);
            } else {
                eprintln!("real_vllm: zmq_frames.py: {line}");
            }
        }
        self.lines_read = lines.len();
    }

    fn take(&mut self, line: &str) {
        let frames: Vec<Bytes> = line.split(' ').map(|h| Bytes::from(unhex(h))).collect();
        let (_seq, at) = parse_live(&frames).expect("a live frame");
        let mut batch = Batch::new();
        decode_batch(&frames[at], &DecodeConfig::default(), &mut batch).expect("the batch decodes");
        for ev in batch.events() {
            let mut raw = Vec::new();
            if let EventRef::Stored(s) = ev {
                let keys = s.extra_keys;
                for b in 0..s.block_hashes.len() {
                    let (mut media, mut strings) = (Vec::new(), Vec::new());
                    for k in keys.iter().flat_map(|k| k.block(b)) {
                        match k {
                            ExtraKey::Media { identifier, offset_tokens } => {
                                media.push((identifier.to_string(), offset_tokens))
                            }
                            ExtraKey::Str(s) => strings.push(s.to_string()),
                            other => panic!("an extra key kvroute cannot reproduce: {other:?}"),
                        }
                    }
                    raw.push((media, strings));
                }
            }
            let mut out = Vec::new();
            self.translator.translate(ev, &mut out).expect("the event translates");
            let mut raw = raw.into_iter();
            for r in out {
                if let RouterEvent::Stored { blocks, .. } = r {
                    for hash in blocks {
                        let (media, strings) = raw.next().unwrap_or_default();
                        self.stored.push(StoredBlock { hash, media, strings });
                    }
                }
            }
        }
    }

    /// Polls until at least `n` blocks were stored in all, for up to 20 s.
    #[track_caller]
    pub fn wait_stored(&mut self, server: &VlmServer, n: usize) {
        let t0 = Instant::now();
        while self.stored.len() < n {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "{} blocks stored, {n} expected, after 20 s",
                self.stored.len()
            );
            std::thread::sleep(Duration::from_millis(50));
            self.poll(server);
        }
    }

    /// Leading blocks of `hashes` the engine holds (by the events): kvroute's
    /// predicted hit, in blocks.
    pub fn overlap(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.stored.iter().any(|s| s.hash == **h)).count()
    }
}

fn unhex(h: &str) -> Vec<u8> {
    (0..h.len() / 2).map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).expect("hex")).collect()
}
