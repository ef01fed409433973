"""The stand-in rank (``trainmesh/testing/standin.py``) that ``bench/control_plane.py`` runs by
the hundred: it answers every call the controller makes of a rank, and the real controller runs
a job through it. (Its own module: a simulated cluster ends the shared local Ray instance.)"""

from __future__ import annotations

import pytest

from trainmesh.cli.loading import load_spec
from trainmesh.controller.launch import run_job
from trainmesh.testing.standin import STEP_S_ENV, StandInEngine, StandInRank

BASE = ["model.preset=tiny", "training.global_batch_size=8", "training.microbatch_size=2",
        "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.collective_timeout_s=60",
        "elastic.ready_ranks_per_node=0"]


def test_the_stand_in_answers_every_call_the_controller_makes_of_a_rank():
    """Every public method of the rank actor that reaches torch or the engine is one the stand-in
    overrides, or one whose only use of the engine the stand-in engine provides (its step,
    ``train_step``, ``step``), or one no job calls (dry runs' and the probes')."""
    import inspect

    from trainmesh.actors.rank_worker import RankWorker

    def public(cls):
        return {n for n, f in vars(cls).items() if inspect.isfunction(f) and not n.startswith("_")}

    def words(name):
        src = inspect.getsource(getattr(RankWorker, name))
        return set(src.replace("(", " ").replace(".", " ").replace(",", " ").split())

    reaching = {n for n in public(RankWorker) if {"torch", "_import_stack", "engine"} & words(n)}
    as_is = {"train_step", "train_segment", "save_status", "save_report", "wait_save", "finish_save",
             "saved_files"}
    never = {"reset_peak_memory", "memory_report", "execute"}
    left = reaching - public(StandInRank) - as_is - never
    assert not left, f"rank methods reaching torch or the engine the stand-in does not answer: {sorted(left)}"
    # what the as-is ones use of the engine, the stand-in engine has
    for name in as_is & reaching:
        used = {w.split("engine", 1)[1] for w in inspect.getsource(getattr(RankWorker, name)).split()
                if "self.engine." in w}
        for attr in {u.strip(".").split("(")[0].split(")")[0].split(".")[0] for u in used}:
            assert hasattr(StandInEngine, attr) or attr in ("step", "device", "rng"), (name, attr)


PROBE = """
import os, sys, tempfile
from trainmesh.cli.loading import load_spec
from trainmesh.testing.standin import StandInRank
spec = load_spec(None, ["model.preset=tiny", "training.global_batch_size=8", "training.seq_len=32"])
r = StandInRank(0, 1, 1)
r.adopt(0, 1, 1, [])
r.init_process_group(*r.create_store(10), "cpu", 10)
r.build(spec.model_dump_json(), {"dp": 1}, "")
assert r.train_segment(0, 3, 60.0)["steps"] == 3
d = os.path.join(tempfile.mkdtemp(), "step-3")
os.makedirs(d)
assert r.save(d)["files"]
r.memory_snapshot("snap-3", None)
r.load(d, 3, None)
r.reset(0, 1)
r.shutdown()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


@pytest.mark.timed  # (its own time bound: with the Ray tests under `make test`)
def test_a_stand_in_rank_process_never_imports_torch():
    """What lets hundreds of stand-ins fit on one machine (a rank process with torch holds ~0.5
    GB): a rank's whole life — start, group, build, a segment, a save, a snapshot, a restore, a
    re-form, its end — in a fresh process, and torch never imported."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_stand_in_ranks_run_a_job_with_checkpoints_and_snapshots(tmp_path):
    """4 stand-in ranks on two simulated nodes of 2 accelerators: the controller runs the job
    through them (segments, a checkpoint, snapshots replicated to a buddy on the other node) with
    no torch in the ranks, and the losses are the stand-in's function of the step."""
    from servers import simulated_cluster

    spec = load_spec(None, [*BASE, "runtime.device=auto", "runtime.cpus_per_rank=0.1",
                            "training.microbatch_size=1",
                            "parallelism.dp=4", "training.steps=12", "checkpoint.every=6",
                            "checkpoint.in_memory.every=4", "tracking.enabled=false",
                            f"runtime.output_dir={tmp_path / 'out'}"])
    with simulated_cluster(2, num_cpus=1, num_gpus=2):
        s = run_job(spec, environ={}, show_progress=False, rank_cls=StandInRank,
                    job_env={STEP_S_ENV: "0.02"})
    assert s["status"] == "FINISHED" and s["losses"] == [10.0 / k for k in range(1, 13)]
    assert len(s["control"]["snapshot_s"]) == 2 and len(s["control"]["save_s"]) == 2
