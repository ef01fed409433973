"""The single-process reference: the same model, data and step function, no distribution."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from trainmesh.data.dataset import open_datasets
from trainmesh.engine.engine import build_model
from trainmesh.engine.step import build_lr_scheduler, build_optimizer, train_step
from trainmesh.spec.job import JobSpec

# Runs already made in this process: parity tables ask for the same model, data and optimizer
# under many meshes and schedules (a run's result depends on no other part of the spec).
_RUNS: dict[str, tuple] = {}
# ... and each run's gradient norms per step (before clipping), under the same keys
_NORMS: dict[str, list[float]] = {}


def reference_run(spec: JobSpec, data_dir: str, steps: int, grads_after: int | None = None,
                  prepare=None) -> tuple[list[float], dict[str, torch.Tensor]] | tuple[list[float], dict, dict]:
    """Losses of ``steps`` steps over the whole global batch, and the parameters after them
    (and, with ``grads_after=k``, every gradient as left by step k). ``prepare(model)`` adjusts
    the built model first (as a parallel test adjusts its ranks' parts). The same run asked
    for again (model, training, optimizer and data sections, the dataset's bytes) is answered
    from the first one's results (copies), unless ``prepare`` is given."""
    key = None if prepare is not None else _run_key(spec, data_dir, steps, grads_after)
    if key not in _RUNS:
        out, norms = _run(spec, data_dir, steps, grads_after, prepare)
        if key is None:
            return out
        _RUNS[key], _NORMS[key] = out, norms
    losses, *tensors = _RUNS[key]
    return (list(losses), *({k: v.clone() for k, v in d.items()} for d in tensors))


def reference_grad_norms(spec: JobSpec, data_dir: str, steps: int,
                         grads_after: int | None = None) -> list[float]:
    """The global gradient norm (before clipping) of each of ``reference_run``'s steps."""
    reference_run(spec, data_dir, steps, grads_after)
    return list(_NORMS[_run_key(spec, data_dir, steps, grads_after)])


def _run_key(spec: JobSpec, data_dir: str, steps: int, grads_after: int | None) -> str:
    digest = hashlib.sha256()
    for f in sorted(p for p in Path(data_dir).rglob("*") if p.is_file()):
        digest.update(f.relative_to(data_dir).as_posix().encode() + f.read_bytes())
    sections = spec.model_dump_json(include={"model", "training", "optimizer", "data"})
    return f"{sections}|{steps}|{grads_after}|{digest.hexdigest()}"


def _run(spec: JobSpec, data_dir: str, steps: int, grads_after: int | None, prepare):
    tr = spec.training
    model = build_model(spec, torch.device("cpu"))
    if spec.training.float8 != "none":  # the same linears as the ranks' (torchao's emulation)
        from trainmesh.models.llama.parallelize import apply_float8

        apply_float8(model, spec.training.float8, "cpu", all_gather_in_float8=False)
    data, _ = open_datasets(data_dir, tr.seq_len, spec.data.eval_path, spec.data.eval_fraction)
    if spec.data.document_mask:  # attention inside each document, as the ranks'
        from trainmesh.models.llama.parallelize import apply_context_parallel
        from trainmesh.parallel.context import ContextParallel

        apply_context_parallel(model, ContextParallel(eos=data.tokens.meta["eos_id"]), None)
    if prepare is not None:
        prepare(model)
    opt = build_optimizer(model, spec.optimizer)
    sched = build_lr_scheduler(opt, spec.optimizer, tr.steps)
    losses, grads, norms = [], {}, []
    for step in range(steps):
        mbs = data.microbatches(tr.seed, step, tr.global_batch_size, 0, 1, tr.microbatch_size)
        stats = train_step(model, opt, sched, mbs, spec.optimizer.grad_clip)
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        if grads_after == step + 1:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ((losses, params) if grads_after is None else (losses, params, grads)), norms


def load_checkpoint_params(spec: JobSpec, directory: str) -> dict[str, torch.Tensor]:
    """Read a sharded checkpoint into the single-process model (DCP without a process group)."""
    import torch.distributed.checkpoint as dcp

    model = build_model(spec, torch.device("cpu"))
    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=directory)
    return sd
