"""ZeRO-3 data parallel on real Ray actors and gloo matches the single-process model."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from reference import load_checkpoint_params, reference_run

from trainmesh.checkpoint import manifest
from trainmesh.jobs.loading import load_spec
from trainmesh.jobs.runner import run_job

BASE = ["model.preset=tiny", "training.global_batch_size=8", "training.microbatch_size=2",
        "training.seq_len=32", "optimizer.warmup_steps=1", "tracking.enabled=false",
        "runtime.device=cpu", "runtime.collective_timeout_s=60"]


def _spec(tmp_path, *extra):
    return load_spec(None, [*BASE, f"runtime.output_dir={tmp_path}", *extra])


def _assert_params_close(got, want, rtol=1e-5, atol=1e-6):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.timeout(240)
def test_dp2_zero3_matches_single_process(ray_local, tmp_path):
    spec = _spec(tmp_path, "parallelism.dp=2", "training.steps=3", "checkpoint.every=0")
    summary = run_job(spec, environ={}, show_progress=False)
    assert summary["status"] == "FINISHED"
    assert summary["mesh"] == {"pp": 1, "dp": 2, "tp": 1, "world_size": 2, "vpp": 1}

    data_dir = str(tmp_path / "data" / "tiny-corpus")
    ref_losses, ref_params = reference_run(spec, data_dir, steps=3)
    # Loss at every step.
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=0)
    # Every parameter after 3 optimizer steps (read back from the sharded checkpoint).
    final = manifest.step_dir(tmp_path / "checkpoints", 3)
    _assert_params_close(load_checkpoint_params(spec, str(final)), ref_params)


@pytest.mark.timeout(300)
def test_resume_from_step2_reaches_uninterrupted_step4(ray_local, tmp_path):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    spec_a = _spec(run_a, "parallelism.dp=2", "training.steps=4", "checkpoint.every=2")
    spec_b = _spec(run_b, "parallelism.dp=2", "training.steps=4", "checkpoint.every=2")
    full = run_job(spec_a, environ={}, show_progress=False)

    first = run_job(spec_b, environ={}, show_progress=False)
    assert manifest.complete_steps(run_b / "checkpoints") == [2, 4]
    # Lose everything after step 2, as a job killed right after its step-2 save would.
    shutil.rmtree(manifest.step_dir(run_b / "checkpoints", 4))
    resumed = run_job(spec_b, environ={}, show_progress=False)

    assert resumed["steps_done"] == 4
    assert resumed["losses"][:2] == first["losses"][:2]  # kept from before the resume
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"]),
                               rtol=1e-6, atol=0)
    got = load_checkpoint_params(spec_b, str(manifest.step_dir(run_b / "checkpoints", 4)))
    want = load_checkpoint_params(spec_a, str(manifest.step_dir(run_a / "checkpoints", 4)))
    _assert_params_close(got, want, rtol=1e-6, atol=1e-7)
    assert os.path.exists(run_b / "summary.json")


@pytest.mark.timeout(240)
def test_bf16_compute_tracks_fp32(ray_local, tmp_path):
    """bf16 parameters in compute (fp32 master weights, fp32 reduction) stay close to fp32."""
    spec = _spec(tmp_path, "parallelism.dp=2", "training.steps=2", "training.dtype=bfloat16",
                 "checkpoint.save_final=false")
    summary = run_job(spec, environ={}, show_progress=False)
    ref_losses, _ = reference_run(spec, str(tmp_path / "data" / "tiny-corpus"), steps=2)
    got = torch.tensor(summary["losses"])
    assert not torch.allclose(got, torch.tensor(ref_losses), rtol=1e-6, atol=0)  # really bf16
    torch.testing.assert_close(got, torch.tensor(ref_losses), rtol=2e-2, atol=0)


@pytest.mark.timeout(240)
def test_parallelism_auto_plans_for_the_live_cluster(ray_local, tmp_path):
    """`parallelism: auto` asks the planner, which sees the session cluster's 4 CPU ranks."""
    spec = _spec(tmp_path, "parallelism=auto", "training.steps=2", "checkpoint.save_final=false",
                 "training.global_batch_size=16")
    summary = run_job(spec, environ={}, show_progress=False)
    assert summary["status"] == "FINISHED"
    assert summary["mesh"]["world_size"] == 4 and summary["mesh"]["dp"] == 4
    assert summary["plan"]["dp"] == 4 and summary["plan"]["tp"] == 1
    assert len(summary["rank_to_node"]) == 4
