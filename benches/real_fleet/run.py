"""Real-fleet benchmark: routers in front of N real vLLM CPU servers, one invocation.

    eval "$(benches/real_fleet/setup.sh)"
    cargo build --release --bin kvroute
    python benches/real_fleet/run.py --rounds 2 --out fleet.json

Starts the vLLM servers once, then for every round runs each policy (kvroute's `kv`,
`round-robin`, `least-loaded`, and the peer routers that are installed) over the same
request sequence, in an order rotated per round, with every engine's prefix cache reset
before each run. Prints one JSON object: per run and per policy (medians over rounds)
TTFT, end-to-end latency, vLLM's own prefix-cache hit rate, where the hits were lost,
and what `kvroute replay` predicts for the same slice and fleet.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import analysis
import drive
import fleet
import workload

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "adapters/sim/fixtures/mooncake_conversation_head.jsonl"
KV_POLICIES = ("kv", "round-robin", "least-loaded")
PEERS = ("sglang-router", "smg", "smg-prefix-hash")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, help="Mooncake JSONL trace (default: the bundled 1,500-request slice)")
    p.add_argument("--start", type=int, default=0, help="first record of the slice")
    p.add_argument("--requests", type=int, default=150, help="requests in the slice")
    p.add_argument("--all-requests", action="store_true",
                   help="keep single-turn conversations too (default: only conversations with 2+ requests)")
    p.add_argument("--time-scale", type=float, default=0.5, help="multiplies the trace's arrival gaps")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--gpu-blocks", type=int, default=256, help="KV blocks per engine (64 tokens each)")
    p.add_argument("--tokens-per-hash-id", type=int, default=64)
    p.add_argument("--prompt-tokens-max", type=int, default=768)
    p.add_argument("--output-tokens-max", type=int, default=8)
    p.add_argument("--inflight-max", type=int, default=12, help="most requests outstanding at once")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policies", default=",".join(KV_POLICIES + PEERS),
                   help="comma-separated; peers that are not installed are skipped and named in the JSON")
    p.add_argument("--kvroute", type=Path, default=REPO / "target/release/kvroute")
    p.add_argument("--baseline-kvroute", type=Path,
                   help="another kvroute binary (say, built from main) run as policy `kv-baseline`")
    p.add_argument("--no-replay", action="store_true")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--keep-logs", type=Path, help="directory for server logs (default: a temporary one)")
    return p.parse_args()


def log(msg):
    print(f"[real-fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_avg():
    return [round(x, 2) for x in os.getloadavg()]


def run_one(policy, engines, items, args, log_dir):
    """One policy over the workload on freshly reset caches."""
    for e in engines:
        e.reset_prefix_cache()
    if policy in PEERS:
        started = fleet.start_peer(policy, engines, log_dir)
    elif policy == "kv-baseline":
        started = fleet.start_kvroute(str(args.baseline_kvroute), "kv", engines, log_dir, "kvroute-kv-baseline")
    else:
        started = fleet.start_kvroute(str(args.kvroute), policy, engines, log_dir)
    proc, url = started
    before = {e.id: drive.scrape(e.url) for e in engines}
    load_before = load_avg()
    t0 = time.monotonic()
    try:
        results = asyncio.run(drive.drive(url, items, args.inflight_max))
    finally:
        proc.stop()
    wall_s = time.monotonic() - t0
    deltas = {e.id: drive.delta(drive.scrape(e.url), before[e.id]) for e in engines}
    cache, per_worker = drive.cache_stats(deltas)
    run = {"policy": policy, "wall_s": round(wall_s, 1), "load_avg_1m": [load_before[0], load_avg()[0]]}
    run.update(drive.latency_stats(results, items))
    run["cache"] = cache
    run["workers"] = per_worker
    run["losses"] = analysis.losses(items, results)
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        run["first_errors"] = errors[:3]
    log(f"{policy}: hit {cache['hit_rate']} ttft mean {run['ttft_ms_mean']} p99 {run['ttft_ms_p99']} "
        f"errors {run['errors']} ({wall_s:.0f} s, load {run['load_avg_1m']})")  # fmt: skip
    return run


def replay(args, items, shape, tmp: Path):
    """What `kvroute replay` predicts for the same slice and fleet."""
    trace = tmp / "replay_trace.jsonl"
    workload.write_replay_trace(items, shape, trace)
    k = workload.MOONCAKE_BLOCK_TOKENS // shape.tokens_per_hash_id
    argv = [str(args.kvroute), "replay", "--trace", str(trace), "--workers", str(args.workers),
            "--block-size", "512", "--blocks-per-worker", str(args.gpu_blocks),
            "--max-batched-tokens", str(fleet.MAX_BATCHED_TOKENS * k), "--max-num-seqs", "16",
            "--compare", ",".join(KV_POLICIES), "--json"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:], "command": argv[1:]}
    rep = json.loads(out.stdout)
    runs = rep.get("runs", rep if isinstance(rep, list) else [rep])
    pred = {}
    for r in runs:
        pred[r["policy"]] = {
            "hit_rate": r["prefix_reuse_ratio"],
            "ttft_ms_mean": r["ttft_ms"]["mean"],
            "ttft_ms_p99": r["ttft_ms"]["p99"],
            "worker_requests": r["worker_requests"],
        }
    return pred


def fidelity(policies, predicted):
    """Real over predicted hit rate per policy (1.0: the replay's cache model is exact)."""
    out = {}
    for pol, pred in predicted.items():
        real = policies.get(pol, {}).get("hit_rate")
        if isinstance(pred, dict) and real is not None and pred.get("hit_rate"):
            out[pol] = {"real_hit_rate": real, "replay_hit_rate": round(pred["hit_rate"], 4),
                        "real_over_replay": round(real / pred["hit_rate"], 3)}  # fmt: skip
    return out


def summarize(runs):
    """Medians over rounds, per policy."""
    by = {}
    for r in runs:
        if "failed" in r:
            continue
        by.setdefault(r["policy"], []).append(r)
    out = {}
    for pol, rs in by.items():

        def med(get):
            xs = [get(r) for r in rs if get(r) is not None]
            return round(statistics.median(xs), 4) if xs else None

        out[pol] = {
            "rounds": len(rs),
            "hit_rate": med(lambda r: r["cache"]["hit_rate"]),
            "ttft_ms_mean": med(lambda r: r["ttft_ms_mean"]),
            "ttft_ms_p50": med(lambda r: r["ttft_ms_p50"]),
            "ttft_ms_p99": med(lambda r: r["ttft_ms_p99"]),
            "e2e_ms_mean": med(lambda r: r["e2e_ms_mean"]),
            "e2e_ms_p99": med(lambda r: r["e2e_ms_p99"]),
            "errors": sum(r["errors"] for r in rs),
        }
    return out


def main():
    args = parse_args()
    trace = args.trace or BUNDLED
    if not trace.exists():
        raise SystemExit(f"trace {trace} is missing; pass --trace with a Mooncake JSONL file")
    if not args.kvroute.exists():
        raise SystemExit(f"{args.kvroute} is missing; run `cargo build --release --bin kvroute` first")
    policies = [p for p in args.policies.split(",") if p]
    if args.baseline_kvroute and "kv-baseline" not in policies:
        policies.insert(1, "kv-baseline")
    shape = workload.Shape(
        tokens_per_hash_id=args.tokens_per_hash_id,
        prompt_tokens_max=args.prompt_tokens_max,
        output_tokens_max=args.output_tokens_max,
        time_scale=args.time_scale,
    )
    model = Path(os.environ.get("KVROUTE_VLLM_MODEL", str(fleet.CACHE / "engine/model")))
    words = workload.Words(model / "tokenizer.json")
    records = workload.read_records(trace, args.start, args.requests, not args.all_requests)
    items = workload.build(records, shape, words)
    max_model_len = max(2048, args.prompt_tokens_max + args.output_tokens_max + 64)
    tmp_ctx = tempfile.TemporaryDirectory(prefix="real-fleet-")
    log_dir = args.keep_logs or Path(tmp_ctx.name)
    log_dir.mkdir(parents=True, exist_ok=True)
    skipped = {p: "not installed (benches/real_fleet/setup.sh installs it)" for p in policies if p in PEERS
               and not os.environ.get("KVROUTE_SGLANG_ROUTER_PYTHON" if p == "sglang-router" else "KVROUTE_SMG")}  # fmt: skip
    policies = [p for p in policies if p not in skipped]
    report = {
        "trace": "bundled slice" if args.trace is None else trace.name,
        "slice": workload.summary(items),
        "fleet": {"workers": args.workers, "gpu_blocks": args.gpu_blocks, "block_size": 64},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "skipped": skipped,
        "load_avg_start": load_avg(),
    }
    log(f"slice: {report['slice']}")
    engines = []
    try:
        engines = [fleet.Engine(w + 1, args.gpu_blocks, max_model_len, log_dir) for w in range(args.workers)]
        for e in engines:
            e.proc.wait_http(f"{e.url}/health", 600)
        log(f"{len(engines)} engines up; warming up")
        for e in engines:
            asyncio.run(drive.drive(e.url, items[:2], 2))
        runs = []
        for rnd in range(args.rounds):
            order = policies[rnd % len(policies) :] + policies[: rnd % len(policies)]
            for pol in order:
                try:
                    run = run_one(pol, engines, items, args, log_dir)
                except RuntimeError as e:
                    log(f"{pol}: failed: {e}")
                    run = {"policy": pol, "failed": str(e)[-2000:]}
                run["round"] = rnd
                runs.append(run)
        report["runs"] = runs
        report["policies"] = summarize(runs)
        report["targets"] = analysis.targets(report["policies"])
    finally:
        for e in engines:
            e.proc.stop()
    if not args.no_replay:
        report["replay"] = replay(args, items, shape, Path(tmp_ctx.name))
        report["replay_fidelity"] = fidelity(report.get("policies", {}), report["replay"])
    report["load_avg_end"] = load_avg()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    tmp_ctx.cleanup()


if __name__ == "__main__":
    main()
