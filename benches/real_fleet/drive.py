"""Sends the workload through one router and measures what the clients and engines saw.

Arrivals are open-loop at the trace's (scaled) times, with at most `inflight_max`
requests outstanding, so the fleet is under sustained concurrent load. Each request is
a streaming `/v1/completions` call with token-id prompts and a fixed output length
(`ignore_eos`); TTFT is the time to the first streamed token.
"""

import asyncio
import json
import time

import aiohttp

from fleet import SERVED_NAME
from stats import quantile


async def one(session, url, item, t0, results):
    body = {
        "model": SERVED_NAME,
        "prompt": item.text,
        "max_tokens": item.output_tokens,
        "min_tokens": item.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    rec = {"i": item.index, "sent_s": sent - t0, "worker": None, "ttft_s": None, "e2e_s": None, "error": None,
           "cached_tokens": None, "prompt_tokens": None}  # fmt: skip
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            rec["worker"] = resp.headers.get("x-kvroute-worker")
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if rec["ttft_s"] is None and chunk.get("choices"):
                    rec["ttft_s"] = time.monotonic() - sent
                details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    rec["cached_tokens"] = details["cached_tokens"]
                if (chunk.get("usage") or {}).get("prompt_tokens") is not None:
                    rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
            rec["e2e_s"] = time.monotonic() - sent
            if rec["ttft_s"] is None:
                rec["error"] = "stream ended without a token"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        results.append(rec)


async def drive(url, items, inflight_max, request_timeout_s=300.0):
    """Per-request records of one run."""
    results = []
    gate = asyncio.Semaphore(inflight_max)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    conn = aiohttp.TCPConnector(limit=inflight_max)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        t0 = time.monotonic()

        async def gated(item):
            async with gate:
                await one(session, url, item, t0, results)

        tasks = []
        for item in items:
            wait = item.arrival_s - (time.monotonic() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(gated(item)))
        await asyncio.gather(*tasks)
    results.sort(key=lambda r: r["i"])
    return results


def latency_stats(results, items):
    """TTFT and end-to-end latency over the run, and prompts vLLM counted differently."""
    lengths = {it.index: len(it.tokens) for it in items}
    ttft = [r["ttft_s"] * 1000.0 for r in results if r["ttft_s"] is not None]
    e2e = [r["e2e_s"] * 1000.0 for r in results if r["e2e_s"] is not None and r["error"] is None]
    return {
        "requests": len(results),
        "errors": sum(1 for r in results if r["error"]),
        "prompt_length_mismatches": sum(
            1 for r in results if r["prompt_tokens"] is not None and r["prompt_tokens"] != lengths[r["i"]]
        ),
        "ttft_ms_p50": quantile(ttft, 0.5),
        "ttft_ms_p99": quantile(ttft, 0.99),
        "ttft_ms_mean": sum(ttft) / len(ttft) if ttft else None,
        "e2e_ms_p50": quantile(e2e, 0.5),
        "e2e_ms_p99": quantile(e2e, 0.99),
        "e2e_ms_mean": sum(e2e) / len(e2e) if e2e else None,
        "ttft_ms_by_request": by_request(results, len(items)),
    }


def by_request(results, n):
    """Each request's TTFT in ms by workload index (None when it failed), for paired ratios."""
    out = [None] * n
    for r in results:
        if r["ttft_s"] is not None and r["error"] is None and 0 <= r["i"] < n:
            out[r["i"]] = round(r["ttft_s"] * 1000.0, 1)
    return out
