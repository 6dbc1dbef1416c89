"""How many hits placement alone can earn on a slice, with load ignored.

Each engine is modelled as an LRU cache of whole KV blocks (vLLM frees a request's
blocks to the tail of its free queue and evicts from the head, so the least recently
used block goes first). A policy only chooses the engine; the engines decide eviction.
Routers differ from these figures because they also balance load.

  - `best_overlap_rr`: the engine holding the longest prefix; with no overlap anywhere,
    the next engine in turn. This is what every cache-aware router does when load is
    even.
  - `best_overlap_emptiest`: the same, but a request with no overlap goes to the engine
    holding the fewest blocks (sglang-router's `cache_aware` rule).
  - `clairvoyant`: knows which conversations come back, sends requests whose blocks are
    never reused to one sacrificial engine and spreads the rest. No online router can
    know this; it shows how far above the online rules the slice's reuse lies.

The best online rule is a practical ceiling for a router that balances nothing; a
target above it asks placement for hits the engines' eviction does not keep.
"""

from collections import OrderedDict

from analysis import BLOCK_TOKENS, _cap


def _blocks(item):
    return list(item.hash_ids[: len(item.tokens) // BLOCK_TOKENS])


def _overlap(cache, blocks):
    n = 0
    for b in blocks:
        if b not in cache:
            break
        n += 1
    return n


def _run(items, workers, blocks_per_worker, choose):
    caches = [OrderedDict() for _ in range(workers)]
    hit = total = 0
    for i, it in enumerate(items):
        bs = _blocks(it)
        overlaps = [_overlap(c, bs) for c in caches]
        w = choose(i, it, overlaps, caches)
        hit += min(overlaps[w] * BLOCK_TOKENS, _cap(len(it.tokens)))
        total += len(it.tokens)
        cache = caches[w]
        for b in bs:
            cache[b] = True
            cache.move_to_end(b)
        while len(cache) > blocks_per_worker:
            cache.popitem(last=False)
    return hit / total if total else 0.0


def _best_or(fallback):
    def choose(i, it, overlaps, caches):
        best = max(overlaps)
        return overlaps.index(best) if best > 1 else fallback(i, caches)

    return choose


def _clairvoyant(items, workers):
    remaining = {}
    for it in items:
        remaining[it.group] = remaining.get(it.group, 0) + 1

    def choose(i, it, overlaps, caches):
        remaining[it.group] -= 1
        best = max(overlaps)
        if best > 1:
            return overlaps.index(best)
        if remaining[it.group] == 0 or workers == 1:
            return 0
        return 1 + i % (workers - 1)

    return choose


def ceilings(items, workers, blocks_per_worker):
    """Hit rates (cached prompt tokens over prompt tokens) of the placement rules above."""
    items = sorted(items, key=lambda x: (x.arrival_s, x.index))
    rules = {
        "best_overlap_rr": _best_or(lambda i, caches: i % workers),
        "best_overlap_emptiest": _best_or(lambda i, caches: min(range(workers), key=lambda w: len(caches[w]))),
        "clairvoyant": _clairvoyant(items, workers),
    }
    out = {name: round(_run(items, workers, blocks_per_worker, rule), 4) for name, rule in rules.items()}
    out["best_online"] = max(out["best_overlap_rr"], out["best_overlap_emptiest"])
    return out
