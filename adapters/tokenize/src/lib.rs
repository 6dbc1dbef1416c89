//! Turns chat requests into the exact token ids an inference engine (vLLM) will compute for
//! them, so the router can hash prompt blocks the way the engine's KV cache does.
//!
//! Per model, [`ModelTokenizer::from_dir`] reads a Hugging Face model folder from local
//! disk: `tokenizer.json` (run by the `tokenizers` crate, pure-Rust regex backend), the chat
//! templates (`tokenizer_config.json`'s `chat_template`, or `chat_template.jinja` files) and
//! the named special tokens. [`ModelTokenizer::encode_chat`] then renders the whole request
//! (system prompt, tools, every message and tool call) with MiniJinja configured like
//! transformers' Jinja2 sandbox, after the same message rewriting the engine applies
//! ([`Dialect`]), and tokenizes the result with `add_special_tokens = false`, as vLLM does
//! for chat requests whose template writes its own BOS.
//!
//! Tokenizing is the router's most expensive step, so prompts are cut where tokenization
//! provably splits: just before added tokens such as `<|im_start|>` (`segment.rs`) and, when
//! the tokenizer's normalizer and pre-tokenizer allow it, at spaces between words every
//! [`CacheConfig::gap_stride_bytes`] (`inner.rs`). The pieces' ids are kept in a bounded LRU
//! cache ([`CacheConfig`]), so turn N+1 of a conversation, chat or plain text, tokenizes
//! only what is new since turn N. What is new is looked up a word at a time in a bounded
//! memo of words seen twice (`words/`), so only words it does not know are tokenized. The
//! output is identical to tokenizing the whole text at once.
//!
//! What this crate leaves to others: it downloads nothing and never reads the network;
//! finding the model folder, choosing the [`Dialect`] per deployment, hashing blocks
//! (`router-core`) and turning errors into HTTP answers (see
//! [`TokenizeError::is_bad_request`]) belong to the proxy. Image parts render as vLLM
//! renders them for a model that takes images ([`VllmOptions::image_text`]), one
//! placeholder per image, which the caller expands; other media parts, and images for
//! a model without images, are refused with a typed error.
//!
//! Testing: `tests/it/parity.rs` renders and tokenizes generated model folders with this
//! crate and with Hugging Face transformers (`tests/it/parity.py`, run with `python3`), and
//! requires `pip install transformers tokenizers jinja2` (no torch).

#![forbid(unsafe_code)]
#![warn(unreachable_pub)]

mod cache;
mod detect;
mod error;
pub mod fallback;
mod files;
pub mod images;
mod inner;
mod pyfmt;
mod request;
pub mod responses;
mod segment;
mod strftime;
mod template;
mod words;
mod wrap;

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

pub use cache::{CacheConfig, CacheStats};
pub use error::TokenizeError;
pub use request::{is_image_part, ChatRequest, ContentFormat, Dialect, ToolDump, VllmOptions};
pub use template::Clock;

use cache::PieceCache;
use segment::Cutter;
use template::Templates;
use words::WordMemo;
use wrap::Wrap;

/// How a [`ModelTokenizer`] renders and caches. Every field has a default.
#[derive(Clone)]
pub struct TokenizerConfig {
    /// Which engine's message rewriting to mirror. Default [`Dialect::Vllm`].
    pub dialect: Dialect,
    /// Limits of the prefix cache. Default [`CacheConfig::default`].
    pub cache: CacheConfig,
    /// The clock behind the templates' `strftime_now`, in Unix seconds (UTC). Default the
    /// system clock.
    pub clock: Clock,
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        Self { dialect: Dialect::default(), cache: CacheConfig::default(), clock: Arc::new(system_unix_secs) }
    }
}

impl std::fmt::Debug for TokenizerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerConfig")
            .field("dialect", &self.dialect)
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

fn system_unix_secs() -> i64 {
    match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

/// One model's tokenizer, chat templates and prefix cache. Shareable across threads: the
/// cache sits behind a mutex held only for map operations, never while tokenizing.
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    templates: Templates,
    /// `(template name, loops over message content)`, computed once at load.
    content_loops: Vec<(String, bool)>,
    special_tokens: Vec<(String, String)>,
    dialect: Dialect,
    cutter: Cutter,
    /// Why prompts are not cut at word gaps, if they are not.
    gap_refusal: Option<&'static str>,
    /// What the post-processor adds around a sequence, if known to only wrap it.
    wrap: Option<Wrap>,
    cache: Mutex<PieceCache>,
    /// Ids of single words, for text the cache has not seen; `None` without word-gap
    /// cuts or when `words_max` keeps none.
    words: Option<Mutex<WordMemo>>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("templates", &self.templates)
            .field("special_tokens", &self.special_tokens)
            .field("dialect", &self.dialect)
            .field("cut_tokens", &self.cutter.tokens())
            .field("gap_refusal", &self.gap_refusal)
            .field("wrap", &self.wrap)
            .finish_non_exhaustive()
    }
}

impl ModelTokenizer {
    /// Loads the model folder `dir` with the default [`TokenizerConfig`].
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        Self::from_dir_with(dir, TokenizerConfig::default())
    }

    /// Loads the model folder `dir`: `tokenizer.json` (required), `tokenizer_config.json`,
    /// `chat_template.jinja`, `additional_chat_templates/*.jinja` and
    /// `special_tokens_map.json` (all optional). Templates are compiled here, so a template
    /// that does not parse fails the load, not the first request.
    pub fn from_dir_with(dir: impl AsRef<Path>, config: TokenizerConfig) -> Result<Self, TokenizeError> {
        let files = files::load(dir.as_ref())?;
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(&files.tokenizer_json)
            .map_err(|e| TokenizeError::TokenizerFile { message: e.to_string() })?;
        // transformers turns both off unless asked per call, and the engine does not ask.
        tokenizer.with_truncation(None).map_err(|e| TokenizeError::TokenizerFile { message: e.to_string() })?;
        tokenizer.with_padding(None);
        let added: Vec<tokenizers::AddedToken> = tokenizer.get_added_tokens_decoder().into_values().collect();
        let templates = Templates::compile(files.templates.clone(), files.templates_named, config.clock)?;
        let content_loops =
            files.templates.iter().map(|(name, source)| (name.clone(), detect::loops_over_content(source))).collect();
        let gap_refusal = inner::check(&tokenizer).err();
        let wrap = Wrap::probe(&tokenizer);
        Ok(Self {
            tokenizer,
            templates,
            content_loops,
            special_tokens: files.special_tokens,
            dialect: config.dialect,
            cutter: Cutter::new(&added, gap_refusal.is_none()),
            gap_refusal,
            wrap,
            words: Some(WordMemo::new(config.cache.words_max))
                .filter(|m| gap_refusal.is_none() && m.enabled())
                .map(Mutex::new),
            cache: Mutex::new(PieceCache::new(config.cache)),
        })
    }

    /// Tokenizes plain `text` (a completions prompt), adding the tokenizer's post-processor
    /// tokens (e.g. BOS) when `add_special_tokens` is set, reusing cached pieces as
    /// [`encode_rendered`](Self::encode_rendered) does. The result equals
    /// [`encode_uncached`](Self::encode_uncached)'s. Uncached when special tokens are asked
    /// for and the post-processor is not known to only wrap the sequence.
    pub fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match (&self.wrap, add_special_tokens) {
            (_, false) => self.encode_rendered(text),
            (Some(wrap), true) => Ok(wrap.around(&self.encode_rendered(text)?)),
            (None, true) => self.encode_uncached(text, true),
        }
    }

    /// Tokenizes `text` in one go, without the cache. Work grows linearly with `text`.
    pub fn encode_uncached(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizeError::Encode { message: e.to_string() })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Renders `req` with the model's chat template, as the engine would before tokenizing.
    /// Work grows with the request's size and the template's loops.
    pub fn render_chat(&self, req: &ChatRequest) -> Result<String, TokenizeError> {
        let name = self.templates.select(req.tools.is_some())?;
        let openai_content = match &self.dialect {
            Dialect::Vllm(opts) => match opts.content_format {
                ContentFormat::Auto => self.content_loops.iter().any(|(n, loops)| n == name && *loops),
                ContentFormat::String => false,
                ContentFormat::OpenAi => true,
            },
            Dialect::Transformers => false,
        };
        let ctx = request::render_context(req, &self.dialect, openai_content, &self.special_tokens)?;
        let ctx = minijinja::Value::from(minijinja::value::Serde(&ctx));
        self.templates.render(name, &ctx)
    }

    /// The engine's prompt token ids for `req`: [`render_chat`](Self::render_chat), then
    /// [`encode_rendered`](Self::encode_rendered).
    pub fn encode_chat(&self, req: &ChatRequest) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(req)?;
        self.encode_rendered(&text)
    }

    /// Tokenizes an already rendered prompt without adding special tokens, reusing cached
    /// pieces. The result equals `encode_uncached(text, false)`. Work is linear in `text`
    /// for hashing and cutting, plus tokenizing the pieces not in the cache.
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let (piece_bytes_min, stride_bytes, enabled) = {
            let cache = self.lock_cache();
            let c = cache.config();
            (c.piece_bytes_min, c.gap_stride_bytes, c.entries_max > 0)
        };
        if !enabled {
            return self.encode_words(text);
        }
        let pieces = self.cutter.split(text, piece_bytes_min, stride_bytes);
        let found: Vec<(u128, Option<Arc<[u32]>>)> = {
            let mut cache = self.lock_cache();
            pieces
                .iter()
                .map(|p| {
                    let key = cache.key(p);
                    (key, cache.get(key, p))
                })
                .collect()
        };
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut fresh = Vec::new();
        for (piece, (key, hit)) in pieces.iter().zip(found) {
            match hit {
                Some(ids) => out.extend_from_slice(&ids),
                None => {
                    let ids: Arc<[u32]> = self.encode_words(piece)?.into();
                    out.extend_from_slice(&ids);
                    fresh.push((key, *piece, ids));
                }
            }
        }
        if !fresh.is_empty() {
            let mut cache = self.lock_cache();
            for (key, piece, ids) in fresh {
                cache.insert(key, piece, ids);
            }
        }
        Ok(out)
    }

    /// Tokenizes `text` without special tokens as [`encode_uncached`](Self::encode_uncached)
    /// does, through the word memo: the pipeline runs only on the words it does not know.
    fn encode_words(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match &self.words {
            Some(memo) => words::encode(memo, text, |run| self.encode_uncached(run, false)),
            None => self.encode_uncached(text, false),
        }
    }

    /// The prefix cache's and word memo's counters.
    pub fn cache_stats(&self) -> CacheStats {
        let (word_hits, word_misses, word_entries) = self.words.as_ref().map_or((0, 0, 0), |m| lock(m).stats());
        CacheStats { word_hits, word_misses, word_entries, ..self.lock_cache().stats() }
    }

    /// The named special tokens passed to templates, e.g. `("bos_token", "<s>")`.
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    /// The added tokens before which prompts are cut for caching, sorted.
    pub fn cut_tokens(&self) -> &[String] {
        self.cutter.tokens()
    }

    /// Whether prompts are also cut at spaces between words (see
    /// [`CacheConfig::gap_stride_bytes`]); `Err` says why this tokenizer's are not.
    pub fn cuts_word_gaps(&self) -> Result<(), &'static str> {
        match self.gap_refusal {
            None => Ok(()),
            Some(why) => Err(why),
        }
    }

    /// A poisoned lock only means another thread panicked mid-call; every cache operation
    /// leaves the maps consistent before it can panic, so the data is still usable.
    fn lock_cache(&self) -> MutexGuard<'_, PieceCache> {
        lock(&self.cache)
    }
}

/// See [`ModelTokenizer::lock_cache`]; the word memo likewise.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
