//! Streaming through kvroute with the official `openai` Python client (installed in the
//! engine's venv): chat and completions arrive as many chunks whose text is what the
//! same greedy request gives unstreamed.

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use crate::engine::MODEL;
use crate::fleet::fleet;

#[test]
fn the_openai_client_streams_chat_and_completions_through_kvroute() {
    let Some(f) = fleet() else { return };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("real_vllm/openai_stream.py");
    let out =
        Command::new(&f.env.python).arg(&script).arg(f.router.base_url()).arg(MODEL).output().expect("python runs");
    assert!(out.status.success(), "openai_stream.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let got: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    // The same requests unstreamed, through kvroute too.
    let chat = f.send(
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three colours of the sea at dusk."}]}),
        None,
    );
    let completion = f.send(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "The router sends each request to", "max_tokens": 16, "temperature": 0}),
        None,
    );
    for (what, want) in [("chat", chat.text()), ("completion", completion.text())] {
        let s = &got[what];
        assert!(s["chunks"].as_u64().unwrap_or(0) >= 4, "{what}: streamed in many chunks: {s}");
        assert_eq!(s["text"], want, "{what}: streamed text is the unstreamed text");
        assert_eq!(s["finish_reason"], "length", "{what}: {s}");
    }
    assert_eq!(got["chat"]["completion_tokens"], 16, "the usage chunk counts the whole generation");
}
