"""Tracking on this machine: a local run's MLflow artifacts go under its output directory, not
into ``./mlruns`` of whatever directory the job was started from; a tracking server's outage
longer than the backlog kept in memory loses no metric."""

from __future__ import annotations

import json
import time

import pytest
from tiers import full

from trainmesh.tracking.mlflow_tracker import MlflowTracker, open_tracker, resolve_tracking_uri


def test_a_local_runs_artifacts_go_under_its_output_directory(tmp_path, monkeypatch):
    elsewhere = tmp_path / "started-here"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "runs" / "job"
    out.mkdir(parents=True)
    uri = resolve_tracking_uri(None, None, out)
    assert uri == f"sqlite:///{out / 'mlflow.db'}"
    warnings: list[str] = []
    tracker = open_tracker(uri, "exp", "job", None, warnings.append, artifact_dir=out / "mlartifacts")
    (out / "summary.json").write_text("{}")
    tracker.log_dict({"a": 1}, "spec.json")
    tracker.log_artifact(out / "summary.json")
    tracker.finish("FINISHED")
    assert tracker.opened() is None and not warnings
    kept = {p.name for p in (out / "mlartifacts").rglob("*.json")}
    assert {"spec.json", "summary.json"} <= kept
    assert not (elsewhere / "mlruns").exists()


@full("a tracking-server outage of 100 steps, ~30 s: make test keeps the tracker's units; "
      "the outages are make test-all's")
@pytest.mark.timeout(300)
def test_an_outage_longer_than_the_memory_bound_spills_to_a_file_and_loses_no_metric(tmp_path):
    """A real tracking server goes away for 100 steps while the tracker keeps 20 metric values
    (10 steps) in memory: the rest go to a file under the output directory, and once the server
    is back every step's metrics reach it, in order, and the file is gone."""
    from mlflow.tracking import MlflowClient
    from servers import MlflowServer

    server = MlflowServer(tmp_path / "server")
    server.start()
    out = tmp_path / "out"
    warnings: list[str] = []
    tracker = MlflowTracker(server.uri, "exp", "outage", on_warning=warnings.append,
                            retry_interval_s=0.2, send_interval_s=0.05, backlog_dir=out,
                            backlog_in_memory=20)
    try:
        assert tracker.opened() is None
        for step in range(5):
            tracker.log_metrics({"loss": 10.0 - step, "lr": step / 100}, step)
        _wait(lambda: tracker._in_memory == 0)  # (sent while the server was there)
        server.stop()
        for step in range(5, 105):
            tracker.log_metrics({"loss": 10.0 - step, "lr": step / 100}, step)
            time.sleep(0.002)
        spilled = out / f"mlflow-backlog-{tracker.run_id}.jsonl"
        lines = spilled.read_text().splitlines()
        assert len(lines) >= 90 and tracker._in_memory <= 20  # the bound held
        assert [json.loads(line)[0][3] for line in lines] == list(range(105 - len(lines), 105))
        server.start()
        tracker.finish("FINISHED")
    finally:
        server.stop()  # (the history is read from the store itself below)
    client = MlflowClient(tracking_uri=f"sqlite:///{server.root / 'mlflow.db'}")
    for key, value in (("loss", lambda s: 10.0 - s), ("lr", lambda s: s / 100)):
        history = client.get_metric_history(tracker.run_id, key)
        assert [(m.step, m.value) for m in history] == [(s, value(s)) for s in range(105)], key
        stamps = [m.timestamp for m in sorted(history, key=lambda m: m.step)]
        assert stamps == sorted(stamps)  # logged when they happened, replayed in order
    assert not spilled.exists()
    assert any("spill" not in w and "unreachable" in w for w in warnings)
    assert any(str(spilled) in w for w in warnings)


def _wait(ok, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)
