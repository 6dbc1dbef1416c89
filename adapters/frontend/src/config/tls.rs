//! `[tls]` (serving clients over TLS) and `[upstream_tls]` (what `https://` workers and
//! OTLP collectors are verified against). The running side is [`crate::tls`].

use std::path::PathBuf;

use serde::Deserialize;

/// `[tls]`: the proxy serves TLS instead of plaintext HTTP, with the certificate chain
/// and key read from PEM files, and reads them again when they change.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The certificate chain, PEM, the server's certificate first (required).
    pub cert_path: PathBuf,
    /// Its private key, PEM: PKCS#8, PKCS#1 (RSA) or SEC1 (EC) (required).
    pub key_path: PathBuf,
    /// How often both files are read again, in ms (default 10,000; 0 never). A pair
    /// that changed and loads serves every new connection; one that does not load
    /// (unreadable, malformed, key not matching the certificate) leaves the old pair
    /// serving and is logged and counted in `kvroute_tls_reloads_total{result="error"}`.
    #[serde(default = "reload_interval_ms")]
    pub reload_interval_ms: u64,
}

fn reload_interval_ms() -> u64 {
    10_000
}

impl TlsConfig {
    /// A section serving `cert_path` and `key_path`, reloaded at the default interval.
    pub fn new(cert_path: impl Into<PathBuf>, key_path: impl Into<PathBuf>) -> Self {
        TlsConfig { cert_path: cert_path.into(), key_path: key_path.into(), reload_interval_ms: reload_interval_ms() }
    }

    /// What types alone cannot check: the key (under `tls.`) and what is wrong. The
    /// files themselves are read at start-up, not here.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.cert_path.as_os_str().is_empty() {
            return Err(("tls.cert_path", "must not be empty".into()));
        }
        if self.key_path.as_os_str().is_empty() {
            return Err(("tls.key_path", "must not be empty".into()));
        }
        Ok(())
    }
}

/// `[upstream_tls]`: how the proxy verifies the servers it reaches over `https`:
/// workers (requests, health checks, metrics scrapes) and the OTLP collector.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamTlsConfig {
    /// A PEM bundle of the certificate authorities trusted, replacing the system's
    /// roots (default none: the system's roots). Read once at start-up.
    pub ca_path: Option<PathBuf>,
}

impl UpstreamTlsConfig {
    /// What types alone cannot check: the key and what is wrong.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        match &self.ca_path {
            Some(p) if p.as_os_str().is_empty() => Err(("upstream_tls.ca_path", "must not be empty".into())),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::ProxyConfig;

    /// `text` loads with the given `[tls]` reload interval and `ca_path`, or fails
    /// naming `key`.
    #[track_caller]
    fn check(text: &str, want: Result<(Option<u64>, Option<&str>), &str>) {
        let got = ProxyConfig::from_toml_str(text);
        match (got, want) {
            (Ok(cfg), Ok((interval, ca))) => {
                assert_eq!(cfg.tls.map(|t| t.reload_interval_ms), interval, "{text}");
                let ca_got = cfg.upstream_tls.ca_path.as_ref().map(|p| p.to_str().unwrap().to_string());
                assert_eq!(ca_got.as_deref(), ca, "{text}");
            }
            (Err(e), Err(key)) => assert!(e.to_string().contains(key), "{text}: {e}"),
            (got, want) => panic!("{text}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn the_sections_are_read_and_checked() {
        check("", Ok((None, None)));
        check("[tls]\ncert_path = \"c.pem\"\nkey_path = \"k.pem\"\n", Ok((Some(10_000), None)));
        check("[tls]\ncert_path = \"c.pem\"\nkey_path = \"k.pem\"\nreload_interval_ms = 0\n", Ok((Some(0), None)));
        check("[upstream_tls]\nca_path = \"ca.pem\"\n", Ok((None, Some("ca.pem"))));
        check("[tls]\ncert_path = \"c.pem\"\n", Err("key_path"));
        check("[tls]\ncert_path = \"\"\nkey_path = \"k.pem\"\n", Err("tls.cert_path"));
        check("[tls]\ncert_path = \"c.pem\"\nkey_path = \"\"\n", Err("tls.key_path"));
        check("[tls]\ncert_path = \"c\"\nkey_path = \"k\"\nreload_s = 1\n", Err("reload_s"));
        check("[upstream_tls]\nca_path = \"\"\n", Err("upstream_tls.ca_path"));
        check("[upstream_tls]\nroots = \"system\"\n", Err("roots"));
    }
}
