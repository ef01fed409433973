"""ZeRO-3 data parallel on real Ray actors and gloo matches the single-process model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from reference import load_checkpoint_params, reference_run
from tiers import everyday

from trainmesh.checkpoint.manifest import CheckpointStore, file_digests
from trainmesh.cli.loading import load_spec
from trainmesh.controller.launch import run_job

pytestmark = pytest.mark.cluster  # every test here starts Ray

BASE = ["model.preset=tiny", "training.global_batch_size=8", "training.microbatch_size=2",
        "training.seq_len=32", "optimizer.warmup_steps=1", "tracking.enabled=false",
        "runtime.device=cpu", "runtime.collective_timeout_s=60",
        # no failure here: a ready rank process (recoveries' spare) would only share the cores
        "elastic.ready_ranks_per_node=0"]


def _spec(tmp_path, *extra):
    return load_spec(None, [*BASE, f"runtime.output_dir={tmp_path}", *extra])


def _assert_params_close(got, want, rtol=1e-5, atol=1e-6):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.timeout(240)
@everyday("the data-parallel axis (ZeRO-3) through the Python API's run (run_job, the real "
          "run path) and its load_model of the sharded checkpoint")
def test_dp2_zero3_matches_single_process(ray_local, tmp_path):
    from trainmesh import api

    spec = _spec(tmp_path, "parallelism.dp=2", "training.steps=3", "checkpoint.every=0")
    summary = api.run(spec, environ={})
    assert summary["status"] == "FINISHED"
    assert summary["mesh"] == {"pp": 1, "dp": 2, "tp": 1, "world_size": 2, "vpp": 1}

    data_dir = str(tmp_path / "data" / "tiny-corpus")
    ref_losses, ref_params = reference_run(spec, data_dir, steps=3)
    # Loss at every step.
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=0)
    # Every parameter after 3 optimizer steps, read back from the sharded checkpoint as the
    # whole model in this process (the run's output directory: its newest checkpoint)
    model = api.load_model(str(tmp_path))
    assert isinstance(model, torch.nn.Module) and not model.training
    _assert_params_close(model.state_dict(), ref_params)


@pytest.mark.timeout(300)
def test_resume_from_step2_reaches_uninterrupted_step4(ray_local, tmp_path):
    """A run writes its checkpoints in the background, to a ``file://`` URI (DCP's fsspec
    storage, the manifest through fsspec): its step-2 checkpoint holds the single process's
    state after step 2, although training went on while it was written, and resuming from it
    reaches the uninterrupted run's step 4."""
    run_b = tmp_path / "b"
    ckpt_b = run_b / "ckpt"
    spec_b = _spec(run_b, "parallelism.dp=2", "training.steps=4", "checkpoint.every=2",
                   "checkpoint.async_save=true", f"checkpoint.dir=file://{ckpt_b}")
    first = run_job(spec_b, environ={}, show_progress=False)
    store_b = CheckpointStore(f"file://{ckpt_b}")
    assert store_b.complete_steps() == [2, 4]
    assert first["checkpoints"] == [f"file://{ckpt_b}/step-000002", f"file://{ckpt_b}/step-000004"]
    _, after2 = reference_run(spec_b, str(run_b / "data" / "tiny-corpus"), steps=2)
    _assert_params_close(load_checkpoint_params(spec_b, store_b.step_dir(2)), after2)
    # The ranks digested what they wrote: the manifest lists every shard with its sha256.
    meta4 = store_b.read_manifest(store_b.step_dir(4))
    assert meta4 is not None and sum(n.endswith(".distcp") for n in meta4["files"]) >= 2
    want4 = load_checkpoint_params(spec_b, store_b.step_dir(4))
    # Step 4 corrupted in place (same size: only a digest tells): the ranks' check on restore
    # sets it aside and the run resumes from step 2.
    shard = next(p for p in Path(store_b.step_dir(4)).iterdir() if p.suffix == ".distcp")
    shard.write_bytes(bytes(255 - b for b in shard.read_bytes()))
    resumed = run_job(spec_b, environ={}, show_progress=False)

    assert list(ckpt_b.glob("step-000004.corrupt-*")), "the corrupt checkpoint was not caught"
    assert resumed["steps_done"] == 4 and (first["resumed_at"], resumed["resumed_at"]) == (0, 2)
    assert resumed["losses"][:2] == first["losses"][:2]  # kept from before the resume
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(first["losses"]),
                               rtol=1e-6, atol=0)
    _assert_params_close(load_checkpoint_params(spec_b, store_b.step_dir(4)), want4, rtol=1e-6, atol=1e-7)
    assert os.path.exists(run_b / "summary.json")


@pytest.mark.timeout(240)
def test_checkpoint_every_auto_chooses_from_measured_costs_and_logs_it_to_mlflow(ray_local, tmp_path):
    """With nodes failing every ~1 s, ``checkpoint.every: auto`` first chooses from the
    predicted save cost (a few bytes: every step or two), then from the measured one (a
    tiny model's save still blocks for a good part of a second here, so its Young/Daly interval
    is several steps), saves exactly where the interval in force falls, and every choice
    reaches MLflow with its reason. The test holds for any measured cost: it checks the saves
    against the choices the run reports."""
    spec = _spec(tmp_path, "parallelism.dp=2", "training.steps=12", "checkpoint.every=auto",
                 "elastic.mtbf_node_hours=0.0003", "checkpoint.keep_last=20",
                 "tracking.enabled=true", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}")
    summary = run_job(spec, environ={}, show_progress=False)
    assert summary["status"] == "FINISHED"
    choices = summary["checkpoint_cadence"]
    assert choices[0]["step"] == 3 and "(predicted)" in choices[0]["reason"]
    assert choices[1]["step"] == 3 and "(measured)" in choices[1]["reason"]
    assert choices[1]["every_steps"] > choices[0]["every_steps"]
    for c in choices:
        assert c["every_steps"] == max(1, round(c["interval_s"] / c["step_time_s"]))
    # the first choice is made after step 3's time is in, before that step's save is due; a
    # choice after a save (at the save's step) holds from the next step on
    want, last = [], 0
    for step in range(1, 12):
        in_force = [c for c in choices if c["step"] < step] or [c for c in choices[:1] if c["step"] == step]
        if in_force and step - last >= in_force[-1]["every_steps"]:
            want.append(step)
            last = step
    saved = CheckpointStore(tmp_path / "checkpoints").complete_steps()
    assert saved == [*want, 12] and want[0] == 3, (saved, choices)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    run_id = summary["mlflow_run_id"]
    logged = client.get_metric_history(run_id, "checkpoint_every_steps")
    assert [int(m.value) for m in sorted(logged, key=lambda m: m.step)] == [
        c["every_steps"] for c in choices]
    events = json.loads(Path(client.download_artifacts(run_id, "events.json", str(tmp_path)))
                        .read_text())
    assert [e["reason"] for e in events if e["kind"] == "checkpoint-cadence"] == [
        c["reason"] for c in choices]
    # Each synchronous save counted at once; its ranks took their files' digests after the
    # write, while training went on, and every one reached its manifest.
    store = CheckpointStore(tmp_path / "checkpoints")
    for step in saved:
        files = store.read_manifest(store.step_dir(step))["files"]
        assert files == file_digests(store.step_dir(step), list(files)), step
    assert sorted(e["step"] for e in events if e["kind"] == "checkpoint-digests") == saved
    assert all(e["lacking"] == 0 for e in events if e["kind"] == "checkpoint-digests")


def test_a_run_naming_another_cluster_than_the_one_connected_is_refused(ray_local, tmp_path, capsys):
    """A program connected to one Ray cluster (its own ray.init) that runs a job whose spec
    names another address is refused naming the field, before anything starts, rather than
    trained on the cluster it happens to be connected to; naming that cluster is accepted."""
    from trainmesh.cli.main import main
    from trainmesh.controller.launch import _other_cluster

    assert main(["run", "jobs/tiny-cpu.yaml", "--set", "runtime.ray_address=127.0.0.1:9",
                 "--set", f"runtime.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    here = ray_local.get_runtime_context().gcs_address
    assert err.startswith(f"runtime.ray_address: this process is connected to the Ray cluster at "
                          f"{here}, not '127.0.0.1:9'") and "ray.shutdown()" in err, err
    assert not list(tmp_path.glob("**/summary.json"))
    port = here.rpartition(":")[2]
    assert _other_cluster(f"localhost:{port}", here) is None  # the same cluster, named so
    assert _other_cluster("local", here) is None and _other_cluster("auto", here) is None
