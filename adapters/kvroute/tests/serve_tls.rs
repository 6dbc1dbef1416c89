//! `kvroute serve` with TLS from the command line: `--tls-cert` and `--tls-key` reach
//! the server, a bad file stops the start with the file named, and the start-up line
//! says `https`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

const CONFIG: &str = "listen = \"127.0.0.1:0\"\n[health_check]\ninterval_ms = 0\n";

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvroute-serve-tls-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn serve(config: &Path, cert: &Path, key: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvroute"));
    c.args(["serve", "--config"]).arg(config).arg("--tls-cert").arg(cert).arg("--tls-key").arg(key);
    c
}

/// `kvroute serve` with these files fails, and its stderr says `want`.
#[track_caller]
fn check_refused(d: &Path, cert: Option<&str>, key: Option<&str>, want: &str) {
    let (cert_path, key_path) = (d.join("cert.pem"), d.join("key.pem"));
    for (path, contents) in [(&cert_path, cert), (&key_path, key)] {
        match contents {
            Some(c) => std::fs::write(path, c).unwrap(),
            None => {
                let _ = std::fs::remove_file(path);
            }
        }
    }
    let out = serve(&d.join("kvroute.toml"), &cert_path, &key_path).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started: {err}");
    assert!(err.contains(want), "{err:?} should say {want:?}");
}

#[test]
fn bad_tls_files_stop_serve_with_the_file_named() {
    let d = dir("refused");
    std::fs::write(d.join("kvroute.toml"), CONFIG).unwrap();
    let c = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
    let (cert, key) = (c.cert.pem(), c.signing_key.serialize_pem());
    check_refused(&d, None, Some(&key), "tls: cannot read");
    check_refused(&d, Some(&cert), Some("garbage"), "key.pem: no private key found");
    check_refused(&d, Some(&key), Some(&key), "cert.pem: no certificate found");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn serve_answers_over_tls_with_the_flags_files() {
    let d = dir("serves");
    std::fs::write(d.join("kvroute.toml"), CONFIG).unwrap();
    let c = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
    std::fs::write(d.join("cert.pem"), c.cert.pem()).unwrap();
    std::fs::write(d.join("key.pem"), c.signing_key.serialize_pem()).unwrap();
    let mut child =
        serve(&d.join("kvroute.toml"), &d.join("cert.pem"), &d.join("key.pem")).stderr(Stdio::piped()).spawn().unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    // The line is printed once listening; a start that fails ends stderr first.
    let line = stderr.lines().map_while(Result::ok).find(|l| l.starts_with("kvroute: serving"));
    let addr = line.as_deref().and_then(|l| l.split("https://").nth(1)).map(str::to_string);
    let status = addr.as_deref().map(|a| health(a, &d.join("cert.pem")));
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&d);
    assert!(addr.is_some(), "no https start-up line: {line:?}");
    assert_eq!(status, Some(200));
}

/// `GET /health` over TLS at `addr`, trusting the certificate in `ca`.
fn health(addr: &str, ca: &Path) -> u16 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let tls = kvroute_frontend::tls::client_config(Some(ca)).unwrap();
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
            .build(kvroute_frontend::tls::https_connector(HttpConnector::new(), &tls));
        let req = hyper::Request::get(format!("https://{addr}/health")).body(Full::new(Bytes::new())).unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req)).await;
        resp.expect("an answer in time").expect("the TLS request succeeds").status().as_u16()
    })
}
