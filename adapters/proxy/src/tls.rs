//! TLS on the proxy's sockets: [`Io`], a connection that is plain TCP or TLS either way,
//! and the two handshakes: [`accept`] for clients under `[tls]`, [`connect`] for
//! `https` workers. The certificates and their reloading are the front end's
//! ([`kvroute_frontend::tls`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioExecutor;
use hyper_util::server::conn::auto;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::{client, server, TlsAcceptor, TlsConnector};

/// A connection to a client or a worker: plain TCP, or TLS over it.
#[derive(Debug)]
pub enum Io {
    /// Plaintext.
    Plain(TcpStream),
    /// TLS to a worker.
    Client(Box<client::TlsStream<TcpStream>>),
    /// TLS from a client.
    Server(Box<server::TlsStream<TcpStream>>),
}

/// The TLS handshake of a client connection, within `limit`, and the server settings
/// for what it negotiated: HTTP/2 only when ALPN chose `h2`, else HTTP/1.1 only (so the
/// first request head is under the HTTP/1 head timeout, with no protocol sniffing).
/// Without `tls` the connection stays plain and `builder` as it is. `None` when the
/// handshake failed or ran out of time (logged at debug: scanners do this all day).
pub async fn accept(
    stream: TcpStream,
    tls: Option<&TlsAcceptor>,
    builder: auto::Builder<TokioExecutor>,
    limit: Duration,
) -> Option<(Io, auto::Builder<TokioExecutor>)> {
    let Some(tls) = tls else { return Some((Io::Plain(stream), builder)) };
    let tls_stream = match tokio::time::timeout(limit, tls.accept(stream)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "TLS handshake failed");
            return None;
        }
        Err(_) => {
            tracing::debug!("TLS handshake timed out");
            return None;
        }
    };
    let h2 = tls_stream.get_ref().1.alpn_protocol() == Some(b"h2");
    let builder = if h2 { builder.http2_only() } else { builder.http1_only() };
    Some((Io::Server(Box::new(tls_stream)), builder))
}

/// The TLS handshake with a worker at `host` (a DNS name or an IP address, which the
/// certificate must name), within `limit`.
pub async fn connect(tls: &TlsConnector, tcp: TcpStream, host: &str, limit: Duration) -> io::Result<Io> {
    let name = ServerName::try_from(host.to_string())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{host:?} is not a server name: {e}")))?;
    match tokio::time::timeout(limit, tls.connect(name, tcp)).await {
        Ok(Ok(s)) => Ok(Io::Client(Box::new(s))),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "the TLS handshake timed out")),
    }
}

impl AsyncRead for Io {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Client(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Io::Server(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Client(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Io::Server(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Client(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            Io::Server(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Client(s) => s.is_write_vectored(),
            Io::Server(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Client(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Io::Server(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Client(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Io::Server(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
