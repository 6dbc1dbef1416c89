"""Real-fleet replay study: routers in front of N real vLLM CPU servers, and how well
`kvroute replay` predicts them.

The fleet benchmark is benches/fleet/bench.py; `--fleet real` runs its workloads on these
same servers. This script is that mode's companion for the replay's fidelity: kvroute
variants, the replay prediction of the same slice, placement ceilings and paired TTFT.
It shares the fleet benchmark's processes (fleet.py), counters (metrics.py), statistics
and load generator.

    eval "$(benches/real_fleet/setup.sh)"
    cargo build --release --bin kvroute
    python benches/real_fleet/run.py --rounds 2 --out fleet.json

Starts the vLLM servers once, then for every round runs each policy (kvroute's `kv`,
`round-robin`, `least-loaded`, `kv-cpu` (kv predicting with the CPU engines' timing,
as every kvroute policy here does since session 33; `kv-gpu` predicts with a GPU's),
`kv-learn` (kv with learned costs and engine load), `kv-pls4` (kv with
`prefill_load_scale = 4`), and the peer routers that are installed) over the same request sequence, in an order
rotated per round, with every engine's prefix cache reset before each run. Prints one
JSON object: per run and per policy (medians over rounds) TTFT, end-to-end latency,
vLLM's own prefix-cache hit rate, where the hits were lost, and what `kvroute replay`
predicts for the same slice and fleet with the engines' fitted timing (`vllm-cpu`),
each engine slowed to the share of a core it got (cores / load average), with the
real-over-predicted ratios of hit rate and TTFT p50/p99, and each policy's hit rate as
a share of the ceilings the replay reports (one pooled LRU cache of the fleet's size, and
an infinite cache).

    python benches/real_fleet/run.py --replay-only fleet.json   # the prediction alone
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import analysis
import fleet
import metrics
import placement
import stats
import workload
from stats import quantile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fleet"))
import loadgen  # noqa: E402  (benches/fleet: the one load generator)

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "adapters/sim/fixtures/mooncake_conversation_head.jsonl"
KV_POLICIES = ("kv", "round-robin", "least-loaded")
# kvroute variants that are not a mode: `kv` predicting with the CPU engines' timing
# (`engine_timing = "vllm-cpu"`, which `fleet.kvroute_config` gives every kvroute policy
# on these engines) or a GPU's, and `kv` with `[learn]` on (learned costs, engine load).
KV_VARIANTS = {
    "kv-cpu": {"router_extra": ['engine_timing = "vllm-cpu"']},
    "kv-gpu": {"router_extra": ['engine_timing = "gpu"']},
    "kv-learn": {"learn": True},
    # Prefill weighted 4x against decode steps: in replay with the CPU engines' timing it
    # lowered TTFT mean and p99 at every load tried; on the real fleet, within the noise.
    "kv-pls4": {"router_extra": ["prefill_load_scale = 4.0"]},
}
PEERS = tuple(fleet.PEERS)


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
    p.add_argument("--policies", default=",".join(KV_POLICIES + tuple(KV_VARIANTS) + PEERS),
                   help="comma-separated; peers that are not installed are skipped and named in the JSON")
    p.add_argument("--kvroute", type=Path, default=REPO / "target/release/kvroute")
    p.add_argument("--baseline-kvroute", type=Path,
                   help="another kvroute binary (say, built from main) run as policy `kv-baseline`")
    p.add_argument("--no-replay", action="store_true")
    p.add_argument("--replay-timing", default="vllm-cpu",
                   help="the simulated engines' timing: a preset (vllm-cpu, mocker) or a JSON file")
    p.add_argument("--replay-speed", default="auto",
                   help="speed of every simulated engine (1: one idle core each); auto: fitted so that the "
                        "replay's round-robin TTFT p50 is the real one (the host's share of a core), and "
                        "the other policies are predicted at that speed")
    p.add_argument("--replay-only", type=Path, metavar="REPORT.json",
                   help="run only the replay prediction for an earlier report's slice and fleet, and compare")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--keep-logs", type=Path, help="directory for server logs (default: a temporary one)")
    return p.parse_args()


def log(msg):
    print(f"[real-fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_avg():
    return [round(x, 2) for x in os.getloadavg()]


def learned_view(url):
    """What a kvroute run's cost learner ended with, per worker (`GET /workers`): its
    learned prefill scale and sample count and the engine's last report."""
    try:
        with urllib.request.urlopen(f"{url}/workers", timeout=5) as r:
            rows = json.loads(r.read())["workers"]
    except (OSError, ValueError, KeyError) as e:
        return {"error": str(e)}
    return {str(w["id"]): w.get("learned") for w in rows}


def send(url, items, inflight_max):
    """The slice through `url` at its arrival times (benches/fleet's load generator), at
    most `inflight_max` outstanding; one record per request."""
    reqs = [SimpleNamespace(index=it.index, arrival_s=it.arrival_s, after=None, gap_s=0.0, session=None)
            for it in items]  # fmt: skip
    bodies = {it.index: loadgen.request_body(fleet.SERVED_NAME, it.text, it.output_tokens) for it in items}
    return loadgen.run(url, reqs, bodies, 1.0, timeout_s=300.0, inflight_max=inflight_max)[0]


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


def run_one(policy, engines, items, args, log_dir):
    """One policy over the workload on freshly reset caches."""
    for e in engines:
        e.reset_prefix_cache()
    if policy in PEERS:
        started = fleet.start_peer(policy, engines, log_dir)
    elif policy in KV_VARIANTS:
        started = fleet.start_kvroute(str(args.kvroute), "kv", engines, log_dir, f"kvroute-{policy}",
                                      **KV_VARIANTS[policy])  # fmt: skip
    elif policy == "kv-baseline":
        started = fleet.start_kvroute(str(args.baseline_kvroute), "kv", engines, log_dir, "kvroute-kv-baseline")
    else:
        started = fleet.start_kvroute(str(args.kvroute), policy, engines, log_dir)
    proc, url = started
    before = {e.id: metrics.scrape(e.url) for e in engines}
    load_before = load_avg()
    t0 = time.monotonic()
    learned = None
    try:
        results = send(url, items, args.inflight_max)
        if policy not in PEERS:
            learned = learned_view(url)
    finally:
        proc.stop()
    wall_s = time.monotonic() - t0
    deltas = {e.id: metrics.delta(metrics.scrape(e.url), before[e.id]) for e in engines}
    cache, per_worker = metrics.cache_stats(deltas)
    run = {"policy": policy, "wall_s": round(wall_s, 1), "load_avg_1m": [load_before[0], load_avg()[0]]}
    run.update(latency_stats(results, items))
    run["cache"] = cache
    run["workers"] = per_worker
    if learned:
        run["learned"] = learned
    run["losses"] = analysis.losses(items, results)
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        run["first_errors"] = errors[:3]
    log(f"{policy}: hit {cache['hit_rate']} ttft mean {run['ttft_ms_mean']} p99 {run['ttft_ms_p99']} "
        f"errors {run['errors']} ({wall_s:.0f} s, load {run['load_avg_1m']})")  # fmt: skip
    return run


# The kvroute variants the replay predicts: name -> extra `kvroute replay` flags.
REPLAY_VARIANTS = {"": [], "-cpu": ["--router-knows-timing"], "-learn": ["--learn-costs", "--engine-load"]}


def replay_argv(args, shape, trace, speed, policies, extra=()):
    """`kvroute replay` of the slice at `trace` on the fleet, every engine at `speed`."""
    return [str(args.kvroute), "replay", "--trace", str(trace), "--workers", str(args.workers),
            "--trace-block-tokens", str(shape.tokens_per_hash_id), "--block-size", "64",
            "--blocks-per-worker", str(args.gpu_blocks), "--max-batched-tokens", str(fleet.MAX_BATCHED_TOKENS),
            "--max-num-seqs", "16", "--engine-timing", args.replay_timing,
            "--worker-speeds", ",".join([str(speed)] * args.workers),
            "--compare", ",".join(policies), "--json", *extra]  # fmt: skip


def replay_speed(args, shape, trace, policies):
    """The simulated engines' speed: --replay-speed, or the one at which the replay's
    round-robin TTFT p50 matches the real one (bisection over 1/32..1; 1 without a real
    round-robin run). The host is shared, so an engine gets a fraction of its core; that
    fraction is fitted on one policy and the others are predicted with it."""
    if args.replay_speed != "auto":
        return float(args.replay_speed)
    real = policies.get("round-robin", {}).get("ttft_ms_p50")
    if not real:
        return 1.0
    lo, hi = math.log(1 / 32), 0.0
    for _ in range(12):
        mid = (lo + hi) / 2
        out = subprocess.run(replay_argv(args, shape, trace, math.exp(mid), ("round-robin",)),
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        if out.returncode != 0:
            return 1.0
        if json.loads(out.stdout)["ttft_ms"]["p50"] > real:
            lo = mid
        else:
            hi = mid
    return round(math.exp((lo + hi) / 2), 4)


def replay(args, items, shape, tmp: Path, real_policies):
    """What `kvroute replay` predicts for the same slice and fleet, with the engines'
    fitted timing: kv as configured, kv predicting with the engines' timing (-cpu), kv
    with learned costs (-learn)."""
    trace = tmp / "replay_trace.jsonl"
    workload.write_replay_trace(items, shape, trace)
    speed = replay_speed(args, shape, trace, real_policies)
    pred = {"timing": args.replay_timing, "speed": speed}
    for suffix, extra in REPLAY_VARIANTS.items():
        argv = replay_argv(args, shape, trace, speed, KV_POLICIES if not suffix else ("kv",), extra)
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            pred["error" + suffix] = {"stderr": out.stderr[-2000:], "command": argv[1:]}
            continue
        rep = json.loads(out.stdout)
        for r in rep.get("runs", [rep]):
            # The same for every policy: what one cache of the fleet's size (LRU) and an
            # infinite one would reuse of this slice.
            pred.setdefault("ceilings", {"pooled_lru": r.get("pooled_reuse_ratio"),
                                         "infinite_cache": r.get("infinite_reuse_ratio")})  # fmt: skip
            pred[r["policy"] + suffix] = {
                "hit_rate": r["prefix_reuse_ratio"],
                "ttft_ms_mean": r["ttft_ms"]["mean"],
                "ttft_ms_p50": r["ttft_ms"]["p50"],
                "ttft_ms_p99": r["ttft_ms"]["p99"],
                "worker_requests": r["worker_requests"],
            }
    return pred


def fidelity(policies, predicted):
    """Real over predicted hit rate and TTFT per policy (1.0: the replay is exact)."""
    out = {}
    for pol, pred in predicted.items():
        real = policies.get(pol)
        if not isinstance(pred, dict) or not real or real.get("hit_rate") is None:
            continue
        row = {"real_hit_rate": real["hit_rate"], "replay_hit_rate": round(pred["hit_rate"], 4),
               "hit_real_over_replay": round(real["hit_rate"] / pred["hit_rate"], 3) if pred["hit_rate"] else None}  # fmt: skip
        for q in ("p50", "p99"):
            r, p = real.get(f"ttft_ms_{q}"), pred.get(f"ttft_ms_{q}")
            row[f"real_ttft_ms_{q}"] = r
            row[f"replay_ttft_ms_{q}"] = p
            row[f"ttft_{q}_real_over_replay"] = round(r / p, 3) if r and p else None
        out[pol] = row
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


# The arguments that shape the slice and the fleet, taken from a report by --replay-only.
SLICE_ARGS = ("trace", "start", "requests", "all_requests", "time_scale", "workers", "gpu_blocks",
              "tokens_per_hash_id", "prompt_tokens_max", "output_tokens_max")  # fmt: skip


def replay_only(args):
    """The replay prediction for an earlier report's slice and fleet, against its real runs."""
    old = json.loads(args.replay_only.read_text())
    for k in SLICE_ARGS:
        v = old["args"].get(k)
        setattr(args, k, Path(v) if k == "trace" and v else v)
    items, shape = build_items(args)
    with tempfile.TemporaryDirectory(prefix="real-fleet-") as tmp:
        pred = replay(args, items, shape, Path(tmp), old.get("policies", {}))
    placed = placement.ceilings(items, args.workers, args.gpu_blocks)
    out = {"report": str(args.replay_only), "load_avg_1m_of_runs": [r.get("load_avg_1m") for r in old.get("runs", [])],
           "replay": pred, "replay_fidelity": fidelity(old.get("policies", {}), pred), "placement": placed,
           "ceilings": analysis.ceilings(old.get("policies", {}), pred.get("ceilings"), placed)}  # fmt: skip
    print(json.dumps(out, indent=1))


def build_items(args):
    """The workload's items and shape for the arguments."""
    trace = args.trace or BUNDLED
    if not trace.exists():
        raise SystemExit(f"trace {trace} is missing; pass --trace with a Mooncake JSONL file")
    shape = workload.Shape(
        tokens_per_hash_id=args.tokens_per_hash_id,
        prompt_tokens_max=args.prompt_tokens_max,
        output_tokens_max=args.output_tokens_max,
        time_scale=args.time_scale,
    )
    model = fleet.text_model()
    words = workload.Words(model / "tokenizer.json")
    records = workload.read_records(trace, args.start, args.requests, not args.all_requests)
    return workload.build(records, shape, words), shape


def main():
    args = parse_args()
    fleet.stop_on_sigterm()
    if not args.kvroute.exists():
        raise SystemExit(f"{args.kvroute} is missing; run `cargo build --release --bin kvroute` first")
    if args.replay_only:
        replay_only(args)
        return
    trace = args.trace or BUNDLED
    policies = [p for p in args.policies.split(",") if p]
    if args.baseline_kvroute and "kv-baseline" not in policies:
        policies.insert(1, "kv-baseline")
    items, shape = build_items(args)
    max_model_len = max(2048, args.prompt_tokens_max + args.output_tokens_max + 64)
    tmp_ctx = tempfile.TemporaryDirectory(prefix="real-fleet-")
    log_dir = args.keep_logs or Path(tmp_ctx.name)
    log_dir.mkdir(parents=True, exist_ok=True)
    skipped = {p: "not installed (benches/fleet/setup.sh installs it)" for p in policies
               if p in PEERS and not fleet.peer_installed(p)}  # fmt: skip
    policies = [p for p in policies if p not in skipped]
    report = {
        "trace": "bundled slice" if args.trace is None else trace.name,
        "slice": workload.summary(items),
        "fleet": {"workers": args.workers, "gpu_blocks": args.gpu_blocks, "block_size": 64},
        "placement": placement.ceilings(items, args.workers, args.gpu_blocks),
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
            send(e.url, items[:2], 2)
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
        report["paired_ttft"] = {a: stats.paired_table(runs, a, [p for p in report["policies"] if p != a])
                                 for a in ("kv", "kv-learn") if a in report["policies"]}  # fmt: skip
    finally:
        for e in engines:
            e.proc.stop()
    if not args.no_replay:
        report["replay"] = replay(args, items, shape, Path(tmp_ctx.name), report.get("policies", {}))
        report["replay_fidelity"] = fidelity(report.get("policies", {}), report["replay"])
        report["ceilings"] = analysis.ceilings(report.get("policies", {}), report["replay"].get("ceilings"),
                                               report["placement"])
    report["load_avg_end"] = load_avg()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    tmp_ctx.cleanup()


if __name__ == "__main__":
    main()
