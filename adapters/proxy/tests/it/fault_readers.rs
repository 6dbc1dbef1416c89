//! Fault injection, slow readers (issue #8, scenario 6): a thousand SSE clients that
//! stop reading while their workers try to push far more than they take. The proxy
//! passes back-pressure upstream instead of buffering: each worker can only write
//! what the sockets and the proxy's per-connection buffers hold, and memory per stream
//! stays within that.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::fault_common::{alone, heavy, rss_bytes};
use crate::*;

/// An SSE event of about 16 KiB.
fn event() -> Bytes {
    Bytes::from(format!("data: {{\"pad\":\"{}\"}}\n\n", "x".repeat(16_360)))
}

/// Opens a connection with a small receive buffer, sends a streaming chat request, and
/// reads the response head and the first bytes of the stream; then stops reading.
/// Returns the connection and the bytes read.
async fn slow_reader(addr: SocketAddr, i: usize) -> (TcpStream, usize) {
    let sock = TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(8 << 10).unwrap();
    let mut s = sock.connect(addr).await.unwrap();
    let body = chat(&format!("reader {i}")).to_string();
    let req = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 2048];
    let mut got = 0;
    while got < 1024 {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "the stream started");
        if got == 0 {
            assert!(buf.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
        }
        got += n;
    }
    (s, got)
}

/// Scenario 6. Workers stream 16 KiB events to each of 1,000 clients, up to 64 MiB per
/// stream; each client reads about 1 KiB and then nothing. Pass criteria, once the
/// workers' writes stop growing:
/// * no stream was sent whole: the workers are held back, not drained into the proxy;
/// * per stream, the workers wrote at most a quarter of the offer beyond what the
///   client read (what the kernel's socket buffers hold: about 2 MiB on loopback here);
/// * the process's resident memory (proxy, fakes and clients) grew by at most
///   2 x `connection_buffer_bytes_max` (16 KiB here) + 160 KiB per stream: the proxy's
///   two connection buffers plus task state. Measured: 90-150 KiB; 190-220 KiB with
///   the default 64 KiB buffers; 361 KiB with hyper's own 400 KB ones;
/// * after the clients go away, everything is released.
///
/// A test-sized client receive buffer and clients arriving in waves of 100 keep it well
/// under 30 s on two cores; the file-descriptor limit is raised for the ~4,000 sockets
/// it needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f6_a_thousand_slow_readers_hold_back_their_workers_instead_of_filling_the_proxy() {
    let _heavy = heavy().await;
    if !alone("fault_readers::f6_a_thousand_slow_readers_hold_back_their_workers_instead_of_filling_the_proxy").await {
        return;
    }
    let streams = 1_000usize;
    let offered = 64u64 << 20;
    rlimit::increase_nofile_limit(4 * streams as u64 + 1_024).unwrap();
    let fakes = [Fake::start(&[MODEL]).await, Fake::start(&[MODEL]).await];
    for f in &fakes {
        f.set(Behavior::Flood { chunk: event(), bytes_total: offered });
    }
    let mut cfg = config(&[(1, fakes[0].addr), (2, fakes[1].addr)]);
    cfg.limits.request_timeout_ms = 60_000;
    cfg.limits.connect_timeout_ms = 5_000; // a thousand connects at once queue up
                                           // Small buffers make the bound plain next to the rest of a stream's memory.
    cfg.limits.connection_buffer_bytes_max = 16 << 10;
    let buffer = cfg.limits.connection_buffer_bytes_max;
    let p = start(cfg).await;
    let addr = p.local_addr();
    let rss_before = rss_bytes();

    // Arrivals in waves of 100, so the test measures streams rather than accept queues.
    let wave = std::sync::Arc::new(tokio::sync::Semaphore::new(100));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..streams {
        let wave = wave.clone();
        tasks.spawn(async move {
            let _turn = wave.acquire().await.unwrap();
            slow_reader(addr, i).await
        });
    }
    let readers: Vec<(TcpStream, usize)> = within(30_000, tasks.join_all()).await;
    let read: usize = readers.iter().map(|(_, n)| n).sum();
    let written = || fakes.iter().map(|f| f.written()).fold((0, 0), |a, w| (a.0 + w.0, a.1 + w.1));
    // Held back: the writes settle instead of running on to the 64 GiB on offer.
    let settle_by = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut last = written().0;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = written().0;
        if now == last {
            break;
        }
        assert!(tokio::time::Instant::now() < settle_by, "the workers' writes never stop growing: {now} bytes");
        last = now;
    }
    let (bytes, whole) = written();
    let grown = rss_bytes().saturating_sub(rss_before);
    let per_stream = bytes.saturating_sub(read as u64) / streams as u64;
    eprintln!(
        "{streams} slow readers: workers wrote {} KiB, clients read {} KiB, {} KiB held per stream, rss +{} KiB ({} KiB per stream)",
        bytes >> 10,
        read >> 10,
        per_stream >> 10,
        grown >> 10,
        (grown / streams as u64) >> 10
    );
    assert_eq!(whole, 0, "no stream was sent whole");
    assert!(per_stream <= offered / 4, "{} KiB held per stream", per_stream >> 10);
    let memory_bound = 2 * buffer as u64 + (160 << 10);
    let memory = grown / streams as u64;
    assert!(memory <= memory_bound, "{} KiB of memory per stream, over {} KiB", memory >> 10, memory_bound >> 10);
    drop(readers);
    eventually(10_000, "the clients' departure frees everything", || released(addr)).await;
}
