"""The fleet benchmark's workloads: seeded request lists in model time.

Every workload is a list of `Request`s made from a seed, the same list for every router
and round. Times are model seconds (the driver divides them by the workers' speedup).
A request either arrives at `arrival_s`, or, inside an agent program, `gap_s` after the
request `after` finished (the agent's tool ran in between), so a program is a loop of
calls whose context grows with each tool result.

  - `conversation`: a Mooncake trace (the bundled conversation slice by default); each
    hash id becomes `words_per_hash_id` words, output lengths are divided by
    `output_divisor`.
  - `agentic`: agent programs of a few types; each type has its own system prompt and
    tool list, each program a task, then calls that append the model's answer and a tool
    result to its context. Programs carry an id, sent as the session header.
  - `shared-doc`: a few long documents, each asked many short questions (popularity
    Zipf-distributed), arrivals Poisson.
  - `multimodal`: chats about one or two images that resend them on every turn (see
    `multimodal.py`); sent as chat completions.

`scaled(requests, rate)` multiplies the arrival rate (program starts, for agents).
"""

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from words import Vocab

REPO = Path(__file__).resolve().parents[2]
BUNDLED_TRACE = REPO / "adapters/sim/fixtures/mooncake_conversation_head.jsonl"
KINDS = ("conversation", "agentic", "shared-doc", "trace", "multimodal")


@dataclass(frozen=True)
class Request:
    """One request of a workload."""

    index: int
    arrival_s: float  # model seconds from the start; for a follow-up call, its program's start
    tokens: tuple  # word ids of the prompt, one token each
    output_tokens: int
    group: str  # what shares a prefix: a conversation, an agent program, a document
    session: str = None  # sent as the session header when set
    after: int = None  # index of the call this one follows (agent programs)
    gap_s: float = 0.0  # model seconds between `after` finishing and this one's send
    chat: tuple = None  # a chat's messages as (role, word ids, image ids); sent as a chat completion


@dataclass(frozen=True)
class Spec:
    """What to generate."""

    kind: str = "conversation"
    seed: int = 20261204
    requests_max: int = None  # cap on requests (conversation, trace, shared-doc) or programs' calls
    trace: Path = None
    words_per_hash_id: int = 128
    output_divisor: int = 4
    prompt_tokens_max: int = 32768
    output_tokens_max: int = 4096
    size_scale: float = 1.0  # multiplies the generated workloads' prompt and output sizes
    multi_turn_only: bool = False  # a trace: keep only conversations (first two hash ids) seen twice
    tokens_per_image: int = 576  # multimodal: placeholders per image (multimodal.tokens_per_image)


def _n(rng, bounds, scale=1.0):
    """A size drawn from `bounds` (inclusive), times `scale`, at least 1."""
    return max(1, round(rng.randint(*bounds) * scale))


def generate(spec: Spec, vocab: Vocab):
    """The workload's requests, sorted by index."""
    if spec.kind in ("conversation", "trace"):
        return mooncake(spec, vocab)
    if spec.kind == "agentic":
        return agentic(spec, vocab)
    if spec.kind == "shared-doc":
        return shared_doc(spec, vocab)
    if spec.kind == "multimodal":
        import multimodal

        return multimodal.generate(spec, vocab, Request)
    raise ValueError(f"unknown workload {spec.kind!r}; one of {', '.join(KINDS)}")


def read_trace(path: Path, count=None):
    """Mooncake JSONL records (timestamp ms, input_length, output_length, hash_ids)."""
    if path is None or not Path(path).is_file():
        raise SystemExit(f"trace {path} is missing: pass --trace with a Mooncake JSONL file "
                         "(one JSON object a line with timestamp, input_length, output_length, hash_ids)")  # fmt: skip
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if count is not None and len(out) >= count:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out.append((float(rec["timestamp"]), int(rec["input_length"]), int(rec["output_length"]),
                            [int(h) for h in rec["hash_ids"]]))  # fmt: skip
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"trace {path} line {n}: not a Mooncake record ({e})") from None
    if not out:
        raise SystemExit(f"trace {path}: no records")
    return out


def mooncake(spec: Spec, vocab: Vocab):
    """A Mooncake trace as requests: hash id h becomes the same `words_per_hash_id` words
    wherever it appears, so records that share leading hash ids share a prefix. A prompt
    is cut to input_length scaled the same way (a trace block is 512 tokens)."""
    path = spec.trace if spec.kind == "trace" else (spec.trace or BUNDLED_TRACE)
    if spec.multi_turn_only:
        records = read_trace(path)
        seen = {}
        for r in records:
            seen[tuple(r[3][:2])] = seen.get(tuple(r[3][:2]), 0) + 1
        records = [r for r in records if seen[tuple(r[3][:2])] > 1][: spec.requests_max]
        if not records:
            raise SystemExit(f"trace {path}: no conversation has two requests")
    else:
        records = read_trace(path, spec.requests_max)
    t0 = min(r[0] for r in records)
    per = spec.words_per_hash_id
    out = []
    for i, (ts, input_length, output_length, hash_ids) in enumerate(records):
        n = min(len(hash_ids) * per, max(1, -(-input_length * per // 512)), spec.prompt_tokens_max)
        ids = hash_ids[: -(-n // per)]
        tokens = tuple(t for h in ids for t in vocab.block(spec.seed, ("h", h), per))[:n]
        out.append(Request(index=i, arrival_s=(ts - t0) / 1000.0, tokens=tokens,
                           output_tokens=min(max(1, output_length // spec.output_divisor), spec.output_tokens_max),
                           group=f"c{hash_ids[:2]}"))  # fmt: skip
    return out


# Agent programs: per type, a shared system prompt and tool list; per program, a task,
# then calls. Sizes in words (tokens).
AGENT_TYPES = 4
AGENT_SYSTEM_WORDS = (900, 1500)
AGENT_TOOLS_WORDS = (500, 1100)
AGENT_TASK_WORDS = (60, 250)
AGENT_CALLS = (3, 12)
AGENT_ANSWER_WORDS = (20, 120)  # the model's tool call, as the next prompt repeats it
AGENT_RESULT_WORDS = (80, 900)
AGENT_THINK_S_MEAN = 1.5  # model seconds a tool runs between calls (exponential)
AGENT_PROGRAMS = 220
AGENT_START_RATE_PER_S = 1.0  # program starts per model second, before scaling


def agentic(spec: Spec, vocab: Vocab):
    rng, k = random.Random(spec.seed), spec.size_scale
    preambles = []
    for t in range(AGENT_TYPES):
        system = vocab.draw(rng, _n(rng, AGENT_SYSTEM_WORDS, k))
        tools = vocab.draw(rng, _n(rng, AGENT_TOOLS_WORDS, k))
        preambles.append(system + tools)
    out, start = [], 0.0
    limit = spec.requests_max or math.inf
    for p in range(AGENT_PROGRAMS):
        if len(out) >= limit:
            break
        start += rng.expovariate(AGENT_START_RATE_PER_S)
        kind = rng.randrange(AGENT_TYPES)
        context = preambles[kind] + vocab.draw(rng, _n(rng, AGENT_TASK_WORDS, k))
        prev = None
        for _ in range(rng.randint(*AGENT_CALLS)):
            if len(out) >= limit or len(context) > spec.prompt_tokens_max:
                break
            answer = _n(rng, AGENT_ANSWER_WORDS, k)
            gap = 0.0 if prev is None else min(rng.expovariate(1 / AGENT_THINK_S_MEAN), 8 * AGENT_THINK_S_MEAN)
            req = Request(index=len(out), arrival_s=start, tokens=tuple(context),
                          output_tokens=min(answer, spec.output_tokens_max),
                          group=f"p{p}", session=f"agent-{kind}-{p}", after=prev, gap_s=round(gap, 4))  # fmt: skip
            out.append(req)
            prev = req.index
            context = context + vocab.draw(rng, answer) + vocab.draw(rng, _n(rng, AGENT_RESULT_WORDS, k))
    return out


DOC_COUNT = 48
DOC_WORDS = (3000, 9000)
DOC_HEADER_WORDS = 150  # instructions shared by every question
DOC_QUESTION_WORDS = (15, 80)
DOC_ANSWER_WORDS = (20, 160)
DOC_QUESTIONS = 1500
DOC_RATE_PER_S = 3.0
DOC_ZIPF = 0.8


def shared_doc(spec: Spec, vocab: Vocab):
    rng, k = random.Random(spec.seed), spec.size_scale
    header = vocab.draw(rng, _n(rng, (DOC_HEADER_WORDS, DOC_HEADER_WORDS), k))
    docs = [vocab.draw(rng, _n(rng, DOC_WORDS, k)) for _ in range(DOC_COUNT)]
    weights = [1 / (k + 1) ** DOC_ZIPF for k in range(DOC_COUNT)]
    n = min(DOC_QUESTIONS, spec.requests_max or DOC_QUESTIONS)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(DOC_RATE_PER_S)
        d = rng.choices(range(DOC_COUNT), weights)[0]
        # Under a prompt cap the document is cut, never the question: cut questions would
        # make every request on a document the same prompt.
        question = vocab.draw(rng, _n(rng, DOC_QUESTION_WORDS, k))
        room = max(0, spec.prompt_tokens_max - len(question))
        prompt = ((header + docs[d])[:room] + question)[: spec.prompt_tokens_max]
        answer = min(_n(rng, DOC_ANSWER_WORDS, k), spec.output_tokens_max)
        out.append(Request(index=i, arrival_s=t, tokens=tuple(prompt), output_tokens=answer, group=f"d{d}"))
    return out


def scaled(requests, rate):
    """The same requests at `rate` times the arrival rate: arrivals (an agent program's
    start) divided by `rate`; a tool's think time stays what it is."""
    if rate <= 0:
        raise ValueError(f"rate {rate} must be positive")
    return [replace(r, arrival_s=r.arrival_s / rate) for r in requests]


def summary(requests):
    """Counts that describe a workload."""
    lengths = sorted(len(r.tokens) for r in requests)
    groups = {}
    for r in requests:
        groups[r.group] = groups.get(r.group, 0) + 1
    return {
        "requests": len(requests),
        "first_arrivals_span_s": round(max(r.arrival_s for r in requests), 2),
        "prompt_tokens_total": sum(lengths),
        "prompt_tokens_p50": lengths[len(lengths) // 2],
        "prompt_tokens_max": lengths[-1],
        "output_tokens_total": sum(r.output_tokens for r in requests),
        "groups": len(groups),
        "groups_with_2plus_requests": sum(1 for n in groups.values() if n > 1),
        "follow_up_calls": sum(1 for r in requests if r.after is not None),
    }


def fingerprint(requests):
    """A short digest of the requests, equal for equal workloads."""
    import hashlib

    h = hashlib.sha256()
    for r in requests:
        h.update(repr((r.index, round(r.arrival_s, 6), r.tokens, r.output_tokens, r.group, r.session, r.after,
                       round(r.gap_s, 6))).encode())  # fmt: skip
    return h.hexdigest()[:16]


def block_keys(tokens, block_tokens=64):
    """One key per block of `tokens` (the last one may be partial) that stands for the
    whole prefix up to the block's end: equal keys, equal prefixes."""
    import hashlib

    keys, key = [], b""
    for k in range(0, len(tokens), block_tokens):
        key = hashlib.sha1(key + repr(tokens[k : k + block_tokens]).encode()).digest()
        keys.append(key)
    return keys


def to_mooncake(requests, block_tokens=64):
    """The requests as Mooncake records for `kvroute replay --trace-block-tokens
    block_tokens --input-scale 1`: a block's hash id stands for the whole prefix up to
    its end, so equal prefixes share ids. A request with a session header carries it as
    `session_id`. A call that follows another (an agent's next call, a chat's next turn)
    carries its chain's `session_id` (the header, else its group) and its think gap as
    `delay`, so replay sends it that long after the call before finishes, as the load
    generator does; its `timestamp` (its program's start plus the gaps before it) only
    orders the trace."""
    ids, at = {}, {}
    heads = {r.after for r in requests if r.after is not None}
    out = []
    for r in requests:
        t = r.arrival_s if r.after is None else at[r.after] + r.gap_s
        at[r.index] = t
        hash_ids = [ids.setdefault(key, len(ids)) for key in block_keys(r.tokens, block_tokens)]
        rec = {"timestamp": round(t * 1000.0, 3), "input_length": len(r.tokens),
               "output_length": r.output_tokens, "hash_ids": hash_ids}  # fmt: skip
        if r.session or r.after is not None or r.index in heads:
            rec["session_id"] = r.session or r.group
        if r.after is not None:
            rec["delay"] = round(r.gap_s * 1000.0, 3)
        out.append(rec)
    out.sort(key=lambda x: x["timestamp"])
    return out
