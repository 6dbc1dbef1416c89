"""The benchmark's workload: a slice of a Mooncake trace made into real token-id prompts.

Mooncake records name their prompt as `hash_ids`, one per 512-token block; two records
that share a leading run of hash ids share that prefix. Here every hash id becomes a
deterministic block of `tokens_per_hash_id` token ids (seeded by the id), so shared hash
ids share real tokens and vLLM's prefix cache sees the trace's prefix structure. With
`tokens_per_hash_id` equal to the engines' KV block size, one hash id is one KV block.

Prompts are sent as text, so every router (the peers route on text) sees the same
requests. Each hash id's block is drawn from the tokenizer's whole-word tokens (" word"
tokens that encode back to themselves); the byte-level pre-tokenizer splits text at
those spaces, so a prompt's text encodes to exactly the tokens it was built from.

Lengths are scaled by `tokens_per_hash_id / 512` and capped, so prompts fit the model's
context; arrival gaps are multiplied by `time_scale`.

The conversation trace's reuse is between the turns of a conversation, which come a
minute or more apart; in between, the trace sends some 100k scaled tokens of prompts
seen once. A CPU fleet cannot serve that in a run of a minute, so by default the slice
keeps only the requests of conversations that have two or more requests in the records
read (`multi_turn_only`), in trace order, with their trace arrival times.
"""

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Shape:
    """How trace records become prompts."""

    tokens_per_hash_id: int = 64
    prompt_tokens_max: int = 2048
    output_tokens_max: int = 8
    time_scale: float = 1.0
    seed: int = 20261201


@dataclass(frozen=True)
class Item:
    """One request of the workload."""

    index: int
    arrival_s: float
    hash_ids: tuple
    tokens: list
    text: str
    output_tokens: int
    trace_input_length: int

    @property
    def group(self):
        """The conversation this request belongs to: its first two hash ids."""
        return self.hash_ids[:2]


def read_records(path: Path, start: int, count: int, multi_turn_only: bool, window: int = 1500):
    """`count` records from `start` of a Mooncake JSONL trace.

    With `multi_turn_only`, the first `count` records (from `start`, within the next
    `window` records) whose conversation (first two hash ids) appears at least twice in
    that window.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if len(out) >= (window if multi_turn_only else count):
                break
            out.append(json.loads(line))
    if multi_turn_only:
        seen = {}
        for rec in out:
            key = tuple(rec["hash_ids"][:2])
            seen[key] = seen.get(key, 0) + 1
        out = [rec for rec in out if seen[tuple(rec["hash_ids"][:2])] > 1][:count]
    if not out:
        raise SystemExit(f"trace {path}: no records at {start}..{start + count}")
    return out


class Words:
    """The tokenizer's whole-word tokens, in id order, and how to turn ids into text."""

    def __init__(self, tokenizer_json: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_json))
        word = re.compile(r" [a-z]{2,}")
        self.ids = []
        for i in range(self.tok.get_vocab_size()):
            text = self.tok.decode([i])
            if word.fullmatch(text) and self.tok.encode(text).ids == [i]:
                self.ids.append(i)
        if len(self.ids) < 256:
            raise SystemExit(f"{tokenizer_json}: only {len(self.ids)} whole-word tokens")

    def text(self, ids):
        text = self.tok.decode(ids)
        if self.tok.encode(text).ids != ids:
            raise RuntimeError("a prompt's text does not encode back to its tokens")
        return text


def block_tokens(hash_id: int, shape: Shape, words: Words, cache: dict):
    """The token ids one hash id stands for; the same for every run with the same seed."""
    got = cache.get(hash_id)
    if got is None:
        rng = random.Random(shape.seed * 1_000_003 + hash_id)
        got = [rng.choice(words.ids) for _ in range(shape.tokens_per_hash_id)]
        cache[hash_id] = got
    return got


def build(records, shape: Shape, words: Words):
    """The workload's items, arrivals relative to the first record."""
    cache = {}
    t0 = records[0]["timestamp"]
    items = []
    for i, rec in enumerate(records):
        scaled = rec["input_length"] * shape.tokens_per_hash_id // MOONCAKE_BLOCK_TOKENS
        n_tokens = max(1, min(scaled, shape.prompt_tokens_max))
        n_ids = -(-n_tokens // shape.tokens_per_hash_id)
        ids = tuple(rec["hash_ids"][:n_ids])
        tokens = [t for h in ids for t in block_tokens(h, shape, words, cache)][:n_tokens]
        items.append(
            Item(
                index=i,
                arrival_s=(rec["timestamp"] - t0) / 1000.0 * shape.time_scale,
                hash_ids=ids,
                tokens=tokens,
                text=words.text(tokens),
                output_tokens=max(1, min(rec["output_length"], shape.output_tokens_max)),
                trace_input_length=rec["input_length"],
            )
        )
    return items


def write_replay_trace(items, shape: Shape, path: Path):
    """The same slice as a Mooncake trace for `kvroute replay --trace-block-tokens
    tokens_per_hash_id --block-size 64`: the real prompts' lengths and block structure
    (one hash id per `tokens_per_hash_id` tokens) and the real arrival times.
    """
    with open(path, "w", encoding="utf-8") as f:
        for it in items:
            rec = {
                "timestamp": round(it.arrival_s * 1000.0, 3),
                "input_length": len(it.tokens),
                "output_length": it.output_tokens,
                "hash_ids": list(it.hash_ids),
            }
            f.write(json.dumps(rec) + "\n")


def summary(items):
    """Counts that describe the slice."""
    groups = {}
    for it in items:
        groups[it.group] = groups.get(it.group, 0) + 1
    tokens = sorted(len(it.tokens) for it in items)
    return {
        "requests": len(items),
        "duration_s": round(items[-1].arrival_s, 2),
        "prompt_tokens_p50": tokens[len(tokens) // 2],
        "prompt_tokens_total": sum(tokens),
        "conversations": len(groups),
        "conversations_with_2plus_requests": sum(1 for n in groups.values() if n > 1),
    }
