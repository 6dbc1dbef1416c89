"""A fleet of `kvroute sim-worker`s, started fresh for every router run.

Each worker serves the OpenAI API and vLLM's metrics on its own port and publishes its
KV events over ZeroMQ (with a replay socket), tokenizing with the generated model folder,
so every router sees real token ids and the workers' prefix-cache counters are exact.
"""

from dataclasses import dataclass
from pathlib import Path

import fleet  # benches/real_fleet: processes, ports, HTTP

START_TRIES = 3


@dataclass(frozen=True)
class Shape:
    """Every worker's engine."""

    block_size: int = 64
    blocks_per_worker: int = 2462
    max_batched_tokens: int = 8192
    max_num_seqs: int = 256
    speedup: float = 10.0
    engine_timing: str = "mocker"
    mm_items_max: int = None  # images per request, for a model folder that takes images


class SimWorker:
    """One sim-worker; has the fields `fleet.kvroute_config` and the routers read."""

    def __init__(self, binary, wid, shape: Shape, model_dir: Path, log_dir: Path, tag):
        self.id = wid
        self.gpu_blocks = shape.blocks_per_worker
        self.max_batched_tokens = shape.max_batched_tokens
        self.model = str(model_dir)
        self.port, self.events_port, self.replay_port = fleet.free_port(), fleet.free_port(), fleet.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [binary, "sim-worker", "--port", str(self.port), "--events-port", str(self.events_port),
                "--replay-port", str(self.replay_port), "--model", fleet.SERVED_NAME, "--tokenizer", self.model,
                "--block-size", str(shape.block_size), "--blocks-per-worker", str(shape.blocks_per_worker),
                "--max-batched-tokens", str(shape.max_batched_tokens), "--max-num-seqs", str(shape.max_num_seqs),
                "--speedup", str(shape.speedup), "--engine-timing", shape.engine_timing]  # fmt: skip
        if shape.mm_items_max is not None:
            # vLLM keys image identifiers on its --model argument; kvroute's default
            # engine_model_id is the same folder (the model's `tokenizer`).
            argv += ["--mm-model-id", self.model, "--mm-items-max", str(shape.mm_items_max)]
        self.proc = fleet.Proc(f"sim-{tag}-{wid}", argv, None, log_dir)


class SimFleet:
    """`count` sim-workers; `start()` makes a fresh set, `stop()` ends them."""

    kind = "sim"

    def __init__(self, binary, count, shape: Shape, model_dir: Path, log_dir: Path):
        self.binary, self.count, self.shape = str(binary), count, shape
        self.model_dir, self.log_dir = model_dir, log_dir
        self.workers = []
        self.runs = 0

    @property
    def speedup(self):
        return self.shape.speedup

    def start(self):
        """Fresh workers (empty caches, zeroed counters); waits until all answer /health.
        A worker that does not come up (another process took a port between our probe and
        its bind) is started again on new ports, up to `START_TRIES` times."""
        self.stop()
        self.runs += 1
        self.workers = [self._spawn(w + 1, 0) for w in range(self.count)]
        for i in range(self.count):
            for attempt in range(1, START_TRIES + 1):
                try:
                    self.workers[i].proc.wait_http(f"{self.workers[i].url}/health", 60)
                    break
                except RuntimeError:
                    if attempt == START_TRIES:
                        raise
                    self.workers[i] = self._spawn(i + 1, attempt)

    def _spawn(self, wid, attempt):
        tag = f"{self.runs}" if attempt == 0 else f"{self.runs}-retry{attempt}"
        return SimWorker(self.binary, wid, self.shape, self.model_dir, self.log_dir, tag)

    def stop(self):
        for w in self.workers:
            w.proc.stop()
        self.workers = []
