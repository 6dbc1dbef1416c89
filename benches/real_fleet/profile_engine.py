"""Times one real vLLM CPU server, to fit the simulator's `vllm-cpu` engine timing.

    eval "$(scripts/real-engine/install.sh)"
    scripts/real-engine/serve.sh 8101 5601 5602 --max-model-len 4096 \
        --max-num-batched-tokens 2048 &          # one server, alone on the host
    "$KVROUTE_VLLM_PYTHON" benches/real_fleet/profile_engine.py --url http://127.0.0.1:8101

Measures, each the median of `--repeats` tries (the host is shared, so medians):
  - prefill: time to the first token of fresh token-id prompts of 64..2048 tokens,
    one token out (nothing cached: every prompt starts with a token never sent before);
  - cached prefixes: 64 or 256 fresh tokens after 0..1,984 tokens of a prompt just sent;
  - decode: the gap between streamed tokens of 64-token outputs, with 1 and 4 requests
    running at once.
Then fits prefill_ms(t) = a t^2 + b t + c (a, b, c >= 0, relative error) to the uncached points and
prints one JSON object: the raw medians and the fitted coefficients, in milliseconds.

`--tokenizing` measures instead what tokenizing a prompt costs the server, which
`forward_token_ids` saves it: the time to the first token of one cached text prompt
sent as text and as the ids vLLM's own `/tokenize` gives for it, alternately (which goes
first alternates too), `--repeats` pairs per size. It prints each size's medians and
the median of the pairs' differences.

`--idle` measures what an idle server's next request pays: the time to the first token
of fresh 100- and 300-token prompts sent after the server sat idle 0.05 to 40 s,
`--repeats` of each (about 4 minutes a repeat), and the cold term that fits them
(`cold_ms_per_idle_s` from the 5 s gap, `cold_ms_max` from the longest).
Standard library only.
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

LENGTHS = (16, 64, 128, 256, 512, 768, 1024, 1536, 2048)
# (cached, uncached) prompt tokens: what a cached prefix costs the tokens after it.
CACHED = ((0, 256), (256, 256), (768, 256), (1536, 256), (960, 64), (1984, 64))
VOCAB_LO, VOCAB_HI = 300, 8000


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8101")
    p.add_argument("--model", default="kvroute-test", help="the served model name")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--tokenizing", action="store_true",
                   help="only measure a cached prompt sent as text against its token ids")
    # The suite's generated model takes 4,096 tokens: 2,000 words are about 3,200.
    p.add_argument("--sizes", default="500,2000", help="--tokenizing's prompt sizes, in words")
    p.add_argument("--idle", action="store_true", help="only measure requests sent after idle gaps")
    return p.parse_args()


class Client:
    """Streaming /v1/completions calls with token-id prompts; times each token."""

    def __init__(self, url, model):
        u = urlparse(url)
        self.host, self.port, self.model = u.hostname, u.port, model

    def tokenize(self, text):
        """vLLM's token ids of `text`, as a completion's prompt gets them."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        conn.request("POST", "/tokenize", json.dumps({"model": self.model, "prompt": text}),
                     {"content-type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"/tokenize: HTTP {resp.status}: {body[:300]!r}")
        return json.loads(body)["tokens"]

    def complete(self, tokens, max_tokens):
        """(ttft_ms, [ms between tokens], cached_tokens) of one streamed completion;
        `tokens` is a prompt of ids or of text."""
        body = json.dumps({
            "model": self.model, "prompt": tokens, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
        })  # fmt: skip
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        t0 = time.monotonic()
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        stamps, cached = [], None
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices"):
                stamps.append(time.monotonic())
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", cached)
        conn.close()
        if not stamps:
            raise RuntimeError("no token streamed")
        gaps = [(b - a) * 1000.0 for a, b in zip(stamps, stamps[1:])]
        return (stamps[0] - t0) * 1000.0, gaps, cached


class Prompts:
    """Fresh prompts: each starts with a token id no earlier prompt started with."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.firsts = list(range(VOCAB_LO, VOCAB_HI))
        self.rng.shuffle(self.firsts)

    def fresh(self, n):
        return [self.firsts.pop()] + [self.rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n - 1)]


def med(xs):
    return round(statistics.median(xs), 2)


def prefill(client, prompts, repeats):
    out = {}
    for n in LENGTHS:
        out[n] = med([client.complete(prompts.fresh(n), 1)[0] for _ in range(repeats)])
        log(f"prefill {n} uncached: {out[n]} ms")
    return out


def cached(client, prompts, repeats):
    out = {}
    for hit, fresh in CACHED:
        times, seen = [], None
        for _ in range(repeats):
            base = prompts.fresh(hit + fresh)
            client.complete(base, 1)
            probe = base[:hit] + prompts.fresh(fresh) if hit else prompts.fresh(fresh)
            ttft, _, seen = client.complete(probe, 1)
            times.append(ttft)
        out[f"{hit}+{fresh}"] = {"ttft_ms": med(times), "cached_tokens": seen}
        log(f"prefill {fresh} after {hit} cached: {out[f'{hit}+{fresh}']}")
    return out


def decode(client, prompts, repeats, concurrency, tokens):
    gaps = []
    for _ in range(repeats):
        results = [None] * concurrency

        def run(i):
            results[i] = client.complete(prompts.fresh(64), tokens)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in results:
            # The middle half: every request is decoding, none is prefilling.
            g = r[1]
            gaps += g[len(g) // 4 : 3 * len(g) // 4]
    got = med(gaps)
    log(f"decode at {concurrency} running: {got} ms/token")
    return got


WORDS = ("router", "cache", "block", "prefix", "worker", "engine", "token", "request", "stream", "event",
         "queue", "load", "session", "batch", "model", "index", "latency", "decode", "prefill", "replica")


def paired(text_ms, ids_ms):
    """Medians of the two series and of their pairs' differences (text less ids), ms."""
    diffs = [t - i for t, i in zip(text_ms, ids_ms)]
    return {"text_ms": med(text_ms), "ids_ms": med(ids_ms), "saved_ms": med(diffs), "pairs": len(diffs)}


def tokenizing(client, rng, repeats, sizes):
    out = {}
    for n in sizes:
        text = " ".join(rng.choice(WORDS) for _ in range(n))
        ids = client.tokenize(text)
        client.complete(text, 1)  # cached from here on, bar the last token
        text_ms, ids_ms = [], []
        for r in range(repeats):
            order = ((text, text_ms), (ids, ids_ms)) if r % 2 == 0 else ((ids, ids_ms), (text, text_ms))
            for prompt, times in order:
                times.append(client.complete(prompt, 1)[0])
        out[n] = {"prompt_tokens": len(ids), **paired(text_ms, ids_ms)}
        log(f"{n} words as text and as ids: {out[n]}")
    return out


IDLE_GAPS_S = (0.05, 1.0, 5.0, 20.0, 40.0)
IDLE_PROMPTS = (100, 300)


def idle(client, prompts, repeats):
    """Per prompt size, the median TTFT after each idle gap, and the fitted cold term."""
    ttft = {n: {g: [] for g in IDLE_GAPS_S} for n in IDLE_PROMPTS}
    for r in range(repeats):
        for n in IDLE_PROMPTS:
            for g in IDLE_GAPS_S:
                time.sleep(g)
                ttft[n][g].append(client.complete(prompts.fresh(n), 1)[0])
        log(f"idle: repeat {r + 1} of {repeats}")
    medians = {n: {g: med(v) for g, v in by_gap.items()} for n, by_gap in ttft.items()}
    extra = {n: {g: round(m[g] - m[IDLE_GAPS_S[0]], 1) for g in IDLE_GAPS_S} for n, m in medians.items()}
    rate = statistics.median(e[5.0] / 5.0 for e in extra.values())
    cap = statistics.median(e[IDLE_GAPS_S[-1]] for e in extra.values())
    fitted = {"cold_ms_per_idle_s": round(max(rate, 0.0), 1), "cold_ms_max": round(max(cap, 0.0), 1)}
    return {"ttft_ms": medians, "extra_ms": extra, "fitted": fitted}


def solve(m):
    """Solves the square system m (rows of coefficients then the right-hand side)."""
    n = len(m)
    for i in range(n):
        p = max(range(i, n), key=lambda r: abs(m[r][i]))
        m[i], m[p] = m[p], m[i]
        for r in range(n):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [a - f * b for a, b in zip(m[r], m[i])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_quadratic(points):
    """(a, b, c), all >= 0, of y = a x^2 + b x + c minimising the squared relative error
    (each point weighs 1/y^2, so short prompts count as much as long ones): the best
    least-squares fit over every subset of the three terms whose solution is >= 0."""
    best = None
    for mask in range(1, 8):
        terms = [k for k in range(3) if mask >> k & 1]  # 0: x^2, 1: x, 2: 1
        rows = [[(x ** (2 - k)) / y for k in terms] + [1.0] for x, y in points]
        m = [[sum(r[i] * r[j] for r in rows) for j in range(len(terms) + 1)] for i in range(len(terms))]
        try:
            sol = solve(m)
        except ZeroDivisionError:
            continue
        if min(sol) < 0:
            continue
        coef = [0.0, 0.0, 0.0]
        for k, v in zip(terms, sol):
            coef[k] = v
        err = sum((coef[0] * x * x + coef[1] * x + coef[2] - y) ** 2 / y**2 for x, y in points)
        if best is None or err < best[0]:
            best = (err, coef)
    return best[1]


def log(msg):
    print(f"[profile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main():
    args = parse_args()
    client, prompts = Client(args.url, args.model), Prompts(args.seed)
    for _ in range(3):  # wake the engine up
        client.complete(prompts.fresh(64), 2)
    if args.idle:
        got = idle(client, prompts, args.repeats)
        print(json.dumps({"url": args.url, "repeats": args.repeats, "idle": got}, indent=1))
        return
    if args.tokenizing:
        sizes = [int(s) for s in args.sizes.split(",")]
        got = tokenizing(client, random.Random(args.seed), args.repeats, sizes)
        print(json.dumps({"url": args.url, "repeats": args.repeats, "tokenizing": got}, indent=1))
        return
    pre = prefill(client, prompts, args.repeats)
    cac = cached(client, prompts, args.repeats)
    dec1 = decode(client, prompts, args.repeats, 1, args.decode_tokens)
    dec4 = decode(client, prompts, args.repeats, 4, args.decode_tokens)
    a, b, c = fit_quadratic(list(pre.items()))
    fitted = {
        "prefill_ms_per_token_squared": a,
        "prefill_ms_per_token": b,
        "prefill_ms_per_pass": c,
        "decode_ms_per_step": dec1,
        "decode_ms_per_running_request": round((dec4 - dec1) / 3.0, 3),
    }
    print(json.dumps({
        "url": args.url, "repeats": args.repeats,
        "prefill_uncached_ms": pre,
        "prefill_after_cached_ms": cac,
        "decode_ms_per_token": {"1_running": dec1, "4_running": dec4},
        "fitted": fitted,
        "fitted_prefill_ms": {n: round(a * n * n + b * n + c, 1) for n in LENGTHS},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
