//! Loading bad model folders fails with a typed error, never a panic.

use std::path::{Path, PathBuf};

use kvroute_tokenize::{ChatRequest, ModelTokenizer, TokenizeError};
use serde_json::json;

use crate::fixture;

/// A copy of the chatml fixture with `edit` applied to its files.
fn folder(name: &str, edit: impl FnOnce(&PathBuf)) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("tokenize-broken-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture::chatml().dir.join(file), dir.join(file)).expect("copy");
    }
    edit(&dir);
    dir
}

#[track_caller]
fn check_load(name: &str, edit: impl FnOnce(&PathBuf), want: fn(&TokenizeError) -> bool) {
    let dir = folder(name, edit);
    match ModelTokenizer::from_dir(&dir) {
        Ok(_) => panic!("{name}: loaded"),
        Err(e) => assert!(want(&e), "{name}: {e:?}"),
    }
}

fn write(dir: &Path, file: &str, text: &str) {
    std::fs::write(dir.join(file), text).expect("write");
}

#[test]
fn broken_folders_fail_with_typed_errors() {
    check_load(
        "no tokenizer",
        |d| std::fs::remove_file(d.join("tokenizer.json")).expect("rm"),
        |e| matches!(e, TokenizeError::TokenizerFile { .. }),
    );
    check_load(
        "garbage tokenizer",
        |d| write(d, "tokenizer.json", "{\"model\": 3}"),
        |e| matches!(e, TokenizeError::TokenizerFile { .. }),
    );
    check_load(
        "config not json",
        |d| write(d, "tokenizer_config.json", "{oops"),
        |e| matches!(e, TokenizeError::ConfigFile { .. }),
    );
    check_load(
        "config not object",
        |d| write(d, "tokenizer_config.json", "[1]"),
        |e| matches!(e, TokenizeError::ConfigFile { .. }),
    );
    check_load(
        "bad template type",
        |d| write(d, "tokenizer_config.json", "{\"chat_template\": 5}"),
        |e| matches!(e, TokenizeError::ConfigFile { .. }),
    );
    check_load(
        "bad template list",
        |d| write(d, "tokenizer_config.json", "{\"chat_template\": [{\"name\": \"x\"}]}"),
        |e| matches!(e, TokenizeError::ConfigFile { .. }),
    );
    check_load(
        "bad special token",
        |d| write(d, "tokenizer_config.json", "{\"bos_token\": {\"id\": 3}}"),
        |e| matches!(e, TokenizeError::ConfigFile { .. }),
    );
    check_load(
        "template syntax",
        |d| write(d, "chat_template.jinja", "{% for %}"),
        |e| matches!(e, TokenizeError::TemplateSyntax { name, .. } if name == "default"),
    );
}

#[test]
fn template_files_override_the_config_and_special_tokens_fall_back() {
    let dir = folder("template files", |d| {
        write(d, "tokenizer_config.json", &json!({"eos_token": "<|im_end|>", "chat_template": "config"}).to_string());
        write(
            d,
            "special_tokens_map.json",
            &json!({"bos_token": {"content": "<|endoftext|>"}, "eos_token": "ignored"}).to_string(),
        );
        write(d, "chat_template.jinja", "file {{ bos_token }} {{ eos_token }}");
    });
    let tok = ModelTokenizer::from_dir(&dir).expect("load");
    let req = ChatRequest::new(vec![json!({"role": "user", "content": "q"})]);
    assert_eq!(tok.render_chat(&req).expect("render"), "file <|endoftext|> <|im_end|>");
    std::fs::create_dir_all(dir.join("additional_chat_templates")).expect("mkdir");
    write(&dir, "additional_chat_templates/tool_use.jinja", "tools {{ tools | length }}");
    let tok = ModelTokenizer::from_dir(&dir).expect("load");
    let mut with_tools = req.clone();
    with_tools.tools = Some(vec![json!({"type": "function", "function": {"name": "f"}})]);
    assert_eq!(tok.render_chat(&with_tools).expect("render"), "tools 1");
    assert_eq!(tok.render_chat(&req).expect("render"), "file <|endoftext|> <|im_end|>");
}

#[test]
fn no_template_is_a_typed_error() {
    let dir = folder("no template", |d| write(d, "tokenizer_config.json", "{}"));
    let tok = ModelTokenizer::from_dir(&dir).expect("load");
    let req = ChatRequest::new(vec![json!({"role": "user", "content": "q"})]);
    assert!(matches!(tok.render_chat(&req), Err(TokenizeError::NoChatTemplate)));
    assert!(!tok.encode_text("plain", false).expect("encode").is_empty());
}

/// The proxy shares one tokenizer per model across request tasks.
#[test]
fn model_tokenizer_is_shareable_across_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<ModelTokenizer>();
}
