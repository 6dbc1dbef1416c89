"""Floors no router can beat on a sim fleet: each request served alone on an idle worker.

A request pays only for the prompt tokens a cache could not hold, computed in passes of
the engine's token budget, and then decodes its output with nothing else on the worker
(one step per token after the first, at the KV usage of its own prompt). The cache is one
LRU pool with the whole fleet's capacity, fed in request order: a router that spreads the
same blocks over separate workers can only hold less. So every router's TTFT mean and
p99 and end-to-end mean are at least these, and a target ratio below floor / best peer
is out of reach for any rule, online or not.

The timing is the reference worker model the sim-workers run (`--engine-timing mocker`),
in model milliseconds, the unit the report uses.
"""

import sys
from collections import OrderedDict
from pathlib import Path

from stats import quantile  # benches/real_fleet

# The reference model's pass time lives in benches/scripts/ttft_lower_bound.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ttft_lower_bound import pass_ms  # noqa: E402


def prefill_ms(tokens, pass_tokens):
    """`tokens` computed alone in passes of at most `pass_tokens`."""
    full, rest = divmod(max(tokens, 0), max(pass_tokens, 1))
    return full * pass_ms(pass_tokens) + pass_ms(rest)


def step_ms(usage):
    """One decode step at `usage` of the worker's KV blocks (clamped to 0..1)."""
    p = min(max(usage, 0.0), 1.0)
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)


def cached_tokens(requests, block_size, capacity_blocks):
    """Per request, the leading prompt tokens an LRU pool of `capacity_blocks` blocks
    (fed every earlier request's full blocks, evicting a prefix's tail before its root)
    holds; never the whole prompt."""
    cache, out = OrderedDict(), []
    for r in requests:
        chain = [tuple(r.tokens[: (k + 1) * block_size]) for k in range(len(r.tokens) // block_size)]
        hit = 0
        for key in chain[: (len(r.tokens) - 1) // block_size]:
            if key not in cache:
                break
            hit += 1
        out.append(hit * block_size)
        # Refreshed tail first, so a prefix's root is the most recent and evicted last,
        # as the reference script's bound does (a root serves every later branch).
        for key in reversed(chain):
            cache[key] = True
            cache.move_to_end(key)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return out


def floors(requests, shape, workers):
    """TTFT and end-to-end floors of `requests` (in index order) on `workers` workers of
    `shape`: per-request lists and their mean and p99, in model ms."""
    reqs = sorted(requests, key=lambda r: r.index)
    cached = cached_tokens(reqs, shape.block_size, workers * shape.blocks_per_worker)
    ttft, e2e = [], []
    for r, c in zip(reqs, cached):
        t = prefill_ms(len(r.tokens) - c, shape.max_batched_tokens)
        usage = len(r.tokens) / shape.block_size / shape.blocks_per_worker
        ttft.append(t)
        e2e.append(t + max(r.output_tokens - 1, 0) * step_ms(usage))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"ttft_ms_mean": mean(ttft), "ttft_ms_p99": quantile(ttft, 0.99), "e2e_ms_mean": mean(e2e)}


def reach(floor, against_best, targets):
    """For each target figure of `targets` (figure -> (bound, op)) that `against_best`
    (the report's kv-vs-best-peer block) has: the floor, the floor over the best peer,
    and whether the bound is out of reach (a `<=` bound below that ratio)."""
    out = {}
    for fig, (bound, op) in targets.items():
        best = against_best.get(fig, {}).get("best")
        if op != "<=" or fig not in floor or not best:
            continue
        ratio = floor[fig] / best
        out[fig] = {"floor": round(floor[fig], 1), "floor_over_best_peer": round(ratio, 3),
                    "bound": bound, "out_of_reach": ratio > bound}  # fmt: skip
    return out
