//! The shared configuration file as the picker reads it: keys only a forwarding proxy
//! acts on are refused by name, and the keys the picker honours still load.

use kvroute_epp::EppConfig;
use kvroute_frontend::{ConfigError, ProxyConfig};

const MODELS: &str = "[[models]]\nname = \"m\"\n";

/// Loads `MODELS` plus `extra` with `overrides`; `refused` is the key the error must
/// name, or `None` when the file must load.
#[track_caller]
fn check(extra: &str, overrides: &[(&str, &str)], refused: Option<&str>) {
    let text = format!("{MODELS}{extra}");
    match (EppConfig::proxy_from_toml(&text, overrides), refused) {
        (Ok(_), None) => {}
        (Err(ConfigError::NotHonoured { key, .. }), Some(want)) => assert_eq!(key, want, "{text}"),
        (other, want) => panic!("{text} with {overrides:?}: got {other:?}, want the key {want:?} refused"),
    }
}

#[test]
fn keys_only_a_forwarding_proxy_acts_on_are_refused_by_name() {
    check("[retry]\nretries_max = 1\n", &[], Some("retry"));
    check("[migration]\nattempts_max = 1\n", &[], Some("migration"));
    check("", &[("migration.deadline_ms", "5")], Some("migration"));
    check("[ejection]\nconsecutive_failures = 3\n", &[], Some("ejection"));
    check("[health_check]\ninterval_ms = 0\n", &[], Some("health_check"));
    check("[limits]\nconnect_timeout_ms = 100\n", &[], Some("limits.connect_timeout_ms"));
    check("", &[("listen", "\"127.0.0.1:1\"")], Some("listen"));
    check("", &[("limits.request_timeout_ms", "5")], Some("limits.request_timeout_ms"));
    let split = "[[models]]\nname = \"d\"\ndisagg_protocol = \"vllm-nixl\"\n";
    check(split, &[], Some("models[1].disagg_protocol"));
    check("[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n", &[], Some("tracing"));
    check("[discovery.kubernetes]\nlabel_selector = \"app=vllm\"\n", &[], Some("discovery"));
}

#[test]
fn keys_the_picker_honours_load() {
    check("", &[], None);
    check("[limits]\nbody_bytes_max = 1024\nconcurrent_requests_max = 2\nshutdown_grace_s = 1\n", &[], None);
    check("[router]\nmode = \"round-robin\"\n[trust]\ntoken = \"t\"\n", &[], None);
    check("[replica]\nid = \"picker-a\"\n", &[], None);
    check("[learn]\nscrape_interval_ms = 1000\nengine_load = true\ncosts = true\n", &[], None);
    check("", &[("router.queue_timeout_ms", "5000")], None);
}

/// Every top-level key of the shared file: a document setting it, and whether the
/// picker refuses it. A key the file gains must be placed here.
const TOP_LEVEL: &[(&str, &str, bool)] = &[
    ("listen", "listen = \"127.0.0.1:1\"\n", true),
    ("session_header", "session_header = \"x-s\"\n", false),
    ("dp_rank_header", "dp_rank_header = \"x-r\"\n", false),
    ("default_model", "default_model = \"m\"\n", false),
    ("seed", "seed = 7\n", false),
    ("limits", "[limits]\nbody_bytes_max = 1024\n", false),
    ("trust", "[trust]\ncidrs = [\"127.0.0.1/32\"]\n", false),
    ("retry", "[retry]\nretries_max = 1\n", true),
    ("migration", "[migration]\nattempts_max = 1\n", true),
    ("ejection", "[ejection]\nbase_ms = 10\n", true),
    ("health_check", "[health_check]\npath = \"/h\"\n", true),
    ("router", "[router]\nmode = \"least-loaded\"\n", false),
    ("models", "", false),
    ("workers", "[[workers]]\nid = 1\nurl = \"http://127.0.0.1:1\"\nmodel = \"m\"\n", false),
    ("replica", "[replica]\nid = \"picker-a\"\n", false),
    ("learn", "[learn]\ncosts = true\n", false),
    ("discovery", "[discovery.kubernetes]\nlabel_selector = \"app=vllm\"\n", true),
    ("tracing", "[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n", true),
    ("tenants", "[[tenants]]\nname = \"a\"\napi_key_sha256 = \"00000000000000000000000000000000000000000000000000000000000000aa\"\n", true),
    ("media", "[media]\nitems_max = 4\n", false),
    ("tls", "[tls]\ncert_path = \"c.pem\"\nkey_path = \"k.pem\"\n", true),
    ("upstream_tls", "[upstream_tls]\nca_path = \"ca.pem\"\n", true),
];

#[test]
fn every_top_level_key_is_refused_or_honoured() {
    let probe = ProxyConfig::from_toml_str("__probe__ = 0\n").expect_err("an unknown key").to_string();
    let (_, expected) = probe.split_once("expected").unwrap_or_else(|| panic!("no key list in {probe:?}"));
    let keys: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    let placed: Vec<&str> = TOP_LEVEL.iter().map(|(k, ..)| *k).collect();
    assert_eq!(keys, placed, "the file's top-level keys, in the order the config type declares them");
    for (key, doc, refused) in TOP_LEVEL {
        // Root keys come before the first table.
        let text = format!("{doc}{MODELS}");
        match (EppConfig::proxy_from_toml(&text, &[]), refused) {
            (Ok(_), false) => {}
            (Err(ConfigError::NotHonoured { key: got, .. }), true) => assert_eq!(got, *key, "{text}"),
            (got, _) => panic!("{key}: {text}: got {got:?}, want refused: {refused}"),
        }
    }
}

#[test]
fn the_refusal_says_which_key_and_why() {
    let e = EppConfig::proxy_from_toml(&format!("{MODELS}[retry]\nretries_max = 1\n"), &[]).unwrap_err();
    let text = e.to_string();
    assert!(text.starts_with("retry: not honoured here (") && text.ends_with("; remove it"), "{text}");
}

#[test]
fn a_refused_key_does_not_hide_a_malformed_file() {
    let e = EppConfig::proxy_from_toml("[retry]\nretries_max = \"many\"\n", &[]).unwrap_err();
    assert!(matches!(e, ConfigError::Parse { line: Some(2), .. }), "{e:?}");
}
