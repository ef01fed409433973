"""Growth on a simulated cluster (ray.cluster_utils.Cluster, real ranks on gloo): scale up when a
node joins; and Ray's drain notice as the controller reads it. Failures, hangs and preemption
notices on a simulated cluster: test_fault_matrix.py; the controller's decisions with a fake
worker group (cold restarts, too few accelerators left): test_controller_states.py."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from servers import simulated_cluster

from trainmesh.checkpoint.manifest import CheckpointStore
from trainmesh.jobs.loading import load_spec
from trainmesh.jobs.runner import run_job

COMMON = ["model.preset=tiny", "training.global_batch_size=16", "training.microbatch_size=2",
          "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.device=auto",
          "runtime.cpus_per_rank=0.5", "runtime.collective_timeout_s=15",
          "elastic.max_restarts=3"]


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(1, num_cpus=4, num_gpus=4) as c:
        yield c


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


@pytest.mark.timeout(120)
def test_a_drain_is_seen_as_a_notice(cluster):
    """Ray draining a node (the autoscaler, KubeRay, ``ray drain-node``) is what the controller
    reads after every step (``draining_nodes``) and treats as the notice a SIGTERM is (the
    job's reaction to a notice: the fault matrix's SIGTERM)."""
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
