"""The controller's small parts: where its data and tracker come from, how a step's metrics
and its summary file are written."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainmesh.spec.job import JobSpec


def make_tracker(spec: JobSpec, uri: str | None, run_id: str | None,
                 on_warning: Callable[[str], None]):
    """The MLflow run (re-opened by ``run_id`` after a restart), or the null tracker."""
    if not spec.tracking.enabled or not uri:
        from trainmesh.tracking.mlflow_tracker import NullTracker

        return NullTracker()
    from trainmesh.tracking.mlflow_tracker import MlflowTracker

    return MlflowTracker(uri, spec.tracking.experiment, spec.name, run_id=run_id,
                         on_warning=on_warning)


def write_json_atomically(path: Path, obj: Any) -> None:
    """Write, then rename over ``path``: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def controller_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def data_dir(spec: JobSpec, out: Path) -> str:
    """The spec's dataset, or the bundled tiny corpus prepared under the run's output."""
    if spec.data.path:
        return spec.data.path if "://" in spec.data.path else str(Path(spec.data.path).resolve())
    from trainmesh.data.shards import ensure_tiny_corpus

    return str(ensure_tiny_corpus(out / "data" / "tiny-corpus"))


def step_metrics(spec: JobSpec, peak_tflops: float) -> Callable[[dict[str, Any], float], dict]:
    """What a step logs, from rank 0's stats and the step's seconds: loss, lr, grad norm, speed
    and MFU (``peak_tflops``: the whole mesh's). The FLOPs per token are counted once."""
    from trainmesh.models.llama.model_math import flops_per_token

    tr = spec.training
    tokens, flops = tr.global_batch_size * tr.seq_len, flops_per_token(spec.model, tr.seq_len)

    def metrics(stats: dict[str, Any], step_s: float) -> dict[str, float]:
        tps = tokens / step_s
        return {"loss": stats["loss"], "lr": stats["lr"], "grad_norm": stats["grad_norm"],
                "tokens_per_s": tps, "step_time_s": step_s,
                "mfu": flops * tps / (peak_tflops * 1e12)}

    return metrics
