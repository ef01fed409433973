"""Held-out evaluation during a run: when it is due, what it logs, what the summary keeps."""

from __future__ import annotations

from typing import Any

from trainmesh.spec.job import JobSpec


class Evaluator:
    def __init__(self, spec: JobSpec):
        self.enabled = bool(spec.data.eval_path or spec.data.eval_fraction)
        self.every, self.batches = spec.eval.every, spec.eval.batches
        self.results: list[dict[str, Any]] = []  # {"step", "loss"}, one per evaluated step

    def due(self, step: int, last: bool) -> bool:
        return self.enabled and (last or (self.every > 0 and step % self.every == 0))

    def run(self, group, step: int, tracker) -> float:
        """Evaluate the model after ``step`` steps; logged as MLflow metric ``eval_loss``. A
        step evaluated again (re-run after a recovery) replaces its earlier result."""
        loss = group.evaluate(self.batches)
        tracker.log_metrics({"eval_loss": loss}, step=step)
        self.results = [r for r in self.results if r["step"] != step] + [{"step": step, "loss": loss}]
        return loss


def evaluate_once(controller) -> dict[str, Any]:
    """``trainmesh eval``: plan, place and build every rank, restore the run's newest
    checkpoint (or start from ``model.init_from`` / the seeded init when there is none) and
    evaluate; nothing is trained, saved or tracked."""
    from trainmesh.tracking.mlflow_tracker import NullTracker

    if not Evaluator(controller.spec).enabled:
        raise ValueError("evaluation needs held-out data: set data.eval_path or data.eval_fraction")
    group = controller._place(replan=False, ready=False)
    try:
        step = controller._prepare(group, NullTracker())
        loss = group.evaluate(controller.spec.eval.batches)
    finally:
        group.shutdown()
    ckpts = controller.ckpts.published()
    return {"eval_loss": loss, "step": step, "batches": controller.spec.eval.batches,
            "checkpoint": ckpts[-1] if step else None, "init_from": controller.spec.model.init_from,
            "mesh": controller.dims.as_dict()}
