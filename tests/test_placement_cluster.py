"""Placement on a simulated multi-node Ray cluster, checked from inside the rank actors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiers import everyday

from trainmesh.actors.worker_group import WorkerGroup
from trainmesh.cli.loading import load_spec
from trainmesh.controller.ray_group import placement_for
from trainmesh.parallel.dims import Axis, ParallelDims
from trainmesh.planning.topology import Topology, topology_from_ray

pytestmark = pytest.mark.cluster  # every test here starts Ray


@pytest.mark.timeout(300)
def test_tp_groups_and_stages_stay_inside_a_node(gpu_cluster):
    """Each TP group and each stage on one node, as the ranks see it. Then, on the same
    actors: a process-group formation whose rank 0 cannot answer (frozen: its store is never
    made) fails at its bound instead of blocking the job."""
    import signal
    import time

    from ray.exceptions import GetTimeoutError

    dims = ParallelDims(pp=2, dp=2, tp=2)
    spec = load_spec(None, ["parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=2"])
    topo = topology_from_ray()
    assert topo.per_node == 4 and topo.world_size == 8
    group = WorkerGroup(placement_for(spec, dims, topo), {}, ready_timeout_s=60)
    infos: list[dict] = []
    try:
        infos = group.call("node_info", timeout_s=120)
        nodes = [info["node_id"] for info in infos]
        for tp in dims.groups(Axis.TP):
            assert len({nodes[r] for r in tp}) == 1, tp
        for stage in range(dims.pp):
            ranks = [r for r in range(dims.world_size) if dims.coords(r)[Axis.PP] == stage]
            assert len({nodes[r] for r in ranks}) == 1
        assert len(set(nodes)) == 2  # one node per stage, two nodes

        os.kill(infos[0]["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(GetTimeoutError):
            group.setup_process_group("cpu", timeout_s=2.0, margin_s=1.0)
        assert time.monotonic() - t0 < 30
    finally:
        if infos:  # (the frozen one: Ray's kill of a stopped process waits 5 s)
            os.kill(infos[0]["pid"], signal.SIGKILL)
        group.shutdown()


@pytest.mark.timeout(120)
def test_a_placement_kept_off_dead_nodes_lands_on_the_others(gpu_cluster):
    """Where no preferred node can hold new ranks' bundles, a re-form places them anywhere
    but on the job's dead nodes (``avoid``): Ray still counts a frozen machine alive, its
    accelerators free, until its health checks time out. Each node in turn is the only one
    not avoided, and the bundle lands there."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from trainmesh.actors.worker_group import place

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(alive) == 3  # the head and 2 nodes
    for target in sorted(alive):
        pg, where = place([{"CPU": 0.01}], "PACK", timeout_s=30, avoid=alive - {target})
        remove_placement_group(pg)
        assert where == {0: target}


def test_dp_peers_span_nodes():
    """Which bundle each rank takes is the placement's (pure); that each bundle is a node of
    its own, and each rank runs on its bundle's node, the test above checks from the ranks."""
    dims = ParallelDims(pp=1, dp=4, tp=2)
    spec = load_spec(None, ["parallelism.tp=2", "parallelism.pp=1", "parallelism.dp=4"])
    bundle = placement_for(spec, dims, Topology.uniform(2, 4, "h100")).rank_bundle
    for group in dims.groups(Axis.TP):
        assert len({bundle[r] for r in group}) == 1
    for group in dims.groups(Axis.DP):
        assert len({bundle[r] for r in group}) == 2, group


@pytest.mark.timeout(300)
def test_plan_cli_plans_for_the_live_cluster(gpu_cluster, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainmesh.cli.main", "plan", "jobs/tiny-cpu.yaml",
         "--set", "parallelism=auto", "--set", f"runtime.ray_address={gpu_cluster.address}",
         "--json", "--top", "50"],
        capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert rows and all(r["tp"] * r["pp"] * r["dp"] + r["idle"] == 8 for r in rows)
    assert rows[0]["idle"] == 0 and max(r["tp"] for r in rows) <= 4  # TP inside a node


@pytest.mark.timeout(300)
def test_checkpoint_dir_the_nodes_do_not_share_is_refused(gpu_cluster, tmp_path):
    """The controller (on the head) writes a probe to ``checkpoint.dir`` and every rank node
    reads it back. ``memory://`` stands in for node-local storage: each process sees its own
    (as each node would see its own disk). Refused before training, naming the field."""
    from trainmesh.controller.elastic import JobFailed
    from trainmesh.controller.launch import run_job

    spec = load_spec(None, ["model.preset=tiny", "parallelism.dp=2", "training.steps=2",
                            "optimizer.warmup_steps=1",
                            "training.global_batch_size=4", "training.seq_len=16",
                            "runtime.device=auto", "tracking.enabled=false",
                            "checkpoint.dir=memory://node-local", f"runtime.output_dir={tmp_path}"])
    with pytest.raises(JobFailed, match="checkpoint.dir: memory://node-local is not shared"):
        run_job(spec, environ={}, show_progress=False)


@pytest.mark.timeout(300)
def test_float8_without_compile_on_gpu_nodes_is_refused_before_any_rank_starts(gpu_cluster, tmp_path):
    """On GPU nodes torchao's float8 casts fuse only under torch.compile (uncompiled, the kit
    measured 0.48× bf16): the controller refuses at its plan, naming the setting, before a rank
    process starts (CPU ranks run torchao's emulation, compiled or not)."""
    import ray

    from trainmesh.controller.elastic import JobFailed
    from trainmesh.controller.launch import run_job

    spec = load_spec(None, ["model.preset=tiny", "parallelism.dp=2", "training.steps=2",
                            "optimizer.warmup_steps=1", "training.float8=tensorwise",
                            "training.global_batch_size=4", "training.seq_len=16",
                            "runtime.device=auto", "tracking.enabled=false", f"runtime.output_dir={tmp_path}"])
    def rank_actors() -> int:  # ever created on this cluster, alive or dead
        if not ray.is_initialized():
            ray.init(address=gpu_cluster.address, log_to_driver=False, configure_logging=False)
        return sum(a["ActorClassName"] in ("RankWorker", "ReadyRank", "Seat")
                   for a in ray._private.state.actors().values())

    before = rank_actors()
    with pytest.raises(JobFailed, match="without model.compile .* set model.compile=true"):
        run_job(spec, environ={}, show_progress=False)
    assert rank_actors() == before


def test_doctor_reports_the_cluster_and_each_problem_with_its_fix(gpu_cluster, tmp_path, capsys):
    from trainmesh.cli.main import main

    blocked = tmp_path / "file"
    blocked.write_text("a file where a directory should be")
    rc = main(["doctor", "jobs/tiny-cpu.yaml", "--set", "runtime.device=auto",
               "--set", "parallelism.tp=2", "--set", "parallelism.dp=2",
               "--set", f"runtime.ray_address={gpu_cluster.address}",
               "--set", "tracking.uri=http://127.0.0.1:9", "--set", f"checkpoint.dir={blocked}/ck"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1 and lines[-1] == "2 problem(s)"
    by = {line.split()[1]: line for line in lines[:-1]}
    assert by["ray"].startswith("ok") and "3 alive node(s)" in by["ray"]
    assert "8 h100 rank slot(s) on 2 node(s)" in by["accelerators"]
    assert by["plan"].startswith("ok") and "tp=2 pp=1 dp=2: 4 rank(s), 4 idle" in by["plan"]
    assert by["tracking"].startswith("FAIL") and "unreachable" in by["tracking"]
    assert "fix: start the MLflow server" in by["tracking"]
    assert by["checkpoints"].startswith("FAIL") and "fix: set checkpoint.dir" in by["checkpoints"]
    # The same cluster as CPU ranks: the head's 1 CPU does not cap tp=2 on the 4-CPU nodes.
    rc = main(["doctor", "jobs/tiny-cpu.yaml", "--set", "runtime.device=cpu",
               "--set", "parallelism.tp=2", "--set", "parallelism.dp=4", "--set", "tracking.enabled=false",
               "--set", f"runtime.ray_address={gpu_cluster.address}",
               "--set", f"runtime.output_dir={tmp_path / 'out'}"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and lines[-1] == "no problems found", lines
    by = {line.split()[1]: line for line in lines[:-1]}
    assert "9 cpu rank slot(s) on 3 node(s)" in by["accelerators"]
    assert "tp=2 pp=1 dp=4: 8 rank(s), 1 idle" in by["plan"]


@pytest.mark.timeout(300)
@everyday("one recovery: a node lost on a simulated cluster, restored warm onto the survivors")
def test_a_lost_node_restores_from_peers_memory_onto_the_survivors_mesh(gpu_cluster, tmp_path, capsys):
    """The in-memory checkpoint tier (last here: it removes a node), with all four axes: an MoE
    model at tp 2 × pp 2 × dp 2 with ep 2 (8 ranks) on the 2 nodes, snapshots every step,
    storage every 6 (the last step here): the node of ranks 4-7 goes as step 5 begins, once
    their snapshots of step 4 are complete (a ``wait`` fault lets the rank's background
    snapshot land first); the 4 survivors re-plan to tp 2 × pp 2 × dp 1 — ep 1: every expert on
    every rank — and restore step 4 (experts, their AdamW moments, the balancing bias) from their
    own snapshots and the copies of the lost ranks', losing only the step in flight, and end
    with the single process's losses. (A node lost while its copies travel restores the
    snapshot before: test_memory_tier.py; a node lost with its buddy: test_fault_matrix.py;
    restored state = storage's, bit for bit, on another mesh: test_reshard_restore.py and, at
    another ep, test_expert_parallel.py.)"""
    from servers import MEMORY_ARGS, assert_reference_losses, run_losing_nodes

    s = run_losing_nodes(gpu_cluster, tmp_path, [
        *MEMORY_ARGS, "model.preset=tiny-moe", "model.moe.balance=bias",
        "model.moe.bias_update_rate=0.01", "parallelism.tp=2", "parallelism.pp=2",
        "parallelism.dp=2", "parallelism.ep=2", "training.steps=6", "checkpoint.every=6",
        "elastic.max_world_size=8"],
        [f"wait@rank={r},step=4,phase=forward" for r in range(4, 8)])
    assert s["status"] == "FINISHED" and s["steps_done"] == 6
    [rec] = s["recoveries"]
    assert rec["restored_from"] == "memory" and rec["mode"] == "warm", rec
    assert rec["step"] == 4 and rec["steps_lost"] == 0, rec  # only the step in flight
    assert (rec["old_mesh"]["world_size"], rec["new_mesh"]["world_size"]) == (8, 4)
    assert rec["old_mesh"]["ep"] == 2 and "ep" not in rec["new_mesh"]
    assert (rec["new_mesh"]["tp"], rec["new_mesh"]["pp"]) == (2, 2)
    assert s["experts"]["all"]["bias_norm"] > 0
    # the console's line for it, as it happened
    from trainmesh.controller.elastic import Recovery

    printed = capsys.readouterr()
    [line] = [x for x in printed.out.splitlines() if x.startswith(("recovered", "resized"))]
    assert "A worker died" not in printed.out + printed.err  # (Ray's notice: in its logs only)
    assert line == Recovery(**rec).line()
    assert ("ep2 (8 ranks) → tp2·pp2·dp1 (4 ranks), warm, step 4 restored from peers' in-memory "
            "snapshots, 0 step(s) lost") in line
    assert_reference_losses(s, tmp_path)
