//! The one error type of this crate: what went wrong loading a model's files or turning a
//! chat request into tokens. It leaves the mapping to HTTP statuses to the proxy, helped by
//! [`TokenizeError::is_bad_request`].

use std::fmt;
use std::path::PathBuf;

/// Why loading a tokenizer, rendering a chat template or encoding text failed.
#[non_exhaustive]
#[derive(Debug)]
pub enum TokenizeError {
    /// A model file exists but could not be read.
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// `tokenizer.json` is missing, not valid JSON, or describes a pipeline this build of
    /// the `tokenizers` crate cannot load.
    TokenizerFile {
        /// The tokenizers crate's message.
        message: String,
    },
    /// A JSON side file (`tokenizer_config.json`, `special_tokens_map.json`) is malformed or
    /// has a field of the wrong type.
    ConfigFile {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The model ships no chat template, so chat requests cannot be rendered.
    NoChatTemplate,
    /// The model ships several named templates and none is called `default` (nor `tool_use`
    /// for a request with tools).
    NoDefaultTemplate {
        /// The template names the model does ship, sorted.
        available: Vec<String>,
    },
    /// A chat template does not parse as Jinja.
    TemplateSyntax {
        /// The template's name (`default` for a single template).
        name: String,
        /// The parser's message.
        message: String,
    },
    /// The template called `raise_exception(message)`: the model refuses this conversation
    /// (for example roles out of order). The engine would answer 400 as well.
    TemplateRaised {
        /// The message the template gave.
        message: String,
    },
    /// Rendering the template failed for another reason (a type error, an unknown method,
    /// an undefined value used where Jinja2 fails too).
    TemplateRender {
        /// The template engine's message.
        message: String,
    },
    /// The chat request itself is malformed (a message that is not an object, a role that is
    /// not a string, a reserved template keyword in the extra kwargs, ...).
    InvalidRequest {
        /// What is wrong.
        message: String,
    },
    /// A content part of a kind this crate does not render (images, audio, video): the
    /// engine replaces those with model-specific placeholders this crate does not know.
    UnsupportedContentPart {
        /// The part's `type` field.
        kind: String,
    },
    /// The tokenizer failed to encode the text.
    Encode {
        /// The tokenizers crate's message.
        message: String,
    },
}

impl TokenizeError {
    /// True when the request, not the model files, is at fault: the proxy answers 400.
    pub fn is_bad_request(&self) -> bool {
        matches!(
            self,
            Self::TemplateRaised { .. }
                | Self::TemplateRender { .. }
                | Self::InvalidRequest { .. }
                | Self::UnsupportedContentPart { .. }
        )
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidRequest { message: message.into() }
    }
}

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, source } => write!(f, "cannot read {}: {source}", path.display()),
            Self::TokenizerFile { message } => write!(f, "bad tokenizer.json: {message}"),
            Self::ConfigFile { path, message } => write!(f, "bad {}: {message}", path.display()),
            Self::NoChatTemplate => f.write_str("the model has no chat template"),
            Self::NoDefaultTemplate { available } => {
                write!(f, "the model has several chat templates and none is named default: {}", available.join(", "))
            }
            Self::TemplateSyntax { name, message } => {
                write!(f, "chat template {name:?} does not parse: {message}")
            }
            Self::TemplateRaised { message } => write!(f, "chat template refused: {message}"),
            Self::TemplateRender { message } => write!(f, "chat template failed: {message}"),
            Self::InvalidRequest { message } => write!(f, "invalid chat request: {message}"),
            Self::UnsupportedContentPart { kind } => {
                write!(f, "content part type {kind:?} is not supported")
            }
            Self::Encode { message } => write!(f, "tokenizer failed: {message}"),
        }
    }
}

impl std::error::Error for TokenizeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
