#!/usr/bin/env python3
"""Lower bounds on TTFT p99 for a Mooncake trace under the reference worker model.

Every request is served alone on an idle worker (no queueing, no decode steps) and pays
only for its uncached prompt tokens, in passes of 8,192 tokens. The cache is either
unbounded (everything computed so far: no router can reuse more) or one LRU pool the
size of the fleet (8 x 16,384 blocks of 64 tokens). Prints, per cache: the p50 and p99
(nearest rank) and how many requests exceed 1,521 ms.

`kvroute replay` computes the fleet-LRU bound itself (kvroute-sim's `bound` module) and
reports it as `ttft_lower_bound_ms`; this script is the reference that port is tested
against, on the bundled trace slice.

usage: ttft_lower_bound.py TRACE.jsonl
"""
import json
import math
import sys
from collections import OrderedDict

PASS_TOKENS = 8192
BLOCK_TOKENS = 64
TRACE_BLOCK_TOKENS = 512
TARGET_MS = 1521


def pass_ms(tokens):
    return 0 if tokens <= 0 else 4.209989e-7 * tokens * tokens + 1.518344e-2 * tokens + 16.50142


def prefill_ms(tokens):
    return (tokens // PASS_TOKENS) * pass_ms(PASS_TOKENS) + pass_ms(tokens % PASS_TOKENS)


def blocks(r):
    per = TRACE_BLOCK_TOKENS // BLOCK_TOKENS
    return [(tuple(r["hash_ids"][: k // per + 1]), k % per) for k in range(r["input_length"] // BLOCK_TOKENS)]


def bound(requests, capacity):
    cache, out = OrderedDict(), []
    for r in requests:
        b = blocks(r)
        hit = 0
        for x in b[: (r["input_length"] - 1) // BLOCK_TOKENS]:
            if x not in cache:
                break
            hit += 1
        out.append(prefill_ms(r["input_length"] - min(hit * BLOCK_TOKENS, r["input_length"])))
        for x in b:
            cache.pop(x, None)
        for x in reversed(b):
            cache[x] = 1
        while capacity and len(cache) > capacity:
            cache.popitem(last=False)
    return sorted(out)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        requests = [json.loads(line) for line in open(sys.argv[1])]
    except OSError as e:
        sys.exit(f"cannot read the trace: {e}")
    for name, cap in (("unbounded", None), ("fleet LRU", 8 * 16384)):
        s = bound(requests, cap)
        p50, p99 = (s[max(math.ceil(q * len(s)), 1) - 1] for q in (0.50, 0.99))
        over = sum(x > TARGET_MS for x in s)
        print(json.dumps({"cache": name, "ttft_p50_ms": round(p50, 1), "ttft_p99_ms": round(p99, 1), "over_target": over}))


if __name__ == "__main__":
    main()
