//! Python's text forms of template values: `json.dumps` (behind the `tojson` filter that
//! transformers installs) and `str()` (what Jinja2 prints for `{{ value }}`). It leaves
//! everything about when to call them to `template.rs`.
//!
//! Chat templates print tool schemas with `tojson`, so every space, escape and key order
//! here ends up in the prompt's tokens. The rules follow CPython's `json` module:
//! separators `", "`/`": "` without indent and `","`/`": "` with one, `ensure_ascii=False`
//! by default (only `"`, `\` and control characters are escaped, as `\n` or `\u00XX`),
//! floats as `repr` (`1e+16`, `1e-05`, `2.0`).

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Options of Python's `json.dumps` that chat templates pass to `tojson`.
#[derive(Debug, Clone, Default)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None` prints on one line; `Some(s)` breaks lines and indents by `s` per level.
    pub indent: Option<String>,
    pub item_separator: Option<String>,
    pub key_separator: Option<String>,
    pub sort_keys: bool,
}

/// `json.dumps(value, ...)` with Python's defaults for what `opts` leaves unset.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let item_sep = match (&opts.item_separator, &opts.indent) {
        (Some(s), _) => s.as_str(),
        (None, Some(_)) => ",",
        (None, None) => ", ",
    };
    let key_sep = opts.key_separator.as_deref().unwrap_or(": ");
    let mut out = String::new();
    let mut w = Dumper { opts, item_sep, key_sep, out: &mut out };
    w.value(value, 0)?;
    Ok(out)
}

struct Dumper<'a> {
    opts: &'a DumpOptions,
    item_sep: &'a str,
    key_sep: &'a str,
    out: &'a mut String,
}

impl Dumper<'_> {
    fn value(&mut self, v: &Value, depth: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self.out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.number(v, true)?,
            ValueKind::String => json_string(self.out, v.as_str().unwrap_or(""), self.opts.ensure_ascii),
            ValueKind::Seq | ValueKind::Iterable => self.seq(v, depth)?,
            ValueKind::Map => self.map(v, depth)?,
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("Object of kind {} is not JSON serializable", v.kind()),
                ))
            }
        }
        Ok(())
    }

    fn number(&mut self, v: &Value, json: bool) -> Result<(), Error> {
        if v.is_integer() {
            self.out.push_str(&v.to_string());
        } else {
            let f = f64::try_from(v.clone()).map_err(|_| Error::new(ErrorKind::InvalidOperation, "bad number"))?;
            push_float(self.out, f, json);
        }
        Ok(())
    }

    fn newline(&mut self, depth: usize) {
        if let Some(indent) = &self.opts.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }

    fn seq(&mut self, v: &Value, depth: usize) -> Result<(), Error> {
        let items: Vec<Value> = v.try_iter()?.collect();
        if items.is_empty() {
            self.out.push_str("[]");
            return Ok(());
        }
        self.out.push('[');
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                self.out.push_str(self.item_sep);
            }
            self.newline(depth + 1);
            self.value(item, depth + 1)?;
        }
        self.newline(depth);
        self.out.push(']');
        Ok(())
    }

    fn map(&mut self, v: &Value, depth: usize) -> Result<(), Error> {
        let mut pairs = Vec::new();
        for key in v.try_iter()? {
            let item = v.get_item(&key)?;
            pairs.push((json_key(&key)?, item));
        }
        if self.opts.sort_keys {
            pairs.sort_by(|a, b| a.0.cmp(&b.0));
        }
        if pairs.is_empty() {
            self.out.push_str("{}");
            return Ok(());
        }
        self.out.push('{');
        for (i, (key, item)) in pairs.iter().enumerate() {
            if i > 0 {
                self.out.push_str(self.item_sep);
            }
            self.newline(depth + 1);
            json_string(self.out, key, self.opts.ensure_ascii);
            self.out.push_str(self.key_sep);
            self.value(item, depth + 1)?;
        }
        self.newline(depth);
        self.out.push('}');
        Ok(())
    }
}

/// Python's `json` turns non-string keys into strings the way it prints them as values.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or("").to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::Number => {
            let mut s = String::new();
            Dumper { opts: &DumpOptions::default(), item_sep: "", key_sep: "", out: &mut s }.number(key, true)?;
            s
        }
        _ => return Err(Error::new(ErrorKind::InvalidOperation, "keys must be str, int, float, bool or None")),
    })
}

fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => push_u_escape(out, c as u32),
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    push_u_escape(out, u32::from(*unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn push_u_escape(out: &mut String, unit: u32) {
    out.push_str(&format!("\\u{unit:04x}"));
}

/// Python's `repr(float)`: shortest round-trip digits, scientific below 1e-4 and from 1e16.
fn push_float(out: &mut String, f: f64, json: bool) {
    if f.is_nan() {
        out.push_str(if json { "NaN" } else { "nan" });
        return;
    }
    if f.is_infinite() {
        let s = match (json, f > 0.0) {
            (true, true) => "Infinity",
            (true, false) => "-Infinity",
            (false, true) => "inf",
            (false, false) => "-inf",
        };
        out.push_str(s);
        return;
    }
    // `{:e}` gives the shortest round-trip digits as `d.ddde-N`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    out.push_str(sign);
    if !(-4..16).contains(&exp) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let e_sign = if exp < 0 { '-' } else { '+' };
        out.push_str(&format!("e{e_sign}{:02}", exp.abs()));
    } else if exp < 0 {
        out.push_str("0.");
        for _ in 0..(-exp - 1) {
            out.push('0');
        }
        out.push_str(&digits);
    } else {
        let point = exp as usize + 1;
        if digits.len() <= point {
            out.push_str(&digits);
            for _ in digits.len()..point {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            out.push_str(&digits[..point]);
            out.push('.');
            out.push_str(&digits[point..]);
        }
    }
}

/// Python's `str(value)`: what Jinja2 prints for `{{ value }}` and the `string` filter.
pub(crate) fn py_str(value: &Value) -> Result<String, Error> {
    match value.kind() {
        ValueKind::Undefined => Ok(String::new()),
        ValueKind::String => Ok(value.as_str().unwrap_or("").to_owned()),
        _ => {
            let mut out = String::new();
            py_repr(&mut out, value)?;
            Ok(out)
        }
    }
}

fn py_repr(out: &mut String, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => {
            let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
            push_float(out, f, false);
        }
        ValueKind::String => py_repr_str(out, value.as_str().unwrap_or("")),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &item)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &key)?;
                out.push_str(": ");
                py_repr(out, &value.get_item(&key)?)?;
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
    Ok(())
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
fn py_repr_str(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests;
