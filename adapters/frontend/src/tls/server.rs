//! `[tls]`: the server's certificate, read again when its files change.
//!
//! Every connection's handshake asks `Current` for the pair serving now, so a reload
//! is one swap under a lock and touches no connection already open. [`ServerTls::watch`]
//! reads both files every `reload_interval_ms` and compares their digests with the last
//! ones it saw, which catches an edit in place, a rename over the file and a swapped
//! symlink (as mounted Kubernetes secrets change) alike, whatever the mtime's grain.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
use tokio::sync::watch;

use super::{certs_of, key_of, provider, read, TlsError};
use crate::config::TlsConfig;

/// Reloads of the certificate by result (`loaded`: a changed pair now serves; `error`:
/// a changed pair did not load and the old one still serves). Clones share the counts.
#[derive(Clone, Debug, Default)]
pub struct TlsReloads(pub(crate) Family<ResultLabels, Counter>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ResultLabels {
    result: &'static str,
}

impl TlsReloads {
    /// How many reloads ended with `result` (`loaded` or `error`).
    pub fn count(&self, result: &'static str) -> u64 {
        self.0.get(&ResultLabels { result }).map_or(0, |c| c.get())
    }

    fn add(&self, result: &'static str) {
        self.0.get_or_create(&ResultLabels { result }).inc();
    }
}

/// The pair every new handshake is served.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(PoisonError::into_inner).clone())
    }
}

/// What the files held when last read: their SHA-256 digests (no second copy of the
/// key stays in memory), or that one could not be read.
#[derive(PartialEq, Eq)]
enum Seen {
    Files { cert: [u8; 32], key: [u8; 32] },
    Unreadable,
}

impl Seen {
    fn files(cert: &[u8], key: &[u8]) -> Seen {
        let digest = |b: &[u8]| {
            let mut out = [0u8; 32];
            out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, b).as_ref());
            out
        };
        Seen::Files { cert: digest(cert), key: digest(key) }
    }
}

/// The server side of `[tls]`: the rustls configuration (ALPN `h2` and `http/1.1`)
/// whose certificate [`ServerTls::reload`] replaces.
pub struct ServerTls {
    config: Arc<ServerConfig>,
    current: Arc<Current>,
    paths: TlsConfig,
    seen: Mutex<Seen>,
    reloads: TlsReloads,
}

impl ServerTls {
    /// Reads the certificate chain and key of `cfg`: an error names the file and what
    /// is wrong with it (missing, not PEM, no certificate, no key, a key that does not
    /// match the certificate).
    pub fn load(cfg: &TlsConfig) -> Result<ServerTls, TlsError> {
        let (cert, key) = (read(&cfg.cert_path)?, read(&cfg.key_path)?);
        let pair = certified(&cfg.cert_path, &cert, &cfg.key_path, &key)?;
        let current = Arc::new(Current(RwLock::new(Arc::new(pair))));
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Rustls)?
            .with_no_client_auth()
            .with_cert_resolver(current.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(ServerTls {
            config: Arc::new(config),
            current,
            paths: cfg.clone(),
            seen: Mutex::new(Seen::files(&cert, &key)),
            reloads: TlsReloads::default(),
        })
    }

    /// The rustls configuration to accept connections with.
    pub fn config(&self) -> Arc<ServerConfig> {
        self.config.clone()
    }

    /// The reload counts, for `/metrics`.
    pub fn reloads(&self) -> TlsReloads {
        self.reloads.clone()
    }

    /// Reads both files again. If they changed since last read and load, the new pair
    /// serves every handshake from now on (`Ok(true)`); unchanged is `Ok(false)`. A
    /// change that does not load leaves the old pair serving, is counted and logged
    /// once, and is returned.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let files = read(&self.paths.cert_path).and_then(|c| Ok((c, read(&self.paths.key_path)?)));
        let seen = match &files {
            Ok((cert, key)) => Seen::files(cert, key),
            Err(_) => Seen::Unreadable,
        };
        {
            let mut last = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            if *last == seen {
                return Ok(false);
            }
            *last = seen;
        }
        let loaded = files.and_then(|(c, k)| certified(&self.paths.cert_path, &c, &self.paths.key_path, &k));
        match loaded {
            Ok(pair) => {
                *self.current.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(pair);
                self.reloads.add("loaded");
                tracing::info!(cert = %self.paths.cert_path.display(), "TLS certificate reloaded");
                Ok(true)
            }
            Err(e) => {
                self.reloads.add("error");
                tracing::warn!(error = %e, "TLS certificate not reloaded; the previous one still serves");
                Err(e)
            }
        }
    }

    /// Reloads every `reload_interval_ms` until `shutdown` turns true; returns at once
    /// if the interval is 0.
    pub async fn watch(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        if self.paths.reload_interval_ms == 0 {
            return;
        }
        let mut tick = tokio::time::interval(Duration::from_millis(self.paths.reload_interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    // File reads block: off the runtime's threads.
                    let me = self.clone();
                    let _ = tokio::task::spawn_blocking(move || me.reload()).await;
                }
                _ = shutdown.changed() => return,
            }
            if *shutdown.borrow() {
                return;
            }
        }
    }
}

/// A chain and its key as rustls serves them; the key must match the first certificate.
fn certified(cert_path: &Path, cert: &[u8], key_path: &Path, key: &[u8]) -> Result<CertifiedKey, TlsError> {
    let chain = certs_of(cert_path, cert)?;
    let key = key_of(key_path, key)?;
    CertifiedKey::from_der(chain, key, &provider()).map_err(|source| TlsError::Key { path: key_path.into(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the files hold before a reload: a pair by index into the test's pairs, a
    /// certificate with another pair's key, garbage, or no certificate file.
    #[derive(Clone, Copy, Debug)]
    enum Files {
        Pair(usize),
        Mismatched,
        Garbage,
        Missing,
    }

    /// One reload: the files written before it, its outcome (`Some(true)` a new pair,
    /// `Some(false)` unchanged, `None` an error), the pair serving after it, and the
    /// `loaded` and `error` counts.
    type Step = (Files, Option<bool>, usize, (u64, u64));

    /// Runs the steps in order from pair 0, checking each.
    #[track_caller]
    fn check(steps: &[Step]) {
        let pairs: Vec<_> =
            (0..2).map(|_| rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap()).collect();
        let dir = std::env::temp_dir().join(format!("kvroute-tls-reload-{}-{:?}", std::process::id(), steps.len()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        let write = |files: Files| {
            let (c, k) = match files {
                Files::Pair(i) => (pairs[i].cert.pem(), pairs[i].signing_key.serialize_pem()),
                Files::Mismatched => (pairs[0].cert.pem(), pairs[1].signing_key.serialize_pem()),
                Files::Garbage => ("garbage".into(), "garbage".into()),
                Files::Missing => {
                    let _ = std::fs::remove_file(&cert);
                    return;
                }
            };
            std::fs::write(&cert, c).unwrap();
            std::fs::write(&key, k).unwrap();
        };
        write(Files::Pair(0));
        let tls = ServerTls::load(&TlsConfig::new(&cert, &key)).unwrap();
        for (i, &(files, want, serving, (loaded, errors))) in steps.iter().enumerate() {
            write(files);
            assert_eq!(tls.reload().ok(), want, "step {i}: {files:?}");
            let served = tls.current.0.read().unwrap().cert[0].to_vec();
            assert_eq!(served, pairs[serving].cert.der().to_vec(), "step {i}: {files:?}");
            assert_eq!((tls.reloads.count("loaded"), tls.reloads.count("error")), (loaded, errors), "step {i}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_changed_pair_serves_and_a_bad_one_is_counted_once() {
        use Files::*;
        // files, reload's outcome, pair serving, (loaded, error) counts
        check(&[
            (Pair(0), Some(false), 0, (0, 0)),
            (Pair(1), Some(true), 1, (1, 0)),
            (Pair(1), Some(false), 1, (1, 0)),
            (Mismatched, None, 1, (1, 1)),
            (Mismatched, Some(false), 1, (1, 1)),
            (Garbage, None, 1, (1, 2)),
            (Missing, None, 1, (1, 3)),
            (Missing, Some(false), 1, (1, 3)),
            (Pair(0), Some(true), 0, (2, 3)),
        ]);
    }
}
