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
    """dp 2, 40 steps, checkpoints at 20 and 40: three segments (the first step alone; then to
    the checkpoint; then to the end), one call per rank each; the calls on the steps' path are
    at most 0.25 per rank per step (the rest: the start, the saves, the end); the losses are the
    single process's and MLflow has every step's metrics."""
    from mlflow.tracking import MlflowClient
    from reference import reference_run

    from trainmesh.actors.rank_worker import RankWorker

    calls_dir = tmp_path / "calls"
    calls_dir.mkdir()
    spec = load_spec(None, [*BASE, "parallelism.dp=2", "training.steps=40", "checkpoint.every=20",
                            "checkpoint.async_save=false",
                            f"runtime.output_dir={tmp_path / 'out'}"])
    s = run_job(spec, environ={}, show_progress=False, rank_cls=counting(RankWorker),
                job_env={CALLS_DIR_ENV: str(calls_dir)})
    assert s["status"] == "FINISHED" and s["steps_done"] == 40
    assert s["control"]["segments"] == 3 and s["control"]["steps"] == 40
    counted = _calls(calls_dir)
    assert sorted(c["rank"] for c in counted) == [0, 1]
    path = ("train_segment", "reports", "progress", "request_stop")
    for c in counted:
        calls = c["calls"]
        assert calls["train_segment"] == 3 and "train_step" not in calls, calls
    # on the steps' path, per rank per step (over the ranks): the segments, rank 0's reports
    # (read once a second: their number follows the job's wall time), progress
    on_path = sum(c["calls"].get(m, 0) for c in counted for m in path) / len(counted) / 40
    assert on_path <= 0.25, json.dumps(counted)
    for c in counted:
        calls = c["calls"]
        on_path = sum(calls.get(m, 0) for m in path)
        # the rest, whatever the job's length: its start (the store, the group, where the rank
        # runs, the build), one call per save (its files' sizes come with the save's answer,
        # their digests with a later segment's or the last wait's), its end (the last save's
        # wait, shutdown)
        assert "saved_files" not in calls, calls
        rest = sum(calls.values()) - on_path
        assert rest <= 4 + 2 + 2, json.dumps(calls)
    ref, _ = reference_run(spec, str(tmp_path / "out" / "data" / "tiny-corpus"), steps=40)
    torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(ref), rtol=1e-5, atol=0)
    history = MlflowClient(tracking_uri=s["tracking_uri"]).get_metric_history(s["mlflow_run_id"], "loss")
    assert [(m.step, m.value) for m in history] == [(i + 1, v) for i, v in enumerate(s["losses"])]
    assert [c[-11:] for c in s["checkpoints"]] == ["step-000020", "step-000040"]
