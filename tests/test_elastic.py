"""Elastic recovery on a simulated cluster (ray.cluster_utils.Cluster, real ranks on gloo):
scale up when a node joins, re-plan onto the survivors when a node dies, give up clearly
below the elastic minimum. The tests share one cluster and run in order."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch

from trainmesh.checkpoint.manifest import CheckpointStore
from trainmesh.jobs.loading import load_spec
from trainmesh.jobs.runner import run_job

COMMON = ["model.preset=tiny", "training.global_batch_size=16", "training.microbatch_size=2",
          "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.device=auto",
          "runtime.cpus_per_rank=0.5", "runtime.collective_timeout_s=15",
          "elastic.max_restarts=3"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    ray.shutdown()
    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=4, num_gpus=4)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _gpu_nodes(c):
    return list(c.worker_nodes)  # the head has no GPUs; every worker node has 4


def _in_background(spec):
    box: dict = {}

    def target():
        try:
            box["summary"] = run_job(spec, environ={}, show_progress=False)
        except Exception as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def _wait_for_checkpoint(root, step, timeout=240):
    t0 = time.monotonic()
    store = CheckpointStore(root)
    while not store.exists(step):
        assert time.monotonic() - t0 < timeout, f"no checkpoint {step} after {timeout} s"
        time.sleep(0.2)


@pytest.mark.timeout(400)
def test_scale_up_soon_after_a_node_joins_from_a_checkpoint_taken_then(cluster, tmp_path):
    spec = load_spec(None, [*COMMON, "parallelism=auto", "elastic.max_world_size=8",
                            "training.steps=8", "checkpoint.every=2", "checkpoint.keep_last=9",
                            f"runtime.output_dir={tmp_path}"])
    thread, box = _in_background(spec)
    _wait_for_checkpoint(tmp_path / "checkpoints", 2)
    # The ranks are held still while the node starts (seconds; the job's steps take less),
    # so the node is there before the job ends, at whatever speed this machine runs.
    import os
    import signal

    ranks = _rank_worker_pids()
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        cluster.add_node(num_cpus=4, num_gpus=4)
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
    thread.join(360)
    assert "error" not in box, box.get("error")
    s = box["summary"]
    assert s["status"] == "FINISHED" and s["steps_done"] == 8
    assert s["mesh"]["world_size"] == 8
    ups = [r for r in s["recoveries"] if r["cause"] == "scale-up"]
    assert ups and ups[0]["old_mesh"]["world_size"] == 4 and ups[0]["new_mesh"]["world_size"] == 8
    # the resize restored the checkpoint it took at the step it grew after: nothing lost
    assert ups[0]["steps_lost"] == 0
    assert ups[0]["step"] in CheckpointStore(tmp_path / "checkpoints").complete_steps()
    # Warm growth: the 4 running actors were kept (same processes), 4 new ones started only
    # for the new node's accelerators.
    assert ups[0]["mode"] == "warm"
    before, after = (set(p) for p in s["rank_pids"][-2:])
    assert before < after and len(after) == 8
    assert len(set(s["rank_to_node"][:4])) == 1 and len(set(s["rank_to_node"])) == 2


ARGS_3D = [*COMMON, "parallelism.pp=2", "parallelism.vpp=2", "parallelism.tp=2", "parallelism.dp=2",
           "parallelism.sequence_parallel=true", "schedule.name=interleaved-1f1b", "training.steps=6",
           "checkpoint.every=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The losses of the run no failure touched, from the single-process model (the 8-rank 3D
    run equals it at 1e-5: test_pipeline_parity), for the killed runs to match."""
    from reference import reference_run

    from trainmesh.data.shards import ensure_tiny_corpus

    spec = load_spec(None, ARGS_3D)
    data_dir = str(ensure_tiny_corpus(tmp_path_factory.mktemp("full") / "data"))
    losses, _ = reference_run(spec, data_dir, steps=spec.training.steps)
    return {"losses": losses}


@pytest.mark.timeout(600)
def test_node_death_mid_checkpoint_restarts_cold_and_matches_uninterrupted(cluster, uninterrupted,
                                                                        tmp_path):
    """With elastic.warm_recovery off, a node dies while the step-4 checkpoint is being written:
    every rank restarts, the interrupted save never counts (step 2 is restored), and the losses
    equal the uninterrupted run's. (Warm recovery onto survivors: the hung-rank test below.)"""
    import os
    import signal

    while len(_gpu_nodes(cluster)) < 2:
        cluster.add_node(num_cpus=4, num_gpus=4)
    spec = load_spec(None, [*ARGS_3D, "elastic.warm_recovery=false",
                            f"runtime.output_dir={tmp_path / 'killed'}"])
    thread, box = _in_background(spec)
    root = tmp_path / "killed" / "checkpoints"
    _wait_for_checkpoint(root, 2)
    node = _gpu_nodes(cluster)[-1]
    raylet = node.all_processes["raylet"][0].process.pid
    writing = root / "step-000004.partial"
    while not writing.exists():
        assert thread.is_alive(), box
    # Freeze that node's ranks inside the save (they can neither finish it nor answer), then
    # take the node away; frozen processes are killed here, as the node's end would.
    ranks = [p for p in _rank_worker_pids() if _parent(p) == raylet]
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    assert len(ranks) == 4
    cluster.remove_node(node, allow_graceful=False)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    thread.join(500)
    assert "error" not in box, box.get("error")
    s = box["summary"]
    assert s["status"] == "FINISHED" and s["steps_done"] == 6
    assert s["mesh"]["world_size"] == 4  # the surviving node's ranks, re-planned
    (rec,) = [r for r in s["recoveries"] if r["cause"] != "scale-up"]
    assert rec["old_mesh"]["world_size"] == 8 and rec["new_mesh"]["world_size"] == 4
    assert rec["downtime_s"] > 0 and rec["mode"] == "cold"
    assert rec["step"] == 2 and rec["steps_lost"] == 2  # the interrupted save never counted
    before, after = (set(p) for p in s["rank_pids"][-2:])
    assert not after & before
    # Same samples in the same order: the losses equal the uninterrupted run's.
    torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(uninterrupted["losses"]),
                               rtol=1e-4, atol=0)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(s["tracking_uri"])
    assert client.get_metric_history(s["mlflow_run_id"], "recovery_downtime_s")


def _parent(pid: int) -> int:
    from pathlib import Path

    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _rank_worker_pids() -> list[int]:
    from pathlib import Path

    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::RankWorker"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@pytest.mark.timeout(400)
@pytest.mark.parametrize("notice", ["sigterm"])  # a drain: test_a_drain_is_seen_as_a_notice
def test_preemption_notice_checkpoints_first_then_continues_without_the_node(cluster, tmp_path,
                                                                              notice):
    """A notice that a node is going (SIGTERM to one of its ranks: a spot reclaim; or Ray
    draining the node: the autoscaler, KubeRay, ``ray drain-node``) is acted on at the next
    step boundary: checkpoint there, then go on without that node."""
    import os
    import signal

    from ray.core.generated import autoscaler_pb2

    while len(_gpu_nodes(cluster)) < 2:
        cluster.add_node(num_cpus=4, num_gpus=4)
    spec = load_spec(None, [*COMMON, "parallelism.dp=8", "training.steps=5", "checkpoint.every=2",
                            "checkpoint.keep_last=10", f"runtime.output_dir={tmp_path}"])
    thread, box = _in_background(spec)
    _wait_for_checkpoint(tmp_path / "checkpoints", 2)
    [victim, *_] = _rank_worker_pids()
    node = _gpu_nodes(cluster)[-1]
    if notice == "sigterm":
        os.kill(victim, signal.SIGTERM)
    else:
        gcs = ray._raylet.GcsClient(address=cluster.gcs_address)
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        accepted, why = gcs.drain_node(node.node_id, reason, "test: spot reclaim",
                                       int(time.time() * 1000) + 120_000)
        assert accepted, why
    thread.join(360)
    if notice == "drain":
        cluster.remove_node(node)  # what the drain's deadline would bring
    assert "error" not in box, box.get("error")
    s = box["summary"]
    assert s["status"] == "FINISHED" and s["steps_done"] == 5
    (rec,) = s["recoveries"]
    assert rec["cause"] == "preemption" and rec["steps_lost"] == 0
    assert rec["old_mesh"]["world_size"] == 8 and rec["new_mesh"]["world_size"] == 4
    # The notice was acted on at the next step boundary, with a checkpoint taken there.
    store = CheckpointStore(tmp_path / "checkpoints")
    assert rec["step"] > 2 and store.read_manifest(store.step_dir(rec["step"])) is not None
    if notice == "sigterm":
        assert victim not in s["rank_pids"][-1]
    else:
        assert node.node_id not in s["rank_to_node"] and len(s["rank_to_node"]) == 4


@pytest.mark.timeout(120)
def test_a_drain_is_seen_as_a_notice(cluster):
    """Ray draining a node (the autoscaler, KubeRay, ``ray drain-node``) is what the controller
    reads after every step (``draining_nodes``) and treats as the notice a SIGTERM is (the
    job's reaction to a notice: the test above)."""
    from ray.core.generated import autoscaler_pb2
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from trainmesh.platform.ray_group import draining_nodes

    node, busy = cluster.add_node(num_cpus=1, num_gpus=1), None
    try:
        # something running there (as ranks would be): an idle node is drained at once
        busy = ray.remote(num_cpus=1)(lambda: time.sleep(60)).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote()
        time.sleep(2)
        assert node.node_id not in draining_nodes()
        gcs = ray._raylet.GcsClient(address=cluster.gcs_address)
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        deadline = int(time.time() * 1000) + 120_000
        accepted, why = gcs.drain_node(node.node_id, reason, "test: spot reclaim", deadline)
        assert accepted, why
        assert draining_nodes()[node.node_id] == deadline
    finally:
        if busy is not None:
            ray.cancel(busy, force=True)
        cluster.remove_node(node)


@pytest.mark.timeout(400)
def test_a_hung_rank_is_detected_long_before_the_collective_timeout(cluster, tmp_path):
    """Rank 6 freezes (SIGSTOP: alive to Ray, silent to its peers) entering a backward of its
    third step. The step outlives ``elastic.hang_timeout_s``, rank 6 does not answer its
    control path, its node's ranks are killed and the job recovers warm on the other node,
    while the collective timeout (120 s) never fires."""
    from trainmesh.actors.progress import FAULT_ENV

    while len(_gpu_nodes(cluster)) < 2:
        cluster.add_node(num_cpus=4, num_gpus=4)
    # Background saves: one may be in flight when the node's ranks are killed (it never counts).
    spec = load_spec(None, [*ARGS_3D, "training.steps=4", "runtime.collective_timeout_s=120",
                            "checkpoint.async_save=true", "elastic.hang_timeout_s=3",
                            f"runtime.output_dir={tmp_path}"])
    fault = f"hang@rank=6,step=2,phase=backward,marker={tmp_path / 'fired'}"
    s = run_job(spec, environ={FAULT_ENV: fault}, show_progress=False)
    assert (tmp_path / "fired").exists()
    assert s["status"] == "FINISHED" and s["steps_done"] == 4 and s["mesh"]["world_size"] == 4
    (rec,) = s["recoveries"]
    assert rec["cause"] == "HangDetected" and rec["mode"] == "warm"
    # the step-2 save was written in the background: it is committed only at a step boundary
    # after it, and the hang comes first, so it never counts and the job starts over
    assert rec["step"] == 0 and rec["steps_lost"] == 2
    assert rec["downtime_s"] < 60, rec  # the hang bound and a recovery, not 120 s of timeout
    # The other node's ranks went on in their processes; one still stuck in a sub-group
    # collective after the abort (gloo frees those only at the timeout) is killed and its
    # place refilled by a new actor on the same node.
    before, after = set(s["rank_pids"][-2]), set(s["rank_pids"][-1])
    assert len(after) == 4 and after & before
    from reference import reference_run  # the run no hang touched (4 steps: its own LR curve)

    want, _ = reference_run(spec, str(tmp_path / "data" / "tiny-corpus"), steps=4)
    torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(want), rtol=1e-4, atol=0)
    # The pipeline's planned grid and measured trace reach MLflow (every stage's work measured).
    import json

    from mlflow.tracking import MlflowClient

    names = {a.path for a in MlflowClient(s["tracking_uri"]).list_artifacts(s["mlflow_run_id"])}
    assert {"pipeline_schedule.txt", "pipeline_schedule.png", "pipeline_trace.json"} <= names
    trace = json.loads((tmp_path / "pipeline_trace.json").read_text())
    computed = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "compute"}
    assert {"0F0", "2F1", "3B1", "1B0"} <= computed
