"""Mesh-independent random init: a parameter's values are a function of its seed alone, and a
shard can fill itself without the rest of the tensor ever existing.

The global tensor, viewed as rows (dim 0) × the rest, is cut into fixed chunks of rows
(``CHUNK_ELEMENTS`` values each, a function of the global shape only); chunk ``k`` is drawn
from a generator seeded with (seed, k). A shard — a plain tensor, or the local part of a
DTensor sharded by TP and/or FSDP — draws only the chunks its rows touch and keeps its slice.
So the single-process model and any (tp, pp, dp) mesh hold bit-identical values, and the
largest temporary is one chunk (4 MiB in float32), whatever the model's size.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

CHUNK_ELEMENTS = 1 << 20


def local_slice(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this process holds for ``p`` and its offset in the global tensor."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return p.to_local(), tuple(offset)
    return p, (0,) * p.ndim


@torch.no_grad()
def fill_normal_(p: torch.Tensor, seed: int, std: float) -> None:
    """Fill ``p`` (or this process's shard of it) with N(0, std²) values that depend only on
    ``seed`` and the global shape."""
    local, offset = local_slice(p)
    fill_slice_(local, offset, tuple(p.shape), seed, std)


@torch.no_grad()
def fill_slice_(local: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...], seed: int,
                std: float) -> None:
    """Fill ``local``, the block of a tensor of global ``shape`` that starts at ``offset``."""
    if local.numel() == 0:
        return
    if len(shape) == 0:
        local.copy_(torch.randn((), generator=torch.Generator().manual_seed(seed)) * std)
        return
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, math.prod(shape[1:])))
    r0, r1 = offset[0], offset[0] + local.shape[0]
    tail = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=True))
    for k in range(r0 // rows_per_chunk, (r1 - 1) // rows_per_chunk + 1):
        c0 = k * rows_per_chunk
        c1 = min(shape[0], c0 + rows_per_chunk)
        g = torch.Generator().manual_seed((seed * 1_000_033 + k) % (1 << 63))
        chunk = torch.randn((c1 - c0, *shape[1:]), generator=g, dtype=torch.float32) * std
        a, b = max(r0, c0), min(r1, c1)
        local[a - r0:b - r0].copy_(chunk[(slice(a - c0, b - c0), *tail)])
