//! TLS with rustls (the `ring` provider): the client side every `https` connection the
//! router makes goes through ([`client_config`], [`https_connector`]), and the server
//! side of `[tls]` ([`ServerTls`], whose certificate is read again when its files change).
//!
//! Certificates and keys are PEM files. Every failure to load one is a [`TlsError`]
//! naming the file, never a panic: at start-up it stops the server; on a reload it
//! leaves the pair already serving in place.

mod server;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use hyper_util::client::legacy::connect::HttpConnector;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

pub use server::{ServerTls, TlsReloads};

/// The connector of hyper's pooled client for `http` and `https` URLs alike.
pub type HttpsConnector = hyper_rustls::HttpsConnector<HttpConnector>;

/// The crypto provider every TLS config here is built with.
// rustls 0.23.48 deprecates ring's provider for lacking post-quantum key exchange; ring
// stays, as the NATS client's provider is ring too and aws-lc would add a C build.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The client configuration for `https` workers and collectors: the roots of
/// `ca_path` (a PEM bundle) when given, else the system's, and no ALPN (HTTP/1.1).
pub fn client_config(ca_path: Option<&Path>) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = match ca_path {
        Some(p) => Arc::new(roots_from(p)?),
        None => system_roots(),
    };
    let cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// hyper's connector over `http`, speaking TLS to `https` URLs with `tls`.
pub fn https_connector(http: HttpConnector, tls: &ClientConfig) -> HttpsConnector {
    let mut http = http;
    http.enforce_http(false);
    // hyper-rustls sets ALPN itself and refuses a config that has one.
    let mut tls = tls.clone();
    tls.alpn_protocols.clear();
    hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http().enable_http1().wrap_connector(http)
}

/// The trust anchors of a PEM bundle; a bundle with none is an error.
fn roots_from(path: &Path) -> Result<RootCertStore, TlsError> {
    let certs = read_certs(path)?;
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(TlsError::NoCertificate { path: path.to_path_buf() });
    }
    Ok(roots)
}

/// The system's roots, read once per process: every server in it shares them.
fn system_roots() -> Arc<RootCertStore> {
    static ROOTS: OnceLock<Arc<RootCertStore>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            let mut roots = RootCertStore::empty();
            let (added, _ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                tracing::warn!(
                    errors = found.errors.len(),
                    "no system root certificates: https workers and collectors will fail verification unless \
                     upstream_tls.ca_path names a bundle"
                );
            }
            Arc::new(roots)
        })
        .clone()
}

/// Every certificate of a PEM file, in order; none is an error.
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path)?;
    certs_of(path, &bytes)
}

fn certs_of(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem { path: path.to_path_buf(), source })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate { path: path.to_path_buf() });
    }
    Ok(certs)
}

fn key_of(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|source| match source {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::NoKey { path: path.to_path_buf() },
        source => TlsError::Pem { path: path.to_path_buf(), source },
    })
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.to_path_buf(), source })
}

/// Why a certificate, key or CA bundle could not be used.
#[derive(Debug)]
#[non_exhaustive]
pub enum TlsError {
    /// The file could not be read.
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not well-formed PEM.
    Pem {
        /// The file.
        path: PathBuf,
        /// What the PEM reader found.
        source: rustls::pki_types::pem::Error,
    },
    /// The file holds no certificate (or, as a CA bundle, none usable as a root).
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// The file holds no private key.
    NoKey {
        /// The file.
        path: PathBuf,
    },
    /// The key is of a kind the provider cannot sign with, or does not match the
    /// certificate.
    Key {
        /// The key's file.
        path: PathBuf,
        /// What rustls said.
        source: rustls::Error,
    },
    /// rustls refused the configuration itself.
    Rustls(rustls::Error),
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsError::Read { path, source } => write!(f, "cannot read {}: {source}", path.display()),
            TlsError::Pem { path, source } => write!(f, "{}: malformed PEM: {source}", path.display()),
            TlsError::NoCertificate { path } => write!(f, "{}: no certificate found", path.display()),
            TlsError::NoKey { path } => write!(f, "{}: no private key found", path.display()),
            TlsError::Key { path, source } => write!(f, "{}: unusable key: {source}", path.display()),
            TlsError::Rustls(e) => write!(f, "TLS configuration: {e}"),
        }
    }
}

impl std::error::Error for TlsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TlsError::Read { source, .. } => Some(source),
            TlsError::Pem { source, .. } => Some(source),
            TlsError::Key { source, .. } | TlsError::Rustls(source) => Some(source),
            TlsError::NoCertificate { .. } | TlsError::NoKey { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a certificate or key file holding `pem` loads as: `Ok(count)` of
    /// certificates or keys, or the error's kind.
    #[track_caller]
    fn check(pem: &str, want_certs: Result<usize, &str>, want_key: Result<(), &str>) {
        let path = Path::new("x.pem");
        let kind = |e: TlsError| format!("{e:?}").split([' ', '(', '{']).next().unwrap_or("").to_string();
        assert_eq!(certs_of(path, pem.as_bytes()).map(|c| c.len()).map_err(kind), want_certs.map_err(String::from));
        assert_eq!(key_of(path, pem.as_bytes()).map(|_| ()).map_err(kind), want_key.map_err(String::from));
    }

    #[test]
    fn pem_files_load_or_say_what_is_missing() {
        let c = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert, key) = (c.cert.pem(), c.signing_key.serialize_pem());
        check(&cert, Ok(1), Err("NoKey"));
        check(&format!("{cert}{cert}"), Ok(2), Err("NoKey"));
        check(&key, Err("NoCertificate"), Ok(()));
        check(&format!("{cert}{key}"), Ok(1), Ok(()));
        check("", Err("NoCertificate"), Err("NoKey"));
        check("not pem at all", Err("NoCertificate"), Err("NoKey"));
        check("-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n", Err("Pem"), Err("Pem"));
    }

    #[test]
    fn a_ca_bundle_must_hold_a_root() {
        let e = client_config(Some(Path::new("/nonexistent/ca.pem"))).unwrap_err();
        assert!(matches!(e, TlsError::Read { .. }), "{e:?}");
        assert!(e.to_string().contains("ca.pem"), "{e}");
    }
}
