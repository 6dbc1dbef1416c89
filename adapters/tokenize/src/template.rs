//! Compiles a model's chat templates into a MiniJinja environment set up the way Hugging Face
//! `transformers` sets up Jinja2 (`_compile_jinja_template`), and renders them. It leaves
//! building the render context (messages, tools, special tokens) to `render.rs`.
//!
//! What transformers installs and this module mirrors: `trim_blocks` and `lstrip_blocks` on,
//! `keep_trailing_newline` off, the `loopcontrols` extension (`break`, `continue`), a `tojson`
//! filter that is `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)` rather than Jinja's HTML-escaping one, and the globals
//! `raise_exception(message)` and `strftime_now(format)`. Jinja2 also prints values the
//! Python way (`None`, `True`, `['a']`), and templates call Python string and dict methods
//! (`.strip()`, `.split()`, `.items()`); the formatter and the pycompat method callback
//! cover those. The `{% generation %}` tag of transformers' assistant-mask extension renders
//! its body unchanged, so it is rewritten to a plain `{% if true %}` block before compiling.

use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

use crate::pyfmt::{self, DumpOptions};
use crate::strftime;
use crate::TokenizeError;

/// Reads the wall clock for `strftime_now`, in Unix seconds (UTC).
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// The detail prefix that marks an error raised by the template's own `raise_exception`.
const RAISED: &str = "raise_exception: ";

/// A model's chat templates, compiled once at load.
pub(crate) struct Templates {
    env: Environment<'static>,
    /// Sorted template names; a single unnamed template is called `default`.
    names: Vec<String>,
    sources: Vec<(String, String)>,
    /// True when the model ships a set of named templates rather than one template.
    named: bool,
}

impl std::fmt::Debug for Templates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Templates").field("names", &self.names).finish()
    }
}

impl Templates {
    /// Compiles `(name, source)` pairs; a syntax error names the template at fault.
    pub(crate) fn compile(sources: Vec<(String, String)>, named: bool, clock: Clock) -> Result<Self, TokenizeError> {
        let mut env = new_environment(clock);
        let mut names = Vec::with_capacity(sources.len());
        for (name, source) in &sources {
            env.add_template_owned(name.clone(), rewrite_generation_tags(source))
                .map_err(|e| TokenizeError::TemplateSyntax { name: name.clone(), message: e.to_string() })?;
            names.push(name.clone());
        }
        names.sort();
        Ok(Self { env, names, sources, named })
    }

    /// Picks the template transformers' `get_chat_template` would: the only one, else
    /// `tool_use` when the request has tools (even an empty list), else `default`.
    pub(crate) fn select(&self, has_tools: bool) -> Result<&str, TokenizeError> {
        let has = |n: &str| self.names.iter().any(|x| x == n);
        if !self.named {
            return self.sources.first().map(|(n, _)| n.as_str()).ok_or(TokenizeError::NoChatTemplate);
        }
        if has_tools && has("tool_use") {
            return Ok("tool_use");
        }
        if has("default") {
            return Ok("default");
        }
        if self.names.is_empty() {
            return Err(TokenizeError::NoChatTemplate);
        }
        Err(TokenizeError::NoDefaultTemplate { available: self.names.clone() })
    }

    /// Renders template `name` with `ctx`. Work grows with the template's loops over the input.
    pub(crate) fn render(&self, name: &str, ctx: &Value) -> Result<String, TokenizeError> {
        let tmpl = self.env.get_template(name).map_err(|e| TokenizeError::TemplateRender { message: e.to_string() })?;
        tmpl.render(ctx).map_err(render_error)
    }
}

fn render_error(err: Error) -> TokenizeError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cur {
        if let Some(mj) = e.downcast_ref::<Error>() {
            if let Some(message) = mj.detail().and_then(|d| d.strip_prefix(RAISED)) {
                return TokenizeError::TemplateRaised { message: message.to_owned() };
            }
        }
        cur = e.source();
    }
    TokenizeError::TemplateRender { message: err.to_string() }
}

fn new_environment(clock: Clock) -> Environment<'static> {
    let mut env = Environment::new();
    // The default delimiters with Jinja2's whitespace options as transformers sets them.
    if let Ok(syntax) =
        SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).keep_trailing_newline(false).build()
    {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        let text = pyfmt::py_str(value)?;
        out.write_str(&text).map_err(Error::from)
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: &Value| pyfmt::py_str(v));
    env.add_function("raise_exception", |message: Value| -> Result<Value, Error> {
        let text = pyfmt::py_str(&message)?;
        Err(Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{text}")))
    });
    env.add_function("strftime_now", move |format: String| strftime::format_utc(clock(), &format));
    env
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let mut slots: [Option<Value>; 4] = Default::default();
    for (slot, arg) in slots.iter_mut().zip(args.iter()) {
        *slot = Some(arg.clone());
    }
    for (i, name) in ["ensure_ascii", "indent", "separators", "sort_keys"].iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            slots[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = slots;
    let mut opts = DumpOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..DumpOptions::default()
    };
    opts.indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_owned()),
        Some(v) if v.kind() == ValueKind::Bool => Some(if v.is_true() { " " } else { "" }.to_owned()),
        Some(v) => {
            let n = i64::try_from(v).map_err(|_| bad_arg("indent must be an int or a str"))?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    if let Some(seps) = separators.filter(|v| !v.is_none()) {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] => {
                opts.item_separator = Some(item.as_str().ok_or_else(|| bad_arg("separator"))?.to_owned());
                opts.key_separator = Some(key.as_str().ok_or_else(|| bad_arg("separator"))?.to_owned());
            }
            _ => return Err(bad_arg("separators must be a pair of strings")),
        }
    }
    pyfmt::dumps(value, &opts)
}

fn bad_arg(message: &str) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.to_owned())
}

/// Turns `{% generation %}` / `{% endgeneration %}` (any whitespace control) into
/// `{% if true %}` / `{% endif %}`, which render their body the same way.
pub(crate) fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = split_ws_control(inner, true);
        let (body, trail) = split_ws_control(body, false);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(word) => out.push_str(&format!("{{%{lead} {word} {trail}%}}")),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_ws_control(s: &str, leading: bool) -> (&str, &str) {
    let is_ctl = |c: char| c == '-' || c == '+';
    if leading {
        match s.chars().next() {
            Some(c) if is_ctl(c) => (&s[..1], &s[1..]),
            _ => ("", s),
        }
    } else {
        match s.chars().last() {
            Some(c) if is_ctl(c) => (&s[..s.len() - 1], &s[s.len() - 1..]),
            _ => (s, ""),
        }
    }
}

#[cfg(test)]
mod tests;
