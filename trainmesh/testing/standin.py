"""A rank actor without torch, for measuring the control plane with hundreds of ranks on one
machine (``bench/control_plane.py``, ``tests/test_control_plane.py``).

``StandInRank`` is the rank actor (``RankWorker``) with its engine replaced: every call the
controller makes — forming the group, building, segments of steps with rank 0's reports,
saves and their digests, in-memory snapshots and their replication to a buddy, restores,
aborts, warm re-forms, shutdown — is the real method or one that answers as a real rank's does,
and a step is a sleep of ``STEP_S_ENV`` seconds. What it does not stand in for: the collectives
themselves (no process group; the in-band agreement at a step's start is this rank's own flags,
and the bench sends no notices), and the bytes of a checkpoint (one small file per rank).
A real rank process holds torch (~0.5 GB here); a stand-in holds Ray and trainmesh (~80 MB).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from types import SimpleNamespace

import ray

from trainmesh.actors.collector import Collector
from trainmesh.actors.rank_worker import RankWorker
from trainmesh.spec.job import JobSpec

STEP_S_ENV = "TRAINMESH_STANDIN_STEP_S"  # a stand-in step's seconds (default 0.05)


@dataclasses.dataclass
class _Stats:  # as ``engine.step.StepStats``
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    experts: dict | None = None
    breakdown: dict | None = None


class _Streams:  # as ``engine.rng.RankStreams``: a state per rank, restored as given
    def __init__(self, rank: int, layout: dict):
        self.rank, self.layout = rank, layout

    def state(self) -> dict:
        return {"coords": f"pp0.dp{self.rank}.cp0.tp0", "layout": dict(self.layout), "cpu": "",
                "device": None, "replica": ""}


class StandInEngine:
    """Steps that sleep; the loss a function of the step alone (every mesh agrees)."""

    def __init__(self, spec: JobSpec, rank: int, layout: dict, on_phase=lambda phase: None):
        self.step, self.step_s = 0, float(os.environ.get(STEP_S_ENV, "0.05"))
        self.on_phase = on_phase  # (the rank's progress: what the controller and faults see)
        self.tokens = spec.training.global_batch_size * spec.training.seq_len
        self.rng = _Streams(rank, layout)
        self.batches = SimpleNamespace(close=lambda: None)
        self.device = SimpleNamespace(type="cpu")

    def train_step(self, measure_activations: bool = False) -> _Stats:
        self.on_phase("forward")
        time.sleep(self.step_s)
        self.step += 1
        return _Stats(loss=10.0 / self.step, grad_norm=1.0, lr=1e-3, tokens=self.tokens,
                      breakdown={"forward_s": self.step_s / 3, "compute_s": self.step_s})


class StandInRank(RankWorker):
    def _prepare_process(self, cpu_threads: int) -> None:  # no torch to import or set up
        pass

    def warm(self) -> int:  # a ready process: nothing to import ahead
        return os.getpid()

    def adopt(self, rank: int, world_size: int, cpu_threads: int, accelerators: list) -> int:
        self.rank, self.world_size = rank, world_size
        self._progress.rank = rank
        return os.getpid()

    def create_store(self, timeout_s: float) -> tuple[str, int]:
        return "127.0.0.1", 0

    def init_process_group(self, host: str, port: int, device: str, timeout_s: float) -> str:
        self.device, self._timeout_s = SimpleNamespace(type="cpu"), timeout_s
        return "stand-in"

    def build(self, spec_json: str, dims: dict, data_dir: str, nodes: tuple[int, ...] = ()) -> int:
        spec = JobSpec.model_validate_json(spec_json)
        self.engine = StandInEngine(spec, self.rank, dims, self._progress.mark)
        self._collector = Collector(spec.runtime.gc_every)
        return 0

    def evaluate(self, batches: int) -> float:
        return 10.0 / max(1, self.engine.step)

    def timeline(self) -> list:
        return []

    def _agree(self, flags: list[int]) -> list[int]:
        return flags  # (no collective: see the module's docstring)

    def save(self, directory: str, background: bool = False) -> dict:
        from fsspec.core import url_to_fs

        self._progress.mark("save")
        data = f"rank {self.rank} step {self.engine.step}".encode()
        fs, path = url_to_fs(directory)
        name = f"__{self.rank}_0.distcp"
        fs.pipe_file(f"{path}/{name}", data)
        self._saved_files = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
        self._saving = None
        return {"rng": self.engine.rng.state(), "files": self.saved_files()}

    def load(self, directory: str, step: int, rng_states, metadata_files=None) -> None:
        self._progress.step = step
        self._progress.mark("restore")
        self.engine.step = step

    def memory_snapshot(self, directory: str, buddy, wait: bool = False) -> dict:
        self._progress.mark("snapshot")
        files = {f"__{self.rank}.metadata": b"m", f"__{self.rank}_0.distcp": b"x" * 64}
        self._memory.put(directory, files)
        self._memory.keep_newest(2)
        if buddy is not None:
            ray.get(buddy.keep_replica.remote(directory, files), timeout=self._timeout_s)
        return {"bytes": 65, "blocked_s": 0.0, "rng": self.engine.rng.state()}

    @ray.method(concurrency_group="memory")
    def keep_replica(self, directory: str, files: dict) -> int:
        self._memory.put(directory, files)
        self._memory.keep_newest(2)
        return sum(len(b) for b in files.values())

    def memory_load(self, directory: str, holders: dict, step: int, rng_states, workers) -> None:
        self.load(directory, step, rng_states)

    @ray.method(concurrency_group="control")
    def abort(self) -> None:
        self.engine = None

    def reset(self, rank: int, world_size: int) -> int:
        self._progress.rank = rank
        self._progress.mark("reform")
        self.engine, self.rank, self.world_size = None, rank, world_size
        return os.getpid()

    def shutdown(self) -> list:
        self.engine = None
        return []


CALLS_DIR_ENV = "TRAINMESH_CALLS_DIR"  # where counting ranks write their counts at shutdown


def counting(cls: type) -> type:
    """``cls`` (a rank actor class) counting the calls it receives, by method — a method that
    calls another on the same rank counts once — written at ``shutdown`` to
    ``$TRAINMESH_CALLS_DIR/calls-PID-N.json`` (one file per rank this process served)."""
    import functools
    import inspect
    import json
    import threading

    def wrap(name, fn):
        @functools.wraps(fn)  # (keeps Ray's method options: the concurrency group)
        def counted(self, *args, **kwargs):
            local = self.__dict__.setdefault("_call_depth", threading.local())
            depth = getattr(local, "depth", 0)
            if depth == 0:
                calls = self.__dict__.setdefault("_calls", {})
                calls[name] = calls.get(name, 0) + 1
            local.depth = depth + 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                local.depth = depth
                if name == "shutdown" and depth == 0:
                    where = os.environ.get(CALLS_DIR_ENV)
                    if where:
                        n = len([p for p in os.listdir(where) if p.startswith(f"calls-{os.getpid()}-")])
                        with open(os.path.join(where, f"calls-{os.getpid()}-{n}.json"), "w") as f:
                            json.dump({"rank": self.rank, "calls": self._calls}, f)
        return counted

    methods = {name: wrap(name, getattr(cls, name)) for name in dir(cls)
               if not name.startswith("_") and inspect.isfunction(getattr(cls, name))}
    return type(f"Counting{cls.__name__}", (cls,), methods)
