"""The single-process reference: the same model, data and step function, no distribution."""

from __future__ import annotations

import torch

from trainmesh.data.dataset import open_datasets
from trainmesh.engine.engine import build_model
from trainmesh.engine.step import build_lr_scheduler, build_optimizer, train_step
from trainmesh.spec.job import JobSpec


def reference_run(spec: JobSpec, data_dir: str, steps: int, grads_after: int | None = None,
                  prepare=None) -> tuple[list[float], dict[str, torch.Tensor]] | tuple[list[float], dict, dict]:
    """Losses of ``steps`` steps over the whole global batch, and the parameters after them
    (and, with ``grads_after=k``, every gradient as left by step k). ``prepare(model)`` adjusts
    the built model first (as a parallel test adjusts its ranks' parts)."""
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
    losses, grads = [], {}
    for step in range(steps):
        mbs = data.microbatches(tr.seed, step, tr.global_batch_size, 0, 1, tr.microbatch_size)
        losses.append(train_step(model, opt, sched, mbs, spec.optimizer.grad_clip).loss)
        if grads_after == step + 1:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return (losses, params) if grads_after is None else (losses, params, grads)


def load_checkpoint_params(spec: JobSpec, directory: str) -> dict[str, torch.Tensor]:
    """Read a sharded checkpoint into the single-process model (DCP without a process group)."""
    import torch.distributed.checkpoint as dcp

    model = build_model(spec, torch.device("cpu"))
    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=directory)
    return sd
