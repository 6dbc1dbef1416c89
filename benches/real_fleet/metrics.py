"""The engines' own counters: what every worker (vLLM, or a kvroute sim-worker, which
serves the same names) says it did, read from its /metrics before and after a run.
"""

import re

from fleet import http

# vLLM's counters (tokens), and the sums and counts of its latency histograms, that the
# benchmark reads from each engine.
TTFT_S = "vllm:time_to_first_token_seconds"
E2E_S = "vllm:e2e_request_latency_seconds"
COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    TTFT_S + "_sum",
    TTFT_S + "_count",
    E2E_S + "_sum",
    E2E_S + "_count",
)
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)\s*$")


def page(url):
    """The /metrics text of a worker or router at `url`."""
    status, text = http("GET", f"{url}/metrics", timeout=10.0)
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    return text


def scrape(engine_url):
    """Sums of the counters in COUNTERS over all their label sets."""
    text = page(engine_url)
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


OVERHEAD = "kvroute_routing_overhead_microseconds"


def overhead_from(text):
    """kvroute's own time per request before forwarding, by stage (parse, tokenize,
    route, queue_wait), from its /metrics text: each stage's mean in microseconds over
    the requests it timed."""
    sums, counts = {}, {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m or not m.group(1).startswith(OVERHEAD):
            continue
        stage = re.search(r'stage="([^"]*)"', m.group(2) or "")
        if stage is None:
            continue
        if m.group(1) == OVERHEAD + "_sum":
            sums[stage.group(1)] = sums.get(stage.group(1), 0.0) + float(m.group(3))
        elif m.group(1) == OVERHEAD + "_count":
            counts[stage.group(1)] = counts.get(stage.group(1), 0.0) + float(m.group(3))
    return {k: round(sums.get(k, 0.0) / n, 1) for k, n in sorted(counts.items()) if n}


# kvroute's own view of a run: what it expected cached where it sent each prompt, and how
# its KV-event streams fared (a gap, a reset or a dropped event leaves its index behind
# the workers' caches).
EXPECTED = ("kvroute_cached_tokens_sum", "kvroute_prompt_tokens_sum")
STREAMS = {
    "kvroute_kv_events_total": "events",
    "kvroute_kv_event_gaps_total": "gaps",
    "kvroute_kv_event_stream_resets_total": "resets",
    "kvroute_kv_event_replays_total": "replays",
}


def router_view_from(text):
    """From kvroute's /metrics text: `expected_hit_rate` (the prompt tokens kvroute
    expected cached on the workers it chose, over all prompt tokens), and its KV-event
    stream counts summed over workers, by result where the family has one
    (`events_applied`, `gaps`, ...)."""
    sums = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m:
            continue
        name, labels = m.group(1), m.group(2) or ""
        if name in EXPECTED:
            key = name
        elif name in STREAMS:
            result = re.search(r'result="([^"]*)"', labels)
            key = STREAMS[name] + (f"_{result.group(1)}" if result else "")
        else:
            continue
        sums[key] = sums.get(key, 0.0) + float(m.group(3))
    cached, prompt = (sums.pop(k, 0.0) for k in EXPECTED)
    out = {k: int(v) for k, v in sorted(sums.items())}
    if prompt:
        out["expected_hit_rate"] = round(cached / prompt, 4)
    return out


def delta(after, before):
    return {k: after[k] - before[k] for k in COUNTERS}


def cache_stats(per_engine):
    """Fleet and per-worker prefix-cache hit rates from counter deltas {worker id: delta}."""
    q = sum(d["vllm:prefix_cache_queries_total"] for d in per_engine.values())
    h = sum(d["vllm:prefix_cache_hits_total"] for d in per_engine.values())
    workers = {}
    for wid, d in sorted(per_engine.items()):
        wq = d["vllm:prefix_cache_queries_total"]
        workers[str(wid)] = {
            "requests": int(d["vllm:request_success_total"]),
            "queried_tokens": int(wq),
            "hit_tokens": int(d["vllm:prefix_cache_hits_total"]),
            "hit_rate": round(d["vllm:prefix_cache_hits_total"] / wq, 4) if wq else None,
        }
    return {"hit_rate": round(h / q, 4) if q else None, "hit_tokens": int(h), "queried_tokens": int(q)}, workers


def worker_latency(per_engine, speedup):
    """The workers' own TTFT and end-to-end means in model ms (their histograms time a
    request from its arrival at the worker): with the client's figures, what the
    router, the network and the client add. Empty when the workers time nothing."""
    out = {}
    for name, metric in (("worker_ttft_ms_mean", TTFT_S), ("worker_e2e_ms_mean", E2E_S)):
        total = sum(d[metric + "_sum"] for d in per_engine.values())
        count = sum(d[metric + "_count"] for d in per_engine.values())
        if count:
            out[name] = round(total / count * 1000.0 * speedup, 1)
    return out
