"""Where users run it: a real Ray head (`ray start --head`, dashboard and job API on 127.0.0.1,
token authentication) and a real `mlflow server` on loopback. `trainmesh submit --follow` runs
the tiny job there; `trainmesh jobs ...` inspect and stop jobs; a tracking server killed in the
middle of a run neither stops training nor loses the metrics logged while it was away, and a
`trainmesh run` SIGKILLed and run again resumes in the same MLflow run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from servers import MlflowServer, RayHead, descendants

from trainmesh.cli.main import main

pytestmark = [pytest.mark.cluster,  # every test here starts Ray,
              pytest.mark.ray_apart]  # only in processes of its own

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "jobs" / "tiny-cpu.yaml")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    head = RayHead(Path(f"/tmp/trainmesh-test-ray-{uuid.uuid4().hex[:8]}"))
    with head.client_env():  # this process is the job API's client
        try:
            head.start()
            yield head
        finally:
            head.stop()


def _runs(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([exp.experiment_id]) if exp else [])


@pytest.mark.timeout(500)
def test_tracking_server_outage_then_trainmesh_run_sigkilled_and_run_again(mlflow_server, tmp_path):
    """``trainmesh run`` goes on while the tracking server is down and logs what it missed once
    it is back; then the run itself is SIGKILLed, and the same command run again resumes from
    the newest complete checkpoint in the same MLflow run: every step logged, the steps trained
    twice with equal losses (the exact data position), the run FINISHED. (First here: the
    module's Ray head is not started yet and takes no core from this job's rank.)"""
    from trainmesh.checkpoint.manifest import CheckpointStore

    server = mlflow_server  # the module's: stopped and started again here
    # (the first run is killed a few steps past its first checkpoint after the outage, near
    # step 45 here; the second trains the rest)
    steps = 150
    out = tmp_path / "out"
    # unbuffered: what it printed before the SIGKILL is read back
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "trainmesh.cli.main", "run", TINY, "--no-progress",
               "--set", f"training.steps={steps}", "--set", "checkpoint.every=10",
               "--set", "parallelism.dp=1", "--set", "training.global_batch_size=8",
               "--set", f"runtime.output_dir={out}", "--set", f"tracking.uri={server.uri}",
               "--set", "tracking.experiment=outage",
               "--set", "elastic.ready_ranks_per_node=0"]  # (no rank fails: no spare process)

    log_path = tmp_path / "run.log"

    def start():
        with open(log_path, "w") as log:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)

    def logged_steps(at_least: int) -> list:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert job.poll() is None, log_path.read_text()[-3000:]
            client, runs = _runs(server.uri, "outage")
            if runs:
                history = client.get_metric_history(runs[0].info.run_id, "loss")
                if max((m.step for m in history), default=0) >= at_least:
                    return history
            time.sleep(0.5)
        raise AssertionError(f"the job never logged step {at_least}")

    job = start()
    try:
        logged_steps(5)
        server.stop()
        # steps go on while nothing listens, until a send has failed (reports are read and
        # sent about once a second: a fixed sleep could end before any send was tried)
        deadline = time.monotonic() + 240
        while "unreachable" not in log_path.read_text():
            assert job.poll() is None, "the job ended while the server was down"
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        frozen = descendants(job.pid) | {job.pid}  # (while the server restarts, however long
        _signal(frozen, signal.SIGSTOP)  # that takes: the job must not reach its end meanwhile)
        server.start()
        _signal(frozen, signal.SIGCONT)
        deadline = time.monotonic() + 240
        while "is back" not in log_path.read_text():  # its next retry found the server
            assert job.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        store = CheckpointStore(out / "checkpoints")
        after = max(m.step for m in logged_steps(1))  # what it logged while nothing listened
        while True:  # a checkpoint after the outage, and steps past it on the server
            logged_steps(max([after, *store.verified_steps()]) + 5)
            started = descendants(job.pid) | {job.pid}  # with its local Ray instance
            _signal(started, signal.SIGSTOP)  # frozen: nothing logs or commits meanwhile
            # (committed: a background save's directory is there while it is written)
            resume_at = max(store.verified_steps(), default=0)
            client, (run,) = _runs(server.uri, "outage")
            logged = max(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
            if resume_at > after and logged > resume_at:
                break
            _signal(started, signal.SIGCONT)
        job.kill()  # SIGKILL: no handler runs, no summary, the MLflow run left RUNNING
        job.wait(timeout=60)
        assert "unreachable" in log_path.read_text()
        _signal(started, signal.SIGKILL)  # the rest of its Ray instance (agents outlive it)

        job = start()
        job.wait(timeout=400)
        assert job.returncode == 0, log_path.read_text()[-3000:]
        client, runs = _runs(server.uri, "outage")
        assert len(runs) == 1  # the same MLflow run, resumed
        (run,) = runs
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "loss")
        by_step: dict[int, list[float]] = {}
        for m in history:
            by_step.setdefault(m.step, []).append(m.value)
        assert sorted(by_step) == list(range(1, steps + 1))
        twice = [s for s, v in by_step.items() if len(v) > 1]
        assert twice and min(twice) == resume_at + 1  # trained again from the checkpoint on
        for s in twice:
            assert max(by_step[s]) - min(by_step[s]) <= 1e-5 * abs(by_step[s][0]), (s, by_step[s])
        events = json.loads(Path(client.download_artifacts(run.info.run_id, "events.json",
                                                           str(tmp_path))).read_text())
        assert {"kind": "resume", "step": resume_at} in [
            {k: e[k] for k in ("kind", "step") if k in e} for e in events if e["kind"] == "resume"]
    finally:
        if job.poll() is None:
            job.kill()
        if server.proc is None:  # left stopped by a failure: the module's other tests use it
            server.start()


@pytest.mark.timeout(400)
def test_submit_follow_runs_the_tiny_job_and_tracks_it_on_the_server(ray_head, mlflow_server, tmp_path,
                                                                      capsys, monkeypatch):
    """The default, relative runtime.output_dir (runs/<name>) lands under the directory the
    user submitted from, and the submit line says where."""
    monkeypatch.chdir(tmp_path)
    rc = main(["submit", TINY, "--address", ray_head.address, "--follow",
               "--set", "training.steps=12", "--set", "checkpoint.every=6", "--set", "optimizer.warmup_steps=2",
               "--set", f"tracking.uri={mlflow_server.uri}", "--set", "tracking.experiment=submitted",
               "--set", "elastic.ready_ranks_per_node=0"])  # (no rank fails: no spare process)
    out, err = capsys.readouterr()
    assert rc == 0, (out + err)[-3000:]
    assert "SUCCEEDED" in out.splitlines()[-1]
    assert f"outputs under {tmp_path / 'runs' / 'tiny-cpu'} on the cluster's filesystem" in out
    client, runs = _runs(mlflow_server.uri, "submitted")
    [run] = runs
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 13))
    assert (tmp_path / "runs" / "tiny-cpu" / "summary.json").exists()


@pytest.mark.timeout(400)
def test_jobs_list_status_logs_and_stop(ray_head, tmp_path, capsys):
    job_id = f"tm-{uuid.uuid4().hex[:8]}"
    assert main(["submit", TINY, "--address", ray_head.address, "--submission-id", job_id,
                 "--set", "training.steps=100000", "--set", "tracking.enabled=false",
                 "--set", "elastic.ready_ranks_per_node=0",  # (no rank fails: no spare process)
                 "--set", f"runtime.output_dir={tmp_path / 'long'}"]) == 0
    assert capsys.readouterr().out.startswith(f"submitted {job_id}")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # running, and training: its log shows steps
        main(["jobs", "logs", job_id, "--address", ray_head.address])
        if "step" in capsys.readouterr().out:
            break
        time.sleep(2)
    assert main(["jobs", "status", job_id, "--address", ray_head.address]) == 0
    assert capsys.readouterr().out.startswith(f"{job_id}: RUNNING")
    assert main(["jobs", "list", "--address", ray_head.address]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    [mine] = [line for line in lines if line.startswith(job_id)]
    # By name and spec as typed, with the outputs' place; submit's probe jobs and the
    # launcher's shell line are not listed.
    assert mine.split()[1:3] == ["RUNNING", "tiny-cpu"]
    assert mine.endswith(f"{TINY} --set training.steps=100000 --set tracking.enabled=false "
                         "--set elastic.ready_ranks_per_node=0 "
                         f"--set runtime.output_dir={tmp_path / 'long'} ({tmp_path / 'long'})")
    assert not [line for line in lines if "trainmesh-probe" in line or "/proc/" in line]
    assert main(["jobs", "stop", job_id, "--address", ray_head.address]) == 0
    assert capsys.readouterr().out.strip() == f"{job_id}: stopped (STOPPED)"
    assert main(["jobs", "status", "no-such-job", "--address", ray_head.address]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["no-such-job: no such job on this cluster; see `trainmesh jobs list`"]


def test_submit_probes_that_the_cluster_has_this_trainmesh(ray_head, capsys, monkeypatch):
    """The head runs from a venv that is not on PATH (tests/servers.py): the probe job finds
    that interpreter; a client of another version is told what to install, nothing runs."""
    import trainmesh

    monkeypatch.setattr(trainmesh, "__version__", "9.9.9")
    assert main(["submit", TINY, "--address", ray_head.address]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    from importlib.metadata import version

    assert f"the cluster has trainmesh {version('trainmesh')}, this client 9.9.9" in line
    assert "pip install trainmesh==9.9.9" in line


def test_submit_refuses_a_bad_spec_and_a_dead_address(capsys, tmp_path):
    assert main(["submit", TINY, "--set", "training.stepz=3", "--address", "http://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err.startswith("training.stepz: unknown field")
    assert main(["submit", TINY, "--address", "http://127.0.0.1:9"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("--address http://127.0.0.1:9: cannot reach a Ray job API there")


def _signal(pids: set[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
