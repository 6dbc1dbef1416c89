"""Checks of the benchmark's pure analysis: placement ceilings, paired ratios, targets.

Run by scripts/test (python3 -m unittest discover -s benches/real_fleet); standard
library only, so it needs neither vLLM nor the benchmark's venv.
"""

import random
import unittest
import unittest.mock
from types import SimpleNamespace

import analysis
import fleet
import metrics
import placement
import stats

BLOCK = analysis.BLOCK_TOKENS


def item(index, hash_ids, n_tokens=None):
    n_tokens = n_tokens if n_tokens is not None else len(hash_ids) * BLOCK
    return SimpleNamespace(index=index, arrival_s=float(index), hash_ids=tuple(hash_ids),
                           tokens=[0] * n_tokens, group=tuple(hash_ids[:2]))  # fmt: skip


def conversations(pairs, fill, length=4):
    """`pairs` conversations asked twice, with `fill` one-off prompts between the turns."""
    items, next_id = [], 1000
    for c in range(pairs):
        first = [c * 10 + k for k in range(length)]
        items.append(item(len(items), first))
        for _ in range(fill):
            items.append(item(len(items), list(range(next_id, next_id + length))))
            next_id += length
        items.append(item(len(items), first + [next_id]))
        next_id += 1
    return items


class Placement(unittest.TestCase):
    def check(self, items, workers, blocks, want):
        got = placement.ceilings(items, workers, blocks)
        for name, (lo, hi) in want.items():
            # The ceilings are rounded to 4 places.
            self.assertTrue(lo - 5e-5 <= got[name] <= hi + 5e-5, f"{name} = {got[name]}, want {lo}..{hi}: {got}")
        self.assertEqual(got["best_online"], max(got["best_overlap_rr"], got["best_overlap_emptiest"]))

    def test_a_cache_big_enough_for_everything_reaches_every_reuse(self):
        items = conversations(pairs=3, fill=2)
        # Each second turn (5 blocks) hits its first turn's 4.
        reuse = 3 * 4 * BLOCK / sum(len(it.tokens) for it in items)
        self.check(items, 2, 1000, {k: (reuse, reuse) for k in ("best_overlap_rr", "clairvoyant")})

    def test_one_offs_evict_what_an_online_rule_keeps_and_the_clairvoyant_does_not(self):
        items = conversations(pairs=4, fill=5)
        got = placement.ceilings(items, 2, 8)
        self.assertGreater(got["clairvoyant"], got["best_online"], got)

    def test_a_one_block_overlap_is_not_followed(self):
        # Two prompts share only their first block: the second goes elsewhere in turn.
        items = [item(0, [1, 2, 3]), item(1, [1, 7, 8])]
        self.check(items, 2, 100, {"best_overlap_rr": (0.0, 0.0)})

    def test_a_full_prompt_hit_stops_one_block_short(self):
        # vLLM computes the last token, so a repeated 3-block prompt hits 2 blocks.
        items = [item(0, [1, 2, 3]), item(1, [1, 2, 3])]
        self.check(items, 1, 100, {"best_overlap_rr": (2 / 6, 2 / 6)})


class Paired(unittest.TestCase):
    def runs(self, factor, rounds=2, n=150, noise=0.0, seed=1):
        rng, out = random.Random(seed), []
        for rnd in range(rounds):
            base = [rng.uniform(100, 2000) for _ in range(n)]
            kv = [b * factor * (1 + rng.uniform(-noise, noise)) for b in base]
            out += [{"policy": "kv", "round": rnd, "ttft_ms_by_request": kv},
                    {"policy": "peer", "round": rnd, "ttft_ms_by_request": base}]  # fmt: skip
        return out

    def check(self, runs, which, want_ratio, ci_excludes_one):
        got = stats.paired_ratio(runs, "kv", "peer", which)
        self.assertAlmostEqual(got["ratio"], want_ratio, delta=0.02, msg=got)
        lo, hi = got["ci95"]
        self.assertLessEqual(lo, got["ratio"])
        self.assertGreaterEqual(hi, got["ratio"])
        self.assertEqual(not lo <= 1.0 <= hi, ci_excludes_one, got)

    def test_a_uniform_speedup_is_its_ratio_with_a_tight_interval(self):
        self.check(self.runs(0.8), "mean", 0.8, True)
        self.check(self.runs(0.8), "p99", 0.8, True)

    def test_noise_around_no_difference_gives_an_interval_around_one(self):
        self.check(self.runs(1.0, noise=0.5), "mean", 1.0, False)

    def test_rounds_that_disagree_widen_the_interval(self):
        # One round kv is 0.7x, the other 1.3x: each round is tight, the pool is not.
        runs = self.runs(1.0, rounds=2)
        for r in runs:
            if r["policy"] == "kv":
                f = 0.7 if r["round"] == 0 else 1.3
                r["ttft_ms_by_request"] = [x * f for x in r["ttft_ms_by_request"]]
        got = stats.paired_ratio(runs, "kv", "peer")
        lo, hi = got["ci95"]
        self.assertTrue(lo < 0.85 and hi > 1.15, got)
        self.assertEqual(got["rounds"], 2)

    def test_failed_requests_and_missing_rounds_are_left_out(self):
        runs = self.runs(0.5, rounds=1)
        runs[0]["ttft_ms_by_request"][0] = None
        runs.append({"policy": "kv", "round": 7, "ttft_ms_by_request": [1.0] * 150})
        self.assertEqual(stats.paired_ratio(runs, "kv", "peer")["pairs"], 149)
        self.assertIsNone(stats.paired_ratio(runs, "kv", "absent"))


class Ceilings(unittest.TestCase):
    def check(self, peer_hit, pooled, online, reachable):
        policies = {"kv": {"hit_rate": 0.2}, "sglang-router": {"hit_rate": peer_hit}}
        got = analysis.ceilings(policies, {"pooled_lru": pooled, "infinite_cache": 0.3}, {"best_online": online})
        self.assertEqual(got["kv_hit_target_reachable"], reachable, got)
        self.assertAlmostEqual(got["share_of_best_online"]["kv"], round(0.2 / online, 3))

    def test_the_target_is_judged_against_the_higher_of_pooled_and_online(self):
        self.check(peer_hit=0.23, pooled=0.24, online=0.26, reachable=True)
        self.check(peer_hit=0.23, pooled=0.24, online=0.25, reachable=False)
        self.check(peer_hit=0.20, pooled=0.24, online=0.21, reachable=True)


class RouterOverhead(unittest.TestCase):
    def test_each_stage_is_its_sum_over_its_count_and_other_series_are_ignored(self):
        text = "\n".join([
            "# TYPE kvroute_routing_overhead_microseconds histogram",
            'kvroute_routing_overhead_microseconds_bucket{stage="tokenize",le="100.0"} 3',
            'kvroute_routing_overhead_microseconds_sum{stage="tokenize"} 5000.0',
            'kvroute_routing_overhead_microseconds_count{stage="tokenize"} 4',
            'kvroute_routing_overhead_microseconds_sum{stage="route"} 90.0',
            'kvroute_routing_overhead_microseconds_count{stage="route"} 3',
            'kvroute_routing_overhead_microseconds_sum{stage="queue_wait"} 0.0',
            'kvroute_routing_overhead_microseconds_count{stage="queue_wait"} 0',
            'kvroute_ttft_seconds_sum{model="m"} 7.0',
        ])
        self.assertEqual(metrics.overhead_from(text), {"route": 30.0, "tokenize": 1250.0})


class RouterView(unittest.TestCase):
    def test_expected_hits_and_stream_counts_sum_over_workers_and_results(self):
        text = "\n".join([
            'kvroute_cached_tokens_sum{model="m",worker="1"} 30.0',
            'kvroute_cached_tokens_sum{model="m",worker="2"} 10.0',
            'kvroute_prompt_tokens_sum{model="m",worker="1"} 100.0',
            'kvroute_prompt_tokens_sum{model="m",worker="2"} 100.0',
            'kvroute_prompt_tokens_count{model="m",worker="2"} 4',
            'kvroute_kv_events_total{model="m",worker="1",rank="0",result="applied"} 7',
            'kvroute_kv_events_total{model="m",worker="2",rank="0",result="applied"} 5',
            'kvroute_kv_events_total{model="m",worker="2",rank="0",result="dropped"} 1',
            'kvroute_kv_event_gaps_total{model="m",worker="1",rank="0"} 2',
            'kvroute_requests_total{model="m"} 9',
        ])
        self.assertEqual(metrics.router_view_from(text), {"events_applied": 12, "events_dropped": 1, "gaps": 2,
                                                          "expected_hit_rate": 0.2})  # fmt: skip
        self.assertEqual(metrics.router_view_from("kvroute_requests_total 3"), {})


class WorkerLatency(unittest.TestCase):
    def check(self, per_engine, speedup, want):
        deltas = {w: {**dict.fromkeys(metrics.COUNTERS, 0.0), **d} for w, d in per_engine.items()}
        self.assertEqual(metrics.worker_latency(deltas, speedup), want)

    def test_the_workers_means_pool_their_sums_and_counts_in_model_ms(self):
        ttft, e2e = metrics.TTFT_S, metrics.E2E_S
        one = {ttft + "_sum": 0.3, ttft + "_count": 2, e2e + "_sum": 4.0, e2e + "_count": 2}
        two = {ttft + "_sum": 0.1, ttft + "_count": 2, e2e + "_sum": 2.0, e2e + "_count": 2}
        self.check({1: one, 2: two}, 1.0, {"worker_ttft_ms_mean": 100.0, "worker_e2e_ms_mean": 1500.0})
        self.check({1: one, 2: two}, 0.25, {"worker_ttft_ms_mean": 25.0, "worker_e2e_ms_mean": 375.0})
        self.check({1: one}, 1.0, {"worker_ttft_ms_mean": 150.0, "worker_e2e_ms_mean": 2000.0})
        # Workers that time nothing (an older sim-worker) give no figure, not a zero.
        self.check({1: {}, 2: {}}, 1.0, {})


if __name__ == "__main__":
    unittest.main()


class KvrouteConfig(unittest.TestCase):
    ENGINE = SimpleNamespace(id=1, url="http://127.0.0.1:1", gpu_blocks=256, events_port=2, replay_port=3)

    def check(self, cpu_engines, want_retry):
        text = fleet.kvroute_config("kv", [self.ENGINE], "/model", 4, cpu_engines=cpu_engines)
        tables = [line for line in text.splitlines() if line.startswith("[")]
        self.assertEqual("[retry]" in tables, want_retry, text)
        if want_retry:
            self.assertIn("first_byte_timeout_base_ms = 120000", text)

    def test_cpu_engines_get_a_first_byte_timeout_sized_for_them(self):
        self.check(cpu_engines=True, want_retry=True)
        self.check(cpu_engines=False, want_retry=False)

    def test_cpu_engines_get_the_cpu_timing_unless_a_line_names_one(self):
        def timing(cpu_engines, extra=()):
            text = fleet.kvroute_config("kv", [self.ENGINE], "/model", 4, router_extra=extra, cpu_engines=cpu_engines)
            router_table = text.split("[router]")[1].split("[[models]]")[0]
            return [line for line in router_table.splitlines() if line.startswith("engine_timing")]

        self.assertEqual(timing(True), ['engine_timing = "vllm-cpu"'])
        self.assertEqual(timing(False), [])
        self.assertEqual(timing(True, ['engine_timing = "gpu"']), ['engine_timing = "gpu"'])

    def test_model_lines_land_in_the_models_table(self):
        text = fleet.kvroute_config("kv", [self.ENGINE], "/model", 4, model_extra=["forward_token_ids = true"])
        model_table = text.split("[[models]]")[1].split("[[workers]]")[0]
        self.assertIn("forward_token_ids = true", model_table)
        self.assertNotIn("forward_token_ids", text.replace(model_table, ""))


class TokenizingCost(unittest.TestCase):
    def test_the_saving_is_the_median_of_the_pairs_not_the_difference_of_medians(self):
        import profile_engine

        # Medians 20 and 12 differ by 8; the pairs' differences are 1, 1 and 18.
        got = profile_engine.paired([20.0, 30.0, 10.0], [19.0, 12.0, 9.0])
        self.assertEqual(got, {"text_ms": 20.0, "ids_ms": 12.0, "saved_ms": 1.0, "pairs": 3})


class PeerArgv(unittest.TestCase):
    """Each peer's command line: its policy, its own flags, then every worker."""

    ENGINES = [SimpleNamespace(url=f"http://127.0.0.1:{p}", events_port=p + 1, replay_port=p + 2) for p in (9000, 9100)]
    PROGRAMS = {"KVROUTE_SGLANG_ROUTER_PYTHON": "python", "KVROUTE_SMG": "smg", "KVROUTE_VLLM_ROUTER": "vllm-router"}

    def check(self, name, policy, flags):
        with unittest.mock.patch.dict("os.environ", self.PROGRAMS):
            argv = fleet.peer_argv(name, self.ENGINES, 4242)
        self.assertEqual(argv[argv.index("--policy") + 1], policy, argv)
        urls = argv.index("--worker-urls")
        self.assertEqual(argv[urls + 1:urls + 3], [e.url for e in self.ENGINES], argv)
        for flag, value in flags:
            at = argv.index(flag)
            self.assertLess(at, urls, argv)
            self.assertEqual(argv[at + 1], value, argv)
        if not flags:
            self.assertNotIn("--load-monitor-interval", argv)

    def test_each_peer_runs_its_policy_with_its_own_flags(self):
        self.check("smg", "cache_aware", [])
        self.check("smg-poll-1s", "cache_aware", [("--load-monitor-interval", "1")])
        self.check("sglang-router", "cache_aware", [])
        self.check("vllm-router-kv-aware", "kv_aware", [])
