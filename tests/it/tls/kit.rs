//! What the TLS scenarios share: certificate authorities made in the test, files that
//! are replaced atomically, a sim-worker and a proxy over it, a TLS front for plain
//! servers, and clients that trust one CA.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_frontend::tls::{client_config, https_connector, HttpsConnector};
use kvroute_proxy::{ProxyConfig, ServeHandle, Tokenizers};
use kvroute_sim_server::{EngineConfig, SimServerConfig, SimServerHandle};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::ServerName;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};

pub const MODEL: &str = "m";

/// A certificate authority made for one test.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate chain and its key, PEM.
#[derive(Clone)]
pub struct Leaf {
    pub cert: String,
    pub key: String,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Ca { issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap() }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A server certificate for loopback (`127.0.0.1` and `localhost`), its CN `name`.
    pub fn leaf(&self, name: &str) -> Leaf {
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf { cert: cert.pem(), key: key.serialize_pem() }
    }
}

/// A folder of this test's files, removed at the end.
pub struct Dir(PathBuf);

impl Dir {
    pub fn new(test: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("kvroute-tls-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes `name` whole: into a side file, then renamed over it, so a reader never
    /// sees half of it.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let (side, path) = (self.0.join(format!(".{name}.new")), self.path(name));
        std::fs::write(&side, contents).unwrap();
        std::fs::rename(&side, &path).unwrap();
        path
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A sim-worker of model `m`, fast.
pub async fn sim() -> SimServerHandle {
    let cfg = SimServerConfig {
        model: MODEL.into(),
        engine: EngineConfig { speedup: 1000.0, block_size: 16, ..EngineConfig::default() },
        shutdown_grace_ms: 100,
        ..SimServerConfig::default()
    };
    kvroute_sim_server::spawn(cfg).await.expect("sim worker starts")
}

/// A proxy on loopback serving model `m` from the workers at `urls` (ids from 1),
/// round-robin, no health checks, short time-outs.
pub fn config(urls: &[String]) -> ProxyConfig {
    let workers: Vec<Value> =
        urls.iter().enumerate().map(|(i, u)| json!({"id": i + 1, "url": u, "model": MODEL})).collect();
    let mut c: ProxyConfig = serde_json::from_value(json!({
        "listen": "127.0.0.1:0",
        "seed": 1,
        "models": [{"name": MODEL, "block_size": 16}],
        "workers": workers,
    }))
    .unwrap();
    c.router.mode = router_core::RouterMode::RoundRobin;
    c.health_check.interval_ms = 0;
    c.limits.connect_timeout_ms = 2_000;
    c.limits.request_timeout_ms = 10_000;
    c.limits.shutdown_grace_s = 5;
    c.retry.backoff_base_ms = 1;
    c.retry.backoff_max_ms = 5;
    c
}

pub async fn start(cfg: ProxyConfig) -> ServeHandle {
    kvroute_proxy::serve(cfg, Tokenizers::new()).await.expect("proxy starts")
}

/// A TLS front for the plain server at `target`, serving `leaf`: every connection's
/// bytes, once decrypted, go to `target` and back.
pub async fn tls_front(target: SocketAddr, leaf: &Leaf) -> SocketAddr {
    let acceptor = tokio_rustls::TlsAcceptor::from(server_config(leaf));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(s).await else { return };
                let Ok(mut plain) = TcpStream::connect(target).await else { return };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    addr
}

/// A rustls server configuration serving `leaf`, HTTP/1.1.
pub fn server_config(leaf: &Leaf) -> Arc<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    let chain = rustls::pki_types::CertificateDer::pem_slice_iter(leaf.cert.as_bytes()).map(Result::unwrap).collect();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    Arc::new(cfg)
}

/// A client trusting only the CA in `ca_path`.
pub fn https_client(ca_path: &Path) -> Client<HttpsConnector, Full<Bytes>> {
    let tls = client_config(Some(ca_path)).unwrap();
    Client::builder(TokioExecutor::new()).build(https_connector(HttpConnector::new(), &tls))
}

/// A non-streaming completion posted to `url` by `client`: the status and the body.
pub async fn complete(client: &Client<HttpsConnector, Full<Bytes>>, url: &str) -> (u16, Value) {
    let body = json!({"model": MODEL, "prompt": "hello over tls", "max_tokens": 4, "stream": false});
    let req = http::Request::post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req)).await.expect("an answer in time");
    let resp = resp.expect("the request reaches the proxy");
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// The DER of the certificate a fresh connection to `addr` is served, verified
/// against the CA in `ca_path`.
pub async fn served_cert(addr: SocketAddr, ca_path: &Path) -> Vec<u8> {
    let tls = tokio_rustls::TlsConnector::from(client_config(Some(ca_path)).unwrap());
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let s = tls.connect(name, tcp).await.expect("the handshake succeeds");
    s.get_ref().1.peer_certificates().expect("a certificate")[0].to_vec()
}

/// `GET /health` over TLS with ALPN `h2` only: the version and status of the answer.
pub async fn health_over_h2(addr: SocketAddr, ca_path: &Path) -> (http::Version, u16) {
    let mut cfg = (*client_config(Some(ca_path)).unwrap()).clone();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let tcp = TcpStream::connect(addr).await.unwrap();
    let s = tls.connect(ServerName::try_from("127.0.0.1").unwrap(), tcp).await.expect("the handshake succeeds");
    let io = hyper_util::rt::TokioIo::new(s);
    let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await.unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(format!("https://127.0.0.1:{}/health", addr.port())).body(Full::new(Bytes::new()));
    let resp = send.send_request(req.unwrap()).await.expect("an answer");
    (resp.version(), resp.status().as_u16())
}

/// The DER of a PEM certificate.
pub fn der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap().to_vec()
}

/// Waits until `cond` holds, polling every few ms; fails the test after `ms`.
pub async fn eventually<F, Fut>(ms: u64, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_millis(ms);
    while !cond().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
