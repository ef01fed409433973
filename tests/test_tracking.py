"""Tracking on this machine: a local run's MLflow artifacts go under its output directory, not
into ``./mlruns`` of whatever directory the job was started from."""

from __future__ import annotations

from trainmesh.tracking.mlflow_tracker import open_tracker, resolve_tracking_uri


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
