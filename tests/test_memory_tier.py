"""The in-memory checkpoint tier on simulated clusters (real ranks on gloo, nodes removed hard):
a lost node restores from the survivors' memory onto the re-planned mesh, losing nothing but
the step in flight; a node lost with its buddy falls back to storage. Both end with the
single-process model's losses. (Restored state = storage's, bit for bit, on another mesh:
test_reshard_restore.py.)"""

from __future__ import annotations

import json
import time

import pytest
import torch
from reference import reference_run
from servers import job_in_background, remove_node_hard, simulated_cluster

from trainmesh.jobs.loading import load_spec

ARGS = ["model.preset=tiny", "training.global_batch_size=8", "training.microbatch_size=2",
        "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.device=auto",
        "runtime.cpus_per_rank=0.5", "checkpoint.in_memory.every=1", "elastic.max_restarts=4",
        "tracking.enabled=false"]


def _run_losing_nodes(cluster, tmp_path, args: list[str], faults: list[str]) -> dict:
    """Run the job; once every fault (``wait@rank=R,...``: that rank stops there) has fired,
    remove the nodes of those ranks at once."""
    from trainmesh.actors.progress import FAULT_ENV

    markers = [tmp_path / f"fired-{i}" for i in range(len(faults))]
    env = ";".join(f"{f},marker={m}" for f, m in zip(faults, markers, strict=True))
    spec = load_spec(None, [*ARGS, *args, f"runtime.output_dir={tmp_path / 'out'}"])
    thread, box = job_in_background(spec, {FAULT_ENV: env})
    removed = False
    while thread.is_alive():
        if not removed and all(m.exists() and m.read_text() for m in markers):
            for node in {json.loads(m.read_text())["node"] for m in markers}:
                remove_node_hard(cluster, node)
            removed = True
        time.sleep(0.1)
    assert "error" not in box, box.get("error")
    assert removed, "the faults never fired"
    box["summary"]["spec"] = spec
    return box["summary"]


def _assert_reference_losses(summary: dict, tmp_path) -> None:
    data_dir = str(tmp_path / "out" / "data" / "tiny-corpus")
    ref, _ = reference_run(summary["spec"], data_dir, steps=summary["steps_done"])
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(ref), rtol=1e-4, atol=0)


@pytest.mark.timeout(300)
def test_a_lost_node_restores_from_peers_memory_onto_the_survivors_mesh(tmp_path):
    """8 ranks (tp 2 × pp 2 × dp 2) on 2 nodes, snapshots every step, storage every 6 (the
    last step here): the node of rank 5 goes as step 5 begins; the 4 survivors re-plan to
    tp 2 × pp 2 and restore step 4 from their own snapshots and the copies of the lost ranks'."""
    with simulated_cluster(2, num_cpus=2, num_gpus=4) as cluster:
        s = _run_losing_nodes(cluster, tmp_path, [
            "parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=2", "training.steps=6",
            "checkpoint.every=6", "elastic.max_world_size=8"], ["wait@rank=5,step=4,phase=forward"])
    assert s["status"] == "FINISHED" and s["steps_done"] == 6
    [rec] = s["recoveries"]
    assert rec["restored_from"] == "memory" and rec["mode"] == "warm", rec
    assert rec["step"] == 4 and rec["steps_lost"] == 0, rec  # only the step in flight
    assert (rec["old_mesh"]["world_size"], rec["new_mesh"]["world_size"]) == (8, 4)
    assert (rec["new_mesh"]["tp"], rec["new_mesh"]["pp"]) == (2, 2)
    _assert_reference_losses(s, tmp_path)


@pytest.mark.timeout(300)
def test_a_node_lost_with_its_buddy_falls_back_to_storage(tmp_path):
    """6 ranks (tp 2 × dp 3) on 3 nodes: the node of ranks 2-3 and the node holding their
    copies (ranks 4-5) go together; the survivors' memory lacks ranks 2-3's shards, so the
    job restores the storage checkpoint of step 2."""
    with simulated_cluster(3, num_cpus=1, num_gpus=2) as cluster:
        s = _run_losing_nodes(cluster, tmp_path, [
            "parallelism.tp=2", "parallelism.dp=3", "training.global_batch_size=12",
            "training.steps=4", "checkpoint.every=2", "elastic.max_world_size=6"],
            ["wait@rank=2,step=3,phase=forward", "wait@rank=4,step=3,phase=forward"])
    assert s["status"] == "FINISHED" and s["steps_done"] == 4
    [rec] = s["recoveries"]
    assert rec["restored_from"] == "storage" and rec["step"] == 2 and rec["steps_lost"] == 1, rec
    assert rec["new_mesh"]["world_size"] == 2
    _assert_reference_losses(s, tmp_path)
