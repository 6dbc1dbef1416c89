"""The fleet benchmark's workloads in replay: kv cost variants against the text-tree rule.

Each workload is made as `bench.py` makes it (same seed, same rate per load) and turned
into a Mooncake trace (`workloads.to_mooncake`, 64-token blocks), which `policy_sweep`
(adapters/sim/examples) replays through kvroute's core and the text-tree routers' rule
("longest match unless the load imbalance passes a threshold") on 8 simulated workers.
Replay runs in model time, so its figures do not depend on how busy the host is.

    cargo build --release -p kvroute-sim --example policy_sweep
    python3 benches/fleet/replay_sweep.py --variants 'kv;dtw=0' --seeds 3
    python3 benches/fleet/replay_sweep.py --variants 'kv;oracle' --sessions --regret

An agent's next call and a chat's next turn are sent their think time after the call
before finishes, as the load generator sends them (the trace's `delay`), so replay sees
the fleet's closed loop. Conversation is one trace (the bundled slice); its seeds beyond
the first scale each arrival time by a factor drawn from 1 ± 0.02, since its outcome
turns on the order of near-simultaneous arrivals. The other workloads are generated
from each seed. Each trace runs with router seeds 0..--router-seeds (its tie-breaking
draws). The report is, per workload and load, the median of each figure over those
runs, and its ratio to the text-tree rule's median: hits (>= 1 meets #27's target), TTFT
mean and p99 (<= 0.8) and end-to-end mean (<= 0.95).

`--real` replays the real vLLM fleet's workloads instead, as `bench.py --fleet real`
makes them (100 requests of short prompts at its rate per server), on 256-block caches
and the vLLM CPU build's timing, with the workers `--engine-speed` times as fast as that
timing at the trace's own arrival times:

    python3 benches/fleet/replay_sweep.py --real --workers 2 --engine-speed 0.1 \
        --workloads agentic --sessions --seeds 20 --router-seeds 1 --variants 'kv;sdtw=0.1'

The variant `oracle` is a clairvoyant reference, not a policy: it sends each request to
the worker where a copy of that worker's engine, run forward with the request added,
gives the first token soonest. `--regret` scores every kv choice the same way on kv's own
run: how much faster the best worker at that moment would have been.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "real_fleet"))
sys.path.insert(0, str(HERE))

import workloads  # noqa: E402
import words  # noqa: E402
import bench  # noqa: E402
from bench import RATES, REAL_DEFAULTS, SPEEDUP_AT_LOAD  # noqa: E402

FIGURES = ("hits", "ttft_mean", "ttft_p99", "e2e_mean")
# Shown beside the targets' figures, without a target: the tail and the throughput (output
# tokens per model second, first arrival to last token), which imbalance costs first.
EXTRAS = ("e2e_p99", "out_tps")
TARGETS = {"hits": (1.0, ">="), "ttft_mean": (0.8, "<="), "ttft_p99": (0.8, "<="), "e2e_mean": (0.95, "<=")}
PEER = "text-tree"


def real_requests(kind, seed, workers, vocab):
    """The workload `bench.py --fleet real --workers N` sends, arrival times included."""
    args = bench.parse_args(["--fleet", "real", "--workload", kind, "--workers", str(workers), "--seed", str(seed)])
    return bench.build_workload(args, vocab)


def traces(kind, load, seeds, vocab, out_dir, workers=8, real=False):
    """Writes the workload's trace per seed, at the fleet benchmark's rate for `workers`
    (the real fleet's with `real`); returns their paths, and whether its requests carry a
    session header (a chat's turns carry a `session_id` that only chains them, as the
    fleet sends no header for them)."""

    def workload(seed):
        if real:
            return real_requests(kind, seed, workers, vocab)
        reqs = workloads.generate(workloads.Spec(kind=kind, seed=seed), vocab)
        return workloads.scaled(reqs, RATES[kind][load] * workers / 8)

    one = workload(workloads.Spec.seed) if kind == "conversation" else None
    paths, headers = [], False
    for i, seed in enumerate(seeds):
        reqs = one or workload(seed)
        headers = headers or any(r.session for r in reqs)
        recs = workloads.to_mooncake(reqs, 64)
        if kind == "conversation" and i > 0:
            rng = random.Random(seed)
            recs = [dict(r, timestamp=round(r["timestamp"] * (1 + rng.uniform(-0.02, 0.02)), 3)) for r in recs]
            recs.sort(key=lambda r: r["timestamp"])
        path = Path(out_dir) / f"{kind}-{load}-{seed}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        paths.append(path)
    return paths, headers


def sweep(binary, path, variants, router_seeds, sessions, workers=8, regret=None, engine_speed=1.0, real=False):
    """policy_sweep's run lines for one trace; with `regret` (a path), each kv run's
    per-request choices against the best worker then are appended there. The workers run
    `engine_speed` times as fast as the timing kv predicts with, at the same load; with
    `real`, on the vLLM CPU build's timing and the real fleet's caches, at the trace's own
    arrival times (the real fleet's engines are slower than their timing, not its load
    lighter)."""
    load_speed = 1.0 if real else engine_speed
    argv = [binary, "--trace", str(path), "--tokens-per-id", "64", "--scale", "1",
            "--speedups", str(load_speed), "--engine-speedup", str(engine_speed), "--workers", str(workers),
            "--variants", variants, "--seeds", str(router_seeds), "--sessions", "1" if sessions else "0"]  # fmt: skip
    if real:
        argv += ["--blocks", str(REAL_DEFAULTS["blocks_per_worker"]), "--engine-timing", "vllm-cpu"]
    if regret:
        argv += ["--regret", str(regret)]
    # stderr passes through: a long variant (`search`) reports its progress there.
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True).stdout
    return [d for d in map(json.loads, out.splitlines()) if "hits" in d]


def engine_speed(flag, load, workers):
    """--engine-speed at `load` on `workers`: a number, or `fleet` for the sim fleet's."""
    if flag == "fleet":
        return min(1.0, 8 / workers) * SPEEDUP_AT_LOAD[load]
    return float(flag)


def regret_summary(path):
    """Per variant, over every request in `path` (policy_sweep's --regret lines): the mean
    TTFT of its choices and of the best worker at each arrival, the mean regret as a share
    of the former, and how many choices were not the best (by more than 1 ms)."""
    by = {}
    for c in map(json.loads, Path(path).read_text().splitlines()):
        if c["chosen_ms"] is not None:
            by.setdefault(c["variant"], []).append(c)
    out = {}
    for v, cs in by.items():
        chosen = statistics.fmean(c["chosen_ms"] for c in cs)
        best = statistics.fmean(c["best_ms"] for c in cs)
        out[v] = {"requests": len(cs), "chosen_ttft_ms": round(chosen, 2), "best_ttft_ms": round(best, 2),
                  "regret_share": round((chosen - best) / chosen, 4) if chosen else None,
                  "not_best_share": round(sum(c["chosen_ms"] > c["best_ms"] + 1.0 for c in cs) / len(cs), 4)}  # fmt: skip
    return out


def medians(runs):
    """Per variant, the median of each figure, of the tail and throughput (`EXTRAS`), and
    of the busiest worker over the mean."""
    by = {}
    for d in runs:
        pw = d["per_worker"]
        d = dict(d, busiest=max(pw) * len(pw) / max(sum(pw), 1))
        by.setdefault(d["variant"], []).append(d)
    keys = FIGURES + EXTRAS + ("busiest",)
    return {v: {k: statistics.median(d[k] for d in ds) for k in keys} for v, ds in by.items()}


def meets(ratio, fig):
    bound, op = TARGETS[fig]
    return ratio >= bound if op == ">=" else ratio <= bound


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="kv", help="policy_sweep's --variants (';'-separated)")
    p.add_argument("--workloads", default="conversation,agentic,shared-doc")
    p.add_argument("--loads", default="busy,saturated")
    p.add_argument("--seeds", type=int, default=3, help="workload seeds (conversation: arrival jitters)")
    p.add_argument("--router-seeds", type=int, default=2)
    p.add_argument("--workers", type=int, default=8, help="fleet size; the arrival rate scales with it, as "
                   "in bench.py")  # fmt: skip
    p.add_argument("--sessions", action="store_true",
                   help="send agent programs' session ids (kvroute binds them hard unless a variant says aff=cost)")
    p.add_argument("--bin", default=str(HERE.parents[1] / "target/release/examples/policy_sweep"))
    p.add_argument("--regret", action="store_true",
                   help="also score every kv choice against the worker where the request's first token "
                   "would have come soonest, given the fleet's state at its arrival (slower: 1 + workers "
                   "engine copies run per request)")  # fmt: skip
    p.add_argument("--engine-speed", default="1",
                   help="the workers' speed against the timing kv predicts with (latencies are then in the "
                        "workers' time); `fleet` runs them as the sim fleet does: half speed when saturated, "
                        "and 8/N of that on N > 8 workers, while kv predicts with full speed")
    p.add_argument("--real", action="store_true",
                   help="the real vLLM fleet's workloads and rate (`bench.py --fleet real`) on its caches "
                        "(256 blocks) and the vLLM CPU build's timing, at the trace's arrival times; pair "
                        "with --workers 2 and an --engine-speed below 1 (0.1 gives this host's agentic TTFT)")  # fmt: skip
    p.add_argument("--out", help="write the report as JSON here too")
    args = p.parse_args()
    if args.real:
        if args.engine_speed == "fleet":
            p.error("--engine-speed fleet is the sim fleet's; with --real give a number (0.1 for this host)")
        if "multimodal" in args.workloads.split(","):
            p.error("--real replays text workloads only: multimodal's prompts need the real model's image size")
        args.loads = "real"
    vocab = words.Vocab.generated()
    seeds = [workloads.Spec().seed] + list(range(1, args.seeds))
    report, regrets = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.workloads.split(","):
            for load in args.loads.split(","):
                reg = Path(tmp) / f"regret-{kind}-{load}.jsonl" if args.regret else None
                paths, headers = traces(kind, load, seeds, vocab, tmp, args.workers, args.real)
                speed = engine_speed(args.engine_speed, load, args.workers)
                runs = [d for path in paths
                        for d in sweep(args.bin, path, args.variants, args.router_seeds, args.sessions and headers,
                                       args.workers, reg, speed, args.real)]  # fmt: skip
                report[f"{kind}/{load}"] = medians(runs)
                if reg:
                    regrets[f"{kind}/{load}"] = regret_summary(reg)
    met = {}
    print(f"{'workload/load':24}{'variant':36}" + "".join(f"{f:>20}" for f in FIGURES)
          + "".join(f"{f:>16}" for f in EXTRAS) + f"{'busiest':>9}")  # fmt: skip
    for wl, by in report.items():
        peer = by[PEER]
        for v, m in by.items():
            cells = []
            for f in FIGURES:
                r = m[f] / peer[f] if peer[f] else float("nan")
                ok = meets(r, f)
                met[v] = met.get(v, 0) + (ok and v != PEER)
                cells.append(f"{m[f]:.4g} ({r:.2f}{'' if ok else '*'})")
            extra = [f"{m[f]:.5g} ({m[f] / peer[f] if peer[f] else float('nan'):.2f})" for f in EXTRAS]
            print(f"{wl:24}{v[:35]:36}" + "".join(f"{c:>20}" for c in cells)
                  + "".join(f"{c:>16}" for c in extra) + f"{m['busiest']:9.2f}")  # fmt: skip
    print("targets met (of %d; * marks a miss):" % (4 * len(report)), json.dumps({v: n for v, n in met.items() if v != PEER}))
    if regrets:
        print("per-request regret (TTFT of each choice against the best worker at its arrival, all requests):")
        print(f"{'workload/load':24}{'variant':36}{'chosen ms':>10}{'best ms':>10}{'regret':>8}{'not best':>9}")
        for wl, by in regrets.items():
            for v, r in by.items():
                print(f"{wl:24}{v[:35]:36}{r['chosen_ttft_ms']:10.1f}{r['best_ttft_ms']:10.1f}"
                      f"{r['regret_share']:8.1%}{r['not_best_share']:9.1%}")  # fmt: skip
        report = {"figures": report, "regret": regrets}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
