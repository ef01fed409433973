"""One optimizer step, identical for the single-process model and any parallel wrapping of it.

The parallel run and the single-process reference call the same functions; what differs is
only how the model was wrapped (FSDP2/DTensor) and which slice of the global batch a rank sees.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainmesh.models.hooks import ModelHooks


@dataclass(frozen=True)
class StepStats:
    loss: float  # this rank's microbatch losses × their weights (averaged across DP: the step's)
    grad_norm: float  # global norm before clipping
    lr: float
    tokens: int  # tokens this rank processed
    experts: dict | None = None  # per MoE block: load, balancing loss, dropped, bias norm
    losses: dict | None = None  # auxiliary losses by name (``ModelHooks.losses``), as ``loss``
    breakdown: dict | None = None  # where the rank's step went (``Engine.train_step``)


def build_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW from an ``OptimizerConfig``; no decay on norms (1-D parameters), the fused step
    (one in-place op over a group's tensors, as TorchTitan's default; no parameter-sized
    temporary). Over DTensor shards the foreach step is a dozen list ops whose sharding DTensor
    works out again for each new mesh: on 2 CPU ranks the first step after a build or a
    re-form took 144 ms against the fused step's 58 ms, equal afterwards, same values.
    Parameters are grouped by decay and by the mesh they live on (plain tensors apart): one
    list op cannot mix DTensors and plain tensors (an MoE block's parameters stay plain under
    tensor parallel when nothing shards them), and DCP keys optimizer state by parameter name,
    so the grouping may differ from mesh to mesh."""
    groups: dict[tuple[bool, object], list[nn.Parameter]] = {}
    for p in model.parameters():
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault((p.ndim >= 2, mesh), []).append(p)
    order = sorted(groups, key=lambda k: (not k[0], k[1] is not None))  # decay first
    opt = ShardwiseAdamW(
        [{"params": groups[k], "weight_decay": cfg.weight_decay if k[0] else 0.0} for k in order],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    opt.register_load_state_dict_pre_hook(_keep_implementation)
    return opt


class ShardwiseAdamW(torch.optim.AdamW):
    """torch's AdamW, stepped on each DTensor parameter's local shard. The step is elementwise:
    where a parameter, its gradient and its moments have one layout (the same mesh, each mesh
    dimension Shard or Replicate), stepping the local tensors is the step DTensor takes, without
    DTensor's dispatch of the lists — whose first call for a list of tensors works out a
    sharding for every element: on a 2 × 2 mesh 0.05 s of a core for 21 parameters and 0.9 s
    for 291 (an 8B model's count; ``bench/first_step.py``), paid by every rank before its first
    step after a build or a re-form (a recovery's first step). Any other layout (a gradient still partial) takes
    DTensor's own step. The moments stay DTensors (checkpoints reshard them)."""

    @torch.no_grad()
    def step(self, closure=None):
        views = None if closure is not None else self._local_views()
        if views is None:
            return super().step(closure)
        pairs = [(p, shard) for local in views for p, shard in local if shard is not p]
        kept = [group["params"] for group in self.param_groups]
        for group, local in zip(self.param_groups, views, strict=True):
            group["params"] = [shard for _, shard in local]
        for p, shard in pairs:  # the gradient and the moments under the shard's key
            shard.grad = None if p.grad is None else p.grad.to_local()
            if p in self.state:
                self.state[shard] = {k: v.to_local() if isinstance(v, DTensor) else v
                                     for k, v in self.state[p].items()}
        try:
            return super().step()
        finally:
            for group, params in zip(self.param_groups, kept, strict=True):
                group["params"] = params
            for p, shard in pairs:
                shard.grad = None
                state = self.state.pop(shard, {})
                old = self.state[p]
                for k, v in state.items():  # moments made at this step: laid out as p
                    if k not in old:
                        old[k] = v if not _elementwise(v, p) else DTensor.from_local(
                            v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                            stride=p.stride())

    def _local_views(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """Per group, (parameter, what the step works on): a DTensor's local shard, a plain
        tensor itself; None where some gradient or moment is laid out otherwise than its
        parameter, or a parameter is partial (DTensor's own step then)."""
        views = []
        for group in self.param_groups:
            local = []
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    local.append((p, p))
                    continue
                tensors = [t for t in (p.grad, *self.state.get(p, {}).values())
                           if t is not None and _elementwise(t, p)]
                if any(pl.is_partial() for pl in p.placements) or not all(
                        isinstance(t, DTensor) and t.device_mesh == p.device_mesh
                        and t.placements == p.placements for t in tensors):
                    return None
                local.append((p, p.to_local()))
            views.append(local)
        return views


def _elementwise(t: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether ``t`` (a gradient or a state entry of ``p``) is one value per element of ``p``,
    not the step counter (a scalar)."""
    return t.ndim > 0 or p.ndim == 0


def _keep_implementation(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A loaded state's groups keep this optimizer's step implementation: torch restores every
    group setting from the saved state, so a checkpoint written with the foreach step would
    turn the job back to it for good (and on CUDA, its step counts left on the device, cost a
    host sync per parameter per step). Set before torch places the step counts, which then go
    where the fused step keeps them."""
    impl = {k: optimizer.defaults[k] for k in ("fused", "foreach")}
    for group in state_dict["param_groups"]:
        group.update(impl)
    return state_dict


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, total_steps, cfg.warmup_steps, cfg.min_lr_ratio))


def shard_squares(grads: Sequence[DTensor]) -> torch.Tensor | None:
    """The squared L2 norm of DTensor gradients on one mesh, from their local shards (float64,
    a 0-dim tensor on their device), or None when one of them holds a partial sum (whose norm
    is not its pieces' norms: DTensor's own norm reduces it first).

    A gradient sharded over some of the mesh's dims has its square summed over those dims, and
    one replicated over a dim is counted once there: each local shard's norm is taken in one
    list op on plain tensors, the squares added up per set of sharded dims, and then one
    all-reduce per sharded mesh dim sums the sets that dim splits (no host sync on the way).
    DTensor's norm of the same list works out a sharding for every element at its first call
    (~0.2 s of a core for 291 parameters on a 2 × 2 mesh, ``bench/first_step.py``), paid again
    by every rank after a build or a re-form."""
    mesh = grads[0].device_mesh
    groups: dict[int, list[int]] = {}  # mesh dims sharded over (a bit set): those gradients
    for i, g in enumerate(grads):
        if any(p.is_partial() for p in g.placements):
            return None
        # (FSDP2 over a TP-sharded dim lays a strided shard, which is no Shard: not replicated
        # is what says the dim holds different pieces)
        groups.setdefault(sum(1 << d for d, p in enumerate(g.placements) if not p.is_replicate()),
                          []).append(i)
    norms = torch._foreach_norm([g.to_local() for g in grads])
    # each set's local sum, in a fixed order (no atomics: the same bits on every run)
    sums = {s: torch.stack([norms[i] for i in members]).double().square().sum()
            for s, members in groups.items()}
    for dim in range(mesh.ndim):  # (the same sets on every rank: the same parameters)
        split = [s for s in sums if s >> dim & 1]
        if split and mesh.size(dim) > 1:
            summed = torch.stack([sums[s] for s in split])
            dist.all_reduce(summed, group=mesh.get_group(dim))
            sums.update(zip(split, summed.unbind(), strict=True))
    return torch.stack(list(sums.values())).sum()


def grad_norm_and_clip(params: Sequence[torch.Tensor], max_norm: float,
                       across: dist.ProcessGroup | None = None,
                       uncounted: Sequence[torch.Tensor] = ()) -> float:
    """Global L2 gradient norm over every shard, clipped to ``max_norm`` when it is positive;
    ``uncounted``: parameters clipped with the rest but left out of the norm (another rank's
    copy counts them: ``parallel/pipeline/shared.py``).

    DTensor gradients may live on different meshes (a TP-sharded weight on (dp, tp), a
    replicated norm weight on (dp,), experts on (ep, ...)): each mesh's squares are summed on
    its own mesh (``shard_squares``), then added up, and summed again ``across`` a group
    holding other parameters (the pipeline stages)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    skip = {id(p) for p in uncounted}
    for p in params:
        if id(p) not in skip:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p.grad)
    device = params[0].device if params else torch.device("cpu")
    parts = [torch.zeros((), dtype=torch.float64, device=device)]
    for mesh, grads in by_mesh.items():
        part = shard_squares(grads) if mesh is not None else None
        if part is None:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            part = (norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2
        parts.append(part.detach())
    squares = torch.stack(parts).sum()  # on the device: one host sync, below
    if across is not None:
        dist.all_reduce(squares, group=across)
    total = float(squares.sqrt())
    coef = max_norm / (total + 1e-6)  # the same coefficient as torch's clip_grad_norm_
    if max_norm > 0 and coef < 1.0:
        # A scalar scales every placement alike (a shard, a replica, a partial sum), so the
        # local tensors are scaled in place, without DTensor's dispatch: its first call for a
        # list works out a sharding for every element (~0.35 s of a core per rank and mesh on
        # the CPU ranks here, paid again after every re-form) and each later one dispatches
        # the whole list in Python.
        with torch.no_grad():
            torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g
                                 for g in [*(g for grads in by_mesh.values() for g in grads),
                                           *(p.grad for p in uncounted if p.grad is not None)]],
                                coef)
    return total


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
               microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], grad_clip: float,
               set_grad_sync: Callable[[bool], None] | None = None,
               loss_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
               on_phase: Callable[[str], None] = lambda phase: None,
               hooks: StepHooks | None = None,
               weights: Sequence[float] | None = None,
               keep_grads: bool = False) -> StepStats:
    """Accumulate gradients over ``microbatches`` (each mean loss scaled by its weight, by
    default 1/len), clip, step.

    ``set_grad_sync(is_last)`` runs before each microbatch (a sharded model sets when it
    gathers and reduces: ``ZeroPolicy.before_backward``); ``loss_context`` wraps loss and
    backward (``loss_parallel`` under TP); ``on_phase`` hears "forward", "backward" and
    "optimizer" as they begin (a rank's progress, ``actors/progress.py``); ``hooks``: what
    the model family and its parallel layout add (``StepHooks``); ``weights``: each
    microbatch's share of the step's loss (a data-parallel rank's: its tokens' share of the
    global batch × dp; 0 for a padding microbatch, which counts for nothing); ``keep_grads``:
    zero the gradients in place (DDP's are views into its buckets: dropped, the microbatches
    before the last would accumulate into a second set)."""
    optimizer.zero_grad(set_to_none=not keep_grads)
    n = len(microbatches)
    weights = [1.0 / n] * n if weights is None else list(weights)
    total = None  # summed where the loss lives: one host sync per step, not per microbatch
    tokens = 0
    hooks = hooks or default_hooks(model)
    before = hooks.model.before_microbatch
    scale = None
    for i, ((x, y), w) in enumerate(zip(microbatches, weights, strict=True)):
        if set_grad_sync is not None:
            set_grad_sync(i == n - 1)
        if before is not None and w != scale:  # an auxiliary loss's share of the step, as the
            before(w)  # loss's: only when the weight changes (at most twice a step)
            scale = w
        with loss_context():
            on_phase("forward")
            loss = model(x, y) * w
            on_phase("backward")
            loss.backward()
        value = loss.detach()
        value = (value.full_tensor() if isinstance(value, DTensor) else value).float()
        total = value if total is None else total + value
        tokens += y.numel() if w else 0
    return finish_step(model, optimizer, scheduler, grad_clip, float(total), tokens,
                       on_phase=on_phase, hooks=hooks)


@dataclass(frozen=True)
class StepHooks:
    """What the step runs besides itself: the model family's hooks (``models/hooks.py``: a
    microbatch's weight for its auxiliary losses, updates after the optimizer with their
    statistics), and the layout's ``before_clip``, which finishes gradients the data-parallel
    reduction did not (an MoE block's over tensor-parallel token shares, an embedding that two
    pipeline stages use)."""

    model: ModelHooks = ModelHooks()
    before_clip: Callable[[], None] = lambda: None
    uncounted: tuple = ()  # parameters whose gradient another rank's norm counts


def default_hooks(model: nn.Module) -> StepHooks:
    """One process's hooks: what the model supplies (``step_hooks``), if it does."""
    supplied = getattr(model, "step_hooks", None)
    return StepHooks(model=supplied()) if callable(supplied) else StepHooks()


def finish_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, grad_clip: float,
                loss: float, tokens: int, across: dist.ProcessGroup | None = None,
                on_phase: Callable[[str], None] = lambda phase: None,
                hooks: StepHooks | None = None) -> StepStats:
    """Clip the accumulated gradients, step the optimizer and the LR schedule."""
    on_phase("optimizer")
    hooks = hooks or default_hooks(model)
    lr = optimizer.param_groups[0]["lr"]
    hooks.before_clip()
    norm = grad_norm_and_clip([p for p in model.parameters() if p.grad is not None], grad_clip,
                              across, hooks.uncounted)
    optimizer.step()
    scheduler.step()
    after, losses = hooks.model.after_update, hooks.model.losses
    return StepStats(loss=loss, grad_norm=norm, lr=lr, tokens=tokens,
                     experts=(after() if after is not None else None) or None,
                     losses=losses() if losses is not None else None)
