"""Recovery after a node's death, trainmesh (warm from storage, warm with the in-memory tier,
cold) beside Ray Train v2, and checkpoint save/restore bandwidth beside plain sequential file IO
of the same bytes; in-memory snapshots and their replication (Ray against gloo).

    .venv/bin/python bench/recovery.py [--trials 3] [--seed 0] [--skip-ray-train] [--ckpt-mib 256]

Part 1 runs on a simulated cluster (ray.cluster_utils.Cluster: a head and 2 nodes advertising
4 GPUs each, real ranks on gloo). trainmesh trains the tiny model in 3D (pp 2 × vpp 2 × tp 2 ×
dp 2 = 8 ranks over both nodes) with the spec's default timeouts (collective 120 s) and
background checkpoint saves every 2 steps; in each trial one node is removed hard (raylet and
rank processes killed) at a random point (the same for every system) after the step-4
checkpoint is committed. The controller re-plans onto the 4 surviving ranks and resumes. Reported
per system, over --trials trials: the median and the worst time from the removal to the next
completed step; the median of:
the time from the removal to the next completed step, split into detection (removal → the
controller sees the failure), decide (health check of the survivors, backoff, re-plan), reform
(process group: the survivors' own when warm; a new placement group and new actors when
cold), restore (build the model parts, load the checkpoint) and the first step; and the steps
lost. Ray Train v2 (TorchTrainer, FailureConfig) trains the same model data-parallel (DDP, 4
workers spread over the 2 nodes, checkpoint every 2 steps through ray.train.report) and gets
the same fault: it restarts its 4 workers on the surviving node from its latest checkpoint.
The workloads differ (8 → 4 re-planned ranks vs 4 → 4 restarted ones); what is compared is
the recovery path.

"trainmesh warm, in-memory tier" adds ``checkpoint.in_memory.every=1`` (tracked in MLflow: the
seconds each snapshot blocks training beside the step time) and restores from the survivors'
memory. "vs plain" of the in-memory rows is against DCP on local storage (page cache warm: an
upper bound for storage); the gloo row is against Ray's transfer.

Part 2: DCP save and load of a state dict of --ckpt-mib MiB (one process) against writing the
same bytes to one file with a sequential write + fsync, and reading them back; and DCP's async
save (``checkpoint.async_save``): how long the caller is blocked (the copy to host memory) and
how long until the write is done; and trainmesh's synchronous save as a rank and the controller
run it: how long training is blocked (the write, the checkpoint published with its files'
sizes) and how long until the rank's digests are in its manifest, beside the path that
digested each file as it was written. The same save and restore with ``checkpoint.dir`` on an
S3 endpoint: moto's server on loopback (s3fs over HTTP, this machine's disk behind it), so
the figures show the object-store path's own cost, not a real bucket's network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_enable_metrics_collection", "0")  # see tests/conftest.py

# The spec's defaults where they matter to recovery: runtime.collective_timeout_s (120 s),
# hang detection; background checkpoint saves on, as in the demo spec.
COMMON = ["model.preset=tiny", "training.global_batch_size=16", "training.microbatch_size=2",
          "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.device=auto",
          "runtime.cpus_per_rank=0.5", "checkpoint.async_save=true", "elastic.max_restarts=3",
          "parallelism.pp=2", "parallelism.vpp=2", "parallelism.tp=2", "parallelism.dp=2",
          "parallelism.sequence_parallel=true", "schedule.name=interleaved-1f1b",
          "training.steps=12", "checkpoint.every=2", "tracking.enabled=false"]
KILL_AFTER_STEP = 4


MAIN_PHASES = ("decide_s", "reform_s", "restore_s", "first_step_s")
DECIDE_PARTS = ("interrupted_s", "abort_s", "stuck_s", "health_s", "plan_s")  # decide_s, split


def _gpu_nodes(cluster):
    return list(cluster.worker_nodes)


def _ensure_two(cluster):
    while len(_gpu_nodes(cluster)) < 2:
        # "slot": the same 4 accelerators as a custom resource, for Ray Train's CPU workers
        # (Ray Train refuses GPU resources without use_gpu, which would switch it to NCCL).
        cluster.add_node(num_cpus=4, num_gpus=4, resources={"slot": 4})
    cluster.wait_for_nodes()


def _remove_hard(cluster, delay_s: float) -> float:
    """After ``delay_s`` (a random point of a step), take the last node away at once: its
    raylet and its rank processes killed, as a machine's loss would. Returns that time."""
    time.sleep(delay_s)
    node = _gpu_nodes(cluster)[-1]
    raylet = node.all_processes["raylet"][0].process.pid
    ranks = [p for p in _worker_pids() if _parent(p) == raylet]
    t = time.time()
    cluster.remove_node(node, allow_graceful=False)
    for pid in ranks:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return t


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return -1


def _worker_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def trainmesh_recovery(cluster, mode: str, tmp: Path, delay_s: float) -> dict:
    from trainmesh.checkpoint.manifest import CheckpointStore
    from trainmesh.cli.loading import load_spec
    from trainmesh.controller.launch import run_job

    _ensure_two(cluster)
    out = tmp / f"trainmesh-{mode}-{delay_s:.3f}"
    kind, _, unready = mode.partition("-")  # "-unready": no ready rank processes kept
    extra = ["checkpoint.in_memory.every=1", "tracking.enabled=true"] if kind == "memory" else []
    if unready:
        extra.append("elastic.ready_ranks_per_node=0")
    spec = load_spec(None, [*COMMON, f"elastic.warm_recovery={str(kind != 'cold').lower()}",
                            f"runtime.output_dir={out}", *extra])
    box: dict = {}

    def target():
        try:
            box["summary"] = run_job(spec, environ={}, show_progress=False)
        except Exception as err:  # noqa: BLE001
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    store = CheckpointStore(out / "checkpoints")
    while not store.exists(KILL_AFTER_STEP):
        if not thread.is_alive():
            raise RuntimeError(f"trainmesh {mode}: ended before step {KILL_AFTER_STEP}: {box}")
        time.sleep(0.05)
    t_kill = _remove_hard(cluster, delay_s)
    thread.join(600)
    if "error" in box:
        raise box["error"]
    [rec] = [r for r in box["summary"]["recoveries"] if r["cause"] != "scale-up"]
    if rec["mode"] != ("cold" if kind == "cold" else "warm"):  # reported, not hidden
        print(f"note: asked for a {mode} recovery, got {rec['mode']}")
    ph = rec["phases"]
    detection = rec["failed_at"] - t_kill
    costs = snapshot_costs(out) if kind == "memory" else {}
    name = "trainmesh warm, in-memory tier" if kind == "memory" else f"trainmesh {kind}"
    procs = rec.get("processes") or {}
    name += (", no ready processes" if unready else
             f", {len(procs.get('ready', []))} of {len(procs.get('ready', [])) + len(procs.get('started', []))}"
             " new ranks from ready processes")
    return {"system": name, "detection": detection, **ph, "mode": rec["mode"], **costs,
            "restored_from": rec["restored_from"],
            "total": detection + sum(ph.get(k, 0.0) for k in MAIN_PHASES),
            "steps_lost": rec["steps_lost"],
            "mesh": f"{rec['old_mesh']['world_size']} → {rec['new_mesh']['world_size']} ranks"}


def _ray_train_loop(config):
    """DDP on the tiny Llama, the data order of trainmesh's sampler, checkpoint every 2."""
    import ray.train
    import torch
    import torch.distributed as dist
    from ray.train import Checkpoint
    from torch.nn.parallel import DistributedDataParallel

    from trainmesh.cli.loading import load_spec
    from trainmesh.data.dataset import TokenDataset
    from trainmesh.data.shards import read_tokens
    from trainmesh.engine.step import build_lr_scheduler, build_optimizer
    from trainmesh.models.llama.model import Llama, LlamaArgs

    spec = load_spec(None, config["spec"])
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Llama(LlamaArgs.from_config(spec.model))
    model.init_weights(spec.training.seed)
    opt = build_optimizer(model, spec.optimizer)
    sched = build_lr_scheduler(opt, spec.optimizer, spec.training.steps)
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["step"]
    ddp = DistributedDataParallel(model)
    tr = spec.training
    data = TokenDataset(read_tokens(config["data_dir"]), tr.seq_len)
    log = Path(config["log"])
    if rank == 0:
        with log.open("a") as f:
            f.write(json.dumps({"event": "start", "step": start, "time": time.time()}) + "\n")
    for step in range(start, tr.steps):
        opt.zero_grad(set_to_none=True)
        mbs = data.microbatches(tr.seed, step, tr.global_batch_size, rank, world, tr.microbatch_size)
        for x, y in mbs:
            (ddp(x, y) / len(mbs)).backward()
        opt.step()
        sched.step()
        ckpt = None
        tmp = None
        if (step + 1) % 2 == 0 and rank == 0:
            tmp = tempfile.mkdtemp()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step + 1}, os.path.join(tmp, "state.pt"))
            ckpt = Checkpoint.from_directory(tmp)
        ray.train.report({"step": step + 1}, checkpoint=ckpt)
        if rank == 0:
            with log.open("a") as f:
                f.write(json.dumps({"event": "step", "step": step + 1, "time": time.time(),
                                    "checkpointed": ckpt is not None}) + "\n")
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def ray_train_recovery(cluster, tmp: Path, delay_s: float) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from trainmesh.data.shards import ensure_tiny_corpus

    _ensure_two(cluster)
    log = tmp / f"ray-train-log-{delay_s:.3f}.jsonl"
    spec = [a for a in COMMON if not a.startswith(("parallelism", "schedule"))]
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"spec": spec, "log": str(log),
                           "data_dir": str(ensure_tiny_corpus(tmp / "data"))},
        scaling_config=ScalingConfig(num_workers=4, use_gpu=False, placement_strategy="SPREAD",
                                     resources_per_worker={"CPU": 0.5, "slot": 1}),
        run_config=RunConfig(name=f"bench-recovery-{delay_s:.3f}", storage_path=str(tmp / "ray-train"),
                             failure_config=FailureConfig(max_failures=3)))
    box: dict = {}

    def target():
        try:
            box["result"] = trainer.fit()
        except Exception as err:  # noqa: BLE001
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def events():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    while not any(e["event"] == "step" and e["step"] >= KILL_AFTER_STEP and e["checkpointed"]
                  for e in events()):
        if not thread.is_alive():
            raise RuntimeError(f"Ray Train ended before step {KILL_AFTER_STEP}: {box}")
        time.sleep(0.05)
    t_kill = _remove_hard(cluster, delay_s)
    reached = max(e["step"] for e in events() if e["event"] == "step" and e["time"] <= t_kill)
    thread.join(600)
    if "error" in box:
        raise box["error"]
    ev = events()
    restart = next(e for e in ev if e["event"] == "start" and e["time"] > t_kill)
    first = next(e for e in ev if e["event"] == "step" and e["time"] > restart["time"])
    reached = max([reached] + [e["step"] for e in ev if e["event"] == "step" and e["time"] <= t_kill])
    return {"system": "Ray Train v2 (DDP)", "detection": None, "decide_s": None,
            "reform_s": None, "restore_s": restart["time"] - t_kill,
            "first_step_s": first["time"] - restart["time"], "total": first["time"] - t_kill,
            "steps_lost": max(0, reached - restart["step"]), "mesh": "4 → 4 workers"}


def checkpoint_bandwidth(mib: int, tmp: Path, reps: int = 5) -> list[dict]:
    import torch
    import torch.distributed.checkpoint as dcp

    n_tensors = 32
    per = mib * 2**20 // 4 // n_tensors
    state = {f"layer{i}.weight": torch.randn(per) for i in range(n_tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values())

    from trainmesh.checkpoint import dcp_io, digest_writer, memory_fs, snapshot_io
    from trainmesh.checkpoint.host_copy import HostCopy
    from trainmesh.checkpoint.manifest import CheckpointStore

    store_root = CheckpointStore(tmp / "trainmesh-saves")
    rows: dict[str, list[float]] = {"dcp save": [],
                                    "trainmesh save: training blocked (write, published with sizes)": [],
                                    "trainmesh save: until its digests are in the manifest": [],
                                    "trainmesh save, digests as written (until 2026-11-26)": [],
                                    "dcp async save: caller blocked": [],
                                     "dcp async save: until written": [],
                                     "plain write + fsync": [], "dcp load": [], "dcp load (pages evicted)": [],
                                     "plain read": [],
                                     "in-memory snapshot: training blocked (staging copy)": [],
                                     "in-memory snapshot (dcp save to memory)": [],
                                     "in-memory snapshot: records indexed": [],
                                     "restore from memory (dcp load)": [],
                                     "restore from memory, DCP's reader (before 2026-11-26)": []}
    store = memory_fs.MemoryStore()  # a rank's in-memory tier
    staging = HostCopy(torch.device("cpu"))  # its host buffers kept, as a rank keeps them
    staging.copy(state)
    for r in range(reps):
        d = tmp / f"dcp-{r}"
        os.sync()  # (before each write timed: its fsync flushes its own bytes, not the last op's)
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(d))
        rows["dcp save"].append(time.perf_counter() - t0)
        # trainmesh's synchronous save, as a rank and the controller run it: the write, the
        # checkpoint published with its files' sizes (training goes on from here), then the
        # digests taken by the rank's thread and written into the manifest
        partial = store_root.prepare(2 * r)  # (the step's own directory)
        os.sync()
        t0 = time.perf_counter()
        saved = dcp_io.save_state(partial, state, no_dist=True)
        final = store_root.commit(partial, {"step": 2 * r}, saved.sizes)
        rows["trainmesh save: training blocked (write, published with sizes)"].append(
            time.perf_counter() - t0)
        assert store_root.add_digests(final, saved.digests.result()) == 0
        rows["trainmesh save: until its digests are in the manifest"].append(time.perf_counter() - t0)
        shutil.rmtree(final)
        # the same, digesting each file as it is written (the path until 2026-11-26)
        partial = store_root.prepare(2 * r + 1)
        os.sync()
        t0 = time.perf_counter()
        writer = digest_writer.storage_writer(partial)
        dcp.save(state, storage_writer=writer, no_dist=True)
        store_root.commit(partial, {"step": 2 * r + 1}, writer.files())
        rows["trainmesh save, digests as written (until 2026-11-26)"].append(time.perf_counter() - t0)
        shutil.rmtree(store_root.step_dir(2 * r + 1))
        os.sync()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(tmp / f"dcp-async-{r}"))
        rows["dcp async save: caller blocked"].append(time.perf_counter() - t0)
        fut.result()
        rows["dcp async save: until written"].append(time.perf_counter() - t0)
        shutil.rmtree(tmp / f"dcp-async-{r}")
        target = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        dcp.load(target, checkpoint_id=str(d))
        rows["dcp load"].append(time.perf_counter() - t0)
        _evict(d)  # as a restore after a failure finds it: not in this machine's page cache
        t0 = time.perf_counter()
        dcp.load(target, checkpoint_id=str(d))
        rows["dcp load (pages evicted)"].append(time.perf_counter() - t0)
        f = tmp / f"plain-{r}.bin"
        os.sync()
        t0 = time.perf_counter()
        with f.open("wb") as fh:
            for v in state.values():
                fh.write(memoryview(v.numpy()).cast("B"))
            fh.flush()
            os.fsync(fh.fileno())
        rows["plain write + fsync"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with f.open("rb") as fh:
            for v in target.values():
                fh.readinto(memoryview(v.numpy()).cast("B"))
        rows["plain read"].append(time.perf_counter() - t0)
        shutil.rmtree(d)
        f.unlink()
        name = f"{r:04d}-00000001"
        snap = memory_fs.uri(name)
        t0 = time.perf_counter()
        staging.copy(state)
        rows["in-memory snapshot: training blocked (staging copy)"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        snapshot_io.snapshot(snap, 0, state, store)  # as a rank's tier writes one (background)
        rows["in-memory snapshot (dcp save to memory)"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        snapshot_io.index_snapshot(store, name)  # (background, after the save: actors/snapshots.py)
        rows["in-memory snapshot: records indexed"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=snapshot_io.snapshot_reader(snap, ["__0.metadata"], store),
                 no_dist=True)
        rows["restore from memory (dcp load)"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=_dcp_reader(snap, store), no_dist=True)
        rows["restore from memory, DCP's reader (before 2026-11-26)"].append(time.perf_counter() - t0)
        store.keep_newest(0)
    out = []
    for name, times in rows.items():
        s = statistics.median(times)
        out.append({"op": name, "s": s, "gb_s": nbytes / s / 1e9})
    return out


def object_store_rows(mib: int, tmp: Path, reps: int = 3) -> list[dict]:
    """trainmesh's save (the files under the step's own prefix, then the manifest) and DCP's
    load, with the checkpoint directory on an S3 endpoint on loopback (moto's server)."""
    import sys

    import torch
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the S3 server
    from servers import S3Server

    from trainmesh.checkpoint import dcp_io
    from trainmesh.checkpoint.manifest import CheckpointStore

    n_tensors = 32
    per = mib * 2**20 // 4 // n_tensors
    state = {f"layer{i}.weight": torch.randn(per) for i in range(n_tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    rows: dict[str, list[float]] = {"s3 (loopback) trainmesh save: until published, digests in": [],
                                    "s3 (loopback) dcp load": []}
    server = S3Server(tmp / "s3")
    server.start()
    try:
        with server.client_env():
            store = CheckpointStore(f"s3://{server.bucket()}/ckpt")
            for r in range(reps):
                t0 = time.perf_counter()
                d = store.prepare(r)
                saved = dcp_io.save_state(store.uri(d), state, no_dist=True)
                store.commit(d, {"step": r}, saved.digests.result())  # (a URI's: as written)
                rows["s3 (loopback) trainmesh save: until published, digests in"].append(
                    time.perf_counter() - t0)
                target = {k: torch.empty_like(v) for k, v in state.items()}
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=dcp_io.storage_reader(store.uri(d)), no_dist=True)
                rows["s3 (loopback) dcp load"].append(time.perf_counter() - t0)
                assert all(torch.equal(target[k], state[k]) for k in state)
                store.remove(d)
    finally:
        server.stop()
    return [{"op": name, "s": statistics.median(t), "gb_s": nbytes / statistics.median(t) / 1e9}
            for name, t in rows.items()]


def _print_io(ckpt: list[dict], mib: int) -> None:
    print(f"\n| checkpoint op ({mib} MiB) | s | GB/s | speed vs |")
    print("|---|---:|---:|---:|")
    plain = {"dcp save": "plain write + fsync", "dcp async save: caller blocked": "plain write + fsync",
             "trainmesh save: training blocked (write, published with sizes)": "plain write + fsync",
             "trainmesh save: until its digests are in the manifest": "plain write + fsync",
             "trainmesh save, digests as written (until 2026-11-26)": "plain write + fsync",
             "dcp async save: until written": "plain write + fsync", "dcp load": "plain read",
             "dcp load (pages evicted)": "dcp load",
             "in-memory snapshot: training blocked (staging copy)": "dcp save",
             "in-memory snapshot (dcp save to memory)": "dcp save",
             "in-memory snapshot: records indexed": "dcp save",
             "restore from memory (dcp load)": "dcp load (pages evicted)",
             "restore from memory, DCP's reader (before 2026-11-26)": "dcp load (pages evicted)",
             "replicate: gloo send/recv": "replicate: Ray actor → actor",
             "s3 (loopback) trainmesh save: until published, digests in":
                 "trainmesh save: until its digests are in the manifest",
             "s3 (loopback) dcp load": "dcp load (pages evicted)"}
    by = {r["op"]: r for r in ckpt}
    for r in ckpt:
        ref = by.get(plain.get(r["op"], r["op"]))
        vs = "" if ref is r else f"{r['gb_s'] / ref['gb_s']:.2f}× {ref['op']}"
        print(f"| {r['op']} | {r['s']:.3f} | {r['gb_s']:.2f} | {vs} |")


def _evict(directory: Path) -> None:
    """Drop a checkpoint's files from the page cache (written back first), so the next read
    comes from the disk."""
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dcp_reader(uri: str, store):
    """DCP's own fsspec reader of a snapshot (each tensor through ``torch.load``: a copy)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from trainmesh.checkpoint import snapshot_io

    class Reader(snapshot_io._MergedReader):
        read_data = FsspecReader.read_data

    return Reader(uri, ["__0.metadata"], store=store)


class _Peer:
    """One end of a replication: receives a snapshot's bytes over Ray or over gloo."""

    def __init__(self, rank: int):
        self.rank = rank

    def keep(self, blob: bytes) -> int:
        self.kept = blob
        return len(blob)

    def send_ray(self, other, nbytes: int) -> float:
        import ray

        blob = os.urandom(nbytes)
        t0 = time.perf_counter()
        ray.get(other.keep.remote(blob))
        return time.perf_counter() - t0

    def gloo(self, host: str, port: int, nbytes: int) -> float:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        store = dist.TCPStore(host, port, 2, is_master=self.rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=2)
        t = torch.empty(nbytes, dtype=torch.uint8)
        dist.barrier()
        t0 = time.perf_counter()
        if self.rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        dt = time.perf_counter() - t0
        dist.destroy_process_group()
        return dt


def replication(mib: int, reps: int = 3) -> list[dict]:
    """A snapshot's bytes to a buddy on the other node: Ray's actor-to-actor transfer (what
    trainmesh uses: no process group, so it survives a failed one) against a gloo send/recv."""
    import socket

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nbytes = mib * 2**20
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")][:2]
    cls = ray.remote(num_cpus=0)(_Peer)
    peers = [cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False),
                         runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}}).remote(i)
             for i, n in enumerate(nodes)]
    rows: dict[str, list[float]] = {"replicate: Ray actor → actor": [], "replicate: gloo send/recv": []}
    for _ in range(reps):
        rows["replicate: Ray actor → actor"].append(ray.get(peers[0].send_ray.remote(peers[1], nbytes)))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        rows["replicate: gloo send/recv"].append(
            max(ray.get([p.gloo.remote("127.0.0.1", port, nbytes) for p in peers])))
    for p in peers:
        ray.kill(p)
    return [{"op": k, "s": statistics.median(v), "gb_s": nbytes / statistics.median(v) / 1e9}
            for k, v in rows.items()]


def snapshot_costs(out: Path) -> dict:
    """From a run tracked in MLflow: seconds blocked per in-memory snapshot beside the step."""
    from mlflow.tracking import MlflowClient

    summary = json.loads((out / "summary.json").read_text())
    client = MlflowClient(summary["tracking_uri"])
    blocked = [m.value for m in client.get_metric_history(summary["mlflow_run_id"], "snapshot_blocked_s")]
    steps = [m.value for m in client.get_metric_history(summary["mlflow_run_id"], "step_time_s")]
    return {"blocked_s": statistics.median(blocked), "step_s": statistics.median(steps)}


def summarize(trials: list[dict]) -> dict:
    """One system's trials: the median of each phase, the median and worst death → next step."""
    def med(key):
        vals = [t.get(key, 0.0 if key == "interrupted_s" else None) for t in trials]  # (none: 0)
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None
    totals = [t["total"] for t in trials]
    return {**trials[0], **{k: med(k) for k in ("detection", *MAIN_PHASES, *DECIDE_PARTS,
                                                 "blocked_s", "step_s")},
            "restored_from": sorted({t.get("restored_from", "") for t in trials}),
            "total": statistics.median(totals), "worst": max(totals),
            "steps_lost": f"{min(t['steps_lost'] for t in trials)}–{max(t['steps_lost'] for t in trials)}",
            "modes": sorted({t.get("mode", "") for t in trials} - {""}), "trials": len(trials)}


def main() -> None:
    import random

    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-ray-train", action="store_true")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-mib", type=int, default=256)
    ap.add_argument("--modes", default="warm,memory,cold,warm-unready,cold-unready",
                    help="trainmesh recoveries to run: warm (from storage), memory (the in-memory "
                         "tier), cold; -unready: without ready rank processes")
    ap.add_argument("--io-only", action="store_true", help="only the checkpoint operations' table")
    args = ap.parse_args()
    if args.io_only:
        with tempfile.TemporaryDirectory() as tmpdir:
            tmp = Path(tmpdir)
            _print_io(checkpoint_bandwidth(args.ckpt_mib, tmp) + object_store_rows(args.ckpt_mib, tmp),
                      args.ckpt_mib)
        return
    import ray
    from ray.cluster_utils import Cluster

    # the same random points of a step (after the step-4 checkpoint) for every system
    delays = [random.Random(args.seed + i).uniform(0.0, 1.5) for i in range(args.trials)]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            _ensure_two(cluster)
            ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
            replicated = replication(args.ckpt_mib)
            for delay in delays:
                for mode in args.modes.split(","):
                    runs.setdefault(f"trainmesh {mode}", []).append(
                        trainmesh_recovery(cluster, mode, tmp, delay))
                if not args.skip_ray_train:
                    runs.setdefault("ray", []).append(ray_train_recovery(cluster, tmp, delay))
        finally:
            ray.shutdown()
            cluster.shutdown()
        ckpt = (checkpoint_bandwidth(args.ckpt_mib, tmp) + replicated
                + object_store_rows(args.ckpt_mib, tmp))
    rows = [summarize(t) for t in runs.values()]

    def f(v):
        return "-" if v is None else f"{v:.2f}"

    base = rows[0]["total"]
    print(f"\n{args.trials} trials each, node removed {', '.join(f'{d:.2f}' for d in delays)} s "
          "after the step-4 checkpoint was committed; medians, and the worst death → next step")
    print("\n| system | mesh | detection s | decide s | reform s | restore s | first step s | "
          "death → next step s (median) | worst s | median vs trainmesh warm | steps lost |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['system']} | {r['mesh']} | {f(r['detection'])} | {f(r.get('decide_s'))} | "
              f"{f(r.get('reform_s'))} | {f(r.get('restore_s'))} | {f(r.get('first_step_s'))} | "
              f"{r['total']:.2f} | {r['worst']:.2f} | {r['total'] / base:.2f}× | {r['steps_lost']} |")
    print("\n| system | decide s | interrupted attempts s | abort s | stuck grace s | health check s | "
          "backoff + re-plan s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r.get("abort_s") is not None:
            print(f"| {r['system']} | {f(r.get('decide_s'))} | "
                  + " | ".join(f(r.get(k)) for k in DECIDE_PARTS) + " |")
    for r in rows:
        if any(r["restored_from"]):
            print(f"{r['system']}: restored from {', '.join(r['restored_from'])}")
        if r.get("blocked_s") is not None:
            print(f"{r['system']}: a snapshot blocks training {r['blocked_s'] * 1e3:.1f} ms per step "
                  f"({r['blocked_s'] / r['step_s']:.1%} of a {r['step_s']:.2f} s step; median)")
    _print_io(ckpt, args.ckpt_mib)


if __name__ == "__main__":
    main()
