//! The socket seam: a small trait the runner talks to, and its ZeroMQ implementation
//! over the pure-Rust `zeromq` crate (no C library). Tests implement the trait with
//! channels to feed frames directly.
//!
//! The transport moves frames only; it neither parses nor orders them. A ZeroMQ
//! subscription ends when its publisher disconnects, so that the runner's capped backoff,
//! not the socket's own (which grows to 30 s), decides when a restarted engine is heard. Message size
//! is not bounded here (the `zeromq` crate has no per-message limit): the decoder
//! refuses oversized payloads, but they have been received by then.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use core::fmt;
use futures_util::StreamExt;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Why a transport operation failed. Each variant carries the socket's own error (or,
/// for a test's transport, any error or message) as its `source()`.
#[derive(Debug)]
#[non_exhaustive]
pub enum TransportError {
    /// Connecting or subscribing failed.
    Connect(BoxError),
    /// Receiving failed; the socket is unusable.
    Recv(BoxError),
    /// Sending the replay request failed.
    Send(BoxError),
    /// The publisher disconnected; the subscription has ended.
    Disconnected,
}

/// A transport's own error, boxed so that the trait does not name the socket crate.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransportError::Connect(m) => write!(f, "connect failed: {m}"),
            TransportError::Recv(m) => write!(f, "receive failed: {m}"),
            TransportError::Send(m) => write!(f, "send failed: {m}"),
            TransportError::Disconnected => f.write_str("receive failed: the publisher disconnected"),
        }
    }
}

impl std::error::Error for TransportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TransportError::Connect(e) | TransportError::Recv(e) | TransportError::Send(e) => Some(&**e),
            TransportError::Disconnected => None,
        }
    }
}

/// What a subscription yields.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum SubEvent {
    /// One multipart message.
    Message(Vec<Bytes>),
    /// The connection to the publisher is (again) up.
    Connected,
    /// The connection dropped; the transport may reconnect by itself.
    Disconnected,
}

/// Opens subscriptions and replay requests.
#[async_trait]
pub trait Connector: Send + Sync + 'static {
    /// Subscribes to `topic` (a prefix; empty for all) at `endpoint`.
    async fn subscribe(&self, endpoint: &str, topic: &str) -> Result<Box<dyn Subscription>, TransportError>;
    /// Sends a replay request for batches from `from` on to `endpoint`.
    async fn replay(&self, endpoint: &str, from: u64) -> Result<Box<dyn ReplayReplies>, TransportError>;
}

/// A live subscription.
#[async_trait]
pub trait Subscription: Send {
    /// The next message or connection change. Cancel-safe.
    async fn next(&mut self) -> Result<SubEvent, TransportError>;
}

/// The replies to one replay request, as raw multipart messages (end marker included).
#[async_trait]
pub trait ReplayReplies: Send {
    /// The next reply.
    async fn next(&mut self) -> Result<Vec<Bytes>, TransportError>;
}

/// The ZeroMQ transport: SUB for the stream, DEALER for replay requests.
#[derive(Clone, Debug)]
pub struct ZmqConnector {
    /// How long one connect attempt may take. Default 2,000 ms.
    pub connect_timeout_ms: u64,
}

impl Default for ZmqConnector {
    fn default() -> Self {
        ZmqConnector { connect_timeout_ms: 2_000 }
    }
}

impl ZmqConnector {
    fn options(&self) -> SocketOptions {
        let mut o = SocketOptions::default();
        o.connect_timeout(Duration::from_millis(self.connect_timeout_ms));
        o
    }
}

struct ZmqSub {
    socket: SubSocket,
    monitor: futures_channel::mpsc::Receiver<SocketEvent>,
}

struct ZmqReplay {
    socket: DealerSocket,
}

fn err<E: Into<BoxError>>(f: fn(BoxError) -> TransportError) -> impl Fn(E) -> TransportError {
    move |e| f(e.into())
}

/// The `zeromq` crate panics on an `ipc://` endpoint when built without IPC (as here),
/// so such an endpoint from a configuration is refused first.
fn tcp_only(endpoint: &str) -> Result<(), TransportError> {
    match endpoint.parse::<zeromq::Endpoint>() {
        Ok(zeromq::Endpoint::Ipc(_)) => {
            Err(TransportError::Connect("ipc:// endpoints are not built in; use tcp://".into()))
        }
        // The socket itself reports anything else it refuses.
        _ => Ok(()),
    }
}

#[async_trait]
impl Connector for ZmqConnector {
    async fn subscribe(&self, endpoint: &str, topic: &str) -> Result<Box<dyn Subscription>, TransportError> {
        tcp_only(endpoint)?;
        let mut socket = SubSocket::with_options(self.options());
        let monitor = socket.monitor();
        socket.connect(endpoint).await.map_err(err(TransportError::Connect))?;
        socket.subscribe(topic).await.map_err(err(TransportError::Connect))?;
        Ok(Box::new(ZmqSub { socket, monitor }))
    }

    async fn replay(&self, endpoint: &str, from: u64) -> Result<Box<dyn ReplayReplies>, TransportError> {
        tcp_only(endpoint)?;
        let mut socket = DealerSocket::with_options(self.options());
        socket.connect(endpoint).await.map_err(err(TransportError::Connect))?;
        // A DEALER adds no delimiter itself; the ROUTER expects [identity, empty, start].
        let request = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
        // The crate's empty-message error is no `Error`; only its text can travel.
        let msg = ZmqMessage::try_from(request).map_err(|e| TransportError::Send(e.to_string().into()))?;
        socket.send(msg).await.map_err(err(TransportError::Send))?;
        Ok(Box::new(ZmqReplay { socket }))
    }
}

#[async_trait]
impl Subscription for ZmqSub {
    async fn next(&mut self) -> Result<SubEvent, TransportError> {
        loop {
            tokio::select! {
                msg = self.socket.recv() => {
                    return msg.map(|m| SubEvent::Message(m.into_vec())).map_err(err(TransportError::Recv));
                }
                ev = self.monitor.next() => match ev {
                    Some(SocketEvent::Connected(..)) => return Ok(SubEvent::Connected),
                    // Ends the subscription, so the runner reconnects on its own capped
                    // backoff: the socket's built-in one waits up to 30 s, long after a
                    // restarted engine is back.
                    Some(SocketEvent::Disconnected(_)) => {
                        return Err(TransportError::Disconnected);
                    }
                    Some(_) => {}
                    // The monitor is gone; keep receiving messages only.
                    None => return self.socket.recv().await
                        .map(|m| SubEvent::Message(m.into_vec()))
                        .map_err(err(TransportError::Recv)),
                },
            }
        }
    }
}

#[async_trait]
impl ReplayReplies for ZmqReplay {
    async fn next(&mut self) -> Result<Vec<Bytes>, TransportError> {
        let m = self.socket.recv().await.map_err(err(TransportError::Recv))?;
        Ok(m.into_vec())
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use super::*;

    #[track_caller]
    fn check(e: &TransportError, text: &str, source_is_zmq: bool) {
        assert_eq!(e.to_string(), text);
        assert_eq!(e.source().is_some_and(|s| s.is::<zeromq::ZmqError>()), source_is_zmq, "{e:?}");
    }

    #[tokio::test]
    async fn the_sockets_error_is_the_source() {
        let zmq = ZmqConnector::default();
        for endpoint in ["nonsense", "tcp://127.0.0.1:notaport"] {
            let Err(e) = zmq.subscribe(endpoint, "").await else { panic!("subscribed to {endpoint:?}") };
            let cause = e.source().map(ToString::to_string).unwrap_or_default();
            check(&e, &format!("connect failed: {cause}"), true);
            let Err(e) = zmq.replay(endpoint, 0).await else { panic!("replay from {endpoint:?}") };
            assert!(matches!(e, TransportError::Connect(_)), "{e:?}");
        }
        // An IPC endpoint is refused, not a panic inside the socket crate.
        let Err(e) = zmq.subscribe("ipc:///nowhere", "").await else { panic!("subscribed over IPC") };
        check(&e, "connect failed: ipc:// endpoints are not built in; use tcp://", false);
        assert!(zmq.replay("ipc:///nowhere", 0).await.is_err());
        check(&TransportError::Disconnected, "receive failed: the publisher disconnected", false);
        let text = TransportError::Recv("closed".into());
        assert_eq!(text.source().map(ToString::to_string).as_deref(), Some("closed"));
    }
}
