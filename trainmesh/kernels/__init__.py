"""Fused ops behind one seam: ``kernel_set(name)`` gives the model its norm, SwiGLU, RoPE and
(for Triton) the fused output-projection + cross-entropy.

``model.kernels: auto | triton | torch`` — auto is Triton on CUDA and the torch references
elsewhere. Triton on CPU runs only under ``TRITON_INTERPRET=1`` (tests), which must be set
before the kernel modules are imported.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import trainmesh.kernels.attention as attention
import trainmesh.kernels.reference as reference

MODES = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelSet:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # (h, head weight, targets) → mean loss without materialising the logits; None: the model
    # computes logits with its output module and then the loss (the torch path).
    linear_cross_entropy: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None
    # One block of attention with its log-sum-exp, and its backward given the merged output
    # (context parallel, document masks): ``kernels/attention.py``.
    attention_block: Callable = attention.attention_block
    attention_block_backward: Callable = attention.attention_block_backward


def resolve(mode: str, device_type: str) -> str:
    """The kernel set a ``model.kernels`` mode means on ``device_type``."""
    if mode not in MODES:
        raise ValueError(f"model.kernels={mode!r}; use one of {', '.join(MODES)}")
    if mode == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if mode == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("model.kernels=triton needs a CUDA device; on CPU set TRITON_INTERPRET=1 "
                         "to interpret the kernels (slow, for tests) or use model.kernels=auto")
    return mode


@functools.cache
def kernel_set(name: str) -> KernelSet:
    if name == "torch":
        return KernelSet("torch", reference.rms_norm, reference.swiglu, reference.rope, None)
    if name != "triton":
        raise ValueError(f"kernel set {name!r}; use torch or triton (resolve 'auto' first)")
    from trainmesh.kernels.linear_cross_entropy import linear_cross_entropy
    from trainmesh.kernels.rms_norm import rms_norm
    from trainmesh.kernels.rope import rope
    from trainmesh.kernels.swiglu import swiglu

    return KernelSet("triton", _rowwise(rms_norm), _elementwise(swiglu), _local_only(rope),
                     linear_cross_entropy)


def _rowwise(fn: Callable) -> Callable:
    """Lift ``fn(x, weight, *rest)``, independent per row of ``x``, to a DTensor ``x`` sharded on
    rows (sequence parallel) with a replicated ``weight``: run on the local rows; the weight's
    gradient is then a partial sum over the ranks that hold different rows."""

    @functools.wraps(fn)
    def wrapped(x, weight, *rest):
        if not isinstance(x, DTensor):
            return fn(x, weight, *rest)
        if any(isinstance(p, Shard) and p.dim % x.ndim == x.ndim - 1 for p in x.placements):
            raise ValueError(f"{fn.__name__}: input sharded on its last dim {x.placements}")
        sharded = any(isinstance(p, Shard) for p in x.placements)
        w = weight
        if isinstance(weight, DTensor):
            w = weight.to_local(grad_placements=[Partial() if sharded else Replicate()]
                                * weight.device_mesh.ndim)
        out = fn(x.to_local(), w, *rest)
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)

    return wrapped


def _elementwise(fn: Callable) -> Callable:
    """Lift an op whose DTensor inputs all share one layout (and whose plain inputs are
    replicated tables) to DTensors: computed on the local shards, same layout out."""

    @functools.wraps(fn)
    def wrapped(*args):
        dts = [a for a in args if isinstance(a, DTensor)]
        if not dts:
            return fn(*args)
        layout = (dts[0].device_mesh, tuple(dts[0].placements))
        if any((d.device_mesh, tuple(d.placements)) != layout for d in dts):
            raise ValueError(f"{fn.__name__}: DTensor inputs with different layouts")
        out = fn(*(a.to_local() if isinstance(a, DTensor) else a for a in args))
        return DTensor.from_local(out, layout[0], layout[1], run_check=False)

    return wrapped


def _local_only(fn: Callable) -> Callable:
    """For ops whose meaning depends on global positions (RoPE): plain tensors only. The TP plans
    hand them the local heads of a full sequence, which is what this allows."""

    @functools.wraps(fn)
    def wrapped(*args):
        if any(isinstance(a, DTensor) for a in args):
            raise ValueError(f"{fn.__name__}: expects local tensors (a full sequence), got a DTensor")
        return fn(*args)

    return wrapped
