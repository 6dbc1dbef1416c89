//! Keys a server does not honour. `kvroute serve` and `kvroute epp` read the same file,
//! but the picker forwards nothing, so it refuses the keys only a forwarding proxy
//! acts on instead of ignoring them without a word.

use super::load::{override_value, parse_error, set_dotted};
use super::{ConfigError, ProxyConfig};

/// A key a server refuses, and why it does not honour it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefusedKey {
    /// Dotted, e.g. `retry` (a whole section), `limits.connect_timeout_ms`, or
    /// `models.disagg_protocol` (that key in any `[[models]]` entry).
    pub key: &'static str,
    /// Why it is not honoured, for the error.
    pub reason: &'static str,
}

impl ProxyConfig {
    /// As [`ProxyConfig::from_toml_with_overrides`], and then refuses the document or
    /// the overrides if they set any of `refused`, naming the first such key. Work is
    /// linear in the document times `refused.len()`.
    pub fn from_toml_refusing(
        text: &str,
        overrides: &[(&str, &str)],
        refused: &[RefusedKey],
    ) -> Result<Self, ConfigError> {
        let cfg = Self::from_toml_with_overrides(text, overrides)?;
        let mut table: toml::Table = toml::from_str(text).map_err(|e| parse_error(text, &e))?;
        for (key, raw) in overrides {
            set_dotted(&mut table, key, override_value(raw))
                .map_err(|message| ConfigError::Invalid { key: (*key).to_string(), message })?;
        }
        for r in refused {
            if let Some(key) = find(&table, r.key) {
                return Err(ConfigError::NotHonoured { key, reason: r.reason });
            }
        }
        Ok(cfg)
    }
}

/// Where `dotted` is set in `table`, with array indices (`models[1].disagg_protocol`).
fn find(table: &toml::Table, dotted: &str) -> Option<String> {
    let (head, rest) = match dotted.split_once('.') {
        Some((h, r)) => (h, Some(r)),
        None => (dotted, None),
    };
    let value = table.get(head)?;
    let Some(rest) = rest else { return Some(head.to_string()) };
    match value {
        toml::Value::Table(t) => find(t, rest).map(|k| format!("{head}.{k}")),
        toml::Value::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            let t = item.as_table()?;
            find(t, rest).map(|k| format!("{head}[{i}].{k}"))
        }),
        _ => None,
    }
}
