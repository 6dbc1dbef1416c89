"""Writes golden KV-event payloads (and malformed seeds) into a directory.

Usage: python3 golden.py OUT_DIR

Each golden_*.msgpack file is one EventBatch payload exactly as msgspec encodes it.
The Rust test suite states, independently, what each must decode to. The bad_* and
ok_* files are hand-made seeds for the decoder corpus (bad_* must be rejected,
ok_* accepted, none may panic).
"""

import os
import sys

from wire import (
    ArrayCleared,
    ArrayRemoved,
    ArrayStored,
    EventBatch,
    MapCleared,
    MapEventBatch,
    MapRemoved,
    MapStored,
    encode,
)
import msgspec

H1 = bytes([1]) * 32
H2 = bytes([2]) * 32
H0 = bytes([0]) * 32


def stored_int(cls):
    return cls(
        block_hashes=[11, -12, 2**64 - 1],
        parent_block_hash=None,
        token_ids=list(range(12)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def stored_bytes(cls):
    return cls(
        block_hashes=[H1, H2],
        parent_block_hash=H0,
        token_ids=[100, 101, 102, 103, 70000, 2**32 - 1, 0, 5],
        block_size=4,
        lora_id=7,
        medium="CPU",
        lora_name="adapter-a",
        extra_keys=[None, ("mm-hash", 3)],
    )


def salted(cls):
    """As vLLM 0.32 publishes a request with `cache_salt`: the salt in the first
    block's extra keys only; u64 hashes above i64::MAX."""
    return cls(
        block_hashes=[14722417665957728748, 2887188193437737155],
        parent_block_hash=None,
        token_ids=list(range(300, 308)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("tenant-a",), None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def lora_mm(cls):
    """An adapter's request with a salt, then a block holding an image: the LoRA name
    on every block, the salt on the first, a (hash, offset) pair where the image is."""
    return cls(
        block_hashes=[2**63, 2**64 - 2],
        parent_block_hash=2**63 + 5,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=1,
        medium="GPU",
        lora_name="sql-lora",
        extra_keys=[("sql-lora", "tenant-b"), ("sql-lora", ("img-hash", 2))],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def cases():
    out = {}
    for form, (st, rm, cl) in {
        "map": (MapStored, MapRemoved, MapCleared),
        "array": (ArrayStored, ArrayRemoved, ArrayCleared),
    }.items():
        out[f"golden_stored_int_{form}"] = EventBatch(ts=1.5, events=[stored_int(st)])
        out[f"golden_stored_bytes_{form}"] = EventBatch(ts=2.25, events=[stored_bytes(st)], data_parallel_rank=0)
        out[f"golden_removed_int_{form}"] = EventBatch(ts=3.0, events=[rm(block_hashes=[11, -12], medium=None)])
        out[f"golden_removed_bytes_{form}"] = EventBatch(
            ts=4.0, events=[rm(block_hashes=[H1], medium="STORAGE", group_idx=1)]
        )
        out[f"golden_cleared_{form}"] = EventBatch(ts=5.0, events=[cl()])
        out[f"golden_multi_rank_{form}"] = EventBatch(
            ts=6.0,
            events=[stored_int(st), rm(block_hashes=[11], medium="GPU"), cl()],
            data_parallel_rank=3,
        )
        newer = st(
            block_hashes=[21],
            parent_block_hash=11,
            token_ids=[1, 2, 3, 4],
            block_size=4,
            lora_id=None,
            medium="DISK",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            kv_cache_spec_sliding_window=None,
            locality="local",
            ownership="owner",
            session_id="s-1",
        )
        out[f"golden_newer_fields_{form}"] = EventBatch(ts=7.0, events=[newer])
        out[f"golden_extra_keys_{form}"] = EventBatch(ts=9.0, events=[salted(st), lora_mm(st)], data_parallel_rank=0)
    out["golden_batch_as_map"] = MapEventBatch(ts=8.0, events=[MapCleared()], data_parallel_rank=2)
    return out


def raw_seeds():
    """Hand-built payloads; msgspec.msgpack.encode writes the plain-value pieces."""
    e = msgspec.msgpack.encode
    future_map = {"type": "BlockMigrated", "block_hashes": [1], "destination": "x"}
    extra_field = {"type": "AllBlocksCleared", "reason": "reset"}
    # The oldest positional BlockStored: no medium, lora_name or later fields.
    legacy = ["BlockStored", [5, 6], None, [9, 9, 9, 9, 8, 8, 8, 8], 4, None]
    neg_token = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, -2, 3, 4], "block_size": 4}
    bad_medium = ["BlockRemoved", [1], "HBM3"]
    good = e([9.0, [["AllBlocksCleared"]]])
    return {
        "ok_unknown_event_and_field": e([1.0, [future_map, extra_field, ["Teleported", 1, 2]], None, "extra"]),
        "ok_legacy_positional": e([1.0, [legacy]]),
        "ok_one_bad_event_kept_rest": e([1.0, [neg_token, bad_medium, ["AllBlocksCleared"]]]),
        "ok_int_timestamp": e([3, []]),
        "bad_array32_bomb": b"\xdd\xff\xff\xff\xff",
        "bad_map32_bomb": b"\xdf\xff\xff\xff\xff",
        "bad_bin32_bomb": b"\x92\xcb" + bytes(8) + b"\x91\x92\xabBlockStored\x91\xc6\xff\xff\xff\xff",
        "bad_tokens_bomb": b"\x92\xcb" + bytes(8) + b"\x91\x81\xa9token_ids\xdd\x7f\xff\xff\xff",
        "bad_deep_nesting": b"\x92\x00\x91" + b"\x91" * 20000,
        "bad_truncated": good[:-1],
        "bad_reserved_marker": b"\xc1",
        "bad_not_a_batch": e("hello"),
        "bad_events_not_array": e([1.0, {"a": 1}]),
        "bad_empty": b"",
    }


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    files = {name: encode(batch) for name, batch in cases().items()}
    files.update(raw_seeds())
    for name, payload in sorted(files.items()):
        with open(os.path.join(out_dir, name + ".msgpack"), "wb") as f:
            f.write(payload)


if __name__ == "__main__":
    main()
