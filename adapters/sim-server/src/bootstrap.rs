//! SGLang-style prefill/decode pairing: bootstrap rooms, the prefill worker's bootstrap
//! server, and the decode worker's call to it.
//!
//! A request to a prefill worker that carries `bootstrap_room` opens that room; the room
//! is done when the prefill finished, and failed when the prefill failed or was dropped
//! before finishing (its client went away). A decode worker given `bootstrap_host`,
//! `bootstrap_port` and `bootstrap_room` asks the prefill worker's bootstrap server
//! `GET /bootstrap/{room}` over real loopback HTTP before it starts; the call blocks until
//! the room is done (200), failed (409) or `bootstrap_timeout_ms` passed (504). The
//! decode may ask before the prefill request arrives: asking opens the room too.
//!
//! Bounds: at most `rooms_max` rooms; each is forgotten `2 × bootstrap_timeout_ms` after
//! it opened (waiters then see it expire). Each open prunes expired rooms first, so the
//! work per call is bounded by the rooms that expired since the last one.
//!
//! What it leaves to others: the KV transfer's timing (the engine task models it once
//! the room is done), and what a pairing failure means to the client (the handler).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Largest bootstrap answer the decode side reads.
const ANSWER_BYTES_MAX: usize = 64 << 10;

/// Where a room stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RoomState {
    /// The prefill has not finished (or not arrived).
    Pending,
    /// The prefill finished: its KV can be pulled.
    Done,
    /// The prefill failed or was aborted.
    Failed(String),
}

struct Room {
    opened: Instant,
    state: watch::Sender<RoomState>,
}

struct Table {
    rooms: HashMap<u64, Room>,
    /// Rooms in the order they opened, for expiry.
    order: VecDeque<(Instant, u64)>,
}

/// Every room of one worker; shared by its handlers and its bootstrap server.
pub(crate) struct Rooms {
    table: Mutex<Table>,
    rooms_max: usize,
    ttl: Duration,
    /// How long a waiter waits for its room.
    pub(crate) timeout: Duration,
}

/// Why a room could not be opened.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct RoomsFull(pub(crate) usize);

/// Why waiting for a room did not end in a done prefill.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WaitError {
    /// The prefill failed or was aborted.
    Failed(String),
    /// The room was forgotten while pending.
    Expired,
    /// No prefill settled the room within the timeout.
    TimedOut(Duration),
    /// `rooms_max` rooms are open.
    Full(usize),
}

impl std::fmt::Display for WaitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitError::Failed(why) => f.write_str(why),
            WaitError::Expired => f.write_str("the room expired"),
            WaitError::TimedOut(t) => write!(f, "no prefill settled the room within {} ms", t.as_millis()),
            WaitError::Full(n) => write!(f, "{n} bootstrap rooms are open"),
        }
    }
}

impl Rooms {
    pub(crate) fn new(rooms_max: usize, timeout: Duration) -> Self {
        let table = Table { rooms: HashMap::new(), order: VecDeque::new() };
        Rooms { table: Mutex::new(table), rooms_max, ttl: timeout.saturating_mul(2), timeout }
    }

    /// The prefill side takes `room`: pending until the guard says otherwise. A room
    /// already done or failed (a reused number) starts over.
    pub(crate) fn open(self: &Arc<Self>, room: u64) -> Result<RoomGuard, RoomsFull> {
        let tx = self.entry(room)?;
        tx.send_replace(RoomState::Pending);
        Ok(RoomGuard { rooms: self.clone(), room, ended: false })
    }

    /// Waits until `room` is done, or fails, expires or times out.
    pub(crate) async fn wait(&self, room: u64) -> Result<(), WaitError> {
        let mut rx = self.entry(room).map_err(|RoomsFull(n)| WaitError::Full(n))?.subscribe();
        let settled = async {
            loop {
                match &*rx.borrow_and_update() {
                    RoomState::Done => return Ok(()),
                    RoomState::Failed(why) => return Err(WaitError::Failed(why.clone())),
                    RoomState::Pending => {}
                }
                if rx.changed().await.is_err() {
                    return Err(WaitError::Expired);
                }
            }
        };
        tokio::time::timeout(self.timeout, settled).await.unwrap_or(Err(WaitError::TimedOut(self.timeout)))
    }

    fn settle(&self, room: u64, state: RoomState) {
        if let Some(r) = self.lock().rooms.get(&room) {
            r.state.send_replace(state);
        }
    }

    /// The room's sender, opening it if needed after pruning expired rooms.
    fn entry(&self, room: u64) -> Result<watch::Sender<RoomState>, RoomsFull> {
        let now = Instant::now();
        let mut t = self.lock();
        while let Some(&(opened, id)) = t.order.front() {
            if now.saturating_duration_since(opened) < self.ttl {
                break;
            }
            t.order.pop_front();
            // A room re-opened since carries a later time and stays.
            if t.rooms.get(&id).is_some_and(|r| r.opened == opened) {
                t.rooms.remove(&id);
            }
        }
        if let Some(r) = t.rooms.get(&room) {
            return Ok(r.state.clone());
        }
        if t.rooms.len() >= self.rooms_max {
            return Err(RoomsFull(self.rooms_max));
        }
        let (tx, _) = watch::channel(RoomState::Pending);
        t.rooms.insert(room, Room { opened: now, state: tx.clone() });
        t.order.push_back((now, room));
        Ok(tx)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The prefill side's hold on a room: [`RoomGuard::done`] when the prefill finished;
/// dropped before that, the room fails.
pub(crate) struct RoomGuard {
    rooms: Arc<Rooms>,
    room: u64,
    ended: bool,
}

impl RoomGuard {
    pub(crate) fn done(mut self) {
        self.ended = true;
        self.rooms.settle(self.room, RoomState::Done);
    }
}

impl Drop for RoomGuard {
    fn drop(&mut self) {
        if !self.ended {
            self.rooms.settle(self.room, RoomState::Failed(format!("the prefill of room {} failed", self.room)));
        }
    }
}

/// Serves `GET /bootstrap/{room}` and `GET /health` until `stop` turns true; open
/// waits are cut then.
pub(crate) async fn serve(listener: TcpListener, rooms: Arc<Rooms>, mut stop: watch::Receiver<bool>) {
    let builder = auto::Builder::new(TokioExecutor::new());
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let rooms = rooms.clone();
                let svc = service_fn(move |req| answer(rooms.clone(), req));
                let conn = builder.serve_connection(TokioIo::new(stream), svc).into_owned();
                conns.spawn(async move {
                    let _ = conn.await;
                });
            }
        }
    }
    conns.abort_all();
}

async fn answer(rooms: Arc<Rooms>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path();
    let (status, body) = match (req.method(), path.strip_prefix("/bootstrap/")) {
        (&Method::GET, Some(room)) => match room.parse::<u64>() {
            Err(_) => (StatusCode::BAD_REQUEST, json!({"error": format!("{room:?} is not a room number")})),
            Ok(room) => match rooms.wait(room).await {
                Ok(()) => (StatusCode::OK, json!({"room": room, "status": "done"})),
                Err(e @ WaitError::TimedOut(_)) => (StatusCode::GATEWAY_TIMEOUT, json!({"error": e.to_string()})),
                Err(e) => (StatusCode::CONFLICT, json!({"error": e.to_string()})),
            },
        },
        (&Method::GET, None) if path == "/health" => (StatusCode::OK, json!({"status": "ok"})),
        _ => (StatusCode::NOT_FOUND, json!({"error": format!("no route for {path}")})),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    Ok(resp)
}

/// The decode side: asks the bootstrap server at `host:port` for `room`, waiting at
/// most `timeout` in all. `Err` says why the pairing failed.
pub(crate) async fn pair(host: &str, port: u16, room: u64, timeout: Duration) -> Result<(), String> {
    let ask = async {
        let stream = TcpStream::connect((host, port))
            .await
            .map_err(|e| format!("cannot reach the bootstrap server {host}:{port}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("bootstrap handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = Request::get(format!("/bootstrap/{room}"))
            .header(hyper::header::HOST, format!("{}:{port}", crate::server::bracket(host)))
            .body(Empty::<Bytes>::new())
            .map_err(|e| format!("bootstrap request: {e}"))?;
        let resp = tx.send_request(req).await.map_err(|e| format!("bootstrap request: {e}"))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), ANSWER_BYTES_MAX).collect().await.map(|c| c.to_bytes());
        if status == StatusCode::OK {
            return Ok(());
        }
        let why = body
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v["error"].as_str().map(String::from))
            .unwrap_or_else(|| format!("status {}", status.as_u16()));
        Err(why)
    };
    match tokio::time::timeout(timeout, ask).await {
        Ok(r) => r,
        Err(_) => Err(format!("the bootstrap server {host}:{port} did not answer within {} ms", timeout.as_millis())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rooms(max: usize, timeout_ms: u64) -> Arc<Rooms> {
        Arc::new(Rooms::new(max, Duration::from_millis(timeout_ms)))
    }

    #[tokio::test(start_paused = true)]
    async fn a_room_settles_its_waiters() {
        let r = rooms(8, 1_000);
        let done = r.open(1).unwrap();
        let failed = r.open(2).unwrap();
        let (a, b, c) = (r.wait(1), r.wait(2), r.wait(3));
        done.done();
        drop(failed);
        let (a, b, c) = tokio::join!(a, b, c);
        assert_eq!(a, Ok(()));
        assert!(matches!(b, Err(WaitError::Failed(_))), "{b:?}");
        assert!(matches!(c, Err(WaitError::TimedOut(_))), "room 3 never opened by a prefill: {c:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_may_come_first() {
        let r = rooms(8, 1_000);
        let waiter = tokio::spawn({
            let r = r.clone();
            async move { r.wait(7).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        r.open(7).unwrap().done();
        assert_eq!(waiter.await.unwrap(), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn rooms_are_bounded_and_expire() {
        let r = rooms(2, 100);
        let _g1 = r.open(1).unwrap();
        let _g2 = r.open(2).unwrap();
        assert_eq!(r.open(3).err(), Some(RoomsFull(2)));
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(r.open(3).is_ok(), "expired rooms make room");
        assert!(matches!(r.wait(1).await, Err(WaitError::TimedOut(_))), "an expired room is forgotten");
    }
}
