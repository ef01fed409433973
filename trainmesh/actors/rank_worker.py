"""RankWorker: the Ray actor that is one accelerator rank of a job. torch is imported inside its
methods, which run in the rank's own process: the controller, which creates these actors, loads no
torch."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import gc
import os
import signal
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    import torch

from trainmesh.actors.collector import Collector, frozen_imports
from trainmesh.actors.gloo_sockets import GlooSockets
from trainmesh.actors.progress import Progress
from trainmesh.parallel.dims import ParallelDims
from trainmesh.spec.job import JobSpec


def select_device(requested: str) -> torch.device:
    """``auto``: this actor's CUDA device when Ray gave it one, else the CPU."""
    import torch

    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("runtime.device is 'cuda' but this rank sees no CUDA device; "
                               "set runtime.device to 'cpu' or 'auto'")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RankWorker:
    """One rank: process group, mesh, engine. Every method is called on all ranks together.

    A subclass may add methods or set ``p2p`` (benches' stand-ins, the tests' probes and
    faults: ``trainmesh/testing``); the worker group starts the class it is given."""

    # How the pipeline's and the context-parallel ring's point-to-point batches are posted:
    # a factory of ``batch_isend_irecv``-like callables taking the collective timeout (None:
    # torch's own ``dist.batch_isend_irecv``).
    p2p = None

    def __init__(self, rank: int, world_size: int, cpu_threads: int):
        """Rank ``rank`` of ``world_size``; or, with rank -1, a ready process (``warm``,
        ``adopt``), which imports the parallel stack in ``warm`` and touches no CUDA device
        before ``adopt``."""
        self.rank, self.world_size = rank, world_size
        if rank >= 0:
            self._prepare_process(cpu_threads)
        self._collector = None  # the step's garbage collection (``build``: the spec's schedule)
        self._store = None  # rank 0's TCPStore
        self._timeout_s = 60.0
        self.engine = None
        self._progress = Progress(rank)
        # Background checkpoint writes: their own gloo group (created at the first one) and the
        # future of the write in flight.
        self._save_group = None  # a torch.distributed.ProcessGroup
        self._saving: concurrent.futures.Future | None = None
        self._gloo = GlooSockets()  # the gloo groups' connections, ended by ``abort``
        self._saved_files: dict = {}
        from trainmesh.actors.snapshots import Snapshots
        from trainmesh.checkpoint.memory_fs import MemoryStore

        self._memory = MemoryStore()  # the in-memory tier's files this rank holds
        self._snapshots = Snapshots(self._memory)  # the in-memory tier's (checkpoint.in_memory)
        # A preemption notice (SIGTERM: a spot reclaim, a node drain) does not end the rank at
        # once: it is reported with the next step so the controller can checkpoint first.
        self.preempted = False
        # Segments of steps (``train_segment``): the one the controller asked to end early,
        # and (rank 0, the reporter) each step's stats of the one running, read by ``reports``.
        self._stop_segment: int | None = None
        self._reported: list[dict] = []
        self._reported_segment: int | None = None
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: keep Ray's own handling
            pass

    def _prepare_process(self, cpu_threads: int) -> None:
        """A rank's process at its start: the parallel stack imported, torch's threads set."""
        _import_stack()
        _set_threads(cpu_threads)

    def _on_sigterm(self, signum, frame) -> None:
        self.preempted = True

    # -- a ready process (actors/ready.py) -------------------------------------------------
    def warm(self) -> int:
        """A ready process, started ahead of need: import what joining a group and building a
        model part import (no accelerator is touched); returns the pid."""
        _import_stack(pipelining=True)
        _set_threads(1)
        return os.getpid()

    def adopt(self, rank: int, world_size: int, cpu_threads: int, accelerators: list) -> int:
        """A ready process becomes rank ``rank``, using the accelerators its seat holds (the
        reservation is the seat's: ``actors/ready.py``), before anything has touched CUDA;
        returns the pid."""
        if accelerators:
            import torch

            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(a) for a in accelerators)
            if torch.cuda.is_available() and torch.cuda.device_count() != len(accelerators):
                raise RuntimeError(  # something touched CUDA before: it sees other devices
                    f"a ready process adopted for accelerators {accelerators} sees "
                    f"{torch.cuda.device_count()} CUDA devices: CUDA was initialised before its "
                    "seat named them; set elastic.ready_ranks_per_node=0")
        _set_threads(cpu_threads)
        self.rank, self.world_size = rank, world_size
        self._progress.rank = rank
        return os.getpid()

    # -- process group ---------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def abort(self) -> None:
        """Out of band (the control group: never queued behind a step): abort every
        communicator of this rank — training's and the background save's — so that what this
        rank and its peers are blocked in returns now rather than at the collective timeout.
        NCCL: its documented abort, from another thread, releases a rank blocked in a
        collective. gloo has none (torch 2.13: a peer blocked on a DeviceMesh/FSDP sub-group
        was released only by this process's death or the collective timeout): its groups'
        connections are shut down (``actors/gloo_sockets.py``), which ends this rank's blocked
        call and every peer's call that waits on it, a frozen peer's too. The references (model,
        mesh, save group) are dropped. Afterwards only ``reset`` (or ``shutdown``) is
        meaningful."""
        import torch.distributed as dist

        self._gloo.release()  # (first: the abort below may destroy a gloo group, closing them)
        if dist.is_initialized():
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        self._save_group = None
        self._drop_engine()

    @ray.method(concurrency_group="control")
    def progress(self) -> dict:
        """Out of band, while a step runs: the step, the phase it is in, a counter per phase
        and the seconds since the last phase began (``actors/progress.py``)."""
        return self._progress.snapshot()

    @ray.method(concurrency_group="control")
    def request_stop(self, segment: int) -> None:
        """Out of band, on rank 0: end segment ``segment`` at the next step boundary (every rank
        hears it there, in-band: ``train_segment``)."""
        self._stop_segment = segment

    @ray.method(concurrency_group="control")
    def reports(self, segment: int, since: int) -> list[dict]:
        """Out of band, on rank 0: the stats of segment ``segment``'s steps from the
        ``since``-th on (the controller logs them while the segment goes on); none while an
        earlier segment's are still the ones held (the call came before the segment began)."""
        return self._reported[since:] if self._reported_segment == segment else []

    @ray.method(concurrency_group="control")
    def node_info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "ip": ray.util.get_node_ip_address()}

    def reset(self, rank: int, world_size: int) -> int:
        """Warm recovery: drop the model and the (possibly broken) process group and take a
        new rank, keeping the process (torch stays imported). Returns the pid."""
        self._progress.rank = rank
        self._progress.mark("reform")
        # A background write still going here was cut off by a failure (a resize settles its
        # save first): it never counts, and one stuck in its group's collective would wait for
        # the collective timeout, so it is given a moment and then left behind.
        self.wait_save(timeout_s=1.0)
        self._snapshots.forget(timeout_s=self._timeout_s)  # (a recovery may restore it)
        self._saving, self._save_group = None, None
        self._drop_engine(collect=False)  # (collected below, with the groups and caches)
        self._gloo.release()  # (a save left behind above, and its peers, leave their collective)
        _abandon_process_groups()
        self._gloo.forget()
        _forget_dtensor_caches()
        self._store = None
        self.rank, self.world_size = rank, world_size
        gc.collect()
        return os.getpid()

    def _drop_engine(self, collect: bool = True) -> None:
        """Let the model part go (it holds reference cycles: a collection frees it, unless the
        caller collects later itself); Python's automatic collection again until the next
        ``build``."""
        if self.engine is not None:
            self.engine.batches.close()  # (its read ahead, if any, is dropped)
        self.engine, self._collector = None, None
        Collector.stop()
        if collect:
            gc.collect()

    def create_store(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0 only: a TCPStore on an OS-chosen port; returns (host, port)."""
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        return host, self._store.port

    def init_process_group(self, host: str, port: int, device: str, timeout_s: float) -> str:
        """Join the job's process group; returns the backend used."""
        import torch.distributed as dist

        self.device = select_device(device)
        self._timeout_s = timeout_s
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":  # a failed collective aborts its communicators, not the process
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        with self._gloo.opened() if backend == "gloo" else contextlib.nullcontext():
            store = self._store or dist.TCPStore(host, port, self.world_size, is_master=False,
                                                 timeout=timedelta(seconds=timeout_s))
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=timeout_s))
        return backend

    # -- training --------------------------------------------------------------------------
    def build(self, spec_json: str, dims: dict, data_dir: str, nodes: tuple[int, ...] = ()) -> int:
        """Build this rank's mesh and engine (``nodes``: each rank's node, ``Mesh.nodes``);
        returns its parameter count (local shards)."""
        from trainmesh.engine.engine import Engine
        from trainmesh.parallel.mesh import Mesh

        spec = JobSpec.model_validate_json(spec_json)
        if self.engine is not None:  # a part built before: gone before the new one is built
            self._drop_engine()
        # The groups, formed together while the rank does nothing else (the mesh's: gloo's on
        # CPU ranks; the background save's: gloo's on any), so that an abort can end their
        # connections (actors/gloo_sockets.py).
        with self._gloo.opened() if self.device.type == "cpu" else contextlib.nullcontext():
            mesh = Mesh.build(ParallelDims(**dims), self.device.type, self.rank,
                              moe=spec.model.moe is not None,
                              dp_replicate=spec.parallelism.dp_replicate, nodes=tuple(nodes))
        if spec.checkpoint.async_save and self._save_group is None:
            self._save_group = self._new_save_group()
        # (read from the class: a plain function set there is not bound as a method)
        self.engine = Engine(spec, mesh, data_dir, self.device, self._progress.mark, type(self).p2p)
        self._collector = Collector(spec.runtime.gc_every)
        return sum(p.numel() for p in self.engine.model.parameters())

    def train_step(self, measure_activations: bool = False) -> dict:
        self._progress.step = self.engine.step
        stats = self.engine.train_step(measure_activations)
        gc_s = self._collector.after_step(self.engine.step)
        if stats.breakdown is not None:  # (after the step: not part of its step_s)
            stats.breakdown["gc_s"] = gc_s
        return {**dataclasses.asdict(stats), "preempted": self.preempted, **self.save_report()}

    def train_segment(self, segment: int, steps: int, until_s: float, save_pending: bool = False) -> dict:
        """Up to ``steps`` steps, run here without a call from the controller between them.
        Every rank leaves at the same step boundary: at each step's start the ranks all-reduce
        (max) three flags, in-band on the default group — a preemption notice on any rank, the
        controller's ``request_stop`` for this segment or ``until_s`` passed (rank 0's clock),
        a background save still being written on some rank — and end the segment on the first
        two, or once a save that was being written (or, ``save_pending``, one the controller has
        yet to commit) is written everywhere (its commit is the controller's, at the boundary).
        Returns ``{"steps": n, "reported": [...], "last": ...}``:
        rank 0 (the reporter) gives every step's stats, every rank its last step's (the save's
        status, the breakdown, the experts': what the controller reads at a boundary) with why
        the segment ended (``ended``: "steps" — all were run —, "notice", "asked", "time" or
        "save_written"; rank 0's is the job's)."""
        if self.rank == 0:
            self._reported, self._reported_segment = [], segment
        t_end = time.monotonic() + until_s
        watching = save_pending  # a write to see end
        last: dict = {}
        done, ended = 0, "steps"
        for i in range(steps):
            stop, late = self.rank == 0 and self._stop_segment == segment, time.monotonic() >= t_end
            notice, asked, writing = self._agree([
                int(self.preempted), int(self.rank == 0 and (stop or late)),
                int(self.save_status() == "running")])
            if i > 0 and (notice or asked or (watching and not writing)):
                ended = ("notice" if notice else "asked" if stop else "time" if asked
                         else "save_written")
                break
            watching = watching or bool(writing)
            t0 = time.perf_counter()
            last = self.train_step()
            last["wall_s"] = time.perf_counter() - t0
            last["step"] = self.engine.step
            done += 1
            if self.rank == 0:  # (the files of a finished save: at the boundary, not per step)
                self._reported.append({k: v for k, v in last.items() if k != "saved_files"})
        last.update(preempted=self.preempted, ended=ended, **self.save_report())  # (as of the boundary)
        return {"steps": done, "reported": list(self._reported) if self.rank == 0 else [],
                "last": last}

    def _agree(self, flags: list[int]) -> list[int]:
        """The maximum of each flag over every rank: one all-reduce on the default group."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(flags, dtype=torch.int64, device=self.engine.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def evaluate(self, batches: int) -> float:
        loss = self.engine.evaluate(batches)
        self._collector.after_call()
        return loss

    def reset_peak_memory(self) -> None:
        """Start a new CUDA peak (the CPU's peak RSS cannot be reset)."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory_report(self) -> dict:
        """This rank's bytes by kind (``Engine.memory_report``) and where it runs."""
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node": ctx.get_node_id(), "device": str(self.device),
                **self.engine.memory_report()}

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, directory: str, background: bool = False) -> dict:
        """Collective save; returns ``{"rng": ..., "files": ...}``: this rank's random streams
        (``engine/rng.py``), which the controller writes beside the shards, and (synchronous)
        the files it wrote with their sizes (``saved_files``; None in the background). Synchronous:
        the shards are written when it returns (``saved_files``: their sizes) and a thread
        takes their digests while training goes on. In the background, this rank's shards are
        copied to host memory before it returns and a thread writes (and digests) them while
        training goes on. ``save_status`` says how either went."""

        self.wait_save()
        self._saved_files = {}
        self._progress.step = self.engine.step
        self._progress.mark("save")
        if not background:
            self._saved_files, self._saving = self.engine.save(directory)
        else:
            if self._save_group is None:
                self._save_group = self._new_save_group()
            self._saving = self.engine.async_save(directory, self._save_group)
        self._collector.after_call()
        return {"rng": self.engine.rng.state(), "files": None if background else self.saved_files()}

    def _new_save_group(self):
        """The background save's own gloo group (all ranks together)."""
        import torch.distributed as dist

        with self._gloo.opened():
            return dist.new_group(backend="gloo", timeout=timedelta(seconds=self._timeout_s))

    def save_status(self) -> str | None:
        """The last save's state: None (none), "running" (a background write, or a synchronous
        save's digests), "done" or "failed: why"."""
        f = self._saving
        if f is None:
            return None
        if not f.done():
            return "running"
        err = f.exception()
        if err is None:
            self._saved_files = f.result()
        return "done" if err is None else f"failed: {err!r}"[:2000]

    def save_report(self) -> dict:
        """The last save's state (``save_status``) and, once it is done, its files
        (``saved_files``, digests in): what a step's or a segment's answer carries, so that
        the controller commits a save, or adds its digests, without a call of its own."""
        status = self.save_status()
        return {"save": status, "saved_files": self.saved_files() if status == "done" else None}

    def finish_save(self, timeout_s: float | None = None) -> dict:
        """``wait_save``, answered as ``save_report`` is (the files of a save that ended done)."""
        status = self.wait_save(timeout_s)
        return {"save": status, "saved_files": self.saved_files() if status == "done" else None}

    def saved_files(self) -> dict:
        """{file: {"size", "sha256"}} of the files this rank wrote in its last save, digested
        here, where they were written (a synchronous save's, until its digests are in: sha256
        None)."""
        return dict(self._saved_files)

    def bad_files(self, directory: str, files: dict) -> list[str]:
        """Which of ``files`` (this rank's share of a manifest) are missing or corrupt."""
        from trainmesh.checkpoint.manifest import bad_files

        return bad_files(directory, files)

    def can_read(self, path: str, token: str) -> bool:
        """Whether this rank's node sees ``token`` in ``path`` (a shared-storage probe)."""
        from fsspec.core import url_to_fs

        try:
            fs, p = url_to_fs(path)
            return fs.cat_file(p).decode() == token
        except (OSError, UnicodeDecodeError):
            return False

    def wait_save(self, timeout_s: float | None = None) -> str | None:
        """Wait (at most ``timeout_s``) for the last save (its background write, its digests);
        returns ``save_status``, and forgets the save once it has ended."""
        if self._saving is not None:
            concurrent.futures.wait([self._saving], timeout=timeout_s)
        status = self.save_status()
        if status != "running":
            self._saving = None
        return status

    def load(self, directory: str, step: int, rng_states: bytes | None,
             metadata_files: list[str] | None = None) -> None:
        """Collective restore from ``directory`` (storage; with ``metadata_files``, an in-memory
        snapshot read through this rank's store); ``rng_states``: every rank's random streams
        as saved (``rng.job_states``), or None."""
        self._progress.step = step
        self._progress.mark("restore")
        self.engine.load(directory, step, rng_states,
                         (metadata_files, self._memory) if metadata_files else None)
        self._collector.after_call()

    # -- in-memory checkpoints (checkpoint/memory_fs.py) --------------------------------------
    def memory_snapshot(self, directory: str, buddy, wait: bool = False) -> dict:
        """This rank alone (no collective): snapshot its shards as ``directory`` in its memory
        and hand a copy to ``buddy`` (a rank actor on another node); training waits only for
        the copy to host memory (``actors/snapshots.py``). ``wait``: for the whole of it."""
        self._progress.mark("snapshot")
        got = self._snapshots.take(directory, self.rank, self.engine.model, self.engine.optimizer,
                                   buddy, self._timeout_s)
        if wait:
            self._snapshots.settle(self._timeout_s)
            got["files_bytes"] = self._memory.nbytes(directory)
        return {**got, "rng": self.engine.rng.state()}

    @ray.method(concurrency_group="memory")
    def keep_replica(self, directory: str, files: dict) -> int:
        """A peer's snapshot files, kept in this process's memory (the newest two snapshots),
        indexed for a restore (``snapshot_io.index_snapshot``)."""
        from trainmesh.checkpoint import snapshot_io

        self._memory.put(directory, files)
        self._memory.keep_newest(2)
        snapshot_io.index_snapshot(self._memory, directory)
        return sum(len(b) for b in files.values())

    @ray.method(concurrency_group="memory")
    def memory_handoff(self, target) -> None:
        """Everything this process holds in memory, copied to ``target`` (before its end)."""

        for directory, names in self._memory.held().items():
            ray.get(target.keep_replica.remote(directory, {n: self._memory.read(directory, n) for n in names}),
                    timeout=self._timeout_s)

    @ray.method(concurrency_group="memory")
    def memory_inventory(self) -> dict:
        """Snapshot directory → the file names this process holds there."""

        return self._memory.held()

    @ray.method(concurrency_group="memory")
    def memory_file(self, directory: str, name: str) -> bytes | None:

        return self._memory.read(directory, name)

    def memory_load(self, directory: str, holders: dict, step: int, rng_states: bytes | None,
                    workers: list) -> dict:
        """Collective: restore from snapshot ``directory`` onto this rank's (new) part: files it
        does not hold are fetched from ``holders`` (file name → the rank holding it, an index
        into ``workers``, the group's rank actors). Returns the names it fetched."""
        from trainmesh.checkpoint import memory_fs

        fetched: list[str] = []

        def fetch(path: str) -> bytes | None:
            name = path.rpartition("/")[2]
            holder = holders.get(name)
            if holder is None:
                return None
            fetched.append(name)
            return ray.get(workers[holder].memory_file.remote(directory, name),
                           timeout=self._timeout_s)

        with self._memory.fetching(fetch):
            self.load(memory_fs.uri(directory), step, rng_states,
                      sorted(n for n in holders if n.endswith(".metadata")))
        return {"fetched": fetched}

    def timeline(self) -> list:
        return self.engine.timeline()

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.wait_save(timeout_s=self._timeout_s + 5)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._gloo.forget()
        self.engine = None


def _import_stack(pipelining: bool = False) -> None:
    """What joining a group and building a model part import (torch, DTensor, FSDP2, DCP, the
    engine), imported at the process's start with the garbage collector off and then frozen
    (``actors/collector.py``). ``pipelining``: torch's pipelining package too, which only a
    split backward (zero-bubble schedules) uses — a ready process does not know its job's
    schedule yet, and is there to take imports off a recovery."""
    with frozen_imports():
        if pipelining:
            import torch.distributed.pipelining  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401

        import trainmesh.engine.engine  # noqa: F401
        import trainmesh.parallel.mesh  # noqa: F401


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(max(1, n))


def _forget_dtensor_caches() -> None:
    """DTensor caches sharding decisions, redistribution planners and mesh facts keyed by the
    mesh's shape, not by its process groups: a new mesh equal in shape to one this process had
    before (a warm re-form) would be handed entries holding the old mesh, whose groups are gone
    ("Could not resolve the process group registered under the name ..."; group names are
    counters that restart with the default group: the stale names resolve to the new groups
    only while the rank keeps its place in the mesh). Every such cache is dropped with the
    groups: the lru caches of torch.distributed.tensor's modules and classes, the planner
    cache, and the sharding-propagation caches (C++ and Python, every thread's)."""
    import functools
    import sys

    import torch
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    def clear(obj) -> None:
        if isinstance(obj, functools._lru_cache_wrapper):
            obj.cache_clear()

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed.tensor"):
            continue
        for value in list(vars(module).values()):
            clear(value)
            if isinstance(value, type) and value.__module__ == name:
                for attr in vars(value).values():
                    clear(getattr(attr, "__func__", attr))
    _redistribute.clear_redistribute_planner_cache()
    # The sharding-propagation caches: the C++ dispatch fast path's, which answers first
    # (missing it: measured, a survivor that changed pipeline stage ran its new stage's ops on its
    # old mesh's groups), and Python's, one per thread (autograd's device threads run backward
    # on CUDA), so it is replaced, not cleared in this thread only.
    torch._C._clear_DTensor_sharding_propagator_cache()
    sp = DTensor._op_dispatcher.sharding_propagator
    sp.propagate_op_sharding = LocalLRUCache(sp.propagate_op_sharding_non_cached)


def _abandon_process_groups() -> None:
    """Leave every process group, even a broken one. NCCL communicators are aborted (destroying
    one whose peer died can hang); gloo groups are destroyed — torch documents its abort for
    NCCL only, and destroying a broken gloo group was measured to work (torch 2.13).
    torch.distributed is uninitialised afterwards."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    else:
        dist.destroy_process_group()
