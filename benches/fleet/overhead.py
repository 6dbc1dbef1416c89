"""Each router's own latency: what it adds to a streamed completion's time to first token
and end to end, against going straight to the worker, per prompt size.

One fast sim-worker (model time ÷ --speedup, so the engine's share is small) serves the
same prompt over and over, so every request after the first is a full cache hit; with
--fresh every request has a prompt no earlier one had, so the router's tokenizer cache
and the worker's prefix cache miss, as they do for a new conversation's text. Each
router in turn stands in front of it; requests go one at a time, in rounds that visit
every router (and the worker itself) in turn, so the host's noise falls on all of them
alike. The report is JSON: per router and prompt size, the median wall TTFT and e2e in
ms, and what the router adds over the direct medians.

    eval "$(benches/fleet/setup.sh)"; cargo build --release --bin kvroute
    python3 benches/fleet/overhead.py --routers kv,sglang-router,smg --sizes 1000,6000
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "real_fleet"))
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
import fleet  # noqa: E402
import loadgen  # noqa: E402
import simfleet  # noqa: E402
import words  # noqa: E402
import workloads  # noqa: E402

DIRECT = "direct"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routers", default="kv,sglang-router,smg", help="comma-separated, as bench.py names them")
    p.add_argument("--sizes", default="1000,6000", help="prompt sizes in tokens, comma-separated")
    p.add_argument("--requests", type=int, default=40, help="per router and size (after one warm-up)")
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--speedup", type=float, default=20.0, help="the sim-worker's speedup")
    p.add_argument("--fresh", action="store_true", help="a new prompt for every request, not one repeated")
    p.add_argument("--kvroute", type=Path, default=workloads.REPO / "target/release/kvroute")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not args.kvroute.exists():
        p.error(f"{args.kvroute} is missing: cargo build --release --bin kvroute")
    return args


def one(url, body):
    """(ttft_ms, e2e_ms) of one streamed completion, or raises with its error."""
    rec = {"ttft_s": None, "e2e_s": None, "error": None}
    asyncio.run(loadgen.stream_completion(url, body, None, rec, time.perf_counter))
    if rec["error"]:
        raise RuntimeError(f"{url}: {rec['error']}")
    return rec["ttft_s"] * 1000.0, rec["e2e_s"] * 1000.0


def measure(targets, sizes, body_for, requests):
    """{name: {size: [(ttft, e2e), ...]}}: rounds that visit every target per size;
    `body_for(size)` gives each request's body."""
    seen = {name: {size: [] for size in sizes} for name in targets}
    for size in sizes:
        for url in targets.values():
            one(url, body_for(size))  # warm: connections are open (and a repeated prompt cached)
        for _ in range(requests):
            for name, url in targets.items():
                seen[name][size].append(one(url, body_for(size)))
    return seen


def bodies(vocab, output_tokens, fresh, seed=1):
    """`body_for(size)`: one prompt per size, repeated, or (`fresh`) a new one each call."""
    rng, fixed = random.Random(seed), {}

    def body_for(size):
        if fresh or size not in fixed:
            fixed[size] = loadgen.request_body(fleet.SERVED_NAME, vocab.text(vocab.draw(rng, size)), output_tokens)
        return fixed[size]

    return body_for


def summarize(seen):
    out = {}
    for name, by_size in seen.items():
        out[name] = {}
        for size, pairs in by_size.items():
            ttft = statistics.median(p[0] for p in pairs)
            e2e = statistics.median(p[1] for p in pairs)
            row = {"ttft_ms_p50": round(ttft, 3), "e2e_ms_p50": round(e2e, 3)}
            if name != DIRECT:
                base = seen[DIRECT][size]
                row["added_ttft_ms"] = round(ttft - statistics.median(p[0] for p in base), 3)
                row["added_e2e_ms"] = round(e2e - statistics.median(p[1] for p in base), 3)
            out[name][str(size)] = row
    return out


def main(argv=None):
    args = parse_args(argv)
    fleet.stop_on_sigterm()
    routers = [r for r in args.routers.split(",") if r]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vocab = words.Vocab(words.write_model_dir(tmp / "model"))
        shape = simfleet.Shape(speedup=args.speedup)
        the_fleet = simfleet.SimFleet(args.kvroute, 1, shape, tmp / "model", tmp)
        the_fleet.start()
        procs, targets = [], {DIRECT: the_fleet.workers[0].url}
        try:
            for name in routers:
                started = bench.start_router(name, args.kvroute, the_fleet.workers, tmp)
                if started is None:
                    print(f"overhead: {name} is not installed; skipped", file=sys.stderr)
                    continue
                procs.append(started[0])
                targets[name] = started[1]
            body_for = bodies(vocab, args.output_tokens, args.fresh)
            report = {"speedup": args.speedup, "requests": args.requests, "fresh": args.fresh, "unit": "wall ms",
                      "routers": summarize(measure(targets, sizes, body_for, args.requests))}  # fmt: skip
        finally:
            for p in procs:
                p.stop()
            the_fleet.stop()
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
