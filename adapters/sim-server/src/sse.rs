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
use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use hyper::body::{Body, Frame};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::bootstrap::RoomGuard;
use crate::engine_task::{Done, Progress};
use crate::greedy::{word, Greedy};
use crate::http::InFlight;
use crate::metrics::{Latency, Metrics};
use crate::openai::{chunk, usage_chunk, ApiError, Kind, KvSource, ResponseMeta};
use crate::responses::Events;

/// A request's arrival, from which its first and last tokens are timed into the
/// worker's latency histograms, as vLLM times them: a router or a benchmark then tells
/// the worker's own latency from what the path to the client adds.
pub(crate) struct Clock {
    arrived: Instant,
    ttft: Latency,
    e2e: Latency,
    first_seen: bool,
}

impl Clock {
    pub(crate) fn start(m: &Metrics) -> Self {
        Clock { arrived: Instant::now(), ttft: m.ttft.clone(), e2e: m.e2e.clone(), first_seen: false }
    }

    /// `n` tokens leave: the first of them, if any, is the request's first.
    fn tokens(&mut self, n: u32) {
        if n > 0 {
            self.first_token();
        }
    }

    fn first_token(&mut self) {
        if !self.first_seen {
            self.first_seen = true;
            self.ttft.0.observe(self.arrived.elapsed().as_secs_f64());
        }
    }

    fn last_token(&mut self) {
        self.first_token();
        self.e2e.0.observe(self.arrived.elapsed().as_secs_f64());
    }
}

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
    pub(crate) clock: Clock,
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
        self.finish.clock.tokens(n);
        let mut buf = BytesMut::with_capacity(n as usize * 200);
        for _ in 0..n {
            let id = self.finish.greedy.next_token();
            if let Some(events) = &mut self.events {
                events.delta(&mut buf, &self.finish.meta, word(id));
                self.emitted += 1;
                continue;
            }
            let mut c = chunk(&self.finish.meta, Some(word(id)), self.emitted == 0);
            let prompt_ids = if self.finish.return_token_ids {
                let prompt_ids = self.finish.prompt_ids.take();
                add_token_ids(&mut c, self.finish.meta.kind, id, prompt_ids.is_some());
                prompt_ids
            } else {
                None
            };
            self.emitted += 1;
            match prompt_ids {
                Some(ids) => push_event_with_prompt_ids(&mut buf, &c, &ids),
                None => push_event(&mut buf, &c),
            }
        }
        buf.freeze()
    }

    /// Fault injection: the stream has sent all it will.
    fn stalled(&self) -> bool {
        self.finish.stall_after_tokens.is_some_and(|s| self.emitted >= s)
    }

    fn done(&mut self, d: &Done) -> Bytes {
        self.finish.clock.last_token();
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
/// chunk, in the choice for completions and at the top for chat. The prompt's ids are a
/// `null` placeholder here, filled in by [`push_event_with_prompt_ids`].
fn add_token_ids(c: &mut Value, kind: Kind, id: u32, with_prompt: bool) {
    if let Some(choice) = c.pointer_mut("/choices/0").and_then(Value::as_object_mut) {
        choice.insert("token_ids".into(), Value::from(vec![id]));
        if kind == Kind::Completions && with_prompt {
            choice.insert(PROMPT_IDS_KEY.into(), Value::Null);
        }
    }
    if let (Kind::Chat, true, Some(o)) = (kind, with_prompt, c.as_object_mut()) {
        o.insert(PROMPT_IDS_KEY.into(), Value::Null);
    }
}

const PROMPT_IDS_KEY: &str = "prompt_token_ids";

fn push_event(buf: &mut BytesMut, v: &Value) {
    buf.put_slice(b"data: ");
    buf.put_slice(v.to_string().as_bytes());
    buf.put_slice(b"\n\n");
}

/// [`push_event`] for a chunk whose `prompt_token_ids` placeholder gets `ids`, written
/// straight from the slice: thousands of ids made into `Value`s first cost a long
/// prompt's first token a tenth of a millisecond of wall time, which no GPU spends.
fn push_event_with_prompt_ids(buf: &mut BytesMut, v: &Value, ids: &[u32]) {
    let text = v.to_string();
    let placeholder = format!("\"{PROMPT_IDS_KEY}\":null");
    let Some(at) = text.find(&placeholder) else {
        return push_event(buf, v);
    };
    let ids = serde_json::to_string(ids).unwrap_or_else(|_| "[]".into());
    let (text, end) = (text.as_bytes(), at + placeholder.len());
    buf.put_slice(b"data: ");
    buf.put_slice(&text[..end - "null".len()]);
    buf.put_slice(ids.as_bytes());
    buf.put_slice(&text[end..]);
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
pub(crate) async fn collect(
    mut rx: mpsc::UnboundedReceiver<Progress>,
    mut greedy: Greedy,
    mut clock: Clock,
) -> Option<(String, Done)> {
    let mut text = String::new();
    while let Some(p) = rx.recv().await {
        match p {
            Progress::Tokens(n) => {
                clock.tokens(n);
                for _ in 0..n {
                    text.push_str(word(greedy.next_token()));
                }
            }
            Progress::Done(d) => {
                clock.last_token();
                return Some((text, d));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The first chunk of a `kind` stream with `return_token_ids` and a prompt of `ids`:
    /// where its `prompt_token_ids` land.
    fn check(kind: Kind, ids: &[u32], pointer: &str) {
        let meta =
            ResponseMeta { id: "x".into(), created: 1, model: "m".into(), kind, prompt_tokens: ids.len() as u32 };
        let mut c = chunk(&meta, Some("w"), true);
        add_token_ids(&mut c, kind, 9, true);
        let mut buf = BytesMut::new();
        push_event_with_prompt_ids(&mut buf, &c, ids);
        let text = std::str::from_utf8(&buf).unwrap();
        let v: Value =
            serde_json::from_str(text.strip_prefix("data: ").unwrap().strip_suffix("\n\n").unwrap()).unwrap();
        assert_eq!(v.pointer(pointer), Some(&json!(ids)), "{text}");
        assert_eq!(v.pointer("/choices/0/token_ids"), Some(&json!([9])), "{text}");
        assert_eq!(text.matches("prompt_token_ids").count(), 1, "{text}");
    }

    #[test]
    fn prompt_ids_go_where_vllm_puts_them() {
        let long: Vec<u32> = (0..5000).collect();
        for ids in [&[][..], &[3, 1, 4], &long] {
            check(Kind::Completions, ids, "/choices/0/prompt_token_ids");
            check(Kind::Chat, ids, "/prompt_token_ids");
        }
    }
}
