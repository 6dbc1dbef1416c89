//! `tenant_auth`: the `[[tenants]]` of a configuration and the `Authorization` headers
//! of requests, through the loader and the check the proxy runs on each request's head.

use http::header::{HeaderMap, HeaderValue, AUTHORIZATION};
use kvroute_proxy::auth::{admin_refusal, authenticate, Caller};
use kvroute_proxy::config::ProxyConfig;
use kvroute_proxy::tenants::Tenants;

/// The plain key every `api_key_env` variable holds, whatever its name.
pub const ENV_KEY: &str = "fuzz-env-key-0123456789";

/// Headers read per input at most.
const HEADERS_MAX: usize = 16;

/// `data` is a configuration (lossily UTF-8), then a line `---`, then one
/// `Authorization` value per line (raw bytes). Key files are not read (their paths are
/// cleared, so an input cannot name a device); every variable holds [`ENV_KEY`].
///
/// Checks: nothing panics; a configuration the file check accepts either loads or
/// names a tenant that had only its file; without tenants every request is open; with
/// them, each header authenticates the same way twice, a refusal is a 401
/// `invalid_api_key` that never quotes the header, and [`ENV_KEY`] names the first
/// tenant with a variable.
pub fn tenant_auth(data: &[u8]) {
    let split = data.windows(5).position(|w| w == b"\n---\n");
    let (config, headers) = match split {
        Some(at) => (&data[..at], &data[at + 5..]),
        None => (data, &[][..]),
    };
    let text = String::from_utf8_lossy(config);
    let Ok(mut cfg) = ProxyConfig::from_toml_str(&text) else { return };
    let had_file: Vec<bool> = cfg.tenants.iter().map(|t| t.api_key_file.is_some()).collect();
    for t in &mut cfg.tenants {
        t.api_key_file = None;
    }
    let tenants = match Tenants::load_with(&cfg.tenants, &|_| Some(ENV_KEY.into())) {
        Ok(t) => t,
        Err(e) => {
            // Written hashes passed the file check; what fails is a key read at load:
            // a tenant left without one, or the variable's key named twice.
            let shown = e.to_string();
            let env_users = cfg.tenants.iter().filter(|t| t.api_key_env.is_some()).count();
            assert!(had_file.iter().any(|&f| f) || env_users > 0, "load refused what check accepted: {shown}");
            return;
        }
    };
    let env_tenant = cfg.tenants.iter().position(|t| t.api_key_env.is_some());
    let env_header = format!("Bearer {ENV_KEY}");
    let lines = headers.split(|&b| b == b'\n').take(HEADERS_MAX);
    for value in lines.chain([env_header.as_bytes()]) {
        check_header(&tenants, value, env_tenant);
    }
}

fn check_header(tenants: &Tenants, value: &[u8], env_tenant: Option<usize>) {
    let Ok(v) = HeaderValue::from_bytes(value) else { return };
    let mut h = HeaderMap::new();
    h.insert(AUTHORIZATION, v);
    let got = authenticate(tenants, &h);
    assert_eq!(got, authenticate(tenants, &h), "the same header twice");
    match &got {
        Ok(Caller::Open) => assert!(tenants.is_empty()),
        Ok(Caller::Tenant { id, admin }) => {
            let t = tenants.get(*id).expect("a known tenant");
            assert_eq!(t.admin, *admin);
        }
        Err(e) => {
            assert_eq!((e.status.as_u16(), e.code), (401, "invalid_api_key"));
            assert_eq!(e.message, refusal_of_another_key(tenants, value), "the refusal depends on the key");
        }
    }
    if value == format!("Bearer {ENV_KEY}").as_bytes() {
        let want = env_tenant.map(|i| i as u16);
        assert_eq!(got.as_ref().ok().and_then(Caller::tenant).map(|t| t.0), want, "the variable's key");
    }
    let refusal = admin_refusal(false, &got);
    assert_eq!(refusal.is_none(), got.as_ref().is_ok_and(Caller::admin));
}

/// The refusal of `value` with each visible byte of its key turned into `k` (same
/// length, same scheme, same blanks): a message that does not quote the key is the same.
fn refusal_of_another_key(tenants: &Tenants, value: &[u8]) -> String {
    let scheme = b"bearer ".len();
    let mut other = value.to_vec();
    if other.len() > scheme && other[..scheme].eq_ignore_ascii_case(b"bearer ") {
        for b in &mut other[scheme..] {
            if b.is_ascii_graphic() || !b.is_ascii() {
                *b = b'k';
            }
        }
    }
    let mut h = HeaderMap::new();
    h.insert(AUTHORIZATION, HeaderValue::from_bytes(&other).expect("still a header value"));
    authenticate(tenants, &h).map_or_else(|e| e.message, |c| format!("accepted as {c:?}"))
}
