"""Paired ratios of TTFT between two policies, with bootstrap confidence intervals.

Within a round every policy serves the same requests, so request i of policy A and
request i of policy B form a pair. The ratio of two policies' TTFT mean (or p99) pools
the pairs of every round both ran. Its interval resamples at two levels (seeded): the
rounds, then the pairs within each drawn round. A round's conditions (which engine got
the cores, what ran before it) move all of its requests together, so resampling
requests alone would make the interval far too narrow; with few rounds the interval is
wide, which is the honest answer on this host (three engines on two cores).
"""

import random

RESAMPLES = 2000
SEED = 20261201


def quantile(xs, q):
    """The `q` quantile of `xs` (nearest rank, no interpolation), or None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _rounds(runs, a, b):
    """The pairs of each round both policies ran, one list per round."""
    by = {}
    for r in runs:
        if "failed" not in r and r.get("ttft_ms_by_request"):
            by.setdefault(r["round"], {})[r["policy"]] = r["ttft_ms_by_request"]
    out = []
    for rnd in sorted(by):
        xs, ys = by[rnd].get(a), by[rnd].get(b)
        if xs and ys:
            pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
            if pairs:
                out.append(pairs)
    return out


def _stat(values, which):
    return sum(values) / len(values) if which == "mean" else quantile(values, 0.99)


def _ratio(pairs, which):
    den = _stat([y for _, y in pairs], which)
    return _stat([x for x, _ in pairs], which) / den if den else None


def paired_ratio(runs, a, b, which="mean"):
    """{ratio, ci95, pairs, rounds} of policy `a`'s TTFT `which` (mean or p99) over
    `b`'s, or None with fewer than 10 pairs."""
    rounds = _rounds(runs, a, b)
    pairs = [p for r in rounds for p in r]
    if len(pairs) < 10:
        return None
    point = _ratio(pairs, which)
    rng = random.Random(SEED)

    def resample():
        drawn = [rounds[rng.randrange(len(rounds))] for _ in rounds]
        return _ratio([r[rng.randrange(len(r))] for r in drawn for _ in r], which)

    boot = sorted(x for x in (resample() for _ in range(RESAMPLES)) if x is not None)
    lo, hi = boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]
    return {"ratio": round(point, 3), "ci95": [round(lo, 3), round(hi, 3)], "pairs": len(pairs), "rounds": len(rounds)}


def paired_table(runs, a, others):
    """`a` against each of `others` that ran, for the TTFT mean and p99."""
    out = {}
    for b in others:
        row = {w: paired_ratio(runs, a, b, w) for w in ("mean", "p99")}
        if any(row.values()):
            out[b] = row
    return out
