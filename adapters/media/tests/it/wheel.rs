//! The installed vLLM wheel itself: fresh images through its connector and hasher, and
//! a request's block hashes through its `Request` and block hasher. Skipped, with the
//! reason printed, when the engine venv is not installed.

use std::collections::HashMap;
use std::path::PathBuf;

use router_core::{MediaItem, MediaItems};
use serde_json::{json, Value};

use crate::engine::{assert_same_facts, identify, media_check, python};

fn engine() -> Option<PathBuf> {
    match python() {
        Ok(p) => Some(p),
        Err(why) => {
            eprintln!("skipped: {why}");
            None
        }
    }
}

#[test]
fn identifiers_match_vllms_hasher_byte_for_byte() {
    let Some(py) = engine() else { return };
    let dir = std::env::temp_dir().join(format!("kvroute-media-{}", std::process::id()));
    let want = media_check(&py, &["images", dir.to_str().expect("a UTF-8 temp dir")], "");
    let files: Vec<PathBuf> = want.iter().map(|w| dir.join(w["file"].as_str().expect("a file name"))).collect();
    let got = identify("kvroute/test-vlm", &files);
    let _ = std::fs::remove_dir_all(&dir);
    assert_same_facts(&want, &got);
}

/// The `(identifier, offset)` keys kvroute folds into each full block.
fn our_keys(items: &[(&str, u32, u32)], tokens: usize, bs: usize) -> Vec<Vec<(String, i64)>> {
    let names: HashMap<u64, &str> =
        items.iter().map(|&(id, _, _)| (router_core::MediaKey::of(id.as_bytes()).0, id)).collect();
    let list = items.iter().map(|&(id, off, len)| MediaItem::new(id.as_bytes(), off, len)).collect();
    let media = MediaItems::new(list, tokens, 16).expect("valid items");
    (0..tokens / bs)
        .map(|b| {
            let mut words = Vec::new();
            media.block_extra_keys((b * bs) as u64, ((b + 1) * bs) as u64, &mut words);
            words.chunks_exact(2).map(|w| (names[&w[0]].to_string(), w[1] as i64)).collect()
        })
        .collect()
}

#[test]
fn block_keys_chain_to_vllms_block_hashes() {
    let Some(py) = engine() else { return };
    // Image A over two blocks and again later, image B across a boundary, a salt.
    let items = [("A", 5, 20), ("B", 30, 6), ("A", 50, 12)];
    let (bs, n) = (16, 90);
    let keys = our_keys(&items, n, bs);
    let req = json!({
        "block_size": bs,
        "tokens": (100..100 + n as u32).collect::<Vec<_>>(),
        "cache_salt": "tenant",
        "items": items.iter().map(|&(id, off, len)| json!({"identifier": id, "offset": off, "length": len})).collect::<Vec<_>>(),
        "extra_keys": keys.iter().map(|b| b.iter().map(|(id, off)| json!([id, off])).collect::<Vec<_>>()).collect::<Vec<_>>(),
    });
    let out = &media_check(&py, &["blocks"], &req.to_string())[0];
    assert_eq!(out["blocks"], json!(n / bs));
    let vllm: Vec<Vec<Value>> = serde_json::from_value(out["vllm_keys"].clone()).expect("keys");
    let vllm_mm: Vec<Vec<Value>> =
        vllm.iter().map(|b| b.iter().filter(|k| k[0] == "mm").map(|k| json!([k[1], k[2]])).collect()).collect();
    assert_eq!(
        vllm_mm,
        req["extra_keys"]
            .as_array()
            .expect("blocks")
            .iter()
            .map(|b| b.as_array().expect("keys").clone())
            .collect::<Vec<_>>()
    );
    assert_eq!(out["equal"], json!(true), "hash_block_tokens over kvroute's keys gives vLLM's block hashes");
}
