"""Fleet benchmark: kvroute's policies and the peer routers over one fleet, one invocation.

    eval "$(benches/fleet/setup.sh)"          # peers, each in its own venv (optional)
    cargo build --release --bin kvroute
    python3 benches/fleet/bench.py --workload conversation --workers 8 --out fleet.json

`--fleet sim` (the default) starts N `kvroute sim-worker`s with a generated word-level
tokenizer, fresh for every router run; `--fleet real` runs the same workloads on vLLM CPU
servers (benches/real_fleet's engines, started once, prefix caches reset between runs).
Every round runs every router over the same seeded requests, in an order rotated per
round; the JSON has each run, the medians per router, and `kv` against the best peer on
each figure. Progress goes to stderr, the JSON to stdout (and --out).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "real_fleet"))

import analysis  # noqa: E402  (benches/real_fleet)
import fleet  # noqa: E402  (benches/real_fleet)
import floors  # noqa: E402
import loadgen  # noqa: E402
import metrics  # noqa: E402  (benches/real_fleet)
import multimodal  # noqa: E402
import report  # noqa: E402
import simfleet  # noqa: E402
import workloads  # noqa: E402
import words  # noqa: E402

REPO = HERE.parents[1]
KVROUTE_DEFAULT = ("kv", "round-robin")
# kvroute settings that are not a mode: `kv` with one more `[router]` line.
KV_VARIANTS = {
    # Sessions placed by the cost alone: a session header binds nothing, the session follows.
    "kv-aff-cost": ("kv", ['affinity_mode = "cost"']),
    # No prompt ends remembered: a short prefix on one worker reads as a conversation's,
    # as before the record existed.
    "kv-no-ends": ("kv", ["prompt_ends_max = 0"]),
    # 5 ms per request a worker runs, or the pile charge from 4 requests, not 36: the
    # settings for document Q&A in the README's "Document Q&A: the pile charge".
    "kv-arw5": ("kv", ["active_request_weight = 5"]),
    "kv-excess4": ("kv", ["excess_requests_min = 4"]),
    # No pile charge, the default before session 34.
    "kv-no-excess": ("kv", ["excess_ms_per_request = 0"]),
    # kv with the pile charge's floor fixed at 36, however busy the fleet (before session 35).
    "kv-fixed-floor": ("kv", ["excess_floor_mean_requests = 0"]),
    # kv sending a completion's prompt on as the token ids it made of it (its model line
    # below): its tokenizer is the workers' own folder, so it may.
    "kv-ids": ("kv", []),
    # kv tokenizing text its prefix cache has not seen without the word memo, as before
    # session 29 (its model line below).
    "kv-no-memo": ("kv", []),
    # kv charging 10 ms per KV block a worker would hold past 0.9 of its capacity, the
    # default before session 30.
    "kv-mem10": ("kv", ["memory_ms_per_block = 10"]),
    # kv predicting with the vLLM CPU engine's timing, not a GPU's: what `--fleet real`
    # gives kv anyway; on the sim fleet, a check of that timing there.
    "kv-cpu": ("kv", ['engine_timing = "vllm-cpu"']),
    # kv predicting with a GPU's timing, on `--fleet real` too (kv there before session 33).
    "kv-gpu": ("kv", ['engine_timing = "gpu"']),
    "kv-learn": ("kv", []),
    "kv-trusting": ("kv", []),
    # kv crediting a worker the whole prefill pass its timing says it ran, however long
    # its first tokens stay away (before session 37).
    "kv-credit-trusting": ("kv", ["overdue_pass_share = 1.0"]),
    # kv with no extra first-token time for a worker that has been idle (the vLLM CPU
    # timing's cold term, which `--fleet real` gives kv).
    "kv-no-cold": ("kv", ["cold_ms_max = 0"]),
}
KV_MODEL_LINES = {"kv-ids": ["forward_token_ids = true"], "kv-no-memo": ["tokenizer_words_max = 0"]}
# Whole tables a variant adds. kv-learn: `[learn]` on, per-worker speeds learned from the
# TTFT the proxy sees and the engines' own load scraped from their metrics. kv-trusting:
# kv trusting its timing however far the engines' first tokens say it is off (before
# session 36), so an idle worker's cold wait always weighs in full.
KV_SECTIONS = {"kv-learn": fleet.LEARN_SECTION, "kv-trusting": ["[learn]", "doubt_scale_min = 0"]}
# Arrival-rate multipliers for 8 workers, per workload and load; a fleet of N workers
# gets N/8 times these. Found with `kvroute replay` of each workload (mocker timing, 2,462
# blocks a worker): at `busy` round-robin's TTFT is still flat, at `saturated` it is past
# its knee (queues build up) while a cache-aware router still keeps up.
RATES = {
    "conversation": {"busy": 12.0, "saturated": 20.0},
    "trace": {"busy": 12.0, "saturated": 20.0},
    "agentic": {"busy": 8.0, "saturated": 16.0},
    "shared-doc": {"busy": 10.0, "saturated": 20.0},
    "multimodal": {"busy": 8.0, "saturated": 32.0},
}
LOADS = ("busy", "saturated")
# The sim-workers' default speedup at each load, for 8 workers (and 8 / N of it for N):
# on a 2-core host, 8 workers at `saturated` and full speed starve the routers and the
# load generator of CPU (send lateness p99 0.3-1 s), so the modelled GPU runs at half speed.
SPEEDUP_AT_LOAD = {"busy": 1.0, "saturated": 0.5}
# What the sim and real fleets default to when a flag is not given. vLLM on CPU is about
# a thousand times slower than the modelled GPU, so the real fleet gets short prompts,
# 8 output tokens, 100 requests and a rate to start from (tune it with --rate): on a
# 2-core host three CPU servers compute about 300 prompt tokens a second, and 768-token
# prompts at rate 1.0 offered 2.6 times that, so every router measured queueing.
SIM_DEFAULTS = {"workers": 8, "blocks_per_worker": 2462, "words_per_hash_id": 128, "size_scale": 1.0,
                "prompt_tokens_max": 32768, "output_tokens_max": 4096, "multi_turn_only": False, "warm_up": 0}  # fmt: skip
REAL_DEFAULTS = {"blocks_per_worker": 256, "words_per_hash_id": 64, "size_scale": 0.125,
                 "prompt_tokens_max": 384, "output_tokens_max": 8, "requests": 100, "multi_turn_only": True,
                 "warm_up": 4}  # fmt: skip
# The real fleet's engines, one per core up to this many: engines sharing a core slow each
# other's decodes whenever another starts a prefill, which separate GPUs never do, so a
# router that spreads work would be measured against the host. The arrival rate at this
# many engines; fewer get the same rate per engine.
REAL_WORKERS_MAX = 3
REAL_RATE_AT_MAX = 0.5
QUICK_REQUESTS = {"conversation": 200, "trace": 200, "agentic": 160, "shared-doc": 160, "multimodal": 160}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleet", choices=("sim", "real"), default="sim")
    p.add_argument("--workload", choices=workloads.KINDS, default="conversation")
    p.add_argument("--trace", type=Path, help="a Mooncake JSONL trace (with --workload trace; conversation "
                   "defaults to the bundled slice)")  # fmt: skip
    p.add_argument("--load", choices=LOADS, default="busy")
    p.add_argument("--workers", type=int, help="fleet size (default: 8 sim-workers; vLLM servers: one per core, "
                   f"at most {REAL_WORKERS_MAX})")  # fmt: skip
    p.add_argument("--rate", type=float, help="arrival-rate multiplier (overrides --load's; real fleet default: "
                   f"{REAL_RATE_AT_MAX} at {REAL_WORKERS_MAX} servers, the same per server at fewer)")  # fmt: skip
    p.add_argument("--requests", type=int, help="cap on requests (default: the whole workload)")
    p.add_argument("--quick", action="store_true", help="a small workload and 1 round: a smoke run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--routers", default="kv,round-robin," + ",".join(fleet.PEERS),
                   help="comma-separated: kvroute modes (kv, round-robin, least-loaded, ...), kv-aff-cost "
                        "(kv, sessions placed by the cost alone), kv-no-ends (kv remembering no prompt ends), "
                        "kv-arw5 (kv charging 5 ms per running request), kv-excess4 (kv's pile charge from 4 "
                        "running requests, not 36), kv-no-excess (kv without the pile charge), kv-fixed-floor (kv's pile charge from 36 running requests however busy the fleet), kv-ids (kv forwarding completion prompts as "
                        "its token ids, not their text), kv-no-memo (kv without the tokenizer's memo of "
                        "words), kv-mem10 (kv charging 10 ms, not 5, per KV block past 0.9 of a "
                        "worker's capacity), kv-cpu (kv predicting with the vLLM CPU engine's timing, as kv does on --fleet real), kv-gpu (kv predicting with a GPU's), kv-learn (kv with [learn] on), kv-trusting (kv never doubting its engine timing) and peers "
                   f"({', '.join(fleet.PEERS)}); peers that are not installed are skipped and named")  # fmt: skip
    p.add_argument("--seed", type=int, default=workloads.Spec.seed)
    p.add_argument("--speedup", type=float,
                   help="sim-workers run this many times faster than the modelled GPU; arrivals are "
                   "compressed and latencies reported in model ms (default: 8 / workers, at most 1, halved at "
                   "--load saturated, so that the host serves the same wall-clock rate at any fleet size)")  # fmt: skip
    p.add_argument("--blocks-per-worker", type=int, help="KV blocks of 64 tokens per worker (default: 2,462 "
                   "sim, 256 real)")  # fmt: skip
    p.add_argument("--words-per-hash-id", type=int, help="tokens a Mooncake hash id becomes (default: 128 sim, "
                   "64 real)")  # fmt: skip
    p.add_argument("--size-scale", type=float, help="multiplies the generated workloads' prompt and output sizes "
                   "(default: 1 sim, 1/8 real)")  # fmt: skip
    p.add_argument("--prompt-tokens-max", type=int, help="prompt cap (default: 32,768 sim, 384 real)")
    p.add_argument("--output-tokens-max", type=int, help="output cap (default: 4,096 sim, 8 real)")
    p.add_argument("--multi-turn-only", action=argparse.BooleanOptionalAction,
                   help="a trace: keep only conversations with 2+ requests (default: off sim, on real, where a "
                   "slice of 150 requests has few)")  # fmt: skip
    p.add_argument("--vlm-text", choices=("test", "fleet"), default="test",
                   help="--fleet real --workload multimodal: the generated LLaVA's language model, the tests' "
                   "(2 layers, 128 wide) or the text model's size (6 layers, 768 wide; far slower on vLLM's CPU "
                   "build than the timing kvroute predicts with, see the README)")  # fmt: skip
    p.add_argument("--warm-up", type=int, help="--fleet real: requests each engine serves, straight and all at "
                   "once, before the first router's run, so that no router gets an engine's first requests; its prefix cache "
                   "is emptied after (default: 4 real, 0 sim)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kvroute", type=Path, default=REPO / "target/release/kvroute")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--keep-logs", type=Path, help="directory for the processes' logs (default: temporary)")
    args = p.parse_args(argv)
    if args.workload == "trace" and args.trace is None:
        p.error("--workload trace needs --trace PATH")
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be at least 1, not {args.workers}")
    if args.warm_up is not None and args.warm_up < 0:
        p.error(f"--warm-up must be 0 or more, not {args.warm_up}")
    for k, v in (SIM_DEFAULTS if args.fleet == "sim" else REAL_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.fleet == "real":
        if args.workers is None:
            args.workers = min(REAL_WORKERS_MAX, host_cores())
        if args.rate is None:
            args.rate = round(REAL_RATE_AT_MAX * args.workers / REAL_WORKERS_MAX, 3)
    if args.speedup is None:
        args.speedup = min(1.0, 8 / args.workers) * SPEEDUP_AT_LOAD[args.load] if args.fleet == "sim" else 1.0
    if args.quick:
        args.requests = args.requests or QUICK_REQUESTS[args.workload]
        args.rounds = 1
    return args


def log(msg):
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def host_cores():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cores_per_engine(workers, cores=None):
    """The host's cores over the real fleet's engines (one thread each), warning below 1:
    engines sharing a core slow each other down, which no fleet of separate machines does,
    and a router that starts more prefills at once pays for it in decode time."""
    if cores is None:
        cores = host_cores()
    share = round(cores / max(workers, 1), 2)
    if share < 1:
        log(f"warning: {workers} engines on {cores} cores ({share} a core): they slow each other down, unlike "
            f"separate machines; --workers {cores} gives each its own")
    return share


def rate_of(args):
    """The arrival-rate multiplier: --rate, or the workload's at the load, times workers / 8."""
    if args.rate is not None:
        return args.rate
    return RATES[args.workload][args.load] * args.workers / 8


def build_workload(args, vocab, model_dir=None):
    """The workload's requests at the run's rate; a multimodal workload counts the
    placeholders `model_dir`'s vision tower gives an image."""
    per_image = multimodal.tokens_per_image(model_dir) if args.workload == "multimodal" else 0
    spec = workloads.Spec(kind=args.workload, seed=args.seed, requests_max=args.requests, trace=args.trace,
                          words_per_hash_id=args.words_per_hash_id, prompt_tokens_max=args.prompt_tokens_max,
                          output_tokens_max=args.output_tokens_max, size_scale=args.size_scale,
                          multi_turn_only=args.multi_turn_only, tokens_per_image=per_image)  # fmt: skip
    reqs = workloads.generate(spec, vocab)
    return workloads.scaled(reqs, rate_of(args))


class RealFleet:
    """vLLM CPU servers (benches/real_fleet), started once; each run resets their caches."""

    kind = "real"
    speedup = 1.0

    def __init__(self, count, gpu_blocks, max_model_len, log_dir, model=None, images_max=0):
        self.engines = [fleet.Engine(w + 1, gpu_blocks, max_model_len, log_dir, model, images_max)
                        for w in range(count)]  # fmt: skip
        for e in self.engines:
            e.proc.wait_http(f"{e.url}/health", 600)
        self.workers = self.engines

    def warm(self, reqs, bodies):
        """Each engine serves `reqs` straight, all at once; its wall seconds. An engine's
        first requests run slower (allocations, first kernels): none should be a router's."""
        took = []
        for e in self.engines:
            records, wall_s = loadgen.run(e.url, reqs, bodies, 1.0)
            failed = [r["error"] for r in records if r["error"]]
            if failed:
                raise RuntimeError(f"vllm-{e.id} failed its warm-up: {failed[0]}")
            took.append(round(wall_s, 1))
        return took

    def start(self):
        for e in self.engines:
            e.reset_prefix_cache()

    def stop(self):
        pass

    def close(self):
        for e in self.engines:
            e.proc.stop()


def start_router(name, kvroute, workers, log_dir, workload="conversation", real=False):
    """(proc, url) of router `name` over `workers` (kvroute's binary at `kvroute`); for
    images, kvroute's `[media]` allows what the workers take; `real` sizes its timeouts
    for vLLM on CPU."""
    if name in fleet.PEERS:
        return fleet.start_peer(name, workers, log_dir)
    sections = ("[media]", f"items_max = {multimodal.MM_ITEMS_MAX}") if workload == "multimodal" else ()
    sections = (*sections, *KV_SECTIONS.get(name, []))
    mode, extra = KV_VARIANTS.get(name, (name, []))
    return fleet.start_kvroute(str(kvroute), mode, workers, log_dir, name=f"kvroute-{name}", router_extra=extra,
                               sections=sections, cpu_engines=real,
                               model_extra=KV_MODEL_LINES.get(name, []))  # fmt: skip


def run_one(name, args, the_fleet, reqs, bodies, log_dir):
    """One router over the workload on fresh workers: its figures."""
    the_fleet.start()
    proc, url = start_router(name, args.kvroute, the_fleet.workers, log_dir, args.workload, args.fleet == "real")
    try:
        before = {w.id: metrics.scrape(w.url) for w in the_fleet.workers}
        cpu_before = proc.cpu_s()
        records, wall_s = loadgen.run(url, reqs, bodies, the_fleet.speedup)
        cpu_after = proc.cpu_s()
        deltas = {w.id: metrics.delta(metrics.scrape(w.url), before[w.id]) for w in the_fleet.workers}
        own = None if name in fleet.PEERS else metrics.page(url)
    finally:
        proc.stop()
        the_fleet.stop()
    cache, per_worker = metrics.cache_stats(deltas)
    run = {"router": name, "wall_s": round(wall_s, 1), "requests": len(records),
           "errors": sum(1 for r in records if r["error"]), "hit_rate": cache["hit_rate"],
           "hit_tokens": cache["hit_tokens"], "prompt_tokens": cache["queried_tokens"]}  # fmt: skip
    run.update(report.latency(records, the_fleet.speedup))
    run.update(metrics.worker_latency(deltas, the_fleet.speedup))
    run.update(report.throughput(records, reqs, the_fleet.speedup))
    run["ttft_ms_by_request"] = [round(r["ttft_s"] * 1000.0 * the_fleet.speedup, 1) if r["error"] is None
                                 and r["ttft_s"] is not None else None for r in records]  # fmt: skip
    run["worker_by_request"] = [r["worker"] for r in records]
    run["worker_requests"] = report.spread([per_worker[k]["requests"] for k in sorted(per_worker, key=int)])
    run["lateness_ms"] = report.lateness(records)
    if own is not None:
        run["router_overhead_us"] = metrics.overhead_from(own)
        # Beside hit_rate: how far the workers' caches fell short of what kvroute expected.
        run["router_view"] = metrics.router_view_from(own)
    if cpu_before is not None and cpu_after is not None:
        # On a small host the router's CPU is the workers' loss: they share the cores.
        run["router_cpu_s"] = round(cpu_after - cpu_before, 2)
    run["losses"] = losses(reqs, records)
    errors = [r["error"] for r in records if r["error"]]
    if errors:
        run["first_errors"] = errors[:3]
    log(f"{name}: hit {run['hit_rate']} ttft mean {run['ttft_ms_mean']} (at the workers "
        f"{run.get('worker_ttft_ms_mean')}) p99 {run['ttft_ms_p99']} e2e mean "
        f"{run['e2e_ms_mean']} errors {run['errors']} late p99 {run['lateness_ms'].get('p99')} ms "
        f"({run['wall_s']} s)")  # fmt: skip
    return run


def warm_requests(reqs, count):
    """The workload's first `count` requests that follow no other, due at once."""
    firsts = sorted((r for r in reqs if r.after is None), key=lambda r: (r.arrival_s, r.index))[:count]
    return [replace(r, arrival_s=0.0) for r in firsts]


def run_with_retry(name, args, the_fleet, reqs, bodies, log_dir, tries=2):
    """`run_one`, tried again once when a process did not come up (a port another
    process took, a router slow to find its workers); then a failed run."""
    for attempt in range(1, tries + 1):
        try:
            return run_one(name, args, the_fleet, reqs, bodies, log_dir)
        except RuntimeError as e:
            log(f"{name}: failed (try {attempt} of {tries}): {str(e)[:300]}")
            failure = str(e)[-2000:]
    return {"router": name, "failed": failure}


def losses(reqs, records):
    """Where hits were lost (benches/real_fleet's analysis.losses), in the order the
    requests were sent: possible anywhere, on the worker chosen (kvroute names it), and
    what the workers reported as cached."""
    sent = {r["i"]: r["sent_s"] for r in records}
    items = [SimpleNamespace(index=r.index, arrival_s=sent[r.index] if sent[r.index] is not None else 1e18,
                             tokens=r.tokens, group=r.group, hash_ids=tuple(workloads.block_keys(r.tokens)))
             for r in reqs]  # fmt: skip
    return analysis.losses(items, records)


def make_vocab(args, tmp: Path):
    """(vocab, model dir): the generated tokenizer for sim, the real model's for real."""
    if args.fleet == "sim":
        model_dir = tmp / "model"
        write = multimodal.write_model_dir if args.workload == "multimodal" else words.write_model_dir
        return words.Vocab(write(model_dir)), model_dir
    model_dir = fleet.vlm_model(text=args.vlm_text) if args.workload == "multimodal" else fleet.text_model()
    import workload as real_workload  # benches/real_fleet; needs the `tokenizers` package

    real = real_workload.Words(model_dir / "tokenizer.json")
    return words.Vocab.from_tokens([real.tok.decode([i]) for i in real.ids]), model_dir


def body_of(r, vocab, seed):
    """A request's body: a completion of its words, or, for a chat, `(path, body)`."""
    if r.chat is None:
        return loadgen.request_body(fleet.SERVED_NAME, vocab.text(r.tokens), r.output_tokens)
    msgs = multimodal.messages(r.chat, vocab, seed)
    return "/v1/chat/completions", multimodal.chat_body(fleet.SERVED_NAME, msgs, r.output_tokens)


def routers_of(args):
    """(routers to run, {skipped peer: why})."""
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    skipped = {n: "not installed (benches/fleet/setup.sh installs it)" for n in names
               if n in fleet.PEERS and not fleet.peer_installed(n)}  # fmt: skip
    return [n for n in names if n not in skipped], skipped


def main(argv=None):
    args = parse_args(argv)
    fleet.stop_on_sigterm()
    if not args.kvroute.exists():
        raise SystemExit(f"{args.kvroute} is missing; run `cargo build --release --bin kvroute` first")
    routers, skipped = routers_of(args)
    tmp_ctx = tempfile.TemporaryDirectory(prefix="kvroute-fleet-")
    tmp = Path(tmp_ctx.name)
    log_dir = args.keep_logs or tmp / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    vocab, model_dir = make_vocab(args, tmp)
    reqs = build_workload(args, vocab, model_dir)
    bodies = {r.index: body_of(r, vocab, args.seed) for r in reqs}
    out = {
        "fleet": args.fleet, "workload": args.workload, "load": args.load, "workers": args.workers,
        "rate_multiplier": rate_of(args), "workload_summary": workloads.summary(reqs),
        "workload_fingerprint": workloads.fingerprint(reqs), "routers": routers, "skipped": skipped,
        "time_unit": f"model ms (wall x speedup {args.speedup if args.fleet == 'sim' else 1.0}); lateness in wall ms",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    log(f"{args.workload} x{out['rate_multiplier']}: {out['workload_summary']}; routers {routers}; skipped {skipped}")
    if args.fleet == "real":
        out["cores_per_engine"] = cores_per_engine(args.workers)
    if args.fleet == "sim":
        mm_items_max = multimodal.MM_ITEMS_MAX if args.workload == "multimodal" else None
        shape = simfleet.Shape(blocks_per_worker=args.blocks_per_worker, max_num_seqs=args.max_num_seqs,
                               speedup=args.speedup, mm_items_max=mm_items_max)  # fmt: skip
        the_fleet = simfleet.SimFleet(args.kvroute, args.workers, shape, model_dir, log_dir)
    else:
        max_model_len = max(2048, args.prompt_tokens_max + args.output_tokens_max + 64)
        images = multimodal.MM_ITEMS_MAX if args.workload == "multimodal" else 0
        the_fleet = RealFleet(args.workers, args.blocks_per_worker, max_model_len, log_dir, model_dir, images)
    runs = []
    try:
        if isinstance(the_fleet, RealFleet) and args.warm_up:
            out["warm_up_s"] = the_fleet.warm(warm_requests(reqs, args.warm_up), bodies)
            log(f"warm-up: {args.warm_up} requests on each engine took {out['warm_up_s']} s")
        for rnd in range(args.rounds):
            k = rnd % len(routers)
            for name in routers[k:] + routers[:k]:
                run = run_with_retry(name, args, the_fleet, reqs, bodies, log_dir)
                run["round"] = rnd
                runs.append(run)
    finally:
        the_fleet.stop()
        if isinstance(the_fleet, RealFleet):
            the_fleet.close()
    out["runs"] = runs
    out["medians"] = report.medians(runs)
    out["kv_vs_best_peer"] = report.against_best_peer(out["medians"], [r for r in routers if r in fleet.PEERS])
    out["kv_vs_peers_paired_ttft"] = report.paired(runs, "kv", [r for r in routers if r != "kv"])
    if args.fleet == "sim":
        floor = floors.floors(reqs, shape, args.workers)
        out["floors"] = {k: round(v, 1) for k, v in floor.items()}
        out["targets_out_of_reach"] = floors.reach(floor, out["kv_vs_best_peer"], report.TARGETS)
    out["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    log("medians over rounds (latencies in model ms):\n" + report.table(out["medians"]))
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    tmp_ctx.cleanup()


if __name__ == "__main__":
    main()
