"""Experiment tracking behind one small interface: MLflow, or nothing at all.

The controller holds a Tracker and calls it unconditionally; ``NullTracker`` stands in where
nothing is tracked, so no ``if tracking_enabled`` is scattered through the loop.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Tracker(Protocol):
    run_id: str | None
    uri: str | None

    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_dict(self, obj: Any, artifact_file: str) -> None: ...
    def log_artifact(self, path: str | Path) -> None: ...
    def event(self, kind: str, **fields: Any) -> None: ...
    def finish(self, status: str) -> None: ...


class NullTracker:
    run_id = None
    uri = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        pass

    def log_artifact(self, path: str | Path) -> None:
        pass

    def event(self, kind: str, **fields: Any) -> None:
        pass

    def finish(self, status: str) -> None:
        pass


def resolve_tracking_uri(spec_uri: str | None, env_uri: str | None, output_dir: str | Path) -> str:
    """The spec's URI wins, then ``MLFLOW_TRACKING_URI``, then sqlite in the output directory."""
    if spec_uri:
        return spec_uri
    if env_uri:
        return env_uri
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class MlflowTracker:
    """One MLflow run, created or (after a restart) re-opened by id."""

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: str | None = None):
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            self.run_id = self.client.get_run(run_id).info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self._events: list[dict[str, Any]] = []

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items() if k not in existing]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step)
                                                    for k, v in metrics.items()])

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def log_artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def event(self, kind: str, **fields: Any) -> None:
        """A job event (start, checkpoint, resume, ...): kept in ``events.json`` and as a tag."""
        self._events.append({"time": time.time(), "kind": kind, **fields})
        self.client.set_tag(self.run_id, "trainmesh.last_event", json.dumps(self._events[-1]))

    def finish(self, status: str) -> None:
        if self._events:
            self.client.log_dict(self.run_id, self._events, "events.json")
        self.client.set_terminated(self.run_id, status=status)
