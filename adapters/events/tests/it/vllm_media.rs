//! A `BlockStored` written by vLLM's own classes for an image request: a `Request`
//! with two images (one of them twice), a LoRA adapter and a cache salt, its extra
//! keys from `generate_block_hash_extra_keys` and `to_event_extra_keys`, encoded by
//! msgspec (`scripts/real-engine/media_check.py blocks`). The bytes committed in
//! `tests/vllm/` were written by vLLM 0.32; with the engine venv installed, the test
//! also asks the wheel afresh.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use kvroute_events::decode::{decode_batch, Batch, DecodeConfig};
use kvroute_events::translate::{TranslateConfig, Translator};
use kvroute_events::RouterEvent;
use router_core::{hash_tokens_with_media, BlockSize, HashSeed, MediaItem, MediaItems, SeqHash};
use serde_json::{json, Value};

use crate::support::crate_dir;

const BLOCK: u32 = 16;
const ITEMS: [(&str, u32, u32); 3] = [("A", 5, 20), ("B", 30, 6), ("A", 50, 12)];

fn tokens() -> Vec<u32> {
    (100..190).collect()
}

/// What the router computes for the request with `items`.
fn request(items: &[(&str, u32, u32)]) -> Vec<SeqHash> {
    let t = tokens();
    let list = items.iter().map(|&(id, off, len)| MediaItem::new(id.as_bytes(), off, len)).collect();
    let media = MediaItems::new(list, t.len(), 8).unwrap();
    let mut out = Vec::new();
    let seed = HashSeed::salted(Some("ad"), Some("tenant"));
    hash_tokens_with_media(&t, BlockSize::new(BLOCK).unwrap(), seed, &media, &mut out);
    out.into_iter().map(|b| b.seq).collect()
}

/// What the translator indexes from `payload`, and its counters (media, opaque).
fn indexed(payload: &[u8]) -> (Vec<SeqHash>, u64, u64) {
    let mut batch = Batch::new();
    decode_batch(payload, &DecodeConfig::default(), &mut batch).expect("vLLM's payload decodes");
    let mut t = Translator::new(TranslateConfig { block_size: BlockSize::new(BLOCK).unwrap(), ..Default::default() });
    let mut out = Vec::new();
    for ev in batch.events() {
        t.translate(ev, &mut out).expect("translates");
    }
    let seqs = out
        .iter()
        .flat_map(|e| match e {
            RouterEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.seq).collect(),
            _ => Vec::new(),
        })
        .collect();
    (seqs, t.stats().media_blocks, t.stats().opaque_blocks)
}

#[track_caller]
fn check(payload: &[u8]) {
    let want = request(&ITEMS);
    assert_eq!(want.len(), 5);
    assert_eq!(indexed(payload), (want.clone(), 4, 0), "the index holds what the request looks up");
    let other = request(&[("C", 5, 20), ("B", 30, 6), ("A", 50, 12)]);
    assert!(want.iter().all(|h| !other.contains(h)), "another first image matches no block");
}

#[test]
fn vllms_own_event_indexes_what_the_image_request_looks_up() {
    check(&std::fs::read(crate_dir().join("tests/vllm/media_event.msgpack")).unwrap());
}

#[test]
fn the_installed_wheel_agrees() {
    let Some(py) = engine_python() else { return };
    let keys = [json!([["A", 5]]), json!([["A", -11], ["B", 14]]), json!([["B", -2]]), json!([["A", 2]]), json!([])];
    let req = json!({
        "block_size": BLOCK, "tokens": tokens(), "cache_salt": "tenant", "lora_name": "ad",
        "items": ITEMS.iter().map(|&(id, off, len)| json!({"identifier": id, "offset": off, "length": len})).collect::<Vec<_>>(),
        "extra_keys": keys,
    });
    let script = crate_dir().join("../../scripts/real-engine/media_check.py");
    let mut child = Command::new(py)
        .arg(script)
        .arg("blocks")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the engine's python");
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), req.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "media_check.py blocks failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["equal"], json!(true));
    let hex = v["event"].as_str().unwrap();
    let bytes: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    check(&bytes);
}

/// The engine venv's Python (`KVROUTE_VLLM_PYTHON`, `KVROUTE_ENGINE_PYTHON`, or the
/// venv `install.sh` completes); `None`, with the reason printed, when there is none.
fn engine_python() -> Option<PathBuf> {
    for var in ["KVROUTE_VLLM_PYTHON", "KVROUTE_ENGINE_PYTHON"] {
        if let Some(p) = std::env::var_os(var).filter(|p| !p.is_empty()) {
            return Some(p.into());
        }
    }
    let env = |k| std::env::var_os(k).map(PathBuf::from);
    let dir = env("KVROUTE_ENGINE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|c| c.join("kvroute/engine")))
        .or_else(|| env("HOME").map(|h| h.join(".cache/kvroute/engine")))?;
    let venv = dir.join("venv");
    if !venv.join(".kvroute-complete").exists() {
        eprintln!("skipped: no complete engine venv at {} (scripts/real-engine/install.sh)", venv.display());
        return None;
    }
    Some(venv.join("bin/python"))
}
