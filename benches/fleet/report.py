"""The fleet benchmark's figures: one run's numbers from its records and counters, the
medians over rounds, and kvroute's `kv` against the best peer on each figure.

Latencies are model milliseconds (wall time times the workers' speedup); lateness is
wall milliseconds, since it measures the host.
"""

import statistics

import stats  # benches/real_fleet
from stats import quantile

# figure -> True when higher is better.
FIGURES = {
    "hit_rate": True,
    "ttft_ms_mean": False,
    "ttft_ms_p50": False,
    "ttft_ms_p99": False,
    "worker_ttft_ms_mean": False,
    "e2e_ms_mean": False,
    "e2e_ms_p50": False,
    "e2e_ms_p99": False,
    "throughput_rps": True,
    "output_tokens_per_s": True,
}
# The targets for `kv` over the best peer: figure -> (bound, kv/best must be >= or <=).
TARGETS = {
    "hit_rate": (1.0, ">="),
    "ttft_ms_mean": (0.8, "<="),
    "ttft_ms_p99": (0.8, "<="),
    "e2e_ms_mean": (0.95, "<="),
}


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _r(x, places=1):
    return round(x, places) if x is not None else None


def latency(records, speedup):
    """TTFT and end-to-end mean/p50/p99 in model ms over the requests that succeeded."""
    ok = [r for r in records if r["error"] is None]
    out = {}
    for name, key in (("ttft", "ttft_s"), ("e2e", "e2e_s")):
        xs = [r[key] * 1000.0 * speedup for r in ok if r[key] is not None]
        out[f"{name}_ms_mean"] = _r(_mean(xs))
        out[f"{name}_ms_p50"] = _r(quantile(xs, 0.5))
        out[f"{name}_ms_p99"] = _r(quantile(xs, 0.99))
    return out


def lateness(records):
    """How late the generator sent, wall ms: mean, p99, max, and the share of requests
    sent more than 10 ms late."""
    xs = [r["lateness_s"] * 1000.0 for r in records if r["lateness_s"] is not None]
    if not xs:
        return {}
    return {"mean": _r(_mean(xs), 2), "p99": _r(quantile(xs, 0.99), 2), "max": _r(max(xs), 2),
            "share_over_10ms": round(sum(1 for x in xs if x > 10.0) / len(xs), 4)}  # fmt: skip


def throughput(records, requests, speedup):
    """Completed requests and output tokens per model second, from the first send to the
    last finish."""
    out_tokens = {r.index: r.output_tokens for r in requests}
    ok = [r for r in records if r["error"] is None and r["e2e_s"] is not None]
    if not ok:
        return {"throughput_rps": None, "output_tokens_per_s": None}
    start = min(r["sent_s"] for r in ok)
    end = max(r["sent_s"] + r["e2e_s"] for r in ok)
    span_s = max(end - start, 1e-9) * speedup
    return {"throughput_rps": round(len(ok) / span_s, 3),
            "output_tokens_per_s": round(sum(out_tokens[r["i"]] for r in ok) / span_s, 1),
            "span_model_s": round(span_s, 1)}  # fmt: skip


def spread(counts):
    """Per-worker request counts: the list, min, max and max over mean."""
    if not counts:
        return {}
    mean = _mean(counts)
    return {"counts": counts, "min": min(counts), "max": max(counts),
            "max_over_mean": round(max(counts) / mean, 3) if mean else None}  # fmt: skip


def medians(runs):
    """Per router, the median over its rounds of every figure (and of lateness and the
    worker spread); failed runs are counted, not used."""
    by = {}
    for r in runs:
        by.setdefault(r["router"], []).append(r)
    out = {}
    for name, rs in by.items():
        ok = [r for r in rs if "failed" not in r]
        row = {"rounds": len(ok), "failed_rounds": len(rs) - len(ok)}
        if ok:
            for fig in FIGURES:
                xs = [r[fig] for r in ok if r.get(fig) is not None]
                row[fig] = round(statistics.median(xs), 4) if xs else None
            for sub in ("lateness_ms", "worker_requests"):
                for k in ("mean", "p99", "max", "min", "max_over_mean"):
                    xs = [r[sub][k] for r in ok if r.get(sub, {}).get(k) is not None]
                    if xs:
                        row[f"{sub}_{k}"] = round(statistics.median(xs), 3)
            row["errors"] = sum(r["errors"] for r in ok)
        out[name] = row
    return out


def best_peer(routers, peers, fig):
    """(peer, value) best on `fig` among `peers` that have it, or None."""
    higher = FIGURES[fig]
    vals = [(p, routers[p][fig]) for p in peers if routers.get(p, {}).get(fig) is not None]
    if not vals:
        return None
    return max(vals, key=lambda x: x[1]) if higher else min(vals, key=lambda x: x[1])


def against_best_peer(routers, peers, subject="kv"):
    """For every figure, the best peer, its value, and `subject`'s value over it; and
    whether the issue's targets hold (None without a peer)."""
    me = routers.get(subject)
    if not me or me.get("rounds", 0) == 0:
        return {}
    out = {}
    for fig in FIGURES:
        best = best_peer(routers, peers, fig)
        if best is None or me.get(fig) is None:
            continue
        name, value = best
        out[fig] = {"best_peer": name, "best": value, subject: me[fig],
                    "ratio": round(me[fig] / value, 3) if value else None}  # fmt: skip
    met = {}
    for fig, (bound, op) in TARGETS.items():
        ratio = out.get(fig, {}).get("ratio")
        met[fig] = None if ratio is None else (ratio >= bound if op == ">=" else ratio <= bound)
    out["targets"] = {f"{fig} {op} {bound}": met[fig] for fig, (bound, op) in TARGETS.items()}
    known = [v for v in met.values() if v is not None]
    out["all_targets_met"] = bool(known) and all(known) if known else None
    return out


def paired(runs, subject, others):
    """`subject`'s TTFT mean and p99 over each of `others`', request by request within a
    round, with a bootstrap 95% interval over rounds and requests (benches/real_fleet's
    stats.paired_table)."""
    views = [{"policy": r["router"], "round": r["round"], "ttft_ms_by_request": r.get("ttft_ms_by_request")}
             for r in runs if "failed" not in r]  # fmt: skip
    return stats.paired_table(views, subject, others)


TABLE = (("hit_rate", "hit rate", 3), ("ttft_ms_mean", "TTFT mean", 0), ("ttft_ms_p99", "TTFT p99", 0),
         ("worker_ttft_ms_mean", "at worker", 0), ("e2e_ms_mean", "e2e mean", 0), ("e2e_ms_p99", "e2e p99", 0),
         ("throughput_rps", "req/s", 2), ("worker_requests_max_over_mean", "busiest/mean", 2),
         ("lateness_ms_p99", "late p99 ms", 1))  # fmt: skip


def table(routers):
    """The medians as a Markdown table, one row per router."""
    lines = ["| router | " + " | ".join(t for _, t, _ in TABLE) + " |", "|---|" + "---:|" * len(TABLE)]
    for name, row in routers.items():
        cells = []
        for key, _, places in TABLE:
            v = row.get(key)
            cells.append("-" if v is None else f"{v:,.{places}f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
