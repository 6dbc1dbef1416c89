//! Mid-stream migration: a stream whose worker breaks after tokens reached the client
//! (the connection drops, the worker dies, the stream stalls past
//! `retry.idle_stream_timeout_ms`) continues on another worker, and the client sees one
//! uninterrupted, standard OpenAI stream.
//!
//! Exactness: greedy decoding on the same weights continues a token sequence the same
//! way, so the continuation's prompt is the *token ids* of the original prompt followed
//! by the ids generated so far; re-tokenizing text could merge or split tokens at the
//! seam. The proxy asks the worker for them with vLLM's `return_token_ids` (the first
//! chunk carries `prompt_token_ids`, every chunk its `token_ids`) and removes those
//! fields before the client sees the chunk, unless the client asked for them itself.
//! A completion continues on `/v1/completions` with the ids as its prompt; so does a
//! chat, whose `prompt_token_ids` already hold the rendered chat template, and its
//! continuation's chunks are turned back into chat deltas. `max_tokens` shrinks by what
//! was generated.
//!
//! Across the seam the chunk `id`, `created` and `model` stay those of the first chunk;
//! a final `usage` counts the original prompt and every token generated. What is not
//! migrated, and ends with an `error` event instead: structured output (a
//! `response_format` other than text, guided decoding, a forced tool call), whose
//! grammar state cannot be resumed; a worker that sent no token ids (kvroute's own
//! tokenization is not used instead: the router keeps only block hashes, and a text
//! prompt or a chat template rendered by kvroute is not guaranteed to give the engine's
//! ids token for token, nor does anything give the generated ids); more than
//! `migration.attempts_max` breaks; no continuation answering within
//! `migration.deadline_ms` of the break. Nor is what a continuation on
//! `/v1/completions` would silently change: logprobs (a chat's have another shape, a
//! completion's offsets restart), tools (unless `tool_choice` is `"none"`), and a chat
//! whose worker parsed its output into reasoning or tool-call deltas (a server-side
//! parser the continuation bypasses). Only streams migrate: a non-streaming request
//! has sent nothing when its worker breaks, and is retried whole (see [`crate::retry`]).

mod body;
mod lift;
mod plan;
mod sse;

pub(crate) use body::respond;
pub use body::MigratingBody;
pub(crate) use plan::Plan;
