//! Reads a Hugging Face model folder: where `tokenizer.json` is, which chat templates the
//! model ships and its named special tokens. It parses no tokenizer pipeline (the
//! `tokenizers` crate does) and compiles no template (`template.rs` does).
//!
//! The rules follow transformers' `from_pretrained`: `chat_template.jinja` (as `default`)
//! and `additional_chat_templates/*.jinja` (named by file stem) take priority over the
//! `chat_template` entry of `tokenizer_config.json`, which is either one template string or
//! a list of `{"name", "template"}` objects. Special tokens are strings or AddedToken
//! objects (`{"content": ...}`); a token missing from the config is looked up in the legacy
//! `special_tokens_map.json`.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use crate::TokenizeError;

/// The named special tokens transformers passes to every chat template render.
pub(crate) const SPECIAL_TOKEN_KEYS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// A model's templates as `(name, source)` pairs, and whether they are named (a set) rather
/// than one template.
type TemplateSet = (Vec<(String, String)>, bool);

/// What `ModelTokenizer` needs from a model folder, read but not yet interpreted.
#[derive(Debug)]
pub(crate) struct ModelFiles {
    pub tokenizer_json: Vec<u8>,
    /// `(name, source)`; a single unnamed template is called `default`.
    pub templates: Vec<(String, String)>,
    /// True when the model ships named templates (a list or template files) rather than one.
    pub templates_named: bool,
    /// `(key, token text)` for the special tokens that are set, in `SPECIAL_TOKEN_KEYS` order.
    pub special_tokens: Vec<(String, String)>,
}

pub(crate) fn load(dir: &Path) -> Result<ModelFiles, TokenizeError> {
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer_json = fs::read(&tokenizer_path)
        .map_err(|e| TokenizeError::TokenizerFile { message: format!("{}: {e}", tokenizer_path.display()) })?;
    let config_path = dir.join("tokenizer_config.json");
    let config = read_json_object(&config_path)?.unwrap_or_default();
    let (templates, templates_named) = match template_files(dir)? {
        Some(found) => found,
        None => config_templates(&config_path, config.get("chat_template"))?,
    };
    let map_path = dir.join("special_tokens_map.json");
    let legacy = read_json_object(&map_path)?.unwrap_or_default();
    let mut special_tokens = Vec::new();
    for key in SPECIAL_TOKEN_KEYS {
        let (path, value) = match config.get(key) {
            Some(v) => (&config_path, v),
            None => match legacy.get(key) {
                Some(v) => (&map_path, v),
                None => continue,
            },
        };
        if let Some(text) = token_text(path, key, value)? {
            special_tokens.push((key.to_owned(), text));
        }
    }
    Ok(ModelFiles { tokenizer_json, templates, templates_named, special_tokens })
}

fn read_json_object(path: &Path) -> Result<Option<serde_json::Map<String, Json>>, TokenizeError> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(TokenizeError::Io { path: path.to_owned(), source }),
    };
    match serde_json::from_slice(&bytes) {
        Ok(Json::Object(map)) => Ok(Some(map)),
        Ok(_) => Err(config_error(path, "expected a JSON object")),
        Err(e) => Err(config_error(path, &e.to_string())),
    }
}

fn config_error(path: &Path, message: &str) -> TokenizeError {
    TokenizeError::ConfigFile { path: path.to_owned(), message: message.to_owned() }
}

/// `chat_template.jinja` and `additional_chat_templates/*.jinja`, if the model has any.
fn template_files(dir: &Path) -> Result<Option<TemplateSet>, TokenizeError> {
    let mut found = Vec::new();
    let main = dir.join("chat_template.jinja");
    if main.is_file() {
        found.push(("default".to_owned(), read_text(&main)?));
    }
    let extra_dir = dir.join("additional_chat_templates");
    if extra_dir.is_dir() {
        let entries =
            fs::read_dir(&extra_dir).map_err(|source| TokenizeError::Io { path: extra_dir.clone(), source })?;
        let mut paths: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
            .collect();
        paths.sort();
        for path in paths {
            let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            found.push((name, read_text(&path)?));
        }
    }
    if found.is_empty() {
        return Ok(None);
    }
    // transformers keeps a lone `chat_template.jinja` as a plain string template.
    let named = !(found.len() == 1 && found[0].0 == "default");
    Ok(Some((found, named)))
}

fn read_text(path: &Path) -> Result<String, TokenizeError> {
    fs::read_to_string(path).map_err(|source| TokenizeError::Io { path: path.to_owned(), source })
}

fn config_templates(path: &Path, value: Option<&Json>) -> Result<TemplateSet, TokenizeError> {
    match value {
        None | Some(Json::Null) => Ok((Vec::new(), false)),
        Some(Json::String(s)) => Ok((vec![("default".to_owned(), s.clone())], false)),
        Some(Json::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some(n), Some(t)) => out.push((n.to_owned(), t.to_owned())),
                    _ => return Err(config_error(path, "chat_template list items need string `name` and `template`")),
                }
            }
            Ok((out, true))
        }
        Some(_) => Err(config_error(path, "chat_template must be a string or a list")),
    }
}

/// A special token's text: a string, or an AddedToken object's `content`.
fn token_text(path: &Path, key: &str, value: &Json) -> Result<Option<String>, TokenizeError> {
    match value {
        Json::Null => Ok(None),
        Json::String(s) => Ok(Some(s.clone())),
        Json::Object(o) => match o.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(config_error(path, &format!("{key} has no string `content`"))),
        },
        _ => Err(config_error(path, &format!("{key} must be a string or an object"))),
    }
}
