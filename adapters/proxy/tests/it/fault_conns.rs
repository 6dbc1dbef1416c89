//! Fault injection, connections (issue #8, scenario 11, and issue #6's TCP_NODELAY):
//! slowloris clients are closed at the header read timeout, the connection cap holds
//! and frees up, and the proxy's sockets on both sides have Nagle off.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::*;

/// How a connection ended, seen from the client: what it read before the close, and when.
async fn read_until_closed(s: &mut TcpStream, limit: Duration) -> Option<(String, Instant)> {
    let mut out = Vec::new();
    match tokio::time::timeout(limit, s.read_to_end(&mut out)).await {
        Ok(_) => Some((String::from_utf8_lossy(&out).into_owned(), Instant::now())),
        Err(_) => None,
    }
}

/// Scenario 11, slowloris: with `header_read_timeout_ms` = 300, a client that trickles
/// its head one byte every 50 ms, one that sends nothing at all, and one that stops
/// inside the h2 preface, are all closed no sooner than 300 ms and well before 3 s (at
/// most with a 408), and no worker sees a thing.
#[tokio::test]
async fn f11_a_slowloris_client_is_closed_at_the_header_read_timeout() {
    let w = Fake::start(&[MODEL]).await;
    let mut cfg = config(&[(1, w.addr)]);
    cfg.limits.header_read_timeout_ms = 300;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let head: &[u8] =
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let cases: [(&str, &[u8], u64); 3] =
        [("a trickled head", head, 50), ("nothing", b"", 0), ("part of the h2 preface", b"PRI * HTTP/2.0\r\n", 0)];
    for (what, bytes, pause_ms) in cases {
        let t0 = Instant::now();
        let (mut rd, mut wr) = TcpStream::connect(addr).await.unwrap().into_split();
        let writer = tokio::spawn(async move {
            for chunk in bytes.chunks(if pause_ms > 0 { 1 } else { bytes.len().max(1) }) {
                if wr.write_all(chunk).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(pause_ms)).await;
            }
            std::future::pending::<()>().await;
        });
        let mut out = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(3), rd.read_to_end(&mut out)).await;
        writer.abort();
        assert!(closed.is_ok(), "{what}: the connection is closed");
        let took = t0.elapsed();
        let text = String::from_utf8_lossy(&out);
        assert!(took >= Duration::from_millis(290), "{what}: closed after {took:?}, before the timeout");
        assert!(text.is_empty() || text.starts_with("HTTP/1.1 408"), "{what}: {text}");
    }
    assert!(w.seen().is_empty());
}

/// Scenario 11, the connection cap: with `connections_max` = 4 and four connections
/// open, a fifth is told 503 (`too_many_connections`) and closed at once, while the
/// four keep being served; once one of them closes, a new connection is served again.
#[tokio::test]
async fn f11_the_connection_cap_refuses_the_next_connection_and_frees_up_on_close() {
    let w = Fake::start(&[MODEL]).await;
    let mut cfg = config(&[(1, w.addr)]);
    cfg.limits.connections_max = 4;
    cfg.limits.header_read_timeout_ms = 20_000;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    // The proxy has taken all four when a request on the last one is answered.
    let last = held.last_mut().unwrap();
    let req = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n";
    last.write_all(req).await.unwrap();
    let mut buf = vec![0u8; 1024];
    let n = within(10_000, last.read(&mut buf)).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));

    for _ in 0..3 {
        let mut extra = TcpStream::connect(addr).await.unwrap();
        let _ = extra.write_all(req).await;
        let (text, _) = read_until_closed(&mut extra, Duration::from_secs(10)).await.expect("closed at once");
        assert!(
            text.is_empty() || (text.starts_with("HTTP/1.1 503") && text.contains("too_many_connections")),
            "{text}"
        );
    }
    // The four still work.
    held[0].write_all(req).await.unwrap();
    let n = within(10_000, held[0].read(&mut buf)).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));

    drop(held.pop());
    eventually(10_000, "a freed slot serves a new connection", || async {
        let Ok(mut s) = TcpStream::connect(addr).await else { return false };
        let _ = s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await;
        matches!(read_until_closed(&mut s, Duration::from_secs(10)).await, Some((t, _)) if t.starts_with("HTTP/1.1 200"))
    })
    .await;
}

/// The connection cap counts what it refuses: with `connections_max` = 2 and both taken,
/// each further connection adds one to `kvroute_connections_refused_total`, and the
/// connections served do not.
#[tokio::test]
async fn connections_refused_at_the_cap_are_counted() {
    let w = Fake::start(&[MODEL]).await;
    let mut cfg = config(&[(1, w.addr)]);
    cfg.limits.connections_max = 2;
    cfg.limits.header_read_timeout_ms = 20_000;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let refused = || sample(&p.metrics_text(), "kvroute_connections_refused_total", &[]);
    assert_eq!(refused(), Some(0.0), "the counter is exported from the start");
    let req = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n";
    let mut buf = vec![0u8; 1024];
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // Answered, so the proxy holds its slot before the next one connects.
        s.write_all(req).await.unwrap();
        let n = within(10_000, s.read(&mut buf)).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
        held.push(s);
    }
    assert_eq!(refused(), Some(0.0), "connections within the cap are not counted");
    for n in 1..=3 {
        let mut extra = TcpStream::connect(addr).await.unwrap();
        let _ = extra.write_all(req).await;
        let (text, _) = read_until_closed(&mut extra, Duration::from_secs(10)).await.expect("refused and closed");
        assert!(text.is_empty() || text.contains("too_many_connections"), "{text}");
        assert_eq!(refused(), Some(f64::from(n)), "refusal {n} is counted");
    }
}

/// This process's sockets, inode to file descriptor, from `/proc/self/fd`. Other tests
/// in the process open and close descriptors all the while, so an entry that is gone by
/// the time it is read is skipped: it was not one of the sockets this test holds open.
fn socket_fds() -> BTreeMap<u64, i32> {
    let dir = std::fs::read_dir("/proc/self/fd").expect("procfs");
    dir.flatten()
        .filter_map(|entry| {
            let link = std::fs::read_link(entry.path()).ok()?;
            let inode = link.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()?;
            Some((inode, entry.file_name().to_str()?.parse().ok()?))
        })
        .collect()
}

/// The established TCP sockets of this process, as `/proc/net/tcp` lists them:
/// (local, remote, file descriptor). That file lists the whole network namespace, so
/// closed ones (TIME_WAIT, inode 0: an earlier connection may linger on a port this
/// test's fake got again) and those of other processes are left out.
fn tcp_sockets() -> Vec<(SocketAddr, SocketAddr, i32)> {
    let fds = socket_fds();
    let text = std::fs::read_to_string("/proc/net/tcp").expect("procfs");
    let addr = |hex: &str| -> Option<SocketAddr> {
        let (ip, port) = hex.split_once(':')?;
        let ip = u32::from_str_radix(ip, 16).ok()?;
        let port = u16::from_str_radix(port, 16).ok()?;
        // The address is in the kernel's byte order, which is the machine's.
        Some(SocketAddr::from((ip.to_ne_bytes(), port)))
    };
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let established = *f.get(3)? == "01";
            let inode: u64 = f.get(9)?.parse().ok()?;
            (established && inode != 0).then_some(())?;
            Some((addr(f.get(1)?)?, addr(f.get(2)?)?, *fds.get(&inode)?))
        })
        .collect()
}

/// Whether the socket `fd` has TCP_NODELAY set.
fn nodelay_of(fd: i32) -> Option<bool> {
    // SAFETY: `fd` is open in this process: it is the socket of a connection the test
    // keeps open, and it is only borrowed for one getsockopt.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    socket2::SockRef::from(&borrowed).tcp_nodelay().ok()
}

/// Issue #6: TCP_NODELAY on every socket, both sides. The proxy's accepted socket (from
/// the test's client) and its socket to the worker both have Nagle off.
#[tokio::test]
async fn tcp_nodelay_is_set_on_accepted_and_upstream_sockets() {
    let w = Fake::start(&[MODEL]).await;
    let p = start(config(&[(1, w.addr)])).await;
    let addr = p.local_addr();
    let mut client = TcpStream::connect(addr).await.unwrap();
    let body = chat("x").to_string();
    let req = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    client.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("[DONE]") {
        let n = within(10_000, client.read(&mut buf)).await.unwrap();
        assert!(n > 0, "the answer is complete before the close");
        got.extend_from_slice(&buf[..n]);
    }
    // Both connections stay open: the client's (keep-alive) and the pooled one upstream.
    let mine = client.local_addr().unwrap();
    let sockets = tcp_sockets();
    let accepted = sockets.iter().find(|(l, r, _)| *l == addr && *r == mine).expect("the proxy's accepted socket");
    let upstream: Vec<_> = sockets.iter().filter(|(_, r, _)| *r == w.addr).collect();
    assert!(!upstream.is_empty(), "the proxy's socket to the worker is open");
    assert_eq!(nodelay_of(accepted.2), Some(true), "accepted socket");
    for u in upstream {
        assert_eq!(nodelay_of(u.2), Some(true), "upstream socket {u:?}");
    }
    // The check can tell: the test's own client socket was left with Nagle on.
    let own = sockets.iter().find(|(l, r, _)| *l == mine && *r == addr).unwrap();
    assert_eq!(nodelay_of(own.2), Some(false));
}
