//! One simulated worker: a `kvroute_sim` engine, the token ledger its `BlockStored`
//! events need, and a publisher that numbers batches the way vLLM's ZeroMQ publisher
//! does and keeps a bounded replay buffer.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use kvroute_events::encode::{encode_batch, WireEvent, WireForm, WireHash};
use kvroute_sim::prompt::OUTPUT_TOKEN_ID_BASE;
use kvroute_sim::{Engine, EngineConfig, EngineOutput, EngineRequest, KvEvent, Prompt};
use router_core::{hash_tokens, BlockHash, BlockSize, HashSeed, SeqHash};

/// A published batch: its sequence number and its three frames.
#[derive(Clone, Debug)]
pub struct Message {
    pub seq: u64,
    pub frames: [Bytes; 3],
}

/// The publisher side of one incarnation of a worker.
pub struct Publisher {
    next_seq: u64,
    /// The last `buffer_max` batches, for replay requests.
    buffer: VecDeque<Message>,
    buffer_max: usize,
    /// Every block the engine's events announced as resident (the router's best case).
    pub announced: BTreeSet<SeqHash>,
}

impl Publisher {
    fn new(buffer_max: usize) -> Self {
        Publisher { next_seq: 0, buffer: VecDeque::new(), buffer_max, announced: BTreeSet::new() }
    }

    /// Numbers and buffers one encoded batch.
    pub fn publish(&mut self, payload: Vec<u8>) -> Message {
        let seq = self.next_seq;
        self.next_seq += 1;
        let frames = [Bytes::from_static(b"kv@soak"), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload)];
        let msg = Message { seq, frames };
        if self.buffer.len() == self.buffer_max {
            self.buffer.pop_front();
        }
        self.buffer.push_back(msg.clone());
        msg
    }

    /// Buffered batches from `from` on, as replay replies (`[empty, seq, payload]`),
    /// then the end marker. A buffer that no longer reaches `from` answers with what
    /// it has, which the sequencer must see as a skip.
    pub fn replay(&self, from: u64) -> Vec<Vec<Bytes>> {
        let mut out: Vec<Vec<Bytes>> = self
            .buffer
            .iter()
            .filter(|m| m.seq >= from)
            .map(|m| vec![Bytes::new(), m.frames[1].clone(), m.frames[2].clone()])
            .collect();
        out.push(vec![Bytes::new(), Bytes::from_static(&kvroute_events::frame::END_SEQ), Bytes::new()]);
        out
    }

    /// The last sequence number published, if any.
    pub fn last_seq(&self) -> Option<u64> {
        self.next_seq.checked_sub(1)
    }
}

/// Which tokens each block hash covers, so stored events can carry `token_ids`.
/// Entries are counted by the running requests that registered them.
#[derive(Default)]
struct Ledger {
    map: BTreeMap<SeqHash, (Arc<[u32]>, usize, u32)>,
}

/// One worker: engine, ledger and publisher. Restarting replaces all three.
pub struct SimWorker {
    pub engine: Engine,
    pub publisher: Publisher,
    ledger: Ledger,
    /// Per running request, the blocks it registered in the ledger.
    registered: BTreeMap<u64, Vec<SeqHash>>,
    /// Mirrors the engine's output-token counter (see `generated_token_id`).
    next_out_token: u32,
    bs: BlockSize,
    /// Outputs of the last `advance`, reused.
    pub outputs: Vec<EngineOutput>,
}

impl SimWorker {
    pub fn new(cfg: EngineConfig, index: u32, buffer_max: usize) -> Self {
        let bs = BlockSize::new(cfg.block_size).expect("the soak uses a valid block size");
        SimWorker {
            engine: Engine::new(cfg, index).expect("the soak's engine config is valid"),
            publisher: Publisher::new(buffer_max),
            ledger: Ledger::default(),
            registered: BTreeMap::new(),
            next_out_token: 0,
            bs,
            outputs: Vec::new(),
        }
    }

    /// Submits a request and registers the tokens it may ever hold.
    pub fn submit(&mut self, now_ms: f64, id: u64, tokens: &[u32], output_len: u32) -> bool {
        let prompt = Prompt::from_tokens(tokens, self.bs, HashSeed::DEFAULT).expect("soak prompts are valid");
        let req = EngineRequest { id, prompt, output_len, generated_before: 0 };
        if self.engine.submit(now_ms, req).is_err() {
            return false;
        }
        let target = output_len.max(1);
        let out_base = self.next_out_token;
        self.next_out_token = self.next_out_token.wrapping_add(target);
        let all: Arc<[u32]> =
            tokens.iter().copied().chain((0..target).map(|k| generated_token_id(out_base, k))).collect();
        let mut blocks = Vec::new();
        hash_tokens(&all, self.bs, HashSeed::DEFAULT, &[], &mut blocks);
        for (i, b) in blocks.iter().enumerate() {
            self.ledger.map.entry(b.seq).or_insert_with(|| (all.clone(), i, 0)).2 += 1;
        }
        self.registered.insert(id, blocks.iter().map(|b| b.seq).collect());
        true
    }

    /// The engine finished `id`: its ledger entries may go.
    pub fn release(&mut self, id: u64) {
        for h in self.registered.remove(&id).unwrap_or_default() {
            if let Some(e) = self.ledger.map.get_mut(&h) {
                e.2 -= 1;
                if e.2 == 0 {
                    self.ledger.map.remove(&h);
                }
            }
        }
    }

    /// Encodes the KV events among `outputs` as one batch (`None` if there are none)
    /// and records what they announce. Must run before the outputs' `Finished` entries
    /// are released.
    pub fn encode_events(&mut self, ts_s: f64) -> Option<Vec<u8>> {
        let bs = self.bs.tokens();
        let mut owned: Vec<(Vec<WireHash<'static>>, Option<WireHash<'static>>, Vec<u32>)> = Vec::new();
        let mut kinds = Vec::new();
        for out in &self.outputs {
            let EngineOutput::Kv { event, .. } = out else { continue };
            match event {
                KvEvent::Stored { parent, blocks } => {
                    let mut tokens = Vec::with_capacity(blocks.len() * bs as usize);
                    for b in blocks {
                        self.tokens_of(*b, &mut tokens);
                        self.publisher.announced.insert(b.seq);
                    }
                    let hashes = blocks.iter().map(|b| wire(b.seq)).collect();
                    owned.push((hashes, parent.map(wire), tokens));
                    kinds.push(true);
                }
                KvEvent::Removed { blocks } => {
                    for h in blocks {
                        self.publisher.announced.remove(h);
                    }
                    owned.push((blocks.iter().map(|h| wire(*h)).collect(), None, Vec::new()));
                    kinds.push(false);
                }
            }
        }
        if owned.is_empty() {
            return None;
        }
        let events: Vec<WireEvent<'_>> = owned
            .iter()
            .zip(&kinds)
            .map(|((hashes, parent, tokens), &stored)| {
                if stored {
                    WireEvent::Stored {
                        block_hashes: hashes,
                        parent: *parent,
                        token_ids: tokens,
                        block_size: bs,
                        medium: Some("GPU"),
                        lora_name: None,
                    }
                } else {
                    WireEvent::Removed { block_hashes: hashes, medium: Some("GPU") }
                }
            })
            .collect();
        Some(encode_batch(ts_s, &events, None, WireForm::Map))
    }

    fn tokens_of(&self, b: BlockHash, out: &mut Vec<u32>) {
        let bs = self.bs.tokens() as usize;
        let (tokens, i, _) = self.ledger.map.get(&b.seq).expect("a stored block belongs to a running request");
        out.extend_from_slice(&tokens[i * bs..(i + 1) * bs]);
    }

    /// Blocks the ledger knows (for the final check that nothing leaks).
    pub fn ledger_len(&self) -> usize {
        self.ledger.map.len()
    }
}

/// The id the engine gives a request's `k`-th generated token (its output range starts
/// at `out_base`); mirrors `kvroute_sim`'s rule, and a drift fails `tokens_of`.
fn generated_token_id(out_base: u32, k: u32) -> u32 {
    OUTPUT_TOKEN_ID_BASE | (out_base.wrapping_add(k) & (OUTPUT_TOKEN_ID_BASE - 1))
}

/// The engine's sequence hash as the wire's engine block hash (what the sim worker
/// publishes; the router recomputes its own from the tokens).
fn wire(h: SeqHash) -> WireHash<'static> {
    WireHash::Int(i128::from(h.0))
}
