"""Fused ops behind one seam: ``kernel_set(name)`` gives the model its norm, SwiGLU, RoPE,
the fused output-projection + cross-entropy (or None: logits through the head) and the
attention block context parallel uses.

``model.kernels``: ``auto`` | ``triton`` | ``torch``, or per op (``spec/kernel_choice.py``);
auto takes what the GPU check kit measured fastest on the GPU, and the torch references where
nothing was measured. Triton on CPU runs only under ``TRITON_INTERPRET=1`` (tests), which must
be set before the kernel modules are imported.
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
from trainmesh.spec import kernel_choice


@dataclass(frozen=True)
class KernelSet:
    name: str  # kernel_choice.key: "torch", "triton", or one implementation per op
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


def resolve(kernels, device_type: str, compiled: bool = False) -> str:
    """The kernel set ``model.kernels`` means on ``device_type`` (``spec/kernel_choice.py``:
    auto takes what the GPU check kit measured faster on this GPU than the torch path,
    compiled with ``model.compile``), as a set name."""
    name = ""
    if device_type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    choice = kernel_choice.choose(kernels, device_type, name, compiled)
    if ("triton" in choice.values() and device_type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        ops = [op for op, impl in choice.items() if impl == "triton"]
        raise ValueError(f"model.kernels: triton for {', '.join(ops)} needs a CUDA device; on CPU "
                         "set TRITON_INTERPRET=1 to interpret the kernels (slow, for tests) or "
                         "use model.kernels=auto")
    return kernel_choice.key(choice)


@functools.cache
def kernel_set(name: str) -> KernelSet:
    """The ops of a set name (``resolve``'s): each op's Triton kernel or torch reference."""
    choice = kernel_choice.parse_key(name)
    triton = {op for op, impl in choice.items() if impl == "triton"}
    ops: dict[str, Callable | None] = {"rms_norm": reference.rms_norm, "swiglu": reference.swiglu,
                                       "rope": reference.rope, "linear_cross_entropy": None}
    if "rms_norm" in triton:
        from trainmesh.kernels.rms_norm import rms_norm
        ops["rms_norm"] = _rowwise(rms_norm)
    if "swiglu" in triton:
        from trainmesh.kernels.swiglu import swiglu
        ops["swiglu"] = _elementwise(swiglu)
    if "rope" in triton:
        from trainmesh.kernels.rope import rope
        ops["rope"] = _local_only(rope)
    if "linear_cross_entropy" in triton:
        from trainmesh.kernels.linear_cross_entropy import linear_cross_entropy
        ops["linear_cross_entropy"] = linear_cross_entropy
    return KernelSet(name, **ops)


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
