//! The Responses API's answers (`POST /v1/responses`), shaped as vLLM 0.32 shapes
//! them: a whole `response` object, or a stream of typed events (`event: TYPE` then
//! `data: {...}`, each with a rising `sequence_number`): `response.created`,
//! `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, one `response.output_text.delta` per token, then
//! `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done` and `response.completed`, with no `[DONE]` after it.
//!
//! The request side is a chat: its `instructions` and `input` become messages as vLLM
//! builds them (`kvroute_tokenize::responses`), tokenized like any chat. The simulator
//! always stops at the output limit, so a finished response is `incomplete` with the
//! reason `max_output_tokens`, as vLLM reports a `length` finish.

use bytes::{BufMut, Bytes, BytesMut};
use serde_json::{json, Value};

use crate::engine_task::Done;
use crate::openai::ResponseMeta;

/// The one output message's id, derived from the response's.
fn message_id(meta: &ResponseMeta) -> String {
    format!("msg_{}", meta.id.trim_start_matches("resp_"))
}

/// The output message carrying `text`, `status` `in_progress` or `completed`.
fn message(meta: &ResponseMeta, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([text_part(text)]) };
    json!({"id": message_id(meta), "type": "message", "role": "assistant", "status": status, "content": content})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": null})
}

/// The `usage` of a finished response.
fn usage(meta: &ResponseMeta, done: &Done) -> Value {
    json!({
        "input_tokens": meta.prompt_tokens,
        "input_tokens_details": {"cached_tokens": done.cached_tokens},
        "output_tokens": done.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u64::from(meta.prompt_tokens) + u64::from(done.completion_tokens),
    })
}

/// The `response` object; `done` is `None` while it is in progress.
pub(crate) fn response(meta: &ResponseMeta, text: &str, done: Option<&Done>) -> Value {
    let (status, output, usage, incomplete) = match done {
        None => ("in_progress", json!([]), Value::Null, Value::Null),
        Some(d) => (
            "incomplete",
            json!([message(meta, text, "completed")]),
            usage(meta, d),
            json!({"reason": "max_output_tokens"}),
        ),
    };
    json!({
        "id": meta.id,
        "object": "response",
        "created_at": meta.created,
        "model": meta.model,
        "status": status,
        "incomplete_details": incomplete,
        "output": output,
        "usage": usage,
        "parallel_tool_calls": true,
        "tool_choice": "auto",
        "tools": [],
        "error": null,
    })
}

/// The events of one streamed response; counts their sequence numbers and keeps the
/// text for the closing events.
#[derive(Default)]
pub(crate) struct Events {
    sequence: u64,
    text: String,
    started: bool,
}

impl Events {
    /// The opening events, once, then a delta event for `word`.
    pub(crate) fn delta(&mut self, buf: &mut BytesMut, meta: &ResponseMeta, word: &str) {
        self.open(buf, meta);
        self.text.push_str(word);
        let e =
            json!({"item_id": message_id(meta), "output_index": 0, "content_index": 0, "delta": word, "logprobs": []});
        self.push(buf, "response.output_text.delta", e);
    }

    /// The closing events (and the opening ones, if no token came).
    pub(crate) fn finish(&mut self, meta: &ResponseMeta, done: &Done) -> Bytes {
        let mut buf = BytesMut::with_capacity(2048);
        self.open(&mut buf, meta);
        let (id, text) = (message_id(meta), self.text.clone());
        let part = json!({"item_id": id, "output_index": 0, "content_index": 0});
        self.push(
            &mut buf,
            "response.output_text.done",
            json!({"text": text, "logprobs": [], "item_id": id, "output_index": 0, "content_index": 0}),
        );
        let mut part_done = part.clone();
        part_done["part"] = text_part(&text);
        self.push(&mut buf, "response.content_part.done", part_done);
        self.push(
            &mut buf,
            "response.output_item.done",
            json!({"output_index": 0, "item": message(meta, &text, "completed")}),
        );
        self.push(&mut buf, "response.completed", json!({"response": response(meta, &text, Some(done))}));
        buf.freeze()
    }

    fn open(&mut self, buf: &mut BytesMut, meta: &ResponseMeta) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        self.push(buf, "response.created", json!({"response": response(meta, "", None)}));
        self.push(buf, "response.in_progress", json!({"response": response(meta, "", None)}));
        self.push(
            buf,
            "response.output_item.added",
            json!({"output_index": 0, "item": message(meta, "", "in_progress")}),
        );
        let part = json!({"item_id": message_id(meta), "output_index": 0, "content_index": 0, "part": text_part("")});
        self.push(buf, "response.content_part.added", part);
    }

    fn push(&mut self, buf: &mut BytesMut, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        buf.put_slice(b"event: ");
        buf.put_slice(kind.as_bytes());
        buf.put_slice(b"\ndata: ");
        buf.put_slice(data.to_string().as_bytes());
        buf.put_slice(b"\n\n");
    }
}
