"""Small launch helpers shared by the kernels (no Triton here)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor


def plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose storage a kernel can address: DTensor redistributions hand back the
    local result of a collective as an ``AsyncCollectiveTensor`` wrapper; wait for it."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a collective's pending result waited for, keeping its autograd history
    (``plain`` drops it: for kernels' own inputs). A compiled region handed the wrapper as an
    input gave its producer no gradient (the embedding's, under tensor parallel)."""
    return wait_tensor(t) if isinstance(t, AsyncCollectiveTensor) else t


def as_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """``x`` as a (rows, last dim) matrix with unit stride on the last dim, and its shape."""
    x = plain(x)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, shape


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def row_programs(n_rows: int, device: torch.device) -> int:
    """How many programs share ``n_rows`` rows in a reduction over rows: one per SM on a GPU
    (each program keeps a float32 partial); a handful under the CPU interpreter."""
    if device.type == "cuda":
        return max(1, min(n_rows, _sm_count(device.index or 0)))
    return max(1, min(n_rows, 4))


def opaque_when_compiled(name: str, fake: Callable,
                         mutates: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """A kernel's launch as ``torch.ops.trainmesh.<name>`` under torch.compile, a plain call in
    eager. The compiled graph calls the op with real tensors, so the launch's block sizes and
    warps come from concrete shapes: traced by dynamo, a dimension it made dynamic (a second
    head count or sequence length in one process, as a re-formed mesh brings) reached the
    launch's ``num_warps`` as a symbol, and CUDA could not compile the block. ``fake`` gives
    the outputs' shapes and dtypes. The launch returns new tensors (no views of its inputs) or
    writes only the arguments named in ``mutates`` and returns None, as a custom op does."""

    def register(launch: Callable) -> Callable:
        # Inductor hands the op its inputs with the strides eager would (the launches index
        # rows and flat buffers by them)
        exact = getattr(torch.Tag, "needs_exact_strides", None)
        op = torch.library.custom_op(f"trainmesh::{name}", launch, mutates_args=mutates,
                                     tags=(exact,) if exact is not None else ())
        op.register_fake(fake)

        @functools.wraps(launch)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else launch(*args)

        call.op = op  # for torch.library.opcheck
        return call

    return register
