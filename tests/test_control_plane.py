"""The control plane: the ranks run segments of steps between boundaries without a call from the
controller per step (``Controller._train``, ``RankWorker.train_segment``), rank 0 reports each
step, and every rank leaves a segment at the same step. (The stand-in rank the control-plane
bench runs by the hundred: ``tests/test_control_plane_standin.py``.)"""

from __future__ import annotations

import json

import pytest
import torch

from trainmesh.cli.loading import load_spec
from trainmesh.controller.launch import run_job
from trainmesh.testing.standin import CALLS_DIR_ENV, counting

pytestmark = pytest.mark.cluster

BASE = ["model.preset=tiny", "training.global_batch_size=8", "training.microbatch_size=2",
        "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.device=cpu",
        "runtime.collective_timeout_s=60", "elastic.ready_ranks_per_node=0"]


def _calls(directory) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("calls-*.json"))]


@pytest.mark.timeout(300)
def test_a_40_step_job_calls_each_rank_once_per_segment(ray_local, tmp_path):
    """dp 2, 40 steps, one checkpoint, at step 25: three segments (the first step alone; then to
    the checkpoint; then to the end; another where the checkpoint's digests came in late, or at
    a segment's time cap on a slow machine), one call per rank each. Every call a rank receives — its
    start, the segments, the save (its files' sizes with its answer, their digests with the
    next segment's), its end — is at most 0.25 per rank per step, rank 0's reports aside:
    those are read once a second (``ray_group.POLL_S``) whatever the ranks and the steps, and
    are bounded by the job's time. The losses are the single process's and MLflow has every
    step's metrics."""
    import time

    from mlflow.tracking import MlflowClient
    from reference import reference_run

    from trainmesh.actors.rank_worker import RankWorker
    from trainmesh.controller.ray_group import POLL_S
    from trainmesh.planning.cadence import SEGMENT_S

    calls_dir = tmp_path / "calls"
    calls_dir.mkdir()
    spec = load_spec(None, [*BASE, "parallelism.dp=2", "training.steps=40", "checkpoint.every=25",
                            "checkpoint.async_save=false", "checkpoint.save_final=false",
                            f"runtime.output_dir={tmp_path / 'out'}"])
    t0 = time.monotonic()
    s = run_job(spec, environ={}, show_progress=False, rank_cls=counting(RankWorker),
                job_env={CALLS_DIR_ENV: str(calls_dir)})
    wall_s = time.monotonic() - t0
    assert s["status"] == "FINISHED" and s["steps_done"] == 40
    # Three segments ran to their planned boundary; one more may end where the checkpoint's
    # digests (taken in a thread while training goes on) are in, on a machine slow enough that
    # they were not by step 26's start, and a segment may end at its time cap (SEGMENT_S): both
    # said in "ended", nothing else ends one.
    control = s["control"]
    extra = control["ended"].get("save_written", 0) + control["ended"].get("time", 0)
    assert set(control["ended"]) <= {"steps", "save_written", "time"}, control["ended"]
    assert control["ended"].get("steps") == 3 and extra <= 1 + wall_s // SEGMENT_S, control["ended"]
    assert control["segments"] == 3 + extra and control["steps"] == 40, control
    assert 0 < control["first_step_cpu_s"] < control["first_step_s"], control
    counted = _calls(calls_dir)
    assert sorted(c["rank"] for c in counted) == [0, 1]
    for c in counted:
        calls = c["calls"]
        assert calls["train_segment"] == 3 + extra and "train_step" not in calls, calls
        assert "saved_files" not in calls and calls["save"] == 1, calls
    print(json.dumps({c["rank"]: c["calls"] for c in counted}), f"{wall_s:.1f} s")
    per_rank_step = sum(sum(n for m, n in c["calls"].items() if m != "reports")
                        for c in counted) / len(counted) / 40
    assert per_rank_step <= 0.25, json.dumps(counted)
    by_rank = {c["rank"]: c["calls"] for c in counted}
    assert by_rank[0].get("reports", 0) <= wall_s / POLL_S + 2, (wall_s, counted)
    assert "reports" not in by_rank[1], counted
    ref, _ = reference_run(spec, str(tmp_path / "out" / "data" / "tiny-corpus"), steps=40)
    torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(ref), rtol=1e-5, atol=0)
    history = MlflowClient(tracking_uri=s["tracking_uri"]).get_metric_history(s["mlflow_run_id"], "loss")
    assert [(m.step, m.value) for m in history] == [(i + 1, v) for i, v in enumerate(s["losses"])]
    assert [c[-11:] for c in s["checkpoints"]] == ["step-000025"]
