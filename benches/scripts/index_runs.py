#!/usr/bin/env python3
"""Runs the index workload as its section 6 asks, and summarises the runs.

One process per run, runs interleaved across worker counts, and for each figure the
median with min and max. Builds nothing: pass the index-workload binary (build it with
`cargo build --release -p kvroute-benches --bin index-workload`).

usage: index_runs.py BIN TRACE [--runs N] [--workers 16,128] [--remove dead-tails|all]
       [--query-reps N] [--mem]

Prints one JSON object per worker count: {"workers", "runs", "checksums_match_reference"
(true only if every run matched), and per figure {"median", "min", "max"}}.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

FIGURES = [
    "a_blocks_per_s", "b_p50_ns", "b_p99_ns", "b_max_ns", "b_queries_per_s",
    "c_blocks_per_s", "d_p50_ns", "d_p99_ns", "loadavg_1m_before",
]
MEM_FIGURES = ["bytes_per_entry", "heap_bytes_per_entry", "rss_bytes_per_entry"]


def run(args, workers, mem):
    cmd = [args.bin, "--trace", args.trace, "--workers", str(workers), "--remove", args.remove]
    cmd += ["--mode", "mem"] if mem else ["--query-reps", str(args.query_reps)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"index_runs: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr.strip()}")
    r = json.loads(out.stdout)
    # How busy the rest of the machine was, as the workload asks to report.
    r["loadavg_1m_before"] = (r.get("loadavg_1m") or {}).get("before")
    return r


def summary(workers, runs, figures):
    s = {"workers": workers, "runs": len(runs)}
    s["checksums_match_reference"] = all(r.get("checksums_match_reference", True) for r in runs)
    for f in figures:
        vals = [r[f] for r in runs if isinstance(r.get(f), (int, float))]
        if vals:
            s[f] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return s


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bin", help="the index-workload binary")
    p.add_argument("trace", help="the Mooncake conversation trace (JSON lines)")
    p.add_argument("--runs", type=int, default=5, help="runs per worker count (default 5)")
    p.add_argument("--workers", default="16,128", help="worker counts, comma-separated")
    p.add_argument("--remove", default="dead-tails", choices=["dead-tails", "all"])
    p.add_argument("--query-reps", type=int, default=1, help="passes over phases B and D")
    p.add_argument("--mem", action="store_true", help="the memory runs (section 5) instead")
    args = p.parse_args()
    for path, what in [(args.bin, "binary"), (args.trace, "trace")]:
        if not os.path.isfile(path):
            sys.exit(f"index_runs: no {what} at {path}")
    try:
        counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        sys.exit(f"index_runs: bad --workers {args.workers!r} (want e.g. 16,128)")
    results = {w: [] for w in counts}
    for i in range(args.runs):
        for w in counts:
            results[w].append(run(args, w, args.mem))
            print(f"run {i + 1}/{args.runs}, {w} workers: done", file=sys.stderr)
    for w in counts:
        print(json.dumps(summary(w, results[w], MEM_FIGURES if args.mem else FIGURES)))


if __name__ == "__main__":
    main()
