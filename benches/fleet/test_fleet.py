"""Checks of the fleet benchmark's pure parts: workload generation (seeded, with the
prefix structure each workload promises), the tokenizer, the figures and the load
generator against a real socket. Standard library only:

    python3 -m unittest discover -s benches/fleet
"""

import asyncio
import contextlib
import io
import json
import signal
import subprocess
import sys
import tempfile
import threading
import unittest
from types import SimpleNamespace
from unittest import mock
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "real_fleet"))
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
import floors  # noqa: E402
import loadgen  # noqa: E402
import multimodal  # noqa: E402
import overhead  # noqa: E402
import replay_sweep  # noqa: E402
import report  # noqa: E402
import simfleet  # noqa: E402
import workloads  # noqa: E402
import words  # noqa: E402

VOCAB = words.Vocab.generated()


def gen(kind, seed=1, n=120, **kw):
    return workloads.generate(workloads.Spec(kind=kind, seed=seed, requests_max=n, **kw), VOCAB)


def is_prefix(a, b):
    return len(a) <= len(b) and tuple(b[: len(a)]) == tuple(a)


class Determinism(unittest.TestCase):
    def check(self, kind, **kw):
        a, b = gen(kind, seed=5, **kw), gen(kind, seed=5, **kw)
        self.assertEqual(a, b)
        self.assertEqual(workloads.fingerprint(a), workloads.fingerprint(b))
        self.assertNotEqual(workloads.fingerprint(a), workloads.fingerprint(gen(kind, seed=6, **kw)))

    def test_the_same_seed_makes_the_same_requests(self):
        for kind in ("conversation", "agentic", "shared-doc"):
            with self.subTest(kind=kind):
                self.check(kind)

    def test_a_trace_read_twice_is_the_same_workload(self):
        self.check("trace", trace=workloads.BUNDLED_TRACE)


class Shapes(unittest.TestCase):
    def test_conversation_hash_ids_become_128_words_and_outputs_a_quarter(self):
        reqs = gen("conversation", n=60)
        recs = workloads.read_trace(workloads.BUNDLED_TRACE, 60)
        for r, (_, input_length, output_length, hash_ids) in zip(reqs, recs):
            self.assertEqual(len(r.tokens), min(len(hash_ids) * 128, -(-input_length // 4)))
            self.assertEqual(r.output_tokens, max(1, output_length // 4))
        # Records 0 and 1 share hash id 0 and nothing after it.
        self.assertEqual(recs[0][3][0], recs[1][3][0])
        self.assertEqual(reqs[0].tokens[:128], reqs[1].tokens[:128])
        self.assertNotEqual(reqs[0].tokens[128:256], reqs[1].tokens[128:256])

    def test_an_agent_call_extends_the_context_of_the_call_before(self):
        reqs = gen("agentic", n=300)
        follow = [r for r in reqs if r.after is not None]
        self.assertGreater(len(follow), 100)
        for r in follow:
            prev = reqs[r.after]
            self.assertEqual((prev.group, prev.session), (r.group, r.session))
            self.assertTrue(is_prefix(prev.tokens, r.tokens) and len(r.tokens) > len(prev.tokens))
            self.assertGreater(r.gap_s, 0.0)
        # Programs of one type share the system prompt and tools (900+ words).
        by_type = {}
        for r in reqs:
            if r.after is None:
                by_type.setdefault(r.session.split("-")[1], []).append(r)
        shared = [rs for rs in by_type.values() if len(rs) > 1]
        self.assertTrue(shared)
        for rs in shared:
            self.assertEqual(rs[0].tokens[:900], rs[1].tokens[:900])

    def test_questions_on_one_document_share_it(self):
        reqs = gen("shared-doc", n=200)
        by_doc = {}
        for r in reqs:
            by_doc.setdefault(r.group, []).append(r)
        self.assertLessEqual(len(by_doc), workloads.DOC_COUNT)
        for rs in by_doc.values():
            for r in rs[1:]:
                common = len(rs[0].tokens) - workloads.DOC_QUESTION_WORDS[1]
                self.assertEqual(r.tokens[:common], rs[0].tokens[:common])
        self.assertTrue(all(b.arrival_s > a.arrival_s for a, b in zip(reqs, reqs[1:])))

    def test_a_capped_prompt_cuts_the_document_and_keeps_the_question(self):
        # The real fleet's sizes: documents of 375-1,125 words under a 384-token cap.
        reqs = gen("shared-doc", n=200, size_scale=0.125, prompt_tokens_max=384)
        by_doc = {}
        for r in reqs:
            by_doc.setdefault(r.group, []).append(r.tokens)
        asked_twice = [ps for ps in by_doc.values() if len(ps) > 1]
        self.assertTrue(asked_twice)
        for ps in asked_twice:
            self.assertTrue(all(len(p) <= 384 for p in ps))
            self.assertEqual(len(set(ps)), len(ps), "two questions on one document made one prompt")
            shared = 384 - round(workloads.DOC_QUESTION_WORDS[1] * 0.125)  # the longest question
            self.assertTrue(all(p[:shared] == ps[0][:shared] for p in ps))

    def test_scaling_the_rate_divides_arrivals_and_keeps_think_time(self):
        reqs = gen("agentic", n=50)
        fast = workloads.scaled(reqs, 4.0)
        for a, b in zip(reqs, fast):
            self.assertAlmostEqual(b.arrival_s, a.arrival_s / 4.0)
            self.assertEqual(b.gap_s, a.gap_s)
        with self.assertRaises(ValueError):
            workloads.scaled(reqs, 0)

    def test_a_missing_or_broken_trace_is_a_clear_error(self):
        with self.assertRaises(SystemExit) as e:
            gen("trace", trace=Path("no/such/trace.jsonl"))
        self.assertIn("--trace", str(e.exception))
        with tempfile.TemporaryDirectory() as d:
            bad = Path(d, "bad.jsonl")
            bad.write_text('{"timestamp": 0}\n')
            with self.assertRaises(SystemExit) as e:
                gen("trace", trace=bad)
            self.assertIn("line 1", str(e.exception))

    def test_the_replay_trace_gives_equal_prefixes_equal_ids(self):
        reqs = gen("shared-doc", n=40)
        recs = workloads.to_mooncake(reqs)
        by_len = sorted(recs, key=lambda x: x["input_length"])
        ids = [set(r["hash_ids"]) for r in recs]
        self.assertTrue(any(a & b for a in ids for b in ids if a is not b))
        self.assertEqual(by_len[0]["input_length"], min(len(r.tokens) for r in reqs))


    def test_the_replay_trace_sends_a_follow_up_its_delay_after_the_call_before(self):
        for kind in ("agentic", "multimodal"):
            reqs = gen(kind, n=60)
            recs = workloads.to_mooncake(reqs)
            follows = [r for r in reqs if r.after is not None]
            self.assertTrue(follows, kind)
            # Each delayed record's session has a record before it: the call it follows.
            last, chained = {}, 0
            for rec in recs:
                sid = rec.get("session_id")
                if "delay" in rec:
                    self.assertIn(sid, last, (kind, rec))
                    self.assertGreaterEqual(rec["delay"], 0.0)
                    chained += 1
                if sid is not None:
                    last[sid] = rec
            self.assertEqual(chained, len(follows), kind)
            self.assertEqual(sorted(rec["delay"] for rec in recs if "delay" in rec),
                             sorted(round(r.gap_s * 1000.0, 3) for r in follows))  # fmt: skip
        # Only the agent programs' ids are the fleet's session headers, and every call
        # of a program carries its id into the trace.
        agents = gen("agentic", n=20)
        self.assertTrue(all(r.session for r in agents))
        self.assertEqual(sorted(rec["session_id"] for rec in workloads.to_mooncake(agents)),
                         sorted(r.session for r in agents))  # fmt: skip
        self.assertFalse(any(r.session for r in gen("multimodal", n=20)))


def png_facts(data):
    """(width, height, pixel bytes) of a PNG, every chunk's CRC checked."""
    import struct
    import zlib

    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    at, chunks = 8, {}
    while at < len(data):
        (n,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + n]
        assert struct.unpack(">I", data[at + 8 + n : at + 12 + n])[0] == zlib.crc32(kind + body), kind
        chunks[kind] = chunks.get(kind, b"") + body
        at += 12 + n
    w, h, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2)
    return w, h, zlib.decompress(chunks[b"IDAT"])


class Multimodal(unittest.TestCase):
    def test_the_same_seed_makes_the_same_conversations_and_images(self):
        a, b = gen("multimodal", seed=5, n=200), gen("multimodal", seed=5, n=200)
        self.assertEqual(a, b)
        self.assertNotEqual(workloads.fingerprint(a), workloads.fingerprint(gen("multimodal", seed=6, n=200)))
        self.assertEqual(multimodal.image(5, 3), multimodal.image(5, 3))
        self.assertNotEqual(multimodal.image(5, 3), multimodal.image(6, 3))

    def test_images_are_valid_pngs_of_seeded_sizes(self):
        for i in range(6):
            w, h, pixels = png_facts(multimodal.image(1, i))
            self.assertTrue(all(lo <= x <= hi for x, (lo, hi) in ((w, multimodal.MM_IMAGE_SIDE_PX),
                                                                  (h, multimodal.MM_IMAGE_SIDE_PX))))  # fmt: skip
            self.assertEqual(len(pixels), h * (1 + 3 * w))

    def test_every_turn_resends_its_conversations_images_and_grows_the_history(self):
        reqs = gen("multimodal", n=400)
        follow = [r for r in reqs if r.after is not None]
        self.assertGreater(len(follow), 200)
        for r in follow:
            prev = reqs[r.after]
            self.assertEqual(prev.group, r.group)
            self.assertEqual(r.chat[: len(prev.chat)], prev.chat, "the history is resent as it was")
            self.assertEqual(r.chat[1][2], prev.chat[1][2], "with the same images")
            self.assertTrue(is_prefix(prev.tokens, r.tokens) and len(r.tokens) > len(prev.tokens))
        images = {}
        for r in reqs:
            images.setdefault(r.group, set()).update(i for _, _, ims in r.chat for i in ims)
        counts = [len(ims) for ims in images.values()]
        self.assertEqual((min(counts), max(counts)), multimodal.MM_IMAGES)
        seen = [i for ims in images.values() for i in ims]
        self.assertEqual(len(seen), len(set(seen)), "no image is in two conversations")
        pngs = {multimodal.image(1, i) for i in seen}
        self.assertEqual(len(pngs), len(seen), "different images are different bytes")

    def test_tokens_are_the_prompt_the_workers_hold(self):
        r = gen("multimodal", n=3)[1]
        msgs = multimodal.messages(r.chat, VOCAB, 1)
        parts = msgs[1]["content"]
        self.assertEqual([p["type"] for p in parts[:-1]], ["image_url"] * len(r.chat[1][2]))
        self.assertTrue(parts[0]["image_url"]["url"].startswith("data:image/png;base64,"))
        words_sent = sum(len((m["content"] if isinstance(m["content"], str) else m["content"][-1]["text"]).split())
                         for m in msgs)  # fmt: skip
        images = len(r.chat[1][2])
        # One role word per message, the words, each image's placeholders, "assistant".
        self.assertEqual(len(r.tokens), len(msgs) + words_sent + images * multimodal.IMAGE_TOKENS + 1)
        self.assertEqual(r.tokens.count(-1), multimodal.IMAGE_TOKENS)
        body = json.loads(multimodal.chat_body("m", msgs, 7))
        self.assertEqual((body["max_tokens"], body["stream"], len(body["messages"])), (7, True, len(msgs)))

    def test_the_model_folder_is_a_llava_with_an_image_word(self):
        with tempfile.TemporaryDirectory() as d:
            text_words = multimodal.write_model_dir(Path(d))
            tok = json.loads(Path(d, "tokenizer.json").read_text())
            config = json.loads(Path(d, "config.json").read_text())
        self.assertEqual(tok["model"]["vocab"][multimodal.IMAGE_WORD], len(text_words))
        self.assertEqual((config["model_type"], config["image_token_index"]), ("llava", len(text_words)))
        self.assertNotIn(multimodal.IMAGE_WORD, text_words, "prompts never draw the image word")
        side, patch = config["vision_config"]["image_size"], config["vision_config"]["patch_size"]
        self.assertEqual((side // patch) ** 2, multimodal.IMAGE_TOKENS)


    def test_a_model_with_smaller_images_counts_its_own_placeholders(self):
        # The real fleet's generated LLaVA: 112-pixel images in 14-pixel patches.
        with tempfile.TemporaryDirectory() as d:
            config = {"vision_config": {"image_size": 112, "patch_size": 14}}
            Path(d, "config.json").write_text(json.dumps(config))
            per_image = multimodal.tokens_per_image(Path(d))
        self.assertEqual(per_image, 64)
        big, small = gen("multimodal", n=40), gen("multimodal", n=40, tokens_per_image=per_image)
        self.assertEqual([r.chat for r in big], [r.chat for r in small], "the same chats")
        for b, s in zip(big, small):
            images = sum(len(ims) for _, _, ims in s.chat)
            self.assertEqual(s.tokens.count(-1), 64 if 0 in s.chat[1][2] else 0)
            self.assertEqual(len(b.tokens) - len(s.tokens), images * (multimodal.IMAGE_TOKENS - 64))

    def test_the_real_fleet_takes_the_multimodal_workload(self):
        with mock.patch.object(bench, "host_cores", return_value=8):
            args = bench.parse_args(["--fleet", "real", "--workload", "multimodal"])
        self.assertEqual((args.workers, args.prompt_tokens_max, args.output_tokens_max), (3, 384, 8))
        self.assertEqual(args.vlm_text, "test")

    def test_the_real_fleets_vlm_shares_the_tests_folder_unless_it_is_the_bigger_one(self):
        calls = []
        done = SimpleNamespace(returncode=0, stdout="")
        env = {"KVROUTE_VLLM_VLM_DIR": "/models/vlm", "KVROUTE_VLLM_PYTHON": "/venv/python"}
        with mock.patch.dict(bench.fleet.os.environ, env), \
                mock.patch.object(bench.fleet.subprocess, "run", lambda argv, **kw: calls.append(argv) or done):
            small, big = bench.fleet.vlm_model(), bench.fleet.vlm_model(text="fleet")
        self.assertEqual((small, big), (Path("/models/vlm/llava"), Path("/models/vlm/llava-fleet")))
        self.assertEqual([c[0] for c in calls], ["/venv/python"] * 2)
        self.assertEqual([c[c.index("--text") + 1] for c in calls], ["test", "fleet"])
        self.assertEqual([c[c.index("--out") + 1] for c in calls], [str(small), str(big)])


class Tokenizer(unittest.TestCase):
    def test_every_word_is_one_lowercase_token(self):
        vocab = words.vocabulary()
        self.assertEqual(len(vocab), words.VOCAB_SIZE)
        self.assertEqual(len(set(vocab)), len(vocab))
        self.assertTrue(all(w.isalpha() and w.islower() for w in vocab[1:]))
        with tempfile.TemporaryDirectory() as d:
            words.write_model_dir(Path(d))
            tok = json.loads(Path(d, "tokenizer.json").read_text())
            self.assertEqual(tok["model"]["vocab"][vocab[42]], 42)
            self.assertEqual(tok["pre_tokenizer"]["type"], "WhitespaceSplit")
        ids = [5, 9, 5, 8000]
        self.assertEqual(VOCAB.text(ids).split(" "), [vocab[i] for i in ids])


def rec(i, ttft, e2e, sent=0.0, late=0.0, error=None):
    return {"i": i, "sent_s": sent, "lateness_s": late, "worker": None, "ttft_s": ttft, "e2e_s": e2e, "error": error}


class Figures(unittest.TestCase):
    def test_latency_is_model_time_and_skips_failures(self):
        recs = [rec(0, 0.01, 0.1), rec(1, 0.03, 0.3), rec(2, 9.0, 9.0, error="HTTP 500")]
        got = report.latency(recs, speedup=10.0)
        self.assertEqual((got["ttft_ms_mean"], got["e2e_ms_mean"]), (200.0, 2000.0))
        self.assertEqual(got["ttft_ms_p99"], 300.0)

    def test_lateness_and_throughput(self):
        reqs = gen("shared-doc", n=4)
        recs = [rec(i, 0.1, 1.0, sent=float(i), late=x) for i, x in enumerate((0.0, 0.002, 0.02, 0.05))]
        late = report.lateness(recs)
        self.assertEqual((late["max"], late["share_over_10ms"]), (50.0, 0.5))
        got = report.throughput(recs, reqs, speedup=2.0)
        # Sends at 0..3 s, the last finishing at 4 s: 4 requests over 8 model seconds.
        self.assertEqual(got["throughput_rps"], 0.5)
        self.assertEqual(got["output_tokens_per_s"], round(sum(r.output_tokens for r in reqs) / 8.0, 1))

    def test_medians_over_rounds_and_kv_against_the_best_peer_per_figure(self):
        def run(router, rnd, hit, ttft, e2e):
            r = {"router": router, "round": rnd, "hit_rate": hit, "ttft_ms_mean": ttft, "ttft_ms_p99": ttft * 4,
                 "worker_ttft_ms_mean": ttft * 0.9, "e2e_ms_mean": e2e, "errors": 0,
                 "worker_requests": report.spread([3, 5])}  # fmt: skip
            return r

        runs = [run("kv", 0, 0.2, 100, 1000), run("kv", 1, 0.4, 300, 1000), run("kv", 2, 0.3, 200, 900),
                run("a", 0, 0.5, 400, 800), run("b", 0, 0.1, 150, 2000), {"router": "b", "failed": "x"}]  # fmt: skip
        med = report.medians(runs)
        self.assertEqual((med["kv"]["hit_rate"], med["kv"]["ttft_ms_mean"], med["kv"]["rounds"]), (0.3, 200, 3))
        self.assertEqual((med["b"]["rounds"], med["b"]["failed_rounds"]), (1, 1))
        self.assertEqual(med["kv"]["worker_requests_max_over_mean"], 1.25)
        got = report.against_best_peer(med, ["a", "b"])
        self.assertEqual((got["hit_rate"]["best_peer"], got["hit_rate"]["ratio"]), ("a", 0.6))
        self.assertEqual((got["ttft_ms_mean"]["best_peer"], got["ttft_ms_mean"]["ratio"]), ("b", 1.333))
        self.assertEqual((got["e2e_ms_mean"]["best_peer"], got["e2e_ms_mean"]["ratio"]), ("a", 1.25))
        self.assertEqual((got["worker_ttft_ms_mean"]["best_peer"], got["worker_ttft_ms_mean"]["ratio"]), ("b", 1.333))
        self.assertFalse(got["all_targets_met"])
        rows = report.table(med).splitlines()
        self.assertEqual(len(rows), 2 + 3)
        self.assertTrue(rows[2].startswith("| kv | 0.300 | 200 | 800 | 180 | 1,000 | - | - | 1.25 |"), rows[2])
        self.assertEqual(report.against_best_peer(med, []).get("all_targets_met"), None)


    def test_paired_ttft_compares_request_by_request(self):
        base = [100.0 + 10 * i for i in range(40)]
        runs = [{"router": "kv", "round": 0, "ttft_ms_by_request": [x * 0.5 for x in base]},
                {"router": "peer", "round": 0, "ttft_ms_by_request": base}, {"router": "x", "failed": "y"}]  # fmt: skip
        got = report.paired(runs, "kv", ["peer", "x"])
        self.assertEqual(got["peer"]["mean"]["ratio"], 0.5)
        self.assertNotIn("x", got)


class Overhead(unittest.TestCase):
    def test_each_router_is_its_medians_less_the_workers_own(self):
        seen = {overhead.DIRECT: {100: [(2.0, 3.0), (1.0, 9.0), (3.0, 4.0)]},
                "kv": {100: [(2.5, 3.5), (9.0, 9.0), (2.0, 4.0)]}}
        got = overhead.summarize(seen)
        self.assertEqual(got[overhead.DIRECT]["100"], {"ttft_ms_p50": 2.0, "e2e_ms_p50": 4.0})
        self.assertEqual(got["kv"]["100"], {"ttft_ms_p50": 2.5, "e2e_ms_p50": 4.0, "added_ttft_ms": 0.5,
                                            "added_e2e_ms": 0.0})  # fmt: skip

    def test_a_fresh_run_sends_a_new_prompt_of_the_size_every_time(self):
        def prompts(fresh):
            body_for = overhead.bodies(VOCAB, 1, fresh)
            return [json.loads(body_for(size))["prompt"] for size in (50, 50, 50, 80)]

        for fresh, distinct in ((False, 2), (True, 4)):
            got = prompts(fresh)
            self.assertEqual(len(set(got)), distinct, fresh)
            self.assertEqual([len(p.split(" ")) for p in got], [50, 50, 50, 80])

    def test_a_routers_cpu_counts_its_group_children_too(self):
        import fleet
        import time

        # A parent that sleeps while its child spins 0.3 s of CPU.
        spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
        argv = [sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {spin!r}]); time.sleep(30)"]
        with tempfile.TemporaryDirectory() as tmp:
            p = fleet.Proc("spin", argv, None, Path(tmp))
            try:
                deadline = time.monotonic() + 20
                while (p.cpu_s() or 0) < 0.3 and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.assertGreaterEqual(p.cpu_s(), 0.3)
                self.assertLess(p.cpu_s(), 5.0)
            finally:
                p.stop()

    def test_engines_sharing_a_core_are_flagged(self):
        for workers, cores, share, warned in [(3, 2, 0.67, True), (2, 2, 1.0, False), (1, 4, 4.0, False)]:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                self.assertEqual(bench.cores_per_engine(workers, cores), share)
            self.assertEqual("warning" in err.getvalue(), warned, (workers, cores))

    def test_the_real_fleet_gives_each_engine_a_core_unless_told(self):
        # (cores, argv) -> (workers, rate): the rate per engine stays 0.5 / 3.
        rows = [(2, [], 2, 0.333), (1, [], 1, 0.167), (8, [], 3, 0.5), (2, ["--workers", "3"], 3, 0.5),
                (2, ["--rate", "0.9"], 2, 0.9), (4, ["--workers", "2", "--rate", "0.1"], 2, 0.1)]
        for cores, extra, workers, rate in rows:
            with mock.patch.object(bench, "host_cores", return_value=cores):
                args = bench.parse_args(["--fleet", "real", *extra])
            self.assertEqual((args.workers, args.rate), (workers, rate), (cores, extra))
        with mock.patch.object(bench, "host_cores", return_value=2):
            self.assertEqual(bench.parse_args([]).workers, 8)
        with contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            bench.parse_args(["--fleet", "real", "--workers", "0"])

    def test_the_real_fleet_warms_its_engines_on_the_first_calls(self):
        # --warm-up defaults to 4 on the real fleet, 0 on the sim fleet (fresh workers per run).
        self.assertEqual([bench.parse_args(a).warm_up for a in ([], ["--fleet", "real"], ["--fleet", "real",
                          "--warm-up", "0"])], [0, 4, 0])  # fmt: skip
        with contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            bench.parse_args(["--fleet", "real", "--warm-up", "-1"])
        # (index, arrival, after): follow-ups wait for a call, so only first calls warm, in arrival order.
        rows = [(0, 5.0, None), (1, 0.0, 0), (2, 1.0, None), (3, 1.0, None), (4, 0.5, None)]
        reqs = [workloads.Request(i, t, (i,), 1, "g", after=a) for i, t, a in rows]
        warm = bench.warm_requests(reqs, 3)
        self.assertEqual([(r.index, r.arrival_s, r.after) for r in warm], [(4, 0.0, None), (2, 0.0, None),
                                                                           (3, 0.0, None)])  # fmt: skip
        self.assertEqual(len(bench.warm_requests(reqs, 10)), 4)

    def test_a_missing_kvroute_binary_is_a_clear_error(self):
        with self.assertRaises(SystemExit):
            overhead.parse_args(["--kvroute", "/nonexistent/kvroute"])

    def test_a_router_starts_from_what_each_caller_gives(self):
        # overhead.py passes only the binary; bench.py the workload and fleet too. Each
        # must reach `kvroute serve`'s config (once, overhead.py crashed on a field only
        # bench.py's arguments had).
        import bench

        seen = []
        with mock.patch.object(bench.fleet, "start_kvroute", lambda *a, **kw: seen.append((a, kw)) or ("p", "u")):
            self.assertEqual(bench.start_router("kv", "bin/kvroute", ["w"], Path("logs")), ("p", "u"))
            bench.start_router("kv-excess4", "bin/kvroute", ["w"], Path("logs"), "multimodal", True)
            bench.start_router("kv-ids", "bin/kvroute", ["w"], Path("logs"))
            bench.start_router("kv-trusting", "bin/kvroute", ["w"], Path("logs"), "multimodal", True)
        (a0, kw0), (a1, kw1), (a2, kw2), (a3, kw3) = seen
        self.assertEqual((a0[:2], kw0["sections"], kw0["cpu_engines"], kw0["router_extra"]),
                         (("bin/kvroute", "kv"), (), False, []))  # fmt: skip
        self.assertEqual((a1[1], kw1["cpu_engines"], kw1["router_extra"]), ("kv", True, ["excess_requests_min = 4"]))
        self.assertIn("[media]", kw1["sections"])
        # Prompts go on as token ids only in the variant that asks for it.
        self.assertEqual([kw["model_extra"] for kw in (kw0, kw1, kw2)], [[], [], ["forward_token_ids = true"]])
        self.assertEqual(a2[1], "kv")
        # A variant's own table comes after the workload's.
        self.assertEqual((a3[1], kw3["sections"][0], kw3["sections"][-2:]), ("kv", "[media]", ("[learn]", "doubt_scale_min = 0")))


class Floors(unittest.TestCase):
    SHAPE = simfleet.Shape(block_size=4, blocks_per_worker=10, max_batched_tokens=8)

    def req(self, i, tokens, out=1):
        return workloads.Request(index=i, arrival_s=float(i), tokens=tuple(tokens), output_tokens=out, group="g")

    def check(self, prompts, workers, want_cached):
        reqs = [self.req(i, p) for i, p in enumerate(prompts)]
        got = floors.cached_tokens(reqs, self.SHAPE.block_size, workers * self.SHAPE.blocks_per_worker)
        self.assertEqual(got, want_cached)

    def test_the_cache_holds_earlier_full_blocks_never_the_whole_prompt(self):
        a = list(range(12))
        # The second copy of a 3-block prompt finds 2 blocks: its last token is computed.
        self.check([a, a], 1, [0, 8])
        # A longer prompt over it finds all 3; another prefix finds nothing.
        self.check([a, a + [50, 51, 52, 53, 54]], 1, [0, 12])
        self.check([a, [99] + a], 1, [0, 0])
        # A 1-worker pool of 10 blocks: three 4-block prompts evict the first one's last
        # two blocks (the tail goes first); its first two are still there.
        others = [[100 + k] * 16 for k in range(2)]
        self.check([a + [7, 7, 7, 7]] + others + [a + [7, 7, 7, 7]], 1, [0, 0, 0, 8])
        # Two workers pool 20 blocks: it is still there.
        self.check([a + [7, 7, 7, 7]] + others + [a + [7, 7, 7, 7]], 2, [0, 0, 0, 12])

    def test_the_floors_follow_the_reference_timing(self):
        a = list(range(20))
        reqs = [self.req(0, a, out=3), self.req(1, a, out=1)]
        got = floors.floors(reqs, self.SHAPE, workers=1)
        # 20 tokens in passes of 8: 2 x f_p(8) + f_p(4); then 16 cached leave 4: f_p(4).
        first, second = 2 * floors.pass_ms(8) + floors.pass_ms(4), floors.pass_ms(4)
        self.assertAlmostEqual(got["ttft_ms_mean"], (first + second) / 2)
        # Two more tokens for the first at 5 of 10 blocks: f_d(0.5) = -6.435 + 27.005 + 5.74 = 26.31 each.
        self.assertAlmostEqual(floors.step_ms(0.5), 26.31)
        self.assertAlmostEqual(got["e2e_ms_mean"], (first + 2 * 26.31 + second) / 2)
        self.assertEqual(got["ttft_ms_p99"], first)

    def test_a_ratio_target_below_the_floor_is_out_of_reach(self):
        against = {"ttft_ms_mean": {"best": 100.0}, "e2e_ms_mean": {"best": 1000.0}, "hit_rate": {"best": 0.3}}
        got = floors.reach({"ttft_ms_mean": 85.0, "e2e_ms_mean": 900.0}, against, report.TARGETS)
        self.assertEqual(got["ttft_ms_mean"]["floor_over_best_peer"], 0.85)
        self.assertTrue(got["ttft_ms_mean"]["out_of_reach"])
        self.assertFalse(got["e2e_ms_mean"]["out_of_reach"])
        self.assertNotIn("hit_rate", got, "a >= target has no floor")


class ReplayMedians(unittest.TestCase):
    def test_each_figure_and_the_tail_is_a_median_over_runs(self):
        run = lambda v, e2e_p99, out_tps, pw: dict(variant=v, hits=0.5, ttft_mean=10.0, ttft_p99=20.0,
                                                   e2e_mean=100.0, e2e_p99=e2e_p99, out_tps=out_tps, per_worker=pw)  # fmt: skip
        runs = [run("kv", 300.0, 50.0, [3, 1]), run("kv", 500.0, 70.0, [2, 2]), run("kv", 400.0, 60.0, [4, 0])]
        got = replay_sweep.medians(runs)["kv"]
        # Busiest over the mean per run: 1.5, 1.0 and 2.0.
        self.assertEqual((got["e2e_p99"], got["out_tps"], got["busiest"]), (400.0, 60.0, 1.5))
        self.assertEqual(got["hits"], 0.5)


class ReplayReal(unittest.TestCase):
    def test_the_real_fleets_trace_is_what_bench_sends_it(self):
        # Two servers: 100 requests at 0.333 times the workload's rate, prompts cut to
        # 384 tokens and 8 output tokens, agent programs with their session ids.
        with tempfile.TemporaryDirectory() as tmp:
            paths, headers = replay_sweep.traces("agentic", "real", [3], VOCAB, tmp, workers=2, real=True)
            recs = [json.loads(line) for line in paths[0].read_text().splitlines()]
            sim = workloads.scaled(gen("agentic", seed=3, n=100), bench.RATES["agentic"]["busy"] * 2 / 8)
        self.assertTrue(headers)
        self.assertEqual(len(recs), 100)
        self.assertLessEqual(max(r["input_length"] for r in recs), 384)
        self.assertLessEqual(max(r["output_length"] for r in recs), 8)
        # Program starts span about 6 times the sim trace's (rate 0.333 against 2).
        span = max(r["timestamp"] for r in recs if "delay" not in r) / 1000
        self.assertGreater(span, 3 * max(q.arrival_s for q in sim if q.after is None))


class Regret(unittest.TestCase):
    def check(self, choices, want):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "regret.jsonl"
            path.write_text("".join(json.dumps(dict(variant="kv", seed=0, id=i, **c)) + "\n" for i, c in enumerate(choices)))
            self.assertEqual(replay_sweep.regret_summary(path)["kv"], want)

    def test_regret_is_the_mean_gap_over_the_mean_choice(self):
        # 40 and 60 ms chosen where 40 and 50 were best: means 50 and 45, so 5 ms of 50
        # is 10%; one choice of two was not the best. A queued request (no time) is left out.
        best, slower, queued = (dict(chosen_ms=40.0, best_ms=40.0), dict(chosen_ms=60.0, best_ms=50.0),
                                dict(chosen_ms=None, best_ms=30.0))  # fmt: skip
        self.check([best, slower, queued], {"requests": 2, "chosen_ttft_ms": 50.0, "best_ttft_ms": 45.0,
                                            "regret_share": 0.1, "not_best_share": 0.5})  # fmt: skip
        # Within 1 ms counts as the best.
        self.check([dict(chosen_ms=40.5, best_ms=40.0)], {"requests": 1, "chosen_ttft_ms": 40.5,
                                                           "best_ttft_ms": 40.0, "regret_share": 0.0123,
                                                           "not_best_share": 0.0})  # fmt: skip


class Signals(unittest.TestCase):
    def test_sigterm_unwinds_so_the_servers_are_stopped(self):
        with tempfile.TemporaryDirectory() as tmp:
            marker = Path(tmp) / "stopped"
            code = (f"import sys, time; sys.path.insert(0, {str(HERE.parent / 'real_fleet')!r}); import fleet\n"
                    "fleet.stop_on_sigterm()\n"
                    "try:\n    print('ready', flush=True); time.sleep(30)\n"
                    f"finally:\n    open({str(marker)!r}, 'w').write('stopped')\n")  # fmt: skip
            p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            self.assertEqual(p.stdout.readline().strip(), "ready")
            p.send_signal(signal.SIGTERM)
            self.assertEqual(p.wait(timeout=10), 128 + signal.SIGTERM)
            p.stdout.close()
            self.assertTrue(marker.exists(), "the finally block did not run")


class LoadGenerator(unittest.TestCase):
    """A real server on 127.0.0.1 that streams chunked SSE and records what it got."""

    def test_open_loop_sends_follow_ups_after_their_call_and_reads_the_stream(self):
        seen = []

        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            body = json.loads(await reader.readexactly(length))
            session = [h for h in head.split(b"\r\n") if h.lower().startswith(b"x-session-id")]
            seen.append((body["prompt"], session[0].split(b": ")[1].decode() if session else None))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-kvroute-worker: 3\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
            for ev in (b'data: {"choices":[{"text":"a"}]}\n\n', b"data: [DONE]\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                await writer.drain()
                await asyncio.sleep(0.02)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        reqs = [workloads.Request(0, 0.0, (1, 2), 1, "g", session="s0"),
                workloads.Request(1, 0.0, (1, 2, 3), 1, "g", session="s0", after=0, gap_s=0.05),
                workloads.Request(2, 0.01, (7,), 1, "h")]  # fmt: skip

        async def go():
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            bodies = {r.index: loadgen.request_body("m", VOCAB.text(r.tokens), 1) for r in reqs}
            async with server:
                return await loadgen.drive(f"http://127.0.0.1:{port}", reqs, bodies, speedup=1.0)

        records, wall_s = asyncio.run(go())
        self.assertEqual([r["error"] for r in records], [None] * 3)
        self.assertEqual({r["worker"] for r in records}, {"3"})
        self.assertEqual([p for p, _ in seen], [VOCAB.text((1, 2)), VOCAB.text((7,)), VOCAB.text((1, 2, 3))])
        self.assertEqual(seen[0][1], "s0")
        first, follow = records[0], records[1]
        # The follow-up goes out its gap after the first call's stream ended.
        self.assertGreaterEqual(follow["sent_s"], first["sent_s"] + first["e2e_s"] + 0.05 - 1e-3)
        self.assertTrue(all(r["ttft_s"] < r["e2e_s"] for r in records))
        self.assertLess(max(r["lateness_s"] for r in records), 0.5)

    def test_a_cap_on_outstanding_requests_holds_the_next_one_back(self):
        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            await reader.readexactly(length)
            await asyncio.sleep(0.1)
            ev = (b'data: {"choices":[{"text":"a"}],'
                  b'"usage":{"prompt_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}}\n\n')
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(ev), ev))
            await writer.drain()
            writer.close()

        reqs = [workloads.Request(i, 0.0, (1, 2), 1, "g") for i in range(2)]

        async def go():
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            async with server:
                return await loadgen.drive(f"http://127.0.0.1:{port}", reqs, {0: b"{}", 1: b"{}"}, 1.0,
                                           inflight_max=1)  # fmt: skip

        records, _ = asyncio.run(go())
        a, b = records
        self.assertGreaterEqual(b["sent_s"], a["sent_s"] + a["e2e_s"] - 1e-3)
        self.assertGreaterEqual(b["lateness_s"], 0.09)
        self.assertEqual((a["prompt_tokens"], a["cached_tokens"]), (2, 1))

    def test_a_body_with_its_path_goes_to_that_path(self):
        paths = []

        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            paths.append(head.split(b" ")[1].decode())
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            await reader.readexactly(length)
            ev = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(ev), ev))
            await writer.drain()
            writer.close()

        reqs = [workloads.Request(i, 0.01 * i, (1,), 1, "g") for i in range(2)]

        async def go():
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            bodies = {0: b"{}", 1: ("/v1/chat/completions", b"{}")}
            async with server:
                return await loadgen.drive(f"http://127.0.0.1:{port}", reqs, bodies, 1.0)

        records, _ = asyncio.run(go())
        self.assertEqual([r["error"] for r in records], [None, None])
        self.assertEqual(paths, ["/v1/completions", "/v1/chat/completions"])

    def test_a_warm_up_reaches_every_engine_and_a_failed_one_stops_the_bench(self):
        hits = []

        async def serve(status):
            async def handle(reader, writer):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
                await reader.readexactly(length)
                hits.append(writer.get_extra_info("sockname")[1])
                ev = b'data: {"choices":[{"text":"a"}]}\n\n'
                writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(ev), ev))
                await writer.drain()
                writer.close()

            return await asyncio.start_server(handle, "127.0.0.1", 0)

        def warm(statuses):
            hits.clear()
            loop = asyncio.new_event_loop()
            servers = [loop.run_until_complete(serve(st)) for st in statuses]
            thread = threading.Thread(target=loop.run_forever, daemon=True)
            thread.start()
            try:
                ports = [sv.sockets[0].getsockname()[1] for sv in servers]
                the_fleet = object.__new__(bench.RealFleet)
                the_fleet.engines = [SimpleNamespace(id=i + 1, url=f"http://127.0.0.1:{p}") for i, p in enumerate(ports)]
                reqs = [workloads.Request(i, 0.0, (1,), 1, "g") for i in range(2)]
                return ports, the_fleet.warm(reqs, {0: b"{}", 1: b"{}"})
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join()

        ports, took = warm([200, 200])
        self.assertEqual(sorted(hits), sorted(ports * 2))
        self.assertEqual(len(took), 2)
        with self.assertRaisesRegex(RuntimeError, "vllm-2 failed its warm-up"):
            warm([200, 500])

    def test_a_refused_connection_is_an_error_not_a_crash(self):
        async def go():
            server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            server.close()
            await server.wait_closed()
            req = workloads.Request(0, 0.0, (1,), 1, "g")
            return await loadgen.drive(f"http://127.0.0.1:{port}", [req], {0: b"{}"}, speedup=1.0)

        records, _ = asyncio.run(go())
        self.assertIn("Error", records[0]["error"])


if __name__ == "__main__":
    unittest.main()
