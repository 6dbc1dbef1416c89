//! The committed images against the facts vLLM 0.32's wheel printed for them
//! (`media_check.py images`, saved as `tests/images/facts.jsonl`): size, Pillow's mode,
//! the size after EXIF orientation, the identifier under each algorithm, and the
//! Qwen2-VL token count.

use std::path::PathBuf;

use crate::engine::{assert_same_facts, identify, json_lines};

#[test]
fn committed_images_match_vllms_facts() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/images");
    let want = json_lines(&std::fs::read(dir.join("facts.jsonl")).expect("facts.jsonl"));
    let files: Vec<PathBuf> = want.iter().map(|w| dir.join(w["file"].as_str().expect("a file name"))).collect();
    assert!(want.len() >= 18, "every format, mode and orientation is covered");
    assert_same_facts(&want, &identify("kvroute/test-vlm", &files));
}
