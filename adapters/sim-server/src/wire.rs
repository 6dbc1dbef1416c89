//! vLLM's KV event wire format: the ZeroMQ frames and the msgpack payload, encode only.
//!
//! A published message is three frames, `[topic, seq, payload]`: the topic bytes (empty
//! by default), the batch's sequence number as an 8-byte big-endian unsigned integer
//! counting from 0, and the payload. The payload is one `KVEventBatch` as vLLM's
//! `msgspec` encodes it: a msgpack **array** `[ts, events, data_parallel_rank]` (the
//! batch is `array_like`), where `ts` is a float64 of Unix seconds and each event is a
//! msgpack **map** tagged by `"type"` (events are not `array_like`), with every field
//! that has no default present and `nil` where unset:
//!
//! * `{"type": "BlockStored", "block_hashes": [u64…], "parent_block_hash": u64|nil,
//!   "token_ids": [u32…], "block_size": int, "lora_id": nil, "medium": "GPU",
//!   "lora_name": nil}`: `token_ids` is the concatenation of the stored blocks' tokens;
//!   when a stored block holds an image's tokens the map also has `"extra_keys"`, one
//!   entry per block, `nil` or a list of `[identifier: str, offset: int]` pairs (vLLM's
//!   `to_event_extra_keys` of `_gen_mm_extra_hash_keys`), the offset being where the
//!   image starts relative to the block's first token;
//! * `{"type": "BlockRemoved", "block_hashes": [u64…], "medium": "GPU"}`;
//! * `{"type": "AllBlocksCleared"}`.
//!
//! Block hashes are msgpack unsigned integers (vLLM's `ExternalBlockHash` int form); here
//! they are the engine's sequence hashes, which router-core recomputes from `token_ids`.
//!
//! The replay ROUTER socket answers a request `[identity, "", start_seq (8 bytes BE)]`
//! with `[identity, "", topic, seq, payload]` for each buffered batch at or after
//! `start_seq`, then the end marker `[identity, "", "", END_SEQ, ""]`, where
//! [`END_SEQ`] is -1 as 8 signed big-endian bytes.
//!
//! Older vLLM releases differ, and this module does not speak them: before
//! `data_parallel_rank` the batch was `[ts, events]`; before the map form, events were
//! arrays with the tag first (`["BlockStored", hashes, parent, tokens, block_size,
//! lora_id]`); and replay replies carried no topic frame (`[identity, "", seq, payload]`).

use std::convert::Infallible;
use std::sync::Arc;

use rmp::encode::{self, ByteBuf, ValueWriteError};

/// The replay end marker's sequence frame: -1 as 8 signed big-endian bytes.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// The `medium` every event carries: the simulated cache lives on the GPU.
pub const MEDIUM_GPU: &str = "GPU";

/// One KV cache event as published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireEvent {
    /// Full blocks newly cached, a chain continuing after `parent_block_hash`.
    BlockStored {
        /// The blocks' hashes, in chain order.
        block_hashes: Vec<u64>,
        /// Hash of the block before the first one, if any.
        parent_block_hash: Option<u64>,
        /// The stored blocks' tokens, concatenated (`block_size` per block).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Per block, the images it holds as `(identifier, offset)`; all empty (or no
        /// entries) for blocks of text, and then the field is not written.
        extra_keys: Vec<Vec<(Arc<str>, i64)>>,
    },
    /// Blocks evicted.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<u64>,
    },
    /// Every cached block dropped at once.
    AllBlocksCleared,
}

/// Encodes one batch payload, `[ts, events, data_parallel_rank]`. Work is linear in the
/// events' hashes and tokens.
pub fn encode_batch(ts: f64, events: &[WireEvent], data_parallel_rank: Option<u32>) -> Vec<u8> {
    let mut b = ByteBuf::with_capacity(64 + events.len() * 64);
    ok(encode::write_array_len(&mut b, 3));
    ok(encode::write_f64(&mut b, ts));
    ok(encode::write_array_len(&mut b, len_u32(events.len())));
    for e in events {
        encode_event(&mut b, e);
    }
    match data_parallel_rank {
        Some(r) => {
            ok(encode::write_uint(&mut b, u64::from(r)));
        }
        None => ok_infallible(encode::write_nil(&mut b)),
    }
    b.into_vec()
}

fn encode_event(b: &mut ByteBuf, e: &WireEvent) {
    match e {
        WireEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, extra_keys } => {
            let media = extra_keys.iter().any(|k| !k.is_empty());
            ok(encode::write_map_len(b, if media { 9 } else { 8 }));
            str(b, "type");
            str(b, "BlockStored");
            str(b, "block_hashes");
            uints(b, block_hashes.iter().copied());
            str(b, "parent_block_hash");
            match parent_block_hash {
                Some(p) => {
                    ok(encode::write_uint(b, *p));
                }
                None => ok_infallible(encode::write_nil(b)),
            }
            str(b, "token_ids");
            uints(b, token_ids.iter().map(|&t| u64::from(t)));
            str(b, "block_size");
            ok(encode::write_uint(b, u64::from(*block_size)));
            str(b, "lora_id");
            ok_infallible(encode::write_nil(b));
            str(b, "medium");
            str(b, MEDIUM_GPU);
            str(b, "lora_name");
            ok_infallible(encode::write_nil(b));
            if media {
                str(b, "extra_keys");
                extra(b, extra_keys);
            }
        }
        WireEvent::BlockRemoved { block_hashes } => {
            ok(encode::write_map_len(b, 3));
            str(b, "type");
            str(b, "BlockRemoved");
            str(b, "block_hashes");
            uints(b, block_hashes.iter().copied());
            str(b, "medium");
            str(b, MEDIUM_GPU);
        }
        WireEvent::AllBlocksCleared => {
            ok(encode::write_map_len(b, 1));
            str(b, "type");
            str(b, "AllBlocksCleared");
        }
    }
}

/// One entry per block: nil, or the block's `[identifier, offset]` pairs.
fn extra(b: &mut ByteBuf, blocks: &[Vec<(Arc<str>, i64)>]) {
    ok(encode::write_array_len(b, len_u32(blocks.len())));
    for keys in blocks {
        if keys.is_empty() {
            ok_infallible(encode::write_nil(b));
            continue;
        }
        ok(encode::write_array_len(b, len_u32(keys.len())));
        for (id, offset) in keys {
            ok(encode::write_array_len(b, 2));
            str(b, id);
            // msgspec writes a non-negative int in the unsigned forms.
            match u64::try_from(*offset) {
                Ok(u) => {
                    ok(encode::write_uint(b, u));
                }
                Err(_) => {
                    ok(encode::write_sint(b, *offset));
                }
            }
        }
    }
}

fn str(b: &mut ByteBuf, s: &str) {
    ok(encode::write_str(b, s));
}

fn uints(b: &mut ByteBuf, items: impl ExactSizeIterator<Item = u64>) {
    ok(encode::write_array_len(b, len_u32(items.len())));
    for v in items {
        ok(encode::write_uint(b, v));
    }
}

/// msgpack arrays hold at most 2^32-1 items; a batch that long cannot be built from one
/// engine pass (a pass stores at most the pool's capacity), so saturating is only a guard.
fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Writing to a `ByteBuf` cannot fail (its error type is `Infallible`).
fn ok<T>(r: Result<T, ValueWriteError<Infallible>>) -> T {
    match r {
        Ok(v) => v,
        Err(ValueWriteError::InvalidMarkerWrite(e) | ValueWriteError::InvalidDataWrite(e)) => match e {},
    }
}

fn ok_infallible(r: Result<(), Infallible>) {
    match r {
        Ok(()) => {}
        Err(e) => match e {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn decode(bytes: &[u8]) -> Value {
        let mut rd = bytes;
        let v = rmpv::decode::read_value(&mut rd).expect("valid msgpack");
        assert!(rd.is_empty(), "trailing bytes");
        v
    }

    #[track_caller]
    fn check_event(e: WireEvent, want: Vec<(&str, Value)>) {
        let batch = decode(&encode_batch(1.25, &[e], Some(3)));
        let want = Value::Array(vec![
            Value::F64(1.25),
            Value::Array(vec![Value::Map(want.into_iter().map(|(k, v)| (Value::from(k), v)).collect())]),
            Value::from(3u32),
        ]);
        assert_eq!(batch, want);
    }

    #[test]
    fn empty_batches_by_hand() {
        // 93: array of 3; cb + 8 bytes: f64 0.5; 90: empty array; 07 or c0 (nil).
        assert_eq!(hex(&encode_batch(0.5, &[], Some(7))), "93cb3fe00000000000009007");
        assert_eq!(hex(&encode_batch(0.5, &[], None)), "93cb3fe000000000000090c0");
    }

    #[test]
    fn events_are_tagged_maps_with_vllm_fields() {
        check_event(
            WireEvent::BlockStored {
                block_hashes: vec![u64::MAX, 5],
                parent_block_hash: Some(1 << 63),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                extra_keys: vec![],
            },
            vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(u64::MAX), Value::from(5u64)])),
                ("parent_block_hash", Value::from(1u64 << 63)),
                ("token_ids", Value::Array((1..=4u32).map(Value::from).collect())),
                ("block_size", Value::from(2u32)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("GPU")),
                ("lora_name", Value::Nil),
            ],
        );
        check_event(
            WireEvent::BlockStored {
                block_hashes: vec![9],
                parent_block_hash: None,
                token_ids: vec![],
                block_size: 64,
                extra_keys: vec![vec![]],
            },
            vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(9u64)])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", Value::Array(vec![])),
                ("block_size", Value::from(64u32)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("GPU")),
                ("lora_name", Value::Nil),
            ],
        );
        check_event(
            WireEvent::BlockRemoved { block_hashes: vec![7] },
            vec![
                ("type", Value::from("BlockRemoved")),
                ("block_hashes", Value::Array(vec![Value::from(7u64)])),
                ("medium", Value::from("GPU")),
            ],
        );
        check_event(WireEvent::AllBlocksCleared, vec![("type", Value::from("AllBlocksCleared"))]);
    }

    #[test]
    fn image_blocks_carry_vllms_extra_keys() {
        let id: Arc<str> = Arc::from("ab12");
        let pair = |off: i64| Value::Array(vec![Value::from("ab12"), Value::from(off)]);
        check_event(
            WireEvent::BlockStored {
                block_hashes: vec![1, 2, 3],
                parent_block_hash: None,
                token_ids: vec![7; 6],
                block_size: 2,
                extra_keys: vec![vec![], vec![(id.clone(), 1)], vec![(id, -1)]],
            },
            vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", Value::Array((1..=3u64).map(Value::from).collect())),
                ("parent_block_hash", Value::Nil),
                ("token_ids", Value::Array(vec![Value::from(7u32); 6])),
                ("block_size", Value::from(2u32)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("GPU")),
                ("lora_name", Value::Nil),
                (
                    "extra_keys",
                    Value::Array(vec![Value::Nil, Value::Array(vec![pair(1)]), Value::Array(vec![pair(-1)])]),
                ),
            ],
        );
    }

    #[test]
    fn end_marker_is_minus_one() {
        assert_eq!(END_SEQ, [0xff; 8]);
    }
}
