"""Data and checkpoints on an object store: an S3 endpoint on loopback (moto's server, reached
over HTTP by s3fs exactly as a bucket would be; ``tests/servers.py``). A dataset prepared
straight into a bucket trains; a run checkpoints there — in the background too — commits by
its manifest (no rename: there is none on S3), keeps the newest verified checkpoint, and a new
run resumes from it on another mesh with the single process's losses (a node lost mid-run:
``tests/test_object_store_recovery.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from reference import reference_run

from trainmesh.checkpoint.manifest import CheckpointStore
from trainmesh.cli.loading import load_spec
from trainmesh.cli.main import main
from trainmesh.controller.launch import run_job
from trainmesh.data import corpus

BASE = ["model.preset=tiny", "training.global_batch_size=8", "training.microbatch_size=2",
        "training.seq_len=32", "optimizer.warmup_steps=1", "tracking.enabled=false",
        "runtime.device=cpu", "runtime.collective_timeout_s=60", "elastic.ready_ranks_per_node=0",
        "checkpoint.every=2", "checkpoint.keep_last=1",
        # a constant LR after the warm-up: a run of 4 steps, then one resumed to 6, is one of 6
        "optimizer.min_lr_ratio=1.0"]


@pytest.mark.timeout(400)
def test_data_and_checkpoints_on_an_s3_endpoint(ray_local, s3_server, tmp_path):
    bucket = s3_server.bucket()
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus.documents()))
    data = f"s3://{bucket}/data"
    assert main(["data", "prepare", str(docs), "--out", data]) == 0
    ckpt = f"s3://{bucket}/ckpt"
    args = [*BASE, f"data.path={data}", f"checkpoint.dir={ckpt}"]

    first = run_job(load_spec(None, [*args, "parallelism.dp=2", "training.steps=4",
                                     "checkpoint.async_save=true", f"runtime.output_dir={tmp_path / 'a'}"]),
                    environ={}, show_progress=False, job_env=s3_server.env)
    assert first["status"] == "FINISHED"
    store = CheckpointStore(ckpt)
    # step 2 pruned behind the verified step 4 (keep_last: 1); nothing left half-written
    assert store.verified_steps() == store.complete_steps() == [4]
    assert first["checkpoints"] == [f"{ckpt}/step-000004"]

    spec = load_spec(None, [*args, "parallelism.dp=1", "training.steps=6",
                            f"runtime.output_dir={tmp_path / 'b'}"])
    second = run_job(spec, environ={}, show_progress=False, job_env=s3_server.env)
    assert second["resumed_at"] == 4 and second["steps_done"] == 6
    want, _ = reference_run(spec, data, steps=6)
    torch.testing.assert_close(torch.tensor(second["losses"]), torch.tensor(want), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(want[:4]), rtol=1e-5, atol=0)
    assert store.verified_steps() == [6]


def test_doctor_checks_an_s3_checkpoint_dir_and_names_the_variables_when_it_cannot(
        s3_server, monkeypatch):
    from servers import free_port

    from trainmesh.cli.doctor import checkpoints

    bucket = s3_server.bucket()
    spec = load_spec(None, [f"checkpoint.dir=s3://{bucket}/ckpt"])
    [ok] = checkpoints(spec)
    assert ok.ok and "writable" in ok.line()
    assert s3_server.filesystem().ls(bucket) == []  # the probe is gone
    # an endpoint that does not answer (a wrong FSSPEC_S3_ENDPOINT_URL): the fix names the variables
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://127.0.0.1:{free_port()}"})
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    [bad] = checkpoints(load_spec(None, [f"checkpoint.dir=s3://{bucket}/other"]))
    assert not bad.ok and "FSSPEC_S3_ENDPOINT_URL" in bad.fix and "AWS_ACCESS_KEY_ID" in bad.fix
