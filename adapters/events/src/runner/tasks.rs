//! The socket-holding tasks: a subscription with reconnect, and one replay request.

use std::sync::Arc;
use std::time::Duration;

use router_core::WorkerKey;
use tokio::sync::mpsc;

use super::{is_replay_end, EndpointConfig, Input, InputKind};
use crate::sequence::ReplayId;
use crate::transport::{Connector, SubEvent, TransportError};

/// Holds `ep`'s subscription until aborted, reconnecting after failures with
/// exponential backoff from `min` to `max` ms. Ends when the owner is gone.
pub(super) async fn subscribe<C: Connector>(
    conn: Arc<C>,
    key: WorkerKey,
    gen: u64,
    ep: EndpointConfig,
    tx: mpsc::Sender<Input>,
    (min_ms, max_ms): (u64, u64),
) {
    let send = |kind| {
        let tx = tx.clone();
        async move { tx.send(Input { key, gen, kind }).await.is_ok() }
    };
    let mut backoff_ms = min_ms;
    loop {
        if let Ok(mut sub) = conn.subscribe(&ep.endpoint, &ep.topic).await {
            backoff_ms = min_ms;
            if !send(InputKind::Connection(true)).await {
                return;
            }
            loop {
                let kind = match sub.next().await {
                    Ok(SubEvent::Message(frames)) => InputKind::Live(frames),
                    Ok(SubEvent::Connected) => InputKind::Connection(true),
                    Ok(SubEvent::Disconnected) => InputKind::Connection(false),
                    Err(_) => break,
                };
                if !send(kind).await {
                    return;
                }
            }
            if !send(InputKind::Connection(false)).await {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
        backoff_ms = backoff_ms.saturating_mul(2).min(max_ms.max(min_ms));
    }
}

/// Carries out one replay request, forwarding every reply; reports failure if the
/// request cannot be sent, a receive fails, or `timeout` passes before the end marker.
#[allow(clippy::too_many_arguments)]
pub(super) async fn replay<C: Connector>(
    conn: Arc<C>,
    key: WorkerKey,
    gen: u64,
    id: ReplayId,
    addr: String,
    from: u64,
    tx: mpsc::Sender<Input>,
    timeout: Duration,
) {
    let work = async {
        let mut replies = conn.replay(&addr, from).await?;
        loop {
            let frames = replies.next().await?;
            let end = is_replay_end(&frames);
            if tx.send(Input { key, gen, kind: InputKind::Replay(id, frames) }).await.is_err() || end {
                return Ok::<(), TransportError>(());
            }
        }
    };
    let ok = matches!(tokio::time::timeout(timeout, work).await, Ok(Ok(())));
    if !ok {
        let _ = tx.send(Input { key, gen, kind: InputKind::ReplayFailed(id) }).await;
    }
}
