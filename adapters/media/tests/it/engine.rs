//! Finding the vLLM engine's Python and running `media_check.py` and `media-identify`.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

/// The engine venv's Python: `KVROUTE_VLLM_PYTHON` or `KVROUTE_ENGINE_PYTHON`, else
/// the venv `scripts/real-engine/install.sh` completes under `KVROUTE_ENGINE_DIR` (by
/// default the user's cache folder). `Err` says why there is none.
pub fn python() -> Result<PathBuf, String> {
    for var in ["KVROUTE_VLLM_PYTHON", "KVROUTE_ENGINE_PYTHON"] {
        if let Some(p) = std::env::var_os(var).filter(|p| !p.is_empty()) {
            return Ok(p.into());
        }
    }
    let dir =
        match (std::env::var_os("KVROUTE_ENGINE_DIR"), std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME")) {
            (Some(d), _, _) => PathBuf::from(d),
            (None, Some(c), _) => PathBuf::from(c).join("kvroute/engine"),
            (None, None, Some(h)) => PathBuf::from(h).join(".cache/kvroute/engine"),
            _ => return Err("no KVROUTE_VLLM_PYTHON, KVROUTE_ENGINE_DIR or HOME".into()),
        };
    let venv = dir.join("venv");
    if !venv.join(".kvroute-complete").exists() {
        return Err(format!(
            "no complete engine venv at {} (scripts/real-engine/install.sh builds it)",
            venv.display()
        ));
    }
    Ok(venv.join("bin/python"))
}

/// Runs `media_check.py` with `args`, feeding `stdin`; its stdout's JSON lines.
pub fn media_check(python: &PathBuf, args: &[&str], stdin: &str) -> Vec<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/real-engine/media_check.py");
    let mut child = Command::new(python)
        .arg(&script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the engine's python");
    std::io::Write::write_all(child.stdin.as_mut().expect("stdin"), stdin.as_bytes()).expect("write stdin");
    let out = child.wait_with_output().expect("media_check.py");
    assert!(out.status.success(), "media_check.py {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    json_lines(&out.stdout)
}

/// Runs the `media-identify` bin on `files`.
pub fn identify(model_id: &str, files: &[PathBuf]) -> Vec<Value> {
    let out =
        Command::new(env!("CARGO_BIN_EXE_media-identify")).arg(model_id).args(files).output().expect("media-identify");
    assert!(out.status.success(), "media-identify failed:\n{}", String::from_utf8_lossy(&out.stderr));
    json_lines(&out.stdout)
}

pub fn json_lines(b: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(b).lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

/// Compares two lists of per-file facts, keyed by file name.
#[track_caller]
pub fn assert_same_facts(want: &[Value], got: &[Value]) {
    assert_eq!(want.len(), got.len(), "files");
    for w in want {
        let g = got.iter().find(|g| g["file"] == w["file"]).unwrap_or_else(|| panic!("no output for {}", w["file"]));
        assert_eq!(g, w, "{}", w["file"]);
    }
}
