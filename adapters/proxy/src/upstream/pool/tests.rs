use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use http_body_util::BodyExt;
use hyper::service::service_fn;
use tokio::net::TcpListener;

use super::*;

/// A worker answering `body` to everything, counting the connections it accepted;
/// `keep_alive: false` closes each connection after one response.
async fn worker(body: &'static str, keep_alive: bool) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let svc =
                    service_fn(|_req| async move { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body)))) });
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(keep_alive)
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, accepted)
}

fn request(addr: SocketAddr) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}/v1/x")).body(Full::new(Bytes::from_static(b"{}"))).unwrap()
}

/// Sends `n` requests one after another, reading each body whole (or dropping it
/// unread when `read` is false), and checks the connections the worker accepted.
#[track_caller]
fn check(keep_alive: bool, read: bool, idle_ms: u64, n: usize, want_connections: usize) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let (addr, accepted) = worker("hello", keep_alive).await;
        let pool = ConnPool::new(Duration::from_millis(idle_ms), Duration::from_secs(5), 64 << 10);
        for i in 0..n {
            let resp = pool.send(request(addr)).await.unwrap_or_else(|e| panic!("request {i}: {e:?}"));
            assert_eq!(resp.status(), 200);
            if read {
                let body = resp.into_body().collect().await.expect("body").to_bytes();
                assert_eq!(body, "hello", "request {i}");
            }
        }
        assert_eq!(accepted.load(Ordering::SeqCst), want_connections);
    });
}

#[test]
fn connections_are_reused_only_when_clean() {
    // keep_alive, read whole body, idle timeout, requests, connections opened
    check(true, true, 60_000, 5, 1);
    check(false, true, 60_000, 3, 3);
    check(true, false, 60_000, 3, 3);
    check(true, true, 0, 3, 3);
}

#[test]
fn nothing_listening_is_a_connect_error() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        // Bound but never listening, and held: a port merely released could be taken by
        // any listener on the machine before the pool connects.
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = sock.local_addr().unwrap();
        let pool = ConnPool::new(Duration::from_secs(60), Duration::from_secs(5), 64 << 10);
        let e = pool.send(request(addr)).await.err().expect("no worker");
        drop(sock);
        assert!(e.is_connect(), "{e:?}");
    });
}

#[test]
fn the_host_header_names_the_worker() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let svc = service_fn(|req: Request<Incoming>| async move {
                let seen = format!("{} {}", req.headers()[HOST].to_str().unwrap(), req.uri());
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(seen))))
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
        });
        let pool = ConnPool::new(Duration::from_secs(60), Duration::from_secs(5), 64 << 10);
        let resp = pool.send(request(addr)).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, format!("{addr} /v1/x"));
    });
}
