"""The single-process reference: the same model and data, stepped by stock torch parts only.

Nothing of the project's own step, optimizer or clipping (``engine/step.py``) is used here, so
that a bug in them shows in every parity test instead of cancelling out: ``torch.optim.AdamW`` (torch's default
implementation, not the fused one the ranks run), ``torch.nn.utils.clip_grad_norm_``, the
model's plain forward to logits and ``F.cross_entropy``, and the LR schedule written out
below. What the model family does around a step (MoE: the balancing loss's share per
microbatch, the router bias after the update) is the model's own code, called directly.

Tolerances: the parity tests compare float32 runs; the stock AdamW and the fused one, and
clipping by one global norm or by shards' partial norms summed in float64, round differently
in the last bits (~1e-7 relative per step), well inside the 1e-5 relative the tests allow
for three steps, and far outside what a wrong epsilon or a per-shard clip moves
(``tests/test_reference_mutations.py``)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from trainmesh.data.dataset import open_datasets
from trainmesh.engine.engine import build_model
from trainmesh.models.moe.moe import balance_experts, moe_layers
from trainmesh.spec.job import JobSpec

# Runs already made in this process: parity tables ask for the same model, data and optimizer
# under many meshes and schedules (a run's result depends on no other part of the spec).
_RUNS: dict[str, tuple] = {}
# ... and each run's gradient norms per step (before clipping), under the same keys
_NORMS: dict[str, list[float]] = {}


def reference_run(spec: JobSpec, data_dir: str, steps: int, grads_after: int | None = None,
                  prepare=None, model_loss: bool = False
                  ) -> tuple[list[float], dict[str, torch.Tensor]] | tuple[list[float], dict, dict]:
    """Losses of ``steps`` steps over the whole global batch, and the parameters after them
    (and, with ``grads_after=k``, every gradient as left by step k). ``prepare(model)`` adjusts
    the built model first (as a parallel test adjusts its ranks' parts). The same run asked
    for again (model, training, optimizer and data sections, the dataset's bytes) is answered
    from the first one's results (copies), unless ``prepare`` is given. ``model_loss``: each
    microbatch's loss from the model's own head (``model(x, y)``: the fused loss kernel where
    ``model.kernels`` picks it), for the kernel tests, instead of logits and F.cross_entropy."""
    key = None if prepare is not None else f"{_run_key(spec, data_dir, steps, grads_after)}|{model_loss}"
    if key not in _RUNS:
        out, norms = _run(spec, data_dir, steps, grads_after, prepare, model_loss)
        if key is None:
            return out
        _RUNS[key], _NORMS[key] = out, norms
    losses, *tensors = _RUNS[key]
    return (list(losses), *({k: v.clone() for k, v in d.items()} for d in tensors))


def reference_grad_norms(spec: JobSpec, data_dir: str, steps: int,
                         grads_after: int | None = None) -> list[float]:
    """The global gradient norm (before clipping) of each of ``reference_run``'s steps."""
    reference_run(spec, data_dir, steps, grads_after)
    return list(_NORMS[f"{_run_key(spec, data_dir, steps, grads_after)}|False"])


def _run_key(spec: JobSpec, data_dir: str, steps: int, grads_after: int | None) -> str:
    digest = hashlib.sha256()
    for f in sorted(p for p in Path(data_dir).rglob("*") if p.is_file()):
        digest.update(f.relative_to(data_dir).as_posix().encode() + f.read_bytes())
    sections = spec.model_dump_json(include={"model", "training", "optimizer", "data"})
    return f"{sections}|{steps}|{grads_after}|{digest.hexdigest()}"


def _run(spec: JobSpec, data_dir: str, steps: int, grads_after: int | None, prepare,
         model_loss: bool):
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
    o = spec.optimizer
    # no weight decay on norms (1-D parameters): the spec's documented grouping
    opt = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
         {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, tr.steps, o))
    losses, grads, norms = [], {}, []
    for step in range(steps):
        mbs = data.microbatches(tr.seed, step, tr.global_batch_size, 0, 1, tr.microbatch_size)
        opt.zero_grad(set_to_none=True)
        for _, moe in moe_layers(model):  # the balancing loss takes a microbatch's share too
            moe.loss_scale = 1.0 / len(mbs)
        loss = 0.0
        for x, y in mbs:
            if model_loss:
                mean = model(x, y) / len(mbs)
            elif spec.model.mtp is not None:
                main, ahead = _with_multi_token_prediction(model, x, y, spec.model.mtp)
                (main + ahead).div(len(mbs)).backward()
                loss += float(main.detach()) / len(mbs)
                continue
            else:
                mean = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / len(mbs)
            mean.backward()
            loss += float(mean.detach())
        clip = o.grad_clip if o.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        balance_experts(model)  # the routers' bias, after the update (the model's own rule)
        losses.append(loss)
        norms.append(float(norm))
        if grads_after == step + 1:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ((losses, params) if grads_after is None else (losses, params, grads)), norms


def _with_multi_token_prediction(model, x, y, mtp) -> tuple[torch.Tensor, torch.Tensor]:
    """The next-token loss and what DeepSeek-V3's multi-token prediction adds, written out
    from the modules (one forward of the model's blocks): module k, over the positions with a
    token k + 1 ahead, takes the previous hidden state (the model's normalised output for the
    first) and the embedding of the token k ahead, and its loss against the token k + 1 ahead
    is averaged over the modules, × loss_weight."""
    T = x.shape[1]
    h = model.tok_embeddings(x)
    for block in model.layers.values():
        h = block(h, model.rope_cos, model.rope_sin)
    h = model.norm(h)
    main = F.cross_entropy(model.output(h).flatten(0, 1).float(), y.flatten())
    losses = []
    for k, module in enumerate(model.mtp.values(), start=1):
        e = model.tok_embeddings(y[:, k - 1:T - 1])  # the tokens k ahead of positions 0 … T-k-1
        z = module.eh_proj(torch.cat([module.enorm(e), module.hnorm(h[:, :T - k])], dim=-1))
        h = module.norm(module.block(z, model.rope_cos, model.rope_sin))
        losses.append(F.cross_entropy(model.output(h).flatten(0, 1).float(), y[:, k:].flatten()))
    return main, mtp.loss_weight * torch.stack(losses).mean()


def _lr_factor(step: int, total: int, o) -> float:
    """Linear warm-up over ``warmup_steps`` to 1, then cosine decay to ``min_lr_ratio`` at
    ``total`` steps (the schedule the spec documents, written out here)."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def load_checkpoint_params(spec: JobSpec, directory: str) -> dict[str, torch.Tensor]:
    """Read a sharded checkpoint into the single-process model (DCP without a process group)."""
    import torch.distributed.checkpoint as dcp

    model = build_model(spec, torch.device("cpu"))
    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=directory)
    return sd
