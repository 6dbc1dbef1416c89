//! TLS end to end on loopback: clients to `kvroute serve` over TLS, the proxy to
//! `https` workers and to an `https` OTLP collector, the certificate replaced while the
//! proxy runs, and the start-up errors of bad files. Certificates are made here.

mod kit;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvroute_frontend::tls::client_config;
use kvroute_proxy::config::{TlsConfig, TracingConfig};
use kvroute_proxy::Tokenizers;
use tokio::net::TcpListener;

use kit::{complete, der, eventually, https_client, served_cert, Ca, Dir};

#[tokio::test]
async fn a_client_gets_a_completion_over_tls() {
    let (ca, dir) = (Ca::new("test ca"), Dir::new("serve"));
    let leaf = ca.leaf("kvroute");
    let ca_path = dir.write("ca.pem", &ca.pem());
    let worker = kit::sim().await;
    let mut cfg = kit::config(&[format!("http://{}", worker.http_addr())]);
    cfg.tls = Some(TlsConfig::new(dir.write("cert.pem", &leaf.cert), dir.write("key.pem", &leaf.key)));
    let proxy = kit::start(cfg).await;
    assert!(proxy.is_tls());

    let url = format!("https://127.0.0.1:{}", proxy.local_addr().port());
    let (status, body) = complete(&https_client(&ca_path), &url).await;
    assert_eq!(status, 200, "{body}");
    assert!(body["choices"][0]["text"].is_string(), "{body}");

    // A client offering h2 by ALPN speaks HTTP/2.
    let (version, status) = kit::health_over_h2(proxy.local_addr(), &ca_path).await;
    assert_eq!((version, status), (http::Version::HTTP_2, 200));

    // Plaintext HTTP on the TLS port gets no HTTP answer.
    let plain = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let req = http::Request::get(format!("http://{}/health", proxy.local_addr())).body(Full::new(Bytes::new()));
    assert!(plain.request(req.unwrap()).await.is_err(), "plaintext must not be served");
    proxy.shutdown().await;
    worker.shutdown().await;
}

/// A proxy whose one worker is a sim-worker behind TLS with a certificate of `worker_ca`,
/// trusting `trusted` (`upstream_tls.ca_path`): the status and error message a client
/// gets, and whether the client of probes and admin calls reads the worker's `/health`.
async fn through_https_worker(worker_ca: &Ca, trusted: &Ca, dir: &Dir) -> (u16, String, bool) {
    let worker = kit::sim().await;
    let front = kit::tls_front(worker.http_addr(), &worker_ca.leaf("worker")).await;
    let mut cfg = kit::config(&[format!("https://127.0.0.1:{}", front.port())]);
    let ca_path = dir.write("trusted.pem", &trusted.pem());
    cfg.upstream_tls.ca_path = Some(ca_path.clone());
    let probes = kvroute_proxy::upstream::client(&cfg.limits, client_config(Some(&ca_path)).unwrap());
    let health = http::Request::get(format!("https://127.0.0.1:{}/health", front.port())).body(Full::new(Bytes::new()));
    let probed = probes.request(health.unwrap()).await.is_ok_and(|r| r.status() == 200);
    cfg.retry.retries_max = 0;
    let proxy = kit::start(cfg).await;
    // The client reaches the proxy in plaintext.
    let client = https_client(&dir.path("trusted.pem"));
    let (status, body) = complete(&client, &format!("http://{}", proxy.local_addr())).await;
    proxy.shutdown().await;
    worker.shutdown().await;
    (status, body["error"]["message"].as_str().unwrap_or("").to_string(), probed)
}

#[tokio::test]
async fn https_workers_are_verified_against_upstream_tls() {
    let (worker_ca, other_ca) = (Ca::new("worker ca"), Ca::new("other ca"));
    let dir = Dir::new("upstream");
    let (status, message, probed) = through_https_worker(&worker_ca, &worker_ca, &dir).await;
    assert_eq!((status, message.as_str(), probed), (200, "", true), "the worker's CA is trusted");
    let (status, message, probed) = through_https_worker(&worker_ca, &other_ca, &dir).await;
    assert!((500..600).contains(&status) && !probed, "{status} {message}");
    assert!(message.contains("TLS handshake failed") && message.contains("certificate"), "{message}");
}

#[tokio::test]
async fn a_replaced_certificate_serves_new_connections() {
    let (ca, dir) = (Ca::new("test ca"), Dir::new("reload"));
    let (first, second) = (ca.leaf("first"), ca.leaf("second"));
    let ca_path = dir.write("ca.pem", &ca.pem());
    let mut tls = TlsConfig::new(dir.write("cert.pem", &first.cert), dir.write("key.pem", &first.key));
    tls.reload_interval_ms = 10;
    let mut cfg = kit::config(&[]);
    cfg.tls = Some(tls);
    let proxy = kit::start(cfg).await;
    let addr = proxy.local_addr();
    assert_eq!(served_cert(addr, &ca_path).await, der(&first.cert));

    // The key first, then the certificate: in between the pair does not match, which
    // may be seen and counted, and the first pair keeps serving.
    dir.write("key.pem", &second.key);
    dir.write("cert.pem", &second.cert);
    eventually(10_000, "new connections get the second certificate", || async {
        served_cert(addr, &ca_path).await == der(&second.cert)
    })
    .await;
    let loaded = reloads(&proxy.metrics_text(), "loaded");
    assert!(loaded >= 1, "{}", proxy.metrics_text());

    // A broken certificate is counted and leaves the second one serving.
    let errors = reloads(&proxy.metrics_text(), "error");
    dir.write("cert.pem", "-----BEGIN CERTIFICATE-----\nbroken\n-----END CERTIFICATE-----\n");
    eventually(10_000, "the broken certificate is counted", || async {
        reloads(&proxy.metrics_text(), "error") > errors
    })
    .await;
    assert_eq!(served_cert(addr, &ca_path).await, der(&second.cert));
    assert_eq!(reloads(&proxy.metrics_text(), "loaded"), loaded, "nothing more was loaded");
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_stalled_handshake_is_cut_at_the_head_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (ca, dir) = (Ca::new("test ca"), Dir::new("stall"));
    let leaf = ca.leaf("kvroute");
    let mut cfg = kit::config(&[]);
    cfg.tls = Some(TlsConfig::new(dir.write("cert.pem", &leaf.cert), dir.write("key.pem", &leaf.key)));
    cfg.limits.header_read_timeout_ms = 200;
    let proxy = kit::start(cfg).await;
    // The first bytes of a ClientHello (a handshake record's header), then nothing.
    let mut s = tokio::net::TcpStream::connect(proxy.local_addr()).await.unwrap();
    s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).await.unwrap();
    let started = tokio::time::Instant::now();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "the proxy closes the connection: {read:?}");
    assert!(started.elapsed() >= std::time::Duration::from_millis(150), "not before the time-out");
    proxy.shutdown().await;
}

/// `kvroute_tls_reloads_total{result}` in a metrics page; 0 when absent.
fn reloads(metrics: &str, result: &str) -> u64 {
    let prefix = format!("kvroute_tls_reloads_total{{result=\"{result}\"}} ");
    metrics.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0, |v| v.trim().parse().unwrap())
}

/// A proxy started with `[tls]` over `cert` and `key` (file contents; `None`: no file)
/// fails, and its error says `want`.
async fn check_refused(dir: &Dir, cert: Option<&str>, key: Option<&str>, want: &str) {
    let _ = std::fs::remove_file(dir.path("cert.pem"));
    let _ = std::fs::remove_file(dir.path("key.pem"));
    let cert_path = cert.map_or_else(|| dir.path("cert.pem"), |c| dir.write("cert.pem", c));
    let key_path = key.map_or_else(|| dir.path("key.pem"), |k| dir.write("key.pem", k));
    let mut cfg = kit::config(&[]);
    cfg.tls = Some(TlsConfig::new(cert_path, key_path));
    match kvroute_proxy::serve(cfg, Tokenizers::new()).await {
        Ok(_) => panic!("started with cert {cert:?} and key {key:?}"),
        Err(e) => assert!(e.to_string().contains(want), "{e} should say {want:?}"),
    }
}

#[tokio::test]
async fn bad_certificates_and_keys_stop_the_start_with_the_file_named() {
    let (ca, dir) = (Ca::new("test ca"), Dir::new("refused"));
    let (leaf, other) = (ca.leaf("a"), ca.leaf("b"));
    check_refused(&dir, None, Some(&leaf.key), "cannot read").await;
    check_refused(&dir, Some(&leaf.cert), None, "key.pem").await;
    check_refused(&dir, Some("not a certificate"), Some(&leaf.key), "cert.pem: no certificate found").await;
    check_refused(&dir, Some(&leaf.cert), Some(&leaf.cert), "key.pem: no private key found").await;
    check_refused(&dir, Some(&leaf.cert), Some(&other.key), "key.pem: unusable key").await;
    let bad_pem = "-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n";
    check_refused(&dir, Some(bad_pem), Some(&leaf.key), "malformed PEM").await;

    let mut cfg = kit::config(&[]);
    cfg.upstream_tls.ca_path = Some(dir.path("no-such-ca.pem"));
    let e = kvroute_proxy::serve(cfg, Tokenizers::new()).await.err().expect("refused");
    assert!(e.to_string().contains("upstream_tls: cannot read") && e.to_string().contains("no-such-ca.pem"), "{e}");
}

/// An OTLP collector over TLS serving `leaf`: the paths of the requests it received.
async fn collector(leaf: &kit::Leaf) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let acceptor = tokio_rustls::TlsAcceptor::from(kit::server_config(leaf));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (addr, seen) = (l.local_addr().unwrap(), Arc::new(Mutex::new(Vec::new())));
    let paths = seen.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let (acceptor, paths) = (acceptor.clone(), paths.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else { return };
                let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    paths.lock().unwrap().push(req.uri().path().to_string());
                    async { Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::new()))) }
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), svc).await;
            });
        }
    });
    (addr, seen)
}

#[tokio::test]
async fn spans_reach_an_https_collector() {
    let (ca, dir) = (Ca::new("collector ca"), Dir::new("otlp"));
    let (addr, seen) = collector(&ca.leaf("collector")).await;
    let worker = kit::sim().await;
    let mut cfg = kit::config(&[format!("http://{}", worker.http_addr())]);
    cfg.upstream_tls.ca_path = Some(dir.write("ca.pem", &ca.pem()));
    let mut tracing = TracingConfig::new(format!("https://127.0.0.1:{}", addr.port()));
    tracing.export_interval_ms = 10;
    cfg.tracing = Some(tracing);
    let proxy = kit::start(cfg).await;
    let client = https_client(&dir.path("ca.pem"));
    let (status, body) = complete(&client, &format!("http://{}", proxy.local_addr())).await;
    assert_eq!(status, 200, "{body}");
    eventually(10_000, "the collector receives spans", || async {
        seen.lock().unwrap().iter().any(|p| p == "/v1/traces")
    })
    .await;
    proxy.shutdown().await;
    worker.shutdown().await;
}
