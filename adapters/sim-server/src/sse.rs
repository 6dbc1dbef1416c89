//! The response side of a generation: a server-sent-events body fed by the engine
//! task's progress channel, and the collector for non-streaming responses.
//!
//! The stream is `data: {chunk}\n\n` per token, a final chunk with `finish_reason`, an
//! optional usage chunk, then `data: [DONE]\n\n`; a Responses API stream is its typed
//! events instead (see the `responses` module). Dropping the body (the client went
//! away) drops the progress receiver; the engine task then discards that request's
//! tokens. The in-flight guard travels with the body, so a streaming request counts
//! against the limit until its stream ends.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use hyper::body::{Body, Frame};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::bootstrap::RoomGuard;
use crate::engine_task::{Done, Progress};
use crate::greedy::{word, Greedy};
use crate::http::InFlight;
use crate::openai::{chunk, usage_chunk, ApiError, Kind, KvSource, ResponseMeta};
use crate::responses::Events;

/// What a finished request's response needs besides its tokens.
pub(crate) struct Finish {
    pub(crate) meta: ResponseMeta,
    /// The decoding state after the prompt.
    pub(crate) greedy: Greedy,
    /// With `return_token_ids`: the prompt's ids, sent in the first chunk (then `None`);
    /// every chunk then carries its `token_ids`.
    pub(crate) prompt_ids: Option<Vec<u32>>,
    pub(crate) return_token_ids: bool,
    /// Fault injection: tokens sent before the stream stalls for good.
    pub(crate) stall_after_tokens: Option<u32>,
    /// Prefill role: where a decode worker would pull the KV from.
    pub(crate) kv_params: Option<KvSource>,
}

/// The SSE body of one streaming response.
pub(crate) struct SseBody {
    rx: mpsc::UnboundedReceiver<Progress>,
    finish: Finish,
    include_usage: bool,
    emitted: u32,
    ended: bool,
    _guard: InFlight,
    /// A prefill's bootstrap room, done with the stream (failed if dropped before).
    room: Option<RoomGuard>,
    /// A Responses API stream's typed events, instead of chunks.
    events: Option<Events>,
}

impl SseBody {
    pub(crate) fn new(
        rx: mpsc::UnboundedReceiver<Progress>,
        finish: Finish,
        include_usage: bool,
        guard: InFlight,
        room: Option<RoomGuard>,
    ) -> Self {
        let events = (finish.meta.kind == Kind::Responses).then(Events::default);
        SseBody { rx, finish, include_usage, emitted: 0, ended: false, _guard: guard, room, events }
    }

    fn tokens(&mut self, n: u32) -> Bytes {
        let n = match self.finish.stall_after_tokens {
            Some(stall) => n.min(stall.saturating_sub(self.emitted)),
            None => n,
        };
        let mut buf = BytesMut::with_capacity(n as usize * 200);
        for _ in 0..n {
            let id = self.finish.greedy.next_token();
            if let Some(events) = &mut self.events {
                events.delta(&mut buf, &self.finish.meta, word(id));
                self.emitted += 1;
                continue;
            }
            let mut c = chunk(&self.finish.meta, Some(word(id)), self.emitted == 0);
            if self.finish.return_token_ids {
                add_token_ids(&mut c, self.finish.meta.kind, id, self.finish.prompt_ids.take());
            }
            self.emitted += 1;
            push_event(&mut buf, &c);
        }
        buf.freeze()
    }

    /// Fault injection: the stream has sent all it will.
    fn stalled(&self) -> bool {
        self.finish.stall_after_tokens.is_some_and(|s| self.emitted >= s)
    }

    fn done(&mut self, d: &Done) -> Bytes {
        if let Some(events) = &mut self.events {
            return events.finish(&self.finish.meta, d);
        }
        let mut buf = BytesMut::with_capacity(512);
        let mut last = chunk(&self.finish.meta, None, false);
        if let (Some(f), Some(o)) = (&self.finish.kv_params, last.as_object_mut()) {
            o.insert("kv_transfer_params".into(), f.params(d.prompt_blocks));
        }
        push_event(&mut buf, &last);
        if self.include_usage {
            push_event(&mut buf, &usage_chunk(&self.finish.meta, d));
        }
        buf.put_slice(b"data: [DONE]\n\n");
        buf.freeze()
    }
}

/// vLLM's token-id fields: `token_ids` in the choice; `prompt_token_ids` in the first
/// chunk, in the choice for completions and at the top for chat.
fn add_token_ids(c: &mut Value, kind: Kind, id: u32, prompt_ids: Option<Vec<u32>>) {
    if let Some(choice) = c.pointer_mut("/choices/0").and_then(Value::as_object_mut) {
        choice.insert("token_ids".into(), Value::from(vec![id]));
        if let (Kind::Completions, Some(p)) = (kind, &prompt_ids) {
            choice.insert("prompt_token_ids".into(), Value::from(p.clone()));
        }
    }
    if let (Kind::Chat, Some(p), Some(o)) = (kind, prompt_ids, c.as_object_mut()) {
        o.insert("prompt_token_ids".into(), Value::from(p));
    }
}

fn push_event(buf: &mut BytesMut, v: &Value) {
    buf.put_slice(b"data: ");
    buf.put_slice(v.to_string().as_bytes());
    buf.put_slice(b"\n\n");
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if self.stalled() {
            // Nothing wakes this body again: it stays open and silent until dropped.
            return Poll::Pending;
        }
        let bytes = match self.rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(Progress::Tokens(n))) => self.tokens(n),
            Poll::Ready(Some(Progress::Done(d))) => {
                self.ended = true;
                if let Some(room) = self.room.take() {
                    room.done();
                }
                self.done(&d)
            }
            Poll::Ready(None) => {
                // The engine task stopped (shutdown) before the request finished.
                self.ended = true;
                let e = ApiError::new(
                    hyper::StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "the worker is shutting down",
                );
                let mut buf = BytesMut::new();
                push_event(&mut buf, &e.body());
                buf.put_slice(b"data: [DONE]\n\n");
                buf.freeze()
            }
        };
        Poll::Ready(Some(Ok(Frame::data(bytes))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

/// Waits for a request to finish and returns its text and figures; `None` if the
/// engine task stopped first.
pub(crate) async fn collect(mut rx: mpsc::UnboundedReceiver<Progress>, mut greedy: Greedy) -> Option<(String, Done)> {
    let mut text = String::new();
    while let Some(p) = rx.recv().await {
        match p {
            Progress::Tokens(n) => {
                for _ in 0..n {
                    text.push_str(word(greedy.next_token()));
                }
            }
            Progress::Done(d) => return Some((text, d)),
        }
    }
    None
}
