"""KV-event wire structs, declared with the msgspec options vLLM uses.

Two generations are declared: the positional ("array_like") events vLLM and SGLang
published first, and the tagged-map events used later. The batch envelope is
positional in both. Shared by golden.py and publisher.py.
"""

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """The envelope as a map: some publisher versions dropped array_like here."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _event_classes(array_like: bool):
    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


MapStored, MapRemoved, MapCleared = _event_classes(array_like=False)
ArrayStored, ArrayRemoved, ArrayCleared = _event_classes(array_like=True)

_ENCODER = msgspec.msgpack.Encoder()


def encode(batch) -> bytes:
    return _ENCODER.encode(batch)


def _hash(h):
    """JSON carries byte hashes as {"hex": "..."}."""
    if isinstance(h, dict):
        return bytes.fromhex(h["hex"])
    return h


def event_from_json(ev: dict, array_like: bool):
    """Builds a struct from a JSON dict: {"type": ..., field: value, ...}."""
    stored, removed, cleared = (ArrayStored, ArrayRemoved, ArrayCleared) if array_like else (
        MapStored,
        MapRemoved,
        MapCleared,
    )
    kind = ev["type"]
    if kind == "BlockStored":
        return stored(
            block_hashes=[_hash(h) for h in ev["block_hashes"]],
            parent_block_hash=_hash(ev.get("parent_block_hash")),
            token_ids=ev["token_ids"],
            block_size=ev["block_size"],
            lora_id=ev.get("lora_id"),
            medium=ev.get("medium"),
            lora_name=ev.get("lora_name"),
        )
    if kind == "BlockRemoved":
        return removed(block_hashes=[_hash(h) for h in ev["block_hashes"]], medium=ev.get("medium"))
    if kind == "AllBlocksCleared":
        return cleared()
    raise ValueError(f"unknown event type {kind}")
