"""A rank's state copied into host memory, for the in-memory checkpoint tier: what training
waits for when it snapshots (``actors/snapshots.py``); writing the copy out goes on behind it.

The first copy is DCP's own stager's (``DefaultStager``): a host tensor for every tensor, a host
DTensor with the same mesh and placements for every DTensor (so DCP plans and reshards the
copy exactly as the original), its buffers pinned on GPUs. Later copies keep that structure and
copy each tensor's local shard into the same buffers (asynchronously on GPUs, waited for once):
the stager's generic deep copy costs ~0.1 ms per tensor (a DTensor's ``new_empty`` goes through
sharding propagation, its spec is copied anew), which was most of a small model's snapshot.
Anything else in the state (optimizer hyper-parameters, the learning rate) is copied afresh each
time, and a state whose structure changed is staged anew.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor


class _Changed(Exception):
    pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class HostCopy:
    def __init__(self, device: torch.device):
        self._device = device
        self._async = device.type != "cpu"
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=self._async, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=self._async))
        self._staged: dict | None = None
        self.nbytes = 0  # tensor bytes of a copy

    @torch.no_grad()
    def copy(self, state: dict) -> dict:
        """``state`` (``dcp_io.rank_state``) in host memory. The buffers are reused by the next
        call: whoever reads the copy must be done with it by then."""
        try:
            if self._staged is None:
                raise _Changed
            staged = self._refill(state, self._staged)
            if self._async:  # the copies queued on the current stream: wait for them alone
                done = torch.Event(self._device)
                done.record()
                done.synchronize()
        except _Changed:
            staged = self._stager.stage(state)
            self.nbytes = sum(_local(t).numel() * _local(t).element_size() for t in _tensors(staged))
        self._staged = staged
        return staged

    def close(self) -> None:
        self._stager.close()
        self._staged = None

    def _refill(self, src, dst):
        if isinstance(src, torch.Tensor):
            if type(dst) is not type(src) or (isinstance(src, DTensor) and (
                    src.placements != dst.placements or src.shape != dst.shape)):
                raise _Changed
            s, d = _local(src), _local(dst)
            if s.shape != d.shape or s.dtype != d.dtype:
                raise _Changed
            d.copy_(s, non_blocking=self._async)
            return dst
        if isinstance(src, dict):
            if not isinstance(dst, dict) or src.keys() != dst.keys():
                raise _Changed
            return {k: self._refill(v, dst[k]) for k, v in src.items()}
        if isinstance(src, list | tuple):
            if type(dst) is not type(src) or len(dst) != len(src):
                raise _Changed
            return type(src)(self._refill(a, b) for a, b in zip(src, dst, strict=True))
        return copy.deepcopy(src)


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from _tensors(v)
