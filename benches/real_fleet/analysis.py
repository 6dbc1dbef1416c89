"""Where the prefix-cache hits went, and whether the issue's targets are met.

For every request, three numbers of cached prompt tokens:
  - `anywhere`: the longest prefix (whole KV blocks) any earlier request sent anywhere
    shares with it: what a fleet with one infinite cache would hit;
  - `same_worker`: the same, counting only earlier requests sent to the worker this one
    went to: what this placement would hit with infinite caches;
  - `actual`: what vLLM reports (`usage.prompt_tokens_details.cached_tokens`).
`anywhere - same_worker` is lost to placement (the prefix lived elsewhere);
`same_worker - actual` is lost to eviction (the worker had it, and dropped it).
"""

from fleet import PEERS

BLOCK_TOKENS = 64


def _cap(n_tokens):
    """vLLM computes at least the prompt's last token, so a hit stops one block short of a full prompt."""
    return (max(n_tokens - 1, 0) // BLOCK_TOKENS) * BLOCK_TOKENS


def _prefixes(item):
    full = len(item.tokens) // BLOCK_TOKENS
    return [item.hash_ids[:k] for k in range(1, full + 1)]


def _longest(seen, item):
    best = 0
    for k, p in enumerate(_prefixes(item), start=1):
        if p not in seen:
            break
        best = k
    return min(best * BLOCK_TOKENS, _cap(len(item.tokens)))


def losses(items, results):
    """Hit tokens possible and lost, over the run; per conversation spread when workers are known."""
    by_index = {r["i"]: r for r in results}
    seen_any, seen_on = set(), {}
    anywhere = same = actual = 0
    group_workers = {}
    evicted_by_group = {}
    for it in sorted(items, key=lambda x: (x.arrival_s, x.index)):
        r = by_index.get(it.index)
        if r is None or r["error"]:
            continue
        w = r["worker"]
        a = _longest(seen_any, it)
        s = _longest(seen_on.setdefault(w, set()), it) if w is not None else None
        got = r.get("cached_tokens")
        anywhere += a
        if s is not None:
            same += s
            group_workers.setdefault(it.group, set()).add(w)
        if got is not None:
            actual += got
            if s is not None and s > got:
                evicted_by_group[it.group] = evicted_by_group.get(it.group, 0) + (s - got)
        for p in _prefixes(it):
            seen_any.add(p)
            if w is not None:
                seen_on[w].add(p)
    out = {"possible_anywhere_tokens": anywhere, "actual_tokens": actual}
    if group_workers:
        multi = [g for g, ws in group_workers.items() if len(ws) > 1]
        out.update({
            "possible_same_worker_tokens": same,
            "lost_to_placement_tokens": anywhere - same,
            "lost_to_eviction_tokens": same - actual,
            "conversations_on_2plus_workers": len(multi),
            "conversations": len(group_workers),
        })  # fmt: skip
    return out


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def ceilings(policies, ceil, placement=None):
    """Each policy's real hit rate as a share of what any router could reach: one pooled
    LRU cache of the whole fleet's size, an infinite cache, and (with `placement`, from
    `placement.ceilings`) the best online placement rule with load ignored. A peer near
    those leaves no room for a 1.1x lead; `kv_hit_target_reachable` says whether 1.1x the
    best peer is below the highest of pooled LRU and the best online rule."""
    if not ceil or not ceil.get("pooled_lru"):
        return {}
    pooled, infinite = ceil["pooled_lru"], ceil.get("infinite_cache")
    out = {"pooled_lru": round(pooled, 4), "infinite_cache": round(infinite, 4) if infinite else None,
           "share_of_pooled": {p: _ratio(v["hit_rate"], pooled) for p, v in policies.items()}}  # fmt: skip
    online = (placement or {}).get("best_online")
    if online:
        out["best_online_placement"] = online
        out["share_of_best_online"] = {p: _ratio(v["hit_rate"], online) for p, v in policies.items()}
    peers = [v["hit_rate"] for p, v in policies.items() if p in PEERS and v.get("hit_rate")]
    if peers:
        out["kv_hit_target"] = round(1.1 * max(peers), 4)
        out["kv_hit_target_reachable"] = 1.1 * max(peers) <= max(pooled, online or 0)
    return out


def targets(policies):
    """The issue's targets for `kv`, from the per-policy medians."""
    kv = policies.get("kv")
    if not kv:
        return {}
    out = {}
    rr = policies.get("round-robin")
    ll = policies.get("least-loaded")
    if rr:
        out["kv_vs_round_robin_hits"] = _ratio(kv["hit_rate"], rr["hit_rate"])
    for name, other in (("round_robin", rr), ("least_loaded", ll)):
        if other:
            out[f"kv_vs_{name}_ttft_mean"] = _ratio(kv["ttft_ms_mean"], other["ttft_ms_mean"])
            out[f"kv_vs_{name}_ttft_p99"] = _ratio(kv["ttft_ms_p99"], other["ttft_ms_p99"])
    peers = {p: v for p, v in policies.items() if p in PEERS}
    base = policies.get("kv-baseline")
    if base:
        out["kv_vs_kv_baseline_hits"] = _ratio(kv["hit_rate"], base["hit_rate"])
        out["kv_vs_kv_baseline_ttft_mean"] = _ratio(kv["ttft_ms_mean"], base["ttft_ms_mean"])
        out["kv_vs_kv_baseline_ttft_p99"] = _ratio(kv["ttft_ms_p99"], base["ttft_ms_p99"])
    if peers:
        best = max(peers, key=lambda p: peers[p]["hit_rate"] or 0)
        out["best_peer"] = best
        out["kv_vs_best_peer_hits"] = _ratio(kv["hit_rate"], peers[best]["hit_rate"])
        out["kv_vs_best_peer_ttft_mean"] = _ratio(kv["ttft_ms_mean"], peers[best]["ttft_ms_mean"])
        out["kv_vs_best_peer_ttft_p99"] = _ratio(kv["ttft_ms_p99"], peers[best]["ttft_ms_p99"])
    met = (out.get("kv_vs_round_robin_hits") or 0) >= 1.3
    met &= all((out.get(k) or 9) < 1.0 for k in out if k.startswith(("kv_vs_round_robin_ttft", "kv_vs_least_loaded_ttft")))
    if peers:
        met &= (out["kv_vs_best_peer_hits"] or 0) >= 1.1
        met &= (out["kv_vs_best_peer_ttft_mean"] or 9) <= 0.85 and (out["kv_vs_best_peer_ttft_p99"] or 9) <= 0.85
    out["all_met"] = bool(met)
    return out
