//! Shared test kit: a set-model sink, a simulated engine that emits valid event
//! streams and knows what the router should end up holding, and the Python helpers.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kvroute_events::encode::{encode_batch, WireEvent, WireForm, WireHash};
use kvroute_events::{EventSink, RouterEvent};
use router_core::{seq_hashes, BlockSize, HashSeed, SeqHash, Tier, WorkerKey};
use serde_json::{json, Value};

/// Blocks per worker as a plain set model: seq hash → tiers holding it.
pub type Blocks = BTreeMap<SeqHash, BTreeSet<Tier>>;

/// The reference sink.
#[derive(Clone, Default, Debug, PartialEq)]
pub struct ModelSink {
    pub workers: BTreeMap<WorkerKey, Blocks>,
    pub untrusted: BTreeSet<WorkerKey>,
}

impl ModelSink {
    pub fn blocks(&self, key: WorkerKey) -> Blocks {
        self.workers.get(&key).cloned().unwrap_or_default()
    }
}

impl EventSink for ModelSink {
    fn apply(&mut self, key: WorkerKey, ev: &RouterEvent) {
        let w = self.workers.entry(key).or_default();
        match ev {
            RouterEvent::Stored { blocks, tier, .. } => {
                for b in blocks {
                    w.entry(b.seq).or_default().insert(*tier);
                }
            }
            RouterEvent::Removed { blocks, tier } => {
                for s in blocks {
                    if let Some(t) = w.get_mut(s) {
                        t.remove(tier);
                        if t.is_empty() {
                            w.remove(s);
                        }
                    }
                }
            }
            RouterEvent::Cleared => w.clear(),
        }
    }
    fn clear_worker(&mut self, key: WorkerKey) {
        self.workers.remove(&key);
    }
    fn set_trusted(&mut self, key: WorkerKey, trusted: bool) {
        if trusted {
            self.untrusted.remove(&key);
        } else {
            self.untrusted.insert(key);
        }
    }
}

/// One simulated engine event (int hashes).
#[derive(Clone, Debug)]
pub enum SimEvent {
    Stored { hashes: Vec<i128>, parent: Option<i128>, tokens: Vec<u32>, medium: &'static str },
    Removed { hashes: Vec<i128>, medium: &'static str },
    Cleared,
}

impl SimEvent {
    pub fn json(&self, block_size: u32) -> Value {
        match self {
            SimEvent::Stored { hashes, parent, tokens, medium } => json!({
                "type": "BlockStored", "block_hashes": hashes.iter().map(|h| *h as i64).collect::<Vec<_>>(),
                "parent_block_hash": parent.map(|p| p as i64), "token_ids": tokens,
                "block_size": block_size, "medium": medium,
            }),
            SimEvent::Removed { hashes, medium } => json!({
                "type": "BlockRemoved", "block_hashes": hashes.iter().map(|h| *h as i64).collect::<Vec<_>>(),
                "medium": medium,
            }),
            SimEvent::Cleared => json!({"type": "AllBlocksCleared"}),
        }
    }
}

/// Encodes simulated events as one batch.
pub fn encode_sim(evs: &[SimEvent], block_size: u32, ts: f64, form: WireForm) -> Vec<u8> {
    let hashes: Vec<Vec<WireHash<'static>>> = evs
        .iter()
        .map(|e| match e {
            SimEvent::Stored { hashes, .. } | SimEvent::Removed { hashes, .. } => {
                hashes.iter().map(|h| WireHash::Int(*h)).collect()
            }
            SimEvent::Cleared => Vec::new(),
        })
        .collect();
    let wires: Vec<WireEvent<'_>> = evs
        .iter()
        .zip(&hashes)
        .map(|(e, hs)| match e {
            SimEvent::Stored { parent, tokens, medium, .. } => WireEvent::Stored {
                block_hashes: hs,
                parent: parent.map(WireHash::Int),
                token_ids: tokens,
                block_size,
                medium: Some(medium),
                lora_name: None,
            },
            SimEvent::Removed { medium, .. } => WireEvent::Removed { block_hashes: hs, medium: Some(medium) },
            SimEvent::Cleared => WireEvent::Cleared,
        })
        .collect();
    encode_batch(ts, &wires, None, form)
}

struct SimBlock {
    parent: Option<i128>,
    tokens: Vec<u32>,
    prefix: Vec<u32>,
    tiers: BTreeSet<Tier>,
}

/// A simulated engine emitting only valid streams.
pub struct Engine {
    state: u64,
    next_hash: i128,
    pub block_size: u32,
    blocks: BTreeMap<i128, SimBlock>,
}

fn medium(t: Tier) -> &'static str {
    match t {
        Tier::Device => "GPU",
        Tier::Host => "CPU",
        Tier::Disk => "STORAGE",
    }
}

impl Engine {
    pub fn new(seed: u64, block_size: u32) -> Self {
        Engine { state: seed, next_hash: 1_000, block_size, blocks: BTreeMap::new() }
    }

    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick(&mut self) -> Option<i128> {
        let n = self.blocks.len();
        if n == 0 {
            return None;
        }
        let i = self.below(n);
        self.blocks.keys().nth(i).copied()
    }

    /// One batch of one to three events.
    pub fn batch(&mut self) -> Vec<SimEvent> {
        let n = 1 + self.below(3);
        (0..n).map(|_| self.event()).collect()
    }

    fn event(&mut self) -> SimEvent {
        match self.below(20) {
            0 => {
                self.blocks.clear();
                SimEvent::Cleared
            }
            1..=4 if !self.blocks.is_empty() => self.remove(),
            5..=6 if !self.blocks.is_empty() => self.offload(),
            _ => self.store(),
        }
    }

    fn store(&mut self) -> SimEvent {
        let parent = if self.below(3) == 0 { None } else { self.pick() };
        let mut prefix = parent.map(|p| self.blocks[&p].prefix.clone()).unwrap_or_default();
        let (n, bs) = (1 + self.below(4), self.block_size as usize);
        let tokens: Vec<u32> = (0..n * bs).map(|_| (self.next() % 50_000) as u32).collect();
        let mut hashes = Vec::new();
        let mut prev = parent;
        for chunk in tokens.chunks(bs) {
            prefix.extend_from_slice(chunk);
            let h = self.next_hash;
            self.next_hash += 1;
            let b =
                SimBlock { parent: prev, tokens: chunk.to_vec(), prefix: prefix.clone(), tiers: [Tier::Device].into() };
            self.blocks.insert(h, b);
            hashes.push(h);
            prev = Some(h);
        }
        SimEvent::Stored { hashes, parent, tokens, medium: "GPU" }
    }

    /// Copies a block whose parent is known to another tier (offloading).
    fn offload(&mut self) -> SimEvent {
        let h = self.pick().unwrap_or(0);
        let tier = [Tier::Host, Tier::Disk][self.below(2)];
        let b = &self.blocks[&h];
        let parent_ok = b.parent.is_none_or(|p| self.blocks.contains_key(&p));
        if !parent_ok {
            return self.store();
        }
        let (parent, tokens) = (b.parent, b.tokens.clone());
        self.blocks.get_mut(&h).map(|b| b.tiers.insert(tier));
        SimEvent::Stored { hashes: vec![h], parent, tokens, medium: medium(tier) }
    }

    fn remove(&mut self) -> SimEvent {
        let h = self.pick().unwrap_or(0);
        let tiers: Vec<Tier> = self.blocks[&h].tiers.iter().copied().collect();
        let tier = tiers[self.below(tiers.len())];
        let b = self.blocks.get_mut(&h).expect("picked");
        b.tiers.remove(&tier);
        if b.tiers.is_empty() {
            self.blocks.remove(&h);
        }
        SimEvent::Removed { hashes: vec![h], medium: medium(tier) }
    }

    /// A restart: the engine comes back with an empty cache.
    pub fn restart(&mut self) {
        self.blocks.clear();
    }

    /// What the router should hold for this engine.
    pub fn expected(&self) -> Blocks {
        let bs = BlockSize::new(self.block_size).expect("valid block size");
        self.blocks
            .values()
            .map(|b| (*seq_hashes(&b.prefix, bs, HashSeed::DEFAULT).last().expect("one block"), b.tiers.clone()))
            .collect()
    }
}

/// This crate's folder.
pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Fails with the install hint when python3 or its packages are missing.
pub fn python() -> Command {
    let ok = Command::new("python3").args(["-c", "import msgspec, zmq"]).status().map(|s| s.success()).unwrap_or(false);
    assert!(ok, "these tests need python3 with `pip install msgspec pyzmq`");
    let mut c = Command::new("python3");
    c.current_dir(crate_dir().join("tests/py"));
    c
}

/// The Python test publisher, driven over its stdin.
pub struct Publisher {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    pub pub_port: u16,
    pub replay_port: u16,
}

impl Publisher {
    pub fn start(replay_form: &str) -> Self {
        Publisher::start_at(replay_form, 0, 0)
    }

    /// Starts one bound to the given ports (0: a free one), as a restarted engine is.
    pub fn start_at(replay_form: &str, pub_port: u16, replay_port: u16) -> Self {
        let ports = [pub_port.to_string(), replay_port.to_string()];
        let mut child = python()
            .args(["publisher.py", "--replay-form", replay_form, "--pub-port", &ports[0], "--replay-port", &ports[1]])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start publisher.py");
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut p = Publisher { child, stdin, lines, pub_port: 0, replay_port: 0 };
        let ports = p.read();
        p.pub_port = ports["pub"].as_u64().expect("pub port") as u16;
        p.replay_port = ports["replay"].as_u64().expect("replay port") as u16;
        p
    }

    fn read(&mut self) -> Value {
        let line = self.lines.recv_timeout(Duration::from_secs(10)).expect("publisher answers within 10 s");
        serde_json::from_str(&line).expect("json line")
    }

    /// Sends one command and returns its answer.
    pub fn cmd(&mut self, v: Value) -> Value {
        writeln!(self.stdin, "{v}").expect("write command");
        self.stdin.flush().expect("flush");
        self.read()
    }
}

impl Publisher {
    /// Kills the process, as an engine dies: its sockets close at once.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.kill();
    }
}
