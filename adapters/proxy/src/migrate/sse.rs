//! The stream side of a migration: reads a worker's SSE events, remembers what a
//! continuation needs (the prompt's and the output's token ids, the chunk identity),
//! and writes the events the client gets: complete events only, token-id fields
//! removed, identity and usage made whole across seams, and a chat continuation's
//! completion chunks turned back into chat deltas.
//!
//! A worker whose first chunk carries no `prompt_token_ids` cannot be continued: from
//! then on its bytes pass through as they come, unsplit and unparsed ([`Stream::passthrough`]).
//! Otherwise only the first chunk and every chunk after a seam are parsed, and a token's
//! chunk only if its ids cannot be cut out of its bytes (`lift.rs`); the others go out
//! byte for byte.
//!
//! No I/O: bytes in, bytes out. Work is linear in the bytes fed.

use std::sync::LazyLock;

use bytes::{BufMut, Bytes, BytesMut};
use memchr::memmem::Finder;
use serde_json::{json, Map, Value};

/// Longest event kept while waiting for its end; a longer one is passed through as it
/// is, unparsed.
const EVENT_BYTES_MAX: usize = 1 << 20;

/// What the stream so far holds.
#[derive(Default)]
pub(crate) struct Stream {
    /// Bytes of an event not yet complete.
    partial: BytesMut,
    /// Bytes of `partial` already searched for an event's end.
    scanned: usize,
    /// The stream cannot be continued: bytes pass through untouched.
    pub(crate) passthrough: bool,
    /// Whether the bytes sent so far end at an event boundary.
    pub(crate) at_boundary: bool,
    /// The last bytes passed through, so that `[DONE]` split across frames is seen.
    tail: Vec<u8>,
    /// `id`, `created`, `model` of the first chunk.
    identity: Option<[Value; 3]>,
    /// The first try's prompt.
    pub(crate) prompt_ids: Option<Vec<u32>>,
    /// Prompt ids lifted out of the chunk being read (see `lift.rs`), whose own array
    /// was left empty.
    lifted: Option<Vec<u32>>,
    /// Every token generated so far, across tries.
    pub(crate) generated: Vec<u32>,
    /// Breaks continued so far.
    pub(crate) seams: u32,
    /// A chunk carried a `finish_reason`.
    pub(crate) finished: bool,
    /// `data: [DONE]` passed.
    pub(crate) done: bool,
    /// The client's stream is a chat.
    chat: bool,
    /// The client asked for the token-id fields itself.
    client_ids: bool,
    /// A chunk carried a usage object.
    pub(crate) usage_seen: bool,
    /// A chat chunk carried reasoning or tool-call deltas: a server-side parser shaped the
    /// output, which a continuation on `/v1/completions` would bypass.
    pub(crate) parsed_output: bool,
}

impl Stream {
    pub(crate) fn new(chat: bool, client_ids: bool) -> Self {
        Stream { chat, client_ids, at_boundary: true, ..Stream::default() }
    }

    /// A break is being continued: what follows comes from a continuation, and a
    /// partial event of the broken try is dropped (the client never saw it).
    pub(crate) fn seam(&mut self) {
        self.seams += 1;
        self.partial.clear();
        self.scanned = 0;
    }

    /// Feeds bytes from the worker; returns the bytes for the client (maybe empty) and
    /// how many events they hold.
    pub(crate) fn feed(&mut self, data: &[u8]) -> (Bytes, u32) {
        if self.passthrough {
            return self.pass(data);
        }
        self.partial.extend_from_slice(data);
        let mut out = BytesMut::new();
        let mut events = 0;
        while let Some(end) = self.event_end() {
            let event = self.partial.split_to(end + 2).freeze();
            self.scanned = 0;
            self.event(&event[..end], &mut out);
            events += 1;
            if self.passthrough {
                let rest = self.partial.split();
                out.extend_from_slice(&rest);
                events += u32::from(!rest.is_empty());
                break;
            }
        }
        if self.partial.len() > EVENT_BYTES_MAX {
            out.extend_from_slice(&self.partial.split());
            self.scanned = 0;
            events += 1;
        }
        if !out.is_empty() {
            self.at_boundary = out.ends_with(b"\n\n");
        }
        (out.freeze(), events)
    }

    fn pass(&mut self, data: &[u8]) -> (Bytes, u32) {
        if !data.is_empty() {
            self.at_boundary = data.ends_with(b"\n\n");
        }
        let n = &*NEEDLES;
        let head = &data[..data.len().min(DONE.len())];
        self.tail.extend_from_slice(head);
        if n.done.find(&self.tail).is_some() || n.done.find(data).is_some() {
            self.done = true;
        }
        let keep = data.len().min(DONE.len());
        self.tail.clear();
        self.tail.extend_from_slice(&data[data.len() - keep..]);
        let events = n.blank_line.find_iter(data).count().max(1) as u32;
        (Bytes::copy_from_slice(data), if data.is_empty() { 0 } else { events })
    }

    /// Where the first whole event in `partial` ends, searching only what is new.
    fn event_end(&mut self) -> Option<usize> {
        let from = self.scanned.saturating_sub(1);
        match NEEDLES.blank_line.find(&self.partial[from..]) {
            Some(i) => Some(from + i),
            None => {
                self.scanned = self.partial.len();
                None
            }
        }
    }

    /// Writes one event for the client: as the worker sent it, byte for byte, unless
    /// it had to change.
    fn event(&mut self, event: &[u8], out: &mut BytesMut) {
        let Some(data) = event.strip_prefix(b"data: ").or_else(|| event.strip_prefix(b"data:")) else {
            return put_event(out, event);
        };
        if data.trim_ascii() == b"[DONE]" {
            self.done = true;
            return put_event(out, event);
        }
        let n = &*NEEDLES;
        self.usage_seen |= has_value(data, &n.usage);
        if self.chat && !self.parsed_output {
            self.parsed_output = n.parsed_output.iter().any(|k| has_value(data, k));
        }
        // Most chunks need no parse: no seam yet, no token ids in them, identity known.
        let plain = self.seams == 0 && self.identity.is_some() && n.token_ids.find(data).is_none();
        if plain {
            self.finished |= finish_reason_set(data);
            return put_event(out, event);
        }
        if self.seams == 0 && self.identity.is_some() && !self.client_ids {
            if let Some((rest, ids)) = super::lift::token_ids(data) {
                self.generated.extend(ids);
                self.finished |= finish_reason_set(&rest);
                let mut line = b"data: ".to_vec();
                line.extend_from_slice(&rest);
                return put_event(out, &line);
            }
        }
        // Ids the client did not ask for are removed anyway, so they need no Value.
        let lifted = if self.client_ids { None } else { super::lift::prompt_ids(data) };
        let parsed = match &lifted {
            Some((rest, _)) => serde_json::from_slice::<Value>(rest),
            None => serde_json::from_slice::<Value>(data),
        };
        self.lifted = lifted.map(|(_, ids)| ids);
        self.parsed(parsed, event, out);
        self.lifted = None;
    }

    /// Writes the event whose chunk parsed to `parsed`.
    fn parsed(&mut self, parsed: serde_json::Result<Value>, event: &[u8], out: &mut BytesMut) {
        match parsed {
            Ok(Value::Object(mut chunk)) if !chunk.contains_key("error") => {
                let first = self.identity.is_none();
                let changed = self.chunk(&mut chunk);
                if first && self.prompt_ids.is_none() {
                    // No token ids to continue from: nothing more to look at.
                    self.passthrough = true;
                }
                if !changed {
                    return put_event(out, event);
                }
                let mut line = b"data: ".to_vec();
                line.extend_from_slice(Value::Object(chunk).to_string().as_bytes());
                put_event(out, &line);
            }
            _ => put_event(out, event),
        }
    }

    /// Reads one chunk and changes what must change; says whether anything did.
    fn chunk(&mut self, chunk: &mut Map<String, Value>) -> bool {
        let continued = self.seams > 0;
        let mut changed = continued;
        match &self.identity {
            Some(ids) if continued => {
                for (k, v) in ["id", "created", "model"].into_iter().zip(ids) {
                    chunk.insert(k.into(), v.clone());
                }
            }
            Some(_) => {}
            None => {
                let get = |k| chunk.get(k).cloned().unwrap_or(Value::Null);
                self.identity = Some([get("id"), get("created"), get("model")]);
            }
        }
        let top_prompt = chunk.remove("prompt_token_ids");
        let keep_prompt = self.client_ids && !continued;
        changed |= top_prompt.is_some() && !keep_prompt;
        if top_prompt.is_some() && !keep_prompt {
            // vLLM sends `prompt_text` next to the ids (null in a chat); it goes with them.
            chunk.remove("prompt_text");
        }
        if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
            for c in choices.iter_mut().filter_map(Value::as_object_mut) {
                let own = c.remove("prompt_token_ids");
                if own.is_some() && !keep_prompt {
                    c.remove("prompt_text");
                }
                match &own {
                    Some(p) if keep_prompt => {
                        c.insert("prompt_token_ids".into(), p.clone());
                    }
                    Some(_) => changed = true,
                    None => {}
                }
                changed |= self.choice(c, own.or(top_prompt.clone()));
            }
        } else {
            self.take_prompt(top_prompt.clone());
        }
        if let (true, Some(p)) = (keep_prompt, top_prompt) {
            chunk.insert("prompt_token_ids".into(), p);
        }
        if continued && self.chat {
            chunk.insert("object".into(), Value::from("chat.completion.chunk"));
        }
        if let (true, Some(Value::Object(usage))) = (continued, chunk.get_mut("usage")) {
            let prompt = self.prompt_ids.as_ref().map_or(0, Vec::len) as u64;
            let completion = self.generated.len() as u64;
            usage.insert("prompt_tokens".into(), Value::from(prompt));
            usage.insert("completion_tokens".into(), Value::from(completion));
            usage.insert("total_tokens".into(), Value::from(prompt + completion));
            // The details stay the continuation's; its cache hits can reach into the
            // generated part of its prompt, which the client does not count as prompt.
            if let Some(Value::Object(details)) = usage.get_mut("prompt_tokens_details") {
                if let Some(cached) = details.get("cached_tokens").and_then(Value::as_u64) {
                    details.insert("cached_tokens".into(), Value::from(cached.min(prompt)));
                }
            }
        }
        changed
    }

    /// Reads one choice; says whether it changed.
    fn choice(&mut self, c: &mut Map<String, Value>, prompt: Option<Value>) -> bool {
        let first_try = self.seams == 0;
        let mut changed = false;
        if first_try {
            self.take_prompt(prompt);
        }
        if let Some(ids) = c.remove("token_ids") {
            self.generated.extend(ids_of(&ids).unwrap_or_default());
            if self.client_ids {
                c.insert("token_ids".into(), ids);
            } else {
                changed = true;
            }
        }
        if c.get("finish_reason").is_some_and(|f| !f.is_null()) {
            self.finished = true;
        }
        // A chat continued on the completions endpoint: its text becomes a delta.
        if !first_try && self.chat {
            if let Some(text) = c.remove("text") {
                c.insert("delta".into(), json!({ "content": text }));
            }
            c.remove("prompt_logprobs");
        }
        changed
    }

    fn take_prompt(&mut self, prompt: Option<Value>) {
        if self.prompt_ids.is_none() && self.seams == 0 {
            let emptied = prompt.as_ref().and_then(Value::as_array).is_some_and(Vec::is_empty);
            let lifted = self.lifted.take().filter(|_| emptied);
            self.prompt_ids = lifted.or_else(|| prompt.as_ref().and_then(ids_of));
        }
    }
}

impl Stream {
    /// A final usage chunk from what is known (the client's prompt and every token
    /// generated), for a stream whose worker broke after its last token but before its
    /// usage. `None` without the prompt's ids.
    pub(crate) fn usage_chunk(&self) -> Option<Bytes> {
        let prompt = self.prompt_ids.as_ref()?.len() as u64;
        let completion = self.generated.len() as u64;
        let [id, created, model] = self.identity.clone()?;
        let object = if self.chat { "chat.completion.chunk" } else { "text_completion" };
        let usage =
            json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion});
        let chunk =
            json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage});
        Some(Bytes::from(format!("data: {chunk}\n\n")))
    }
}

const DONE: &[u8] = b"data: [DONE]";

/// The searchers of every chunk, built once: building one costs more than searching a
/// chunk with it.
struct Needles {
    done: Finder<'static>,
    blank_line: Finder<'static>,
    token_ids: Finder<'static>,
    usage: Finder<'static>,
    /// Keys whose value means the chat's output was parsed (reasoning, tool calls).
    parsed_output: [Finder<'static>; 3],
    finish: [Finder<'static>; 2],
}

static NEEDLES: LazyLock<Needles> = LazyLock::new(|| Needles {
    done: Finder::new(DONE),
    blank_line: Finder::new(b"\n\n"),
    token_ids: Finder::new(b"token_ids"),
    usage: Finder::new(b"\"usage\":"),
    parsed_output: [
        Finder::new(b"\"reasoning_content\":"),
        Finder::new(b"\"reasoning\":"),
        Finder::new(b"\"tool_calls\":"),
    ],
    finish: [Finder::new(b"\"finish_reason\":\""), Finder::new(b"\"finish_reason\": \"")],
});

/// Whether a chunk names a `finish_reason` (a string; `null` while it goes on).
fn finish_reason_set(data: &[u8]) -> bool {
    NEEDLES.finish.iter().any(|f| f.find(data).is_some())
}

/// Whether `data` holds `key` (a quoted name and its colon) with a value other than null.
fn has_value(data: &[u8], key: &Finder<'_>) -> bool {
    key.find_iter(data).any(|at| {
        let rest = data[at + key.needle().len()..].trim_ascii_start();
        !rest.is_empty() && !rest.starts_with(b"null")
    })
}

fn ids_of(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
}

#[cfg(test)]
impl Stream {
    fn feed_bytes(&mut self, data: &[u8]) -> Bytes {
        self.feed(data).0
    }
}

fn put_event(out: &mut BytesMut, event: &[u8]) {
    out.put_slice(event);
    out.put_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(b: &Bytes) -> String {
        String::from_utf8(b.to_vec()).unwrap()
    }

    #[test]
    fn ids_are_collected_and_removed_and_partial_events_wait() {
        let mut s = Stream::new(false, false);
        let first = r#"data: {"id":"a","created":1,"model":"m","choices":[{"index":0,"text":"x ","prompt_token_ids":[1,2],"token_ids":[7]}]}"#;
        let out = s.feed_bytes(format!("{first}\n\ndata: {{\"id\":\"a\",").as_bytes());
        let v: Value = serde_json::from_str(text(&out).strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert_eq!(v, json!({"id": "a", "created": 1, "model": "m", "choices": [{"index": 0, "text": "x "}]}));
        assert!(text(&out).ends_with("}\n\n"));
        assert_eq!((s.prompt_ids.clone(), s.generated.clone()), (Some(vec![1, 2]), vec![7]));
        // The broken try's partial event is dropped at the seam; the continuation's
        // identity is replaced by the first one's and its usage covers everything.
        s.seam();
        let cont = r#"data: {"id":"b","created":2,"model":"m2","choices":[{"index":0,"text":"y ","token_ids":[8],"prompt_token_ids":[1,2,7],"finish_reason":"length"}]}"#;
        let usage = r#"data: {"id":"b","created":2,"model":"m2","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;
        let out = text(&s.feed_bytes(format!("{cont}\n\n{usage}\n\ndata: [DONE]\n\n").as_bytes()));
        let events: Vec<Value> = out
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert_eq!(events[0]["id"], "a");
        assert_eq!(events[0]["created"], 1);
        assert_eq!(events[0]["model"], "m");
        assert_eq!(events[0]["choices"][0], json!({"index": 0, "text": "y ", "finish_reason": "length"}));
        assert_eq!(events[1]["usage"], json!({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}));
        assert!(out.ends_with("data: [DONE]\n\n") && s.done && s.finished);
        assert_eq!(s.prompt_ids, Some(vec![1, 2]), "a continuation's prompt is not the client's");
    }

    #[test]
    fn a_chat_continuation_speaks_chat_and_client_ids_stay() {
        let mut s = Stream::new(true, true);
        let first = r#"data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","prompt_token_ids":[5],"choices":[{"index":0,"delta":{"role":"assistant","content":"a "},"token_ids":[9]}]}"#;
        let out = text(&s.feed_bytes(format!("{first}\n\n").as_bytes()));
        assert!(out.contains("\"prompt_token_ids\":[5]") && out.contains("\"token_ids\":[9]"), "{out}");
        s.seam();
        let cont = r#"data: {"id":"d","object":"text_completion","created":2,"model":"m","choices":[{"index":0,"text":"b ","token_ids":[10],"logprobs":null}]}"#;
        let v: Value = serde_json::from_str(
            text(&s.feed_bytes(format!("{cont}\n\n").as_bytes())).trim().strip_prefix("data: ").unwrap(),
        )
        .unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(v["id"], "c");
        assert_eq!(v["choices"][0]["delta"], json!({"content": "b "}));
        assert!(v["choices"][0].get("text").is_none());
        assert_eq!(s.generated, [9, 10]);
    }

    /// A chat's first chunk as vLLM sends it when asked for token ids.
    const CHAT_FIRST: &str = r#"data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[3,64],"prompt_text":null}"#;

    #[track_caller]
    fn check_first_chunk(client_ids: bool, first: &str, want: Value) {
        let mut s = Stream::new(true, client_ids);
        let out = text(&s.feed_bytes(format!("{first}\n\n").as_bytes()));
        let got: Value = serde_json::from_str(out.strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert_eq!(got, want, "client_ids {client_ids}");
        assert_eq!(s.prompt_ids, Some(vec![3, 64]));
    }

    #[test]
    fn the_prompt_text_that_comes_with_the_ids_goes_with_them() {
        let choice = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
        let standard =
            json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choice});
        check_first_chunk(false, CHAT_FIRST, standard.clone());
        let mut asked = standard;
        asked["prompt_token_ids"] = json!([3, 64]);
        asked["prompt_text"] = Value::Null;
        check_first_chunk(true, CHAT_FIRST, asked);
        // In a completion the ids (and the text) are the choice's.
        let mut s = Stream::new(false, false);
        let first = r#"data: {"id":"a","created":1,"model":"m","choices":[{"index":0,"text":"x","prompt_token_ids":[1],"prompt_text":"p","token_ids":[7]}]}"#;
        let out = text(&s.feed_bytes(format!("{first}\n\n").as_bytes()));
        assert!(!out.contains("prompt_text") && !out.contains("token_ids"), "{out}");
    }

    #[test]
    fn a_long_prompt_reads_the_same_lifted_or_parsed_whole() {
        let ids: Vec<u32> = (0..6000).map(|i| i * 7 % 8192).collect();
        let one = format!(
            r#"{{"id":"a","created":1,"model":"m","choices":[{{"index":0,"text":"x","prompt_token_ids":{ids:?},"token_ids":[7]}}]}}"#
        );
        // Two choices name the key twice, so nothing is lifted and the chunk is parsed whole.
        let two = format!(
            r#"{{"id":"a","created":1,"model":"m","choices":[{{"index":0,"text":"x","prompt_token_ids":{ids:?},"token_ids":[7]}},{{"index":1,"text":"y","prompt_token_ids":{ids:?}}}]}}"#
        );
        for (chunk, lifts) in [(one, true), (two, false)] {
            assert_eq!(super::super::lift::prompt_ids(chunk.as_bytes()).is_some(), lifts);
            let mut s = Stream::new(false, false);
            let out = text(&s.feed_bytes(format!("data: {chunk}\n\n").as_bytes()));
            assert!(!out.contains("token_ids") && out.contains(r#""text":"x""#), "{out}");
            assert_eq!(s.prompt_ids.as_deref(), Some(&ids[..]));
            assert_eq!(s.generated, vec![7]);
        }
    }

    /// The usage after a seam, for a continuation whose usage is `usage`, after a first
    /// try with a 200-token prompt that generated 10 tokens.
    #[track_caller]
    fn check_usage_after_seam(usage: Value, want: Value) {
        let mut s = Stream::new(true, false);
        let first = format!(
            r#"data: {{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{{"index":0,"delta":{{"content":"a"}},"token_ids":[1,2,3,4,5,6,7,8,9,10]}}],"prompt_token_ids":{:?}}}"#,
            vec![4u32; 200]
        );
        s.feed_bytes(format!("{first}\n\n").as_bytes());
        s.seam();
        let last =
            json!({"id": "d", "object": "text_completion", "created": 2, "model": "m", "choices": [], "usage": usage});
        let out = text(&s.feed_bytes(format!("data: {last}\n\n").as_bytes()));
        let got: Value = serde_json::from_str(out.strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert_eq!(got["usage"], want);
    }

    #[test]
    fn usage_after_a_seam_counts_the_clients_prompt_and_keeps_the_engines_details() {
        let counts = json!({"prompt_tokens": 210, "completion_tokens": 4, "total_tokens": 214});
        let whole = json!({"prompt_tokens": 200, "completion_tokens": 10, "total_tokens": 210});
        let with = |mut u: Value, details: Value| {
            u["prompt_tokens_details"] = details;
            u
        };
        check_usage_after_seam(counts.clone(), whole.clone());
        let engine = json!({"cached_tokens": 192, "created_cache_tokens": 0});
        check_usage_after_seam(with(counts.clone(), engine.clone()), with(whole.clone(), engine));
        // Hits in the generated part of the continuation's prompt are not the client's.
        let engine = json!({"cached_tokens": 209});
        check_usage_after_seam(with(counts.clone(), engine), with(whole.clone(), json!({"cached_tokens": 200})));
        check_usage_after_seam(with(counts, Value::Null), with(whole, Value::Null));
    }

    #[test]
    fn a_worker_without_token_ids_is_passed_through_untouched() {
        let mut s = Stream::new(false, false);
        let first = "data: {\"id\":\"x\", \"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"te";
        assert_eq!(text(&s.feed_bytes(first.as_bytes())), first, "the rest of the frame goes out at once");
        assert!(s.passthrough && !s.at_boundary);
        let rest = "xt\":\"b\"}]}\n\ndata: [DO";
        assert_eq!(text(&s.feed_bytes(rest.as_bytes())), rest);
        assert!(!s.done);
        assert_eq!(text(&s.feed_bytes(b"NE]\n\n")), "NE]\n\n");
        assert!(s.done && s.at_boundary, "[DONE] split across frames is seen");
    }

    #[test]
    fn usage_and_parsed_deltas_are_noticed_and_a_lost_usage_is_rebuilt() {
        let mut s = Stream::new(true, false);
        let first = r#"data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"a","reasoning_content":null},"token_ids":[7]}],"prompt_token_ids":[1,2,3],"usage":null}"#;
        s.feed_bytes(format!("{first}\n\n").as_bytes());
        assert!(!s.usage_seen && !s.parsed_output, "null values are not output");
        let last = r#"data: {"id":"c","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"b"},"token_ids":[8],"finish_reason":"stop"}]}"#;
        s.feed_bytes(format!("{last}\n\n").as_bytes());
        let u = s.usage_chunk().unwrap();
        let v: Value = serde_json::from_str(text(&u).strip_prefix("data: ").unwrap().trim_end()).unwrap();
        let usage = json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5});
        let want = json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [], "usage": usage});
        assert_eq!(v, want);
        let reasoning =
            r#"data: {"id":"c","choices":[{"index":0,"delta":{"reasoning_content":"hm"},"token_ids":[9]}]}"#;
        s.feed_bytes(format!("{reasoning}\n\n").as_bytes());
        assert!(s.parsed_output);
        let mut t = Stream::new(true, false);
        t.feed_bytes(b"data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"tool_calls\": [{\"index\":0}]}}]}\n\n");
        assert!(t.parsed_output);
        let mut u = Stream::new(false, false);
        u.feed_bytes(b"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\n");
        assert!(u.usage_seen && !u.parsed_output);
        assert_eq!(Stream::new(false, false).usage_chunk(), None, "nothing known, nothing made up");
    }

    #[test]
    fn comments_errors_and_garbage_pass_through() {
        let mut s = Stream::new(false, false);
        let input = ": ping\n\nevent: error\ndata: {\"error\":{\"message\":\"x\"}}\n\ndata: not json\n\n";
        assert_eq!(text(&s.feed_bytes(input.as_bytes())), input);
        assert!(s.prompt_ids.is_none() && s.generated.is_empty());
    }
}
