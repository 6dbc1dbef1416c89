"""Processes of the benchmark: vLLM CPU servers and the routers in front of them.

Everything listens on 127.0.0.1 only. Every process is started in its own process group
and stopped by its own pid (SIGTERM, then SIGKILL), never by name.
"""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvroute"
SERVED_NAME = "kvroute-bench"
# Prompt tokens per forward pass, the same for vLLM, kvroute's cost model and the replay.
MAX_BATCHED_TOKENS = 2048


def stop_on_sigterm():
    """Makes SIGTERM unwind like Ctrl-C, so the `finally` blocks that stop the workers and
    routers run: a benchmark killed by its caller leaves no server behind."""

    def raise_exit(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, raise_exit)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, timeout=5.0):
    """(status, text) of one request; status 0 when nothing answered."""
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError):
        return 0, ""


class Proc:
    """A child process with its log file."""

    def __init__(self, name, argv, env, log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w", encoding="utf-8")
        self.p = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_http(self, url, timeout_s):
        """Waits until `url` answers 200; raises with the log's tail when it never does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                break
            if http("GET", url, timeout=2.0)[0] == 200:
                return
            time.sleep(0.5)
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{self.name} did not come up at {url}; log tail:\n{tail}")

    def cpu_s(self):
        """CPU seconds (user + system) used so far by the processes of its group (it and
        whatever it spawned), or None where /proc cannot tell."""
        ticks, tick_s = 0, 1.0 / os.sysconf("SC_CLK_TCK")
        try:
            pids = [d for d in os.listdir("/proc") if d.isdigit()]
        except OSError:
            return None
        for pid in pids:
            try:
                # Fields after the command's closing parenthesis: state is [0], pgrp [2],
                # utime [11], stime [12].
                rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(rest[2]) == self.p.pid:
                ticks += int(rest[11]) + int(rest[12])
        return round(ticks * tick_s, 2)

    def stop(self):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait()
        self.log.close()


def engine_python():
    """The engine venv's python (`setup.sh` prints it as KVROUTE_VLLM_PYTHON)."""
    return os.environ.get("KVROUTE_VLLM_PYTHON", str(CACHE / "engine/venv/bin/python"))


def text_model():
    """The generated text model's folder (`setup.sh` prints it as KVROUTE_VLLM_MODEL)."""
    return Path(os.environ.get("KVROUTE_VLLM_MODEL", str(CACHE / "engine/model")))


def vlm_model(family="llava", text="test"):
    """The generated vision-language model (`scripts/real-engine/gen_vlm.py`, a no-op when
    present): with `text="test"` (the tests' small language model) the real-engine
    tests' own folder, `KVROUTE_VLLM_VLM_DIR/<family>` or else `vlm/<family>` beside the
    text model's; with `text="fleet"` (the text model's size) `<family>-fleet` there."""
    root = os.environ.get("KVROUTE_VLLM_VLM_DIR") or str(text_model().parent / "vlm")
    out = Path(root) / (family if text == "test" else f"{family}-{text}")
    script = Path(__file__).resolve().parents[2] / "scripts/real-engine/gen_vlm.py"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    argv = [engine_python(), str(script), "--family", family, "--text", text, "--out", str(out)]
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gen_vlm.py --family {family} failed:\n{done.stdout[-3000:]}")
    return out


class Engine:
    """One vLLM CPU server with prefix caching, KV events and a small KV cache."""

    def __init__(self, wid, gpu_blocks, max_model_len, log_dir: Path, model=None, images_max=0):
        """`model` defaults to the generated text model; `images_max` > 0 lets a prompt
        carry that many images (a vision-language model)."""
        self.id = wid
        self.gpu_blocks = gpu_blocks
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        python = engine_python()
        model = str(model or text_model())
        if not Path(python).exists() or not Path(model, "config.json").exists():
            raise SystemExit(
                f"vLLM engine or model missing ({python}, {model}); run benches/real_fleet/setup.sh first"
            )
        self.model = model
        events = (
            '{"enable_kv_cache_events": true, "publisher": "zmq", '
            f'"endpoint": "tcp://*:{self.events_port}", "replay_endpoint": "tcp://*:{self.replay_port}", "topic": ""}}'
        )
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                "--port", str(self.port), "--model", model, "--served-model-name", SERVED_NAME,
                "--dtype", os.environ.get("KVROUTE_ENGINE_DTYPE") or "bfloat16", "--enable-prefix-caching", "--block-size", "64",
                "--enforce-eager", "--max-model-len", str(max_model_len), "--max-num-seqs", "16",
                "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
                "--num-gpu-blocks-override", str(gpu_blocks), "--kv-events-config", events,
                "--enable-prompt-tokens-details"]  # fmt: skip
        if images_max:
            argv += ["--limit-mm-per-prompt", json.dumps({"image": images_max})]
        env = dict(os.environ)
        env.update({
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONHASHSEED": "0",
            "VLLM_SERVER_DEV_MODE": "1",  # serves /reset_prefix_cache
        })  # fmt: skip
        self.proc = Proc(f"vllm-{wid}", argv, env, log_dir)

    def reset_prefix_cache(self, timeout_s=30.0):
        """Empties the prefix cache (retrying while requests still hold blocks), then runs
        one engine step so that the `AllBlocksCleared` event goes out. vLLM queues it until
        its scheduler next steps; a router started before that would replay the cleared
        blocks from the engine's event buffer and route to a cache that is not there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, text = http("POST", f"{self.url}/reset_prefix_cache", b"")
            if status == 200 and '"success":true' in text.replace(" ", ""):
                self.step()
                return
            if status == 404:
                raise RuntimeError("vLLM has no /reset_prefix_cache (needs VLLM_SERVER_DEV_MODE=1)")
            time.sleep(0.5)
        raise RuntimeError(f"vllm-{self.id}: prefix cache reset did not succeed")

    def step(self, timeout_s=120.0):
        """Has the engine compute a one-token completion (shorter than a block, so it
        stores none): a scheduler step, which publishes the KV events it has queued."""
        status, text = http("POST", f"{self.url}/v1/completions", STEP_BODY, timeout=timeout_s)
        if status != 200:
            raise RuntimeError(f"vllm-{self.id}: a one-token completion failed: {status} {text[:200]}")


STEP_BODY = json.dumps({"model": SERVED_NAME, "prompt": "hello", "max_tokens": 1}).encode()


def wait_routable(url, timeout_s=90.0):
    """Waits until a router forwards a one-token completion (its /health can answer
    before it has found its workers healthy); raises when it never does."""
    deadline = time.monotonic() + timeout_s
    last = (0, "")
    while time.monotonic() < deadline:
        last = http("POST", f"{url}/v1/completions", STEP_BODY, timeout=30.0)
        if last[0] == 200:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not route a completion in {timeout_s} s: {last}")


def ready_or_stop(proc, url):
    try:
        wait_routable(url)
    except RuntimeError:
        proc.stop()
        raise


# `[learn]` of the `kv-learn` policy: learned per-worker speeds and the engines' own load,
# scraped from their /metrics.
LEARN_SECTION = ["[learn]", "costs = true", "engine_load = true", "scrape_interval_ms = 500"]


# `[retry]` for vLLM on CPU. It computes about a hundred prompt tokens a second, a
# thousand times slower than the GPUs kvroute's first-byte timeout is sized for (15 s plus
# 1 ms per uncached token). Past the timeout a try on a busy worker waits on if the worker
# served anyone meanwhile, but one pass of a full 2,048-token batch here can take longer
# than 30 s, and a worker in such a pass serves no one: the try would count as a wedge.
# Two minutes covers a pass even at 20 tokens a second.
CPU_ENGINE_SECTION = ["[retry]", "first_byte_timeout_base_ms = 120000"]
# The cost model's timing for vLLM on CPU, as a user with these engines sets it: the
# CPU build's prefill and decode, and the wait an idle server's first pass adds.
CPU_ENGINE_TIMING = 'engine_timing = "vllm-cpu"'


def kvroute_config(mode, engines, tokenizer_dir, port, learn=False, router_extra=(), sections=(), cpu_engines=False,
                   model_extra=()):  # fmt: skip
    """A `kvroute serve` TOML for one policy over the fleet; `learn` turns on `[learn]`,
    `router_extra` are more `[router]` lines, `model_extra` more lines of the model's
    table, `sections` more lines at the end (whole tables, such as `[media]`),
    `cpu_engines` the timeouts and timing of vLLM on CPU (unless `router_extra`
    names an `engine_timing`)."""
    lines = [
        f'listen = "127.0.0.1:{port}"',
        "seed = 7",
        "[trust]",
        'cidrs = ["127.0.0.1/32"]',
        "[health_check]",
        "interval_ms = 0",
        "[router]",
        f'mode = "{mode}"',
        "block_size = 64",
        *router_extra,
        *([CPU_ENGINE_TIMING] if cpu_engines and not any(x.startswith("engine_timing") for x in router_extra) else []),
        "[[models]]",
        f'name = "{SERVED_NAME}"',
        f'tokenizer = "{tokenizer_dir}"',
        *model_extra,
    ]
    if learn:
        lines += LEARN_SECTION
    if cpu_engines:
        lines += CPU_ENGINE_SECTION
    for e in engines:
        lines += [
            "[[workers]]",
            f"id = {e.id}",
            f'url = "{e.url}"',
            f'model = "{SERVED_NAME}"',
            f"kv_blocks = {e.gpu_blocks}",
            f"max_batched_tokens = {getattr(e, 'max_batched_tokens', MAX_BATCHED_TOKENS)}",
            f'kv_events = "tcp://127.0.0.1:{e.events_port}"',
            f'kv_events_replay = "tcp://127.0.0.1:{e.replay_port}"',
        ]
    lines += sections
    return "\n".join(lines) + "\n"


def start_kvroute(binary, mode, engines, log_dir: Path, name=None, learn=False, router_extra=(), sections=(),
                  cpu_engines=True, model_extra=()):  # fmt: skip
    """`kvroute serve` with `mode` (see `kvroute_config` for the rest); returns (proc, base url)."""
    port = free_port()
    name = name or f"kvroute-{mode}"
    cfg = log_dir / f"{name}.toml"
    text = kvroute_config(mode, engines, engines[0].model, port, learn, router_extra, sections, cpu_engines, model_extra)
    cfg.write_text(text)
    proc = Proc(name, [binary, "serve", "--config", str(cfg)], dict(os.environ), log_dir)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(f"{url}/health", 60)
    ready_or_stop(proc, url)
    return proc, url


# SMG 1.13 places a request that matches no worker's tree by the engines' load, which
# it polls from their /metrics every 10 s by default, and it vetoes a worker for a poll
# or more once that load passes its overload bar. On conversation, a 10 s old load sent
# bursts of new conversations to one worker (34 and 49 waiting requests on two of eight
# at the first poll); the spill and veto then moved their turns off their caches. With
# a 1 s poll its figures there match sglang-router's when busy; saturated, the veto
# still costs it a third of its hits. Turning the spill gate and the veto off instead
# (`--balance-rel-threshold 1000000 --disable-worker-overload-protection`) raised its
# hits but made the piles worse.
SMG_POLL_1S = ("--load-monitor-interval", "1")

# Peer routers: name -> (program, policy, extra flags). The program's path comes from the
# environment variable that setup.sh prints; a peer whose variable is unset is not
# installed.
PEERS = {
    "sglang-router": ("sglang-router", "cache_aware", ()),
    "smg": ("smg", "cache_aware", ()),
    "smg-poll-1s": ("smg", "cache_aware", SMG_POLL_1S),
    "smg-prefix-hash": ("smg", "prefix_hash", ()),
    "vllm-router-kv-aware": ("vllm-router", "kv_aware", ()),
    "vllm-router-cache-aware": ("vllm-router", "cache_aware", ()),
}
PEER_ENV = {
    "sglang-router": "KVROUTE_SGLANG_ROUTER_PYTHON",
    "smg": "KVROUTE_SMG",
    "vllm-router": "KVROUTE_VLLM_ROUTER",
}


def peer_installed(name):
    """The peer's program from the environment, or None."""
    return os.environ.get(PEER_ENV[PEERS[name][0]]) or None


def peer_argv(name, engines, port, block_size=64):
    """The command line of peer router `name` over `engines` on `port`; its metrics go to
    a port of its own, so that nothing else on the host collides with their default."""
    program, policy, extra = PEERS[name]
    exe = peer_installed(name)
    urls = [e.url for e in engines]
    common = ["--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(free_port()), *extra, "--worker-urls", *urls]  # fmt: skip
    if program == "sglang-router":
        return [exe, "-m", "sglang_router.launch_router", *common]
    if program == "smg":
        return [exe, "launch", "--backend", "vllm", *common]
    argv = [exe, *common]
    if policy == "kv_aware":
        # The workers' KV events; vllm-router asks each worker's /v1/completions/render
        # for a request's token ids, so it hashes what the worker hashes.
        for e in engines:
            argv += ["--kv-event-source", f"{e.url}=tcp://127.0.0.1:{e.events_port}",
                     "--kv-event-replay-source", f"{e.url}=tcp://127.0.0.1:{e.replay_port}"]  # fmt: skip
        argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", SERVED_NAME]
    return argv


def start_peer(name, engines, log_dir: Path, block_size=64):
    """Peer router `name` (a key of PEERS) over the same fleet; returns (proc, url), or
    None when it is not installed."""
    if not peer_installed(name):
        return None
    port = free_port()
    proc = Proc(name, peer_argv(name, engines, port, block_size), dict(os.environ), log_dir)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(f"{url}/health", 90)
    ready_or_stop(proc, url)
    return proc, url
