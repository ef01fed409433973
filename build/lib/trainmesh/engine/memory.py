"""What a rank really holds: exact bytes of its parameter, gradient and optimizer-state shards,
the activations autograd saves during a step (counted through saved-tensor hooks, by storage so
a tensor saved by several ops counts once), and the process's peak memory."""

from __future__ import annotations

import resource
import weakref
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

GIB = 1024**3


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensors_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the local parts of ``tensors`` (a DTensor counts its shard on this rank)."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    params = list(model.parameters())
    opt = 0
    if optimizer is not None:
        opt = tensors_bytes(v for s in optimizer.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor) and v.ndim > 0)
    return {"params": tensors_bytes(params), "grads": tensors_bytes(p.grad for p in params),
            "optimizer": opt}


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (``weight.t()`` saved by a linear), gathered or not."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


class _Saved:
    """Stands for one saved tensor until autograd frees it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedActivations:
    """Peak bytes of the tensors autograd keeps for backward while this context is active.
    Parameters (and views of them) are not activations and are not counted."""

    def __init__(self):
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Saved:
        holder = _Saved(t)
        local = _local(t)
        if local.device.type == "meta" or _is_parameter(t):
            return holder
        try:
            storage = local.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # no real storage (a wrapper made by a transform): by identity
            key, nbytes = id(holder), local.numel() * local.element_size()
        if key == 0:
            return holder
        if key not in self._refs:
            self._refs[key] = 0
            self._sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)

    @staticmethod
    def _unpack(holder: _Saved) -> torch.Tensor:
        return holder.tensor

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def peak_process_bytes(device: torch.device) -> int:
    """The peak this rank's memory reached: CUDA allocations on a GPU, the process's peak
    resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
