"""ZeRO-3 data parallel on real Ray actors and gloo matches the single-process model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from reference import load_checkpoint_params, reference_run

from trainmesh.checkpoint.manifest import CheckpointStore
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
    final = tmp_path / "checkpoints" / "step-000003"
    _assert_params_close(load_checkpoint_params(spec, str(final)), ref_params)


@pytest.mark.timeout(300)
def test_resume_from_step2_reaches_uninterrupted_step4(ray_local, tmp_path):
    """Run b writes its checkpoints in the background, to a ``file://`` URI (DCP's fsspec
    storage, the manifest through fsspec): its step-2 checkpoint is identical to run a's
    synchronous local one, although training went on while it was written, and resuming from
    it reaches the uninterrupted run's step 4."""
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    ckpt_b = run_b / "ckpt"
    spec_a = _spec(run_a, "parallelism.dp=2", "training.steps=4", "checkpoint.every=2")
    spec_b = _spec(run_b, "parallelism.dp=2", "training.steps=4", "checkpoint.every=2",
                   "checkpoint.async_save=true", f"checkpoint.dir=file://{ckpt_b}")
    full = run_job(spec_a, environ={}, show_progress=False)

    first = run_job(spec_b, environ={}, show_progress=False)
    store_b = CheckpointStore(f"file://{ckpt_b}")
    assert store_b.complete_steps() == [2, 4]
    assert first["checkpoints"] == [f"file://{ckpt_b}/step-000002", f"file://{ckpt_b}/step-000004"]
    a2 = load_checkpoint_params(spec_a, str(run_a / "checkpoints" / "step-000002"))
    b2 = load_checkpoint_params(spec_b, store_b.step_dir(2))
    assert a2.keys() == b2.keys() and all(torch.equal(a2[k], b2[k]) for k in a2)
    # The ranks digested what they wrote: the manifest lists every shard with its sha256.
    meta4 = store_b.read_manifest(store_b.step_dir(4))
    assert meta4 is not None and sum(n.endswith(".distcp") for n in meta4["files"]) >= 2
    # Step 4 corrupted in place (same size: only a digest tells): the ranks' check on restore
    # sets it aside and the run resumes from step 2.
    shard = next(p for p in Path(store_b.step_dir(4)).iterdir() if p.suffix == ".distcp")
    shard.write_bytes(bytes(255 - b for b in shard.read_bytes()))
    resumed = run_job(spec_b, environ={}, show_progress=False)

    assert list(ckpt_b.glob("step-000004.corrupt-*")), "the corrupt checkpoint was not caught"
    assert resumed["steps_done"] == 4
    assert resumed["losses"][:2] == first["losses"][:2]  # kept from before the resume
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"]),
                               rtol=1e-6, atol=0)
    got = load_checkpoint_params(spec_b, store_b.step_dir(4))
    want = load_checkpoint_params(spec_a, str(run_a / "checkpoints" / "step-000004"))
    _assert_params_close(got, want, rtol=1e-6, atol=1e-7)
    assert os.path.exists(run_b / "summary.json")
