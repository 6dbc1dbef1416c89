//! `[[tenants]]` through the configuration parser and [`Tenants::load_with`], each case
//! through one `check`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::sync::atomic::{AtomicU32, Ordering};

use super::*;
use crate::ProxyConfig;

/// The hex SHA-256 of `key`.
fn hex(key: &str) -> String {
    keys::sha256(key.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// What a configuration must give.
enum Want<'a> {
    /// It loads, and each key authenticates as that tenant (or none).
    Keys(&'a [(&'a str, Option<&'a str>)]),
    /// Parsing or loading fails with this message, or one containing it.
    Error(&'a str),
}

/// Parses `toml` as a whole configuration, loads its tenants with `env` as the
/// environment, and compares with `want`.
#[track_caller]
fn check(toml: &str, env: &[(&str, &str)], want: Want<'_>) {
    let env: BTreeMap<String, OsString> = env.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
    let loaded = ProxyConfig::from_toml_str(toml)
        .map_err(|e| e.to_string())
        .and_then(|cfg| Tenants::load_with(&cfg.tenants, &|var| env.get(var).cloned()).map_err(|e| e.to_string()));
    match (loaded, want) {
        (Ok(tenants), Want::Keys(keys)) => {
            for (key, name) in keys {
                let got = tenants.authenticate(key.as_bytes()).map(|t| t.name.as_str());
                assert_eq!(got, *name, "key {key:?}");
            }
        }
        (Err(e), Want::Error(msg)) => assert!(e.contains(msg), "got {e:?}, want {msg:?}"),
        (Ok(t), Want::Error(msg)) => panic!("loaded {t:?}, want the error {msg:?}"),
        (Err(e), Want::Keys(_)) => panic!("refused: {e}"),
    }
}

fn one(name: &str, key: &str) -> String {
    format!("[[tenants]]\nname = {name:?}\napi_key_sha256 = {:?}\n", hex(key))
}

/// A file of `text` in the temp folder, unique to this test run.
fn key_file(text: &str) -> std::path::PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!("kvroute-tenant-keys-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
    let path = std::env::temp_dir().join(name);
    std::fs::write(&path, text).expect("write the key file");
    path
}

#[test]
fn keys_name_their_tenant_and_nothing_else_does() {
    let toml = format!("{}{}", one("team-a", "key-a"), one("team-b", "key-b"));
    check(
        &toml,
        &[],
        Want::Keys(&[
            ("key-a", Some("team-a")),
            ("key-b", Some("team-b")),
            ("key-c", None),
            ("", None),
            ("key-a ", None),
            ("KEY-A", None),
        ]),
    );
    // The hash itself is not a key.
    check(&one("a", "k"), &[], Want::Keys(&[("k", Some("a"))]));
    let h = hex("k");
    check(&one("a", "k"), &[], Want::Keys(&[(h.as_str(), None)]));
}

#[test]
fn rotation_lists_several_hashes_in_either_case() {
    let toml = format!(
        "[[tenants]]\nname = \"a\"\napi_key_sha256 = {:?}\napi_keys_sha256 = [{:?}, {:?}]\n",
        hex("old"),
        hex("new").to_uppercase(),
        hex("newer")
    );
    check(&toml, &[], Want::Keys(&[("old", Some("a")), ("new", Some("a")), ("newer", Some("a")), ("x", None)]));
}

#[test]
fn keys_from_a_file_and_the_environment_are_hashed_at_load() {
    let file = key_file("# team a's keys\n\nfile-key-1\n  file-key-2  \n");
    let toml = format!(
        "[[tenants]]\nname = \"a\"\napi_key_file = {:?}\n[[tenants]]\nname = \"b\"\napi_key_env = \"B_KEYS\"\nadmin = true\n",
        file.display().to_string()
    );
    let keys = [("file-key-1", Some("a")), ("file-key-2", Some("a")), ("env-1", Some("b")), ("env-2", Some("b"))];
    check(&toml, &[("B_KEYS", "env-1\nenv-2")], Want::Keys(&keys));
    check(
        &toml,
        &[("B_KEYS", "env-1\nfile-key-2")],
        Want::Error("tenants[1].api_key_env ($B_KEYS line 2): the same key as tenants[0].api_key_file"),
    );
    check(&toml, &[], Want::Error("tenants[1].api_key_env: the variable B_KEYS is not set"));
    check(&toml, &[("B_KEYS", "has space")], Want::Error("$B_KEYS line 1): the key holds a space"));
    let long = "k".repeat(KEY_BYTES_MAX + 1);
    check(&toml, &[("B_KEYS", &long)], Want::Error("the key is longer than 512 bytes"));
    check(&toml, &[("B_KEYS", "# only a comment")], Want::Error("tenants[1]: tenant \"b\" has no key"));
    let many: String = (0..=KEYS_PER_TENANT_MAX).map(|i| format!("key-{i}\n")).collect();
    check(&toml, &[("B_KEYS", &many)], Want::Error("tenants[1]: more than 64 keys"));
    let bad_var = toml.replace("\"B_KEYS\"", "\"A=B\"");
    check(&bad_var, &[], Want::Error("tenants[1].api_key_env: not a variable name"));
    let _ = std::fs::remove_file(&file);
    check(&toml, &[("B_KEYS", "env-1")], Want::Error("tenants[0].api_key_file: cannot read"));
}

#[test]
fn an_unreadable_key_file_keeps_the_os_error() {
    let cfg = TenantConfig {
        name: "a".into(),
        api_key_file: Some(std::env::temp_dir().join("kvroute-no-such-key-file")),
        ..toml::from_str("name = \"a\"").expect("a bare tenant")
    };
    let e = Tenants::load_with(&[cfg], &|_| None).expect_err("no such file");
    let io = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<std::io::Error>()).expect("an io::Error");
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    assert!(e.to_string().ends_with(&io.to_string()), "{e}");
    let wrapped = crate::ConfigError::Tenant(e);
    let inner = std::error::Error::source(&wrapped).expect("the tenant error");
    assert_eq!(wrapped.to_string(), inner.to_string());
}

#[test]
fn bad_hashes_say_where_and_what() {
    let with = |h: &str| format!("[[tenants]]\nname = \"a\"\napi_key_sha256 = {h:?}\n");
    check(
        &with("abc"),
        &[],
        Want::Error("tenants[0].api_key_sha256: a key hash is the hex SHA-256 of the key, 64 characters, not 3"),
    );
    let not_hex = format!("{}g", &hex("k")[..63]);
    check(&with(&not_hex), &[], Want::Error("tenants[0].api_key_sha256: character 63 is not a hex digit"));
    // 64 characters, some of them more than one byte: not hex, and no panic.
    let wide = format!("{}é", &hex("k")[..63]);
    check(&with(&wide), &[], Want::Error("character 63 is not a hex digit"));
    let list = format!("[[tenants]]\nname = \"a\"\napi_keys_sha256 = [{:?}, \"\"]\n", hex("k"));
    check(
        &list,
        &[],
        Want::Error("tenants[0].api_keys_sha256[1]: a key hash is the hex SHA-256 of the key, 64 characters, not 0"),
    );
}

#[test]
fn a_key_named_twice_is_refused_even_across_tenants() {
    let toml = format!("{}{}", one("a", "k"), one("b", "k"));
    check(&toml, &[], Want::Error("tenants[1].api_key_sha256: the same key as tenants[0].api_key_sha256"));
    let twice =
        format!("[[tenants]]\nname = \"a\"\napi_keys_sha256 = [{:?}, {:?}]\n", hex("k"), hex("k").to_uppercase());
    check(&twice, &[], Want::Error("tenants[0].api_keys_sha256[1]: the same key as tenants[0].api_keys_sha256[0]"));
}

#[test]
fn entries_are_checked() {
    check(
        &format!("{}{}", one("a", "1"), one("a", "2")),
        &[],
        Want::Error("tenants[1].name: \"a\" is also the name of tenants[0]"),
    );
    check(&one("", "1"), &[], Want::Error("tenants[0].name: must be 1 to 64 bytes"));
    check("[[tenants]]\nname = \"a\"\n", &[], Want::Error("tenants[0]: tenant \"a\" has no key"));
    let with = |extra: &str| format!("{}{extra}\n", one("a", "k"));
    check(&with("weight = 0"), &[], Want::Error("tenants[0].weight: 0 is not in 1..=65536"));
    check(&with("weight = 65537"), &[], Want::Error("tenants[0].weight: 65537 is not in 1..=65536"));
    check(&with("requests_per_second = 0"), &[], Want::Error("tenants[0].requests_per_second: must be above 0"));
    check(&with("concurrent_max = 0"), &[], Want::Error("tenants[0].concurrent_max: must be above 0"));
    // Unknown keys and values are refused with their line, as everywhere in the file.
    check(&with("api_key = \"plain\""), &[], Want::Error("line 4: `api_key = \"plain\"`: unknown field `api_key`"));
    check(&with("cache = \"private\""), &[], Want::Error("line 4: `cache = \"private\"`: unknown variant `private`"));
    check(&with("weight = -1"), &[], Want::Error("line 4: `weight = -1`"));
}

#[test]
fn limits_and_defaults_load() {
    let toml = format!(
        "{}requests_per_second = 20\ntokens_per_minute = 200000\nconcurrent_max = 64\nweight = 3\ncache = \"shared\"\nadmin = true\n{}",
        one("a", "ka"),
        one("b", "kb")
    );
    let cfg = ProxyConfig::from_toml_str(&toml).expect("valid");
    let t = Tenants::load_with(&cfg.tenants, &|_| None).expect("loads");
    let a = t.authenticate(b"ka").expect("a");
    assert_eq!(
        (a.id, a.requests_per_second, a.tokens_per_minute, a.concurrent_max, a.weight, a.cache, a.admin),
        (TenantId(0), Some(20), Some(200_000), Some(64), 3, CacheMode::Shared, true)
    );
    let b = t.get(TenantId(1)).expect("b");
    assert_eq!(
        (b.name.as_str(), b.requests_per_second, b.concurrent_max, b.weight, b.cache, b.admin),
        ("b", None, None, 1, CacheMode::Isolated, false)
    );
    let mut q = QueueConfig::default();
    t.apply_to_queue(&mut q);
    assert_eq!((q.tenant_weights, q.tenants_max), (vec![3, 1], 2));
    assert!(Tenants::load_with(&[], &|_| None).expect("none").is_empty());
}

#[test]
fn debug_never_prints_a_hash() {
    let toml = format!("{}api_keys_sha256 = [{:?}]\n", one("a", "k1"), hex("k2"));
    let cfg = ProxyConfig::from_toml_str(&toml).expect("valid");
    let t = Tenants::load_with(&cfg.tenants, &|_| None).expect("loads");
    let printed = format!("{cfg:?} {t:?} {:?}", t.authenticate(b"k1"));
    for h in [hex("k1"), hex("k2")] {
        assert!(!printed.to_lowercase().contains(&h[..16]), "a hash in {printed}");
    }
    assert!(printed.contains("\"a\""), "{printed}");
}

#[test]
fn too_many_tenants_or_keys_are_refused() {
    let many: String = (0..=TENANTS_MAX).map(|i| one(&format!("t{i}"), &format!("k{i}"))).collect();
    check(&many, &[], Want::Error("tenants: 1025 entries, at most 1024"));
    let hashes: Vec<String> = (0..=KEYS_PER_TENANT_MAX).map(|i| format!("{:?}", hex(&i.to_string()))).collect();
    let toml = format!("[[tenants]]\nname = \"a\"\napi_keys_sha256 = [{}]\n", hashes.join(", "));
    check(&toml, &[], Want::Error("tenants[0]: more than 64 keys"));
}

#[test]
fn an_isolated_tenants_salt_is_its_own_and_leads_a_clients() {
    let load = |toml: &str| Tenants::load_with(&ProxyConfig::from_toml_str(toml).unwrap().tenants, &|_| None).unwrap();
    let entry = |name: &str, key: &str, cache: &str| {
        format!("[[tenants]]\nname = \"{name}\"\napi_key_sha256 = \"{}\"\ncache = \"{cache}\"\n", hex(key))
    };
    let salt = |t: &Tenants, i: u16| t.get(TenantId(i)).unwrap().cache_salt.clone();
    let one = load(&[entry("a", "k1", "isolated"), entry("b", "k2", "isolated"), entry("s", "k3", "shared")].concat());
    let again = load(&[entry("a", "k1", "isolated"), entry("b", "k9", "isolated")].concat());
    let a = salt(&one, 0).unwrap();
    assert_eq!(Some(a.clone()), salt(&again, 0), "the same name and key give the same salt across restarts");
    assert_ne!(salt(&one, 1), salt(&again, 1), "another key, another salt");
    assert_ne!(Some(a.clone()), salt(&one, 1));
    assert_eq!(salt(&one, 2), None, "a shared tenant is unsalted");
    let plain = a.combine(None);
    assert_eq!(a.combine(Some("")), plain);
    assert_eq!(a.combine(Some("x")), format!("{plain}:x"));
    assert!(!format!("{a:?}").contains(&plain), "the salt is not printed");
}

#[test]
fn a_tenants_models_restrict_what_it_may_use() {
    let models = "[[models]]\nname = \"m\"\n[[models]]\nname = \"n\"\n[[models]]\nname = \"o\"\n";
    let toml = format!("{models}{}models = [\"m\", \"n\"]\n{}", one("a", "ka"), one("b", "kb"));
    let t = Tenants::load_with(&ProxyConfig::from_toml_str(&toml).expect("valid").tenants, &|_| None).expect("loads");
    let (a, b) = (t.authenticate(b"ka").expect("a"), t.authenticate(b"kb").expect("b"));
    for (pool, a_may, b_may) in [("m", true, true), ("n", true, true), ("o", false, true), ("", false, true)] {
        assert_eq!((a.may_use(pool), b.may_use(pool)), (a_may, b_may), "{pool:?}");
    }
    let bad = format!("{models}{}models = \"m\"\n", one("a", "ka"));
    assert!(ProxyConfig::from_toml_str(&bad).is_err(), "a list, not a string");
    check(&format!("{models}{}models = [\"m\", \"mm\"]\n", one("a", "ka")), &[], Want::Error("tenants[0].models"));
}

/// `body` with the salt of `a` put in front parses to the same object plus the salt,
/// or is left to the caller (`None`).
#[track_caller]
fn check_prepend(body: &str, spliced: bool) {
    let t = Tenants::load_with(&ProxyConfig::from_toml_str(&one("a", "k")).unwrap().tenants, &|_| None).unwrap();
    let salt = t.get(TenantId(0)).unwrap().cache_salt.clone().unwrap();
    let got = salt.prepend_to(body.as_bytes());
    assert_eq!(got.is_some(), spliced, "{body}");
    let Some(got) = got else { return };
    let mut want: serde_json::Value = serde_json::from_str(body).unwrap();
    want["cache_salt"] = salt.combine(None).into();
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&got).unwrap(), want, "{body}");
    assert!(got.ends_with(body.trim_start().strip_prefix('{').unwrap().as_bytes()), "the client's bytes follow");
}

#[test]
fn the_salt_goes_in_front_of_the_clients_bytes() {
    check_prepend(r#"{"model":"m","prompt":"x"}"#, true);
    check_prepend(" \n\t{ \"model\" : \"m\",\n \"messages\": [] } ", true);
    check_prepend("{}", true);
    check_prepend("{ }", true);
    check_prepend(r#"{"model":"m","prompt":"caf\u00e9 \"q\""}"#, true);
    check_prepend("[1]", false);
    check_prepend("", false);
    check_prepend("  ", false);
}
