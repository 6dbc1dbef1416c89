//! `kvroute serve`: the routing proxy, with its tokenizers, KV-event subscriptions and,
//! with `[discovery.kubernetes]`, the pods it follows (see [`crate::discover`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;

use kvroute_frontend::media::{load_image_model, ChatMedia, MediaSection};
use kvroute_proxy::{ConfigError, ProxyConfig, Tokenize, TokenizeError, Tokenizers};
use kvroute_tokenize::CacheConfig;

use crate::tok::HfTokenizer;

/// Flags of `kvroute serve`; each overrides the file.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// The TOML configuration (see kvroute.example.toml in the frontend crate).
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Address to listen on, overriding `listen`.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Routing mode, overriding `router.mode` (kv, round-robin, random, ...).
    #[arg(long)]
    pub mode: Option<String>,
    /// Serve TLS with this PEM certificate chain, overriding `tls.cert_path` (needs
    /// --tls-key or `tls.key_path`). The files are read again when they change, every
    /// `tls.reload_interval_ms` (default 10,000); a pair that fails to load leaves the
    /// old one serving. `https://` workers and OTLP collectors are verified against the
    /// system's roots, or the PEM bundle of `upstream_tls.ca_path`.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert, overriding `tls.key_path`.
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Any other key, e.g. --set limits.body_bytes_max=1048576 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

/// A model's tokenizer, and how its images are read when it takes them.
struct ServeTokenizer {
    hf: HfTokenizer,
    media: Option<ChatMedia>,
}

impl ServeTokenizer {
    /// The tokenizer in `dir`; for a vision-language model (its `config.json` says so),
    /// rendering image parts as vLLM does, with identifiers keyed on `engine_model_id`.
    fn load(dir: &Path, engine_model_id: &str, section: &MediaSection, cache: CacheConfig) -> Result<Self, String> {
        let Some(images) = load_image_model(dir)? else {
            return Ok(ServeTokenizer { hf: HfTokenizer::load_for_images(dir, None, cache)?, media: None });
        };
        let hf = HfTokenizer::load_for_images(dir, Some(images.prompt_text), cache)?;
        Ok(ServeTokenizer { hf, media: Some(ChatMedia::new(&images, engine_model_id, section)) })
    }
}

impl Tokenize for ServeTokenizer {
    fn encode_chat(&self, body: &serde_json::Value) -> Result<Vec<u32>, TokenizeError> {
        self.hf.chat_tokens(body).map_err(TokenizeError::new)
    }
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.hf.0.encode_text(text, true).map_err(TokenizeError::new)
    }
    fn media(&self) -> Option<&ChatMedia> {
        self.media.as_ref()
    }
    fn cache_stats(&self) -> Option<kvroute_tokenize::CacheStats> {
        Some(self.hf.0.cache_stats())
    }
}

/// Reads the file and applies the flags.
pub fn load_config(a: &ServeArgs) -> Result<ProxyConfig, String> {
    let text = std::fs::read_to_string(&a.config).map_err(|e| format!("cannot read {}: {e}", a.config.display()))?;
    let mut overrides: Vec<(String, String)> =
        a.listen.iter().map(|l| ("listen".to_string(), format!("{l:?}"))).collect();
    for (key, path) in [("tls.cert_path", &a.tls_cert), ("tls.key_path", &a.tls_key)] {
        if let Some(p) = path {
            overrides.push((key.into(), format!("{:?}", p.display().to_string())));
        }
    }
    let origin = a.config.display().to_string();
    config_with_flags(ProxyConfig::from_toml_with_overrides, &text, &origin, overrides, a.mode.as_ref(), &a.sets)
}

/// How a subcommand turns a file and its overrides into a configuration.
pub type Loader = fn(&str, &[(&str, &str)]) -> Result<ProxyConfig, ConfigError>;

/// `text` as a configuration read by `load`, with `overrides`, then `--mode`, then each
/// `--set KEY=VALUE` applied in that order; errors name `origin`. Shared by `serve` and
/// `epp`, whose loader refuses the keys it does not honour.
pub fn config_with_flags(
    load: Loader,
    text: &str,
    origin: &str,
    mut overrides: Vec<(String, String)>,
    mode: Option<&String>,
    sets: &[String],
) -> Result<ProxyConfig, String> {
    if let Some(m) = mode {
        overrides.push(("router.mode".into(), format!("{m:?}")));
    }
    for s in sets {
        let (k, v) = s.split_once('=').ok_or_else(|| format!("--set {s:?}: expected KEY=VALUE"))?;
        overrides.push((k.trim().into(), v.trim().into()));
    }
    let pairs: Vec<(&str, &str)> = overrides.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    load(text, &pairs).map_err(|e| format!("{origin}: {e}"))
}

/// Loads every model's tokenizer named in the config, each from a local folder, and
/// warns about models whose workers publish KV events that cannot match without one.
pub fn load_tokenizers(cfg: &ProxyConfig) -> Result<Tokenizers, String> {
    let mut t = Tokenizers::new();
    for m in &cfg.models {
        if let Some(dir) = &m.tokenizer {
            let engine_model_id = m.engine_model_id.as_deref().unwrap_or(dir);
            let mut cache = CacheConfig::default();
            if let Some(n) = m.tokenizer_words_max {
                cache.words_max = n;
            }
            let tok = ServeTokenizer::load(&tokenizer_dir(&m.name, dir)?, engine_model_id, &cfg.media, cache)
                .map_err(|e| format!("model {:?}: {e}", m.name))?;
            t.insert(m.name.clone(), Arc::new(tok));
        }
    }
    // A model without a tokenizer is warned about by the proxy's log, once.
    Ok(t)
}

/// `dir` as a tokenizer folder that exists. kvroute downloads nothing: a value that is
/// not a folder, such as a Hugging Face hub id, is an error that says what to do.
fn tokenizer_dir(model: &str, dir: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(dir);
    if path.is_dir() {
        return Ok(path);
    }
    let hub_like = !dir.starts_with(['/', '.', '~']) && dir.split('/').count() == 2 && !dir.contains('\\');
    if hub_like {
        return Err(format!(
            "model {model:?}: tokenizer = {dir:?} looks like a Hugging Face hub id, but `tokenizer` takes a local \
             folder (kvroute downloads nothing): download the model's tokenizer.json and tokenizer_config.json \
             into a folder (for example `hf download {dir} tokenizer.json tokenizer_config.json --local-dir \
             DIR`) and set tokenizer = \"DIR\""
        ));
    }
    Err(format!(
        "model {model:?}: tokenizer = {dir:?} is not a folder; point it at a local folder holding the model's \
         tokenizer.json and tokenizer_config.json"
    ))
}

/// `kvroute serve`.
pub fn run(a: &ServeArgs) -> Result<(), String> {
    let cfg = load_config(a)?;
    let tokenizers = load_tokenizers(&cfg)?;
    let rt = tokio::runtime::Runtime::new().map_err(|e| format!("cannot start the async runtime: {e}"))?;
    rt.block_on(async move {
        let handle = kvroute_proxy::serve(cfg.clone(), tokenizers).await.map_err(|e| e.to_string())?;
        eprintln!(
            "kvroute: serving {} model(s), {} worker(s) on {}://{}",
            cfg.models.len(),
            cfg.workers.len(),
            if handle.is_tls() { "https" } else { "http" },
            handle.local_addr()
        );
        let discovery = crate::discover::start(&cfg, &handle).await?;
        shutdown_signal().await;
        if let Some(d) = discovery {
            d.abort();
        }
        eprintln!("kvroute: shutting down; in-flight streams get {} s", cfg.limits.shutdown_grace_s);
        let report = handle.shutdown().await;
        eprintln!("kvroute: stopped ({report:?})");
        Ok(())
    })
}

/// Resolves on SIGTERM or Ctrl-C, whichever comes first.
pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{load_tokenizers, ProxyConfig};

    /// Loads a word-level tokenizer as model `m` with `words_line` in its `[[models]]`
    /// entry, tokenizes two new texts of the same words, and compares the words the
    /// tokenizer then holds in its memo.
    #[track_caller]
    fn check(words_line: &str, held_some: bool) {
        let dir = std::env::temp_dir().join(format!("kvroute-serve-words-{}-{}", std::process::id(), held_some));
        std::fs::create_dir_all(&dir).unwrap();
        let vocab: serde_json::Map<String, serde_json::Value> =
            ["[UNK]", "alpha", "beta", "gamma"].iter().enumerate().map(|(i, w)| (w.to_string(), json!(i))).collect();
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        let toml = format!("[[models]]\nname = \"m\"\ntokenizer = {:?}\n{words_line}\n", dir.display().to_string());
        let cfg = ProxyConfig::from_toml_with_overrides(&toml, &[]).unwrap();
        let tok = load_tokenizers(&cfg).unwrap().get("m").cloned().unwrap();
        for text in ["alpha beta gamma", "gamma beta alpha beta"] {
            tok.encode_text(text).unwrap();
        }
        let held = tok.cache_stats().unwrap().word_entries;
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(held > 0, held_some, "{words_line:?}: {held} words held");
    }

    #[test]
    fn a_models_tokenizer_words_max_bounds_its_word_memo() {
        check("", true);
        check("tokenizer_words_max = 0", false);
    }
}
