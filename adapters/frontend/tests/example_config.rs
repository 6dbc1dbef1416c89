//! `kvroute.example.toml` lists every key the configuration accepts.
//!
//! The key set comes from the config types themselves: every table is probed with an
//! unknown key, and `deny_unknown_fields` answers with the full list of fields that
//! table accepts. A field that itself answers a probe (as a table or an array of tables)
//! is a nested section, walked the same way. The example's keys are read with its
//! commented-out lines (`# key = value`, `# [section]`) counted, since keys without a
//! default are shown that way.

use std::collections::BTreeSet;

use kvroute_frontend::ProxyConfig;

const EXAMPLE: &str = include_str!("../kvroute.example.toml");
const PROBE: &str = "__probe__";

/// One step of a key path: a table, or an array of tables.
#[derive(Clone)]
enum Seg {
    Table(String),
    Array(String),
}

fn dotted(path: &[Seg]) -> String {
    let parts: Vec<String> = path
        .iter()
        .map(|s| match s {
            Seg::Table(k) => k.clone(),
            Seg::Array(k) => format!("{k}[]"),
        })
        .collect();
    parts.join(".")
}

/// A document holding only a probe key at `path`.
fn probe_doc(path: &[Seg]) -> toml::Value {
    let mut v = toml::Value::Table(toml::Table::from_iter([(PROBE.to_string(), toml::Value::Integer(0))]));
    for seg in path.iter().rev() {
        v = match seg {
            Seg::Table(k) => toml::Value::Table(toml::Table::from_iter([(k.clone(), v)])),
            Seg::Array(k) => toml::Value::Table(toml::Table::from_iter([(k.clone(), toml::Value::Array(vec![v]))])),
        };
    }
    v
}

/// The fields the table at `path` accepts, or `None` if `path` is not a table of a
/// struct with `deny_unknown_fields`.
fn fields_at(path: &[Seg]) -> Option<Vec<String>> {
    let text = toml::to_string(&probe_doc(path)).expect("probe serializes");
    let err = toml::from_str::<ProxyConfig>(&text).err()?.to_string();
    let (_, expected) = err.split_once(&format!("unknown field `{PROBE}`, expected"))?;
    let names = expected.split('`').skip(1).step_by(2).map(str::to_string).collect::<Vec<_>>();
    assert!(!names.is_empty(), "cannot read the fields from {err:?}");
    Some(names)
}

/// Every key path the config types accept, e.g. `workers[].kv_events`.
fn type_keys(path: Vec<Seg>, out: &mut BTreeSet<String>) {
    let Some(fields) = fields_at(&path) else { return };
    for f in fields {
        let as_table = [path.clone(), vec![Seg::Table(f.clone())]].concat();
        let as_array = [path.clone(), vec![Seg::Array(f.clone())]].concat();
        if fields_at(&as_table).is_some() {
            type_keys(as_table, out);
        } else if fields_at(&as_array).is_some() {
            type_keys(as_array, out);
        } else {
            out.insert(dotted(&as_table));
        }
    }
}

/// The example with `# key = value` and `# [section]` lines uncommented.
fn uncommented(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let body = line.trim_start().strip_prefix('#').map(str::trim_start);
        let is_key = |s: &str| {
            let name: String = s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            !name.is_empty() && s[name.len()..].trim_start().starts_with('=')
        };
        match body {
            Some(b)
                if b.starts_with("[")
                    && b[1..].trim_start_matches('[').starts_with(|c: char| c.is_ascii_lowercase()) =>
            {
                out.push_str(b)
            }
            Some(b) if is_key(b) => out.push_str(b),
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

fn example_keys(v: &toml::Value, prefix: &str, out: &mut BTreeSet<String>) {
    let Some(t) = v.as_table() else { return };
    for (k, v) in t {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            toml::Value::Table(_) => example_keys(v, &key, out),
            toml::Value::Array(items) if items.iter().any(toml::Value::is_table) => {
                for item in items {
                    example_keys(item, &format!("{key}[]"), out);
                }
            }
            _ => {}
        }
        out.insert(key);
    }
}

#[test]
fn the_example_lists_every_config_key() {
    let mut want = BTreeSet::new();
    type_keys(Vec::new(), &mut want);
    for key in ["listen", "workers[].kv_events", "workers[].kv_events_replay", "replica.id", "router.classes[].name"] {
        assert!(want.contains(key), "the probe found {key} in the config types: {want:?}");
    }
    let full = uncommented(EXAMPLE);
    let doc: toml::Value = toml::from_str(&full).expect("the example, uncommented, is TOML");
    let mut have = BTreeSet::new();
    example_keys(&doc, "", &mut have);
    let missing: Vec<&String> = want.difference(&have).collect();
    assert!(missing.is_empty(), "kvroute.example.toml lacks these keys: {missing:?}");
    // Its commented-out keys are real keys too: the uncommented example parses.
    if let Err(e) = toml::from_str::<ProxyConfig>(&full) {
        panic!("the example with its commented keys uncommented does not parse: {e}");
    }
}

#[test]
fn probing_finds_nested_sections_and_stops_at_values() {
    assert!(fields_at(&[]).is_some_and(|f| f.contains(&"router".to_string())));
    assert!(fields_at(&[Seg::Table("router".into())]).is_some_and(|f| f.contains(&"mode".to_string())));
    assert!(fields_at(&[Seg::Array("workers".into()), Seg::Array("taints".into())]).is_some());
    assert!(fields_at(&[Seg::Table("router".into()), Seg::Table("mode".into())]).is_none());
    assert!(fields_at(&[Seg::Array("workers".into()), Seg::Table("labels".into())]).is_none());
}
