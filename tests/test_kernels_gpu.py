"""Compiled Triton kernels on a real GPU against the torch references, at model-sized shapes.

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/test_kernels_gpu.py

Skipped without CUDA, and under the interpreter (conftest sets TRITON_INTERPRET=1 unless the
environment says otherwise).
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import (
    compiled_over_shapes_case,
    linear_cross_entropy_case,
    rms_norm_case,
    rope_case,
    swiglu_case,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="set TRITON_INTERPRET=0 to compile the kernels"),
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [((1,), 4096), ((4, 2048), 4096), ((8191,), 5120)])
def test_rms_norm(rows, dim, dtype):
    rms_norm_case(rows, dim, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 2048, 14336), (3, 1001, 11008)])
def test_swiglu(shape, dtype):
    swiglu_case(shape, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "t", "h", "d"), [(2, 2048, 32, 128), (1, 4097, 8, 128), (3, 17, 5, 64)])
def test_rope(b, t, h, d, dtype):
    rope_case(b, t, h, d, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim", "vocab"), [((2, 2048), 4096, 128_256), ((1000,), 2048, 32_003)])
def test_linear_cross_entropy(rows, dim, vocab, dtype):
    linear_cross_entropy_case(rows, dim, vocab, dtype, "cuda")


@pytest.mark.parametrize(("factor", "accumulate"), [(1, "native"), (8, "fp32")])
def test_linear_cross_entropy_tunings(factor, accumulate):
    # The kit's sweep settings; "fp32" in bf16 accumulates through cuBLAS's float32 output,
    # a path only CUDA has.
    linear_cross_entropy_case((4, 1024), 4096, 128_256, torch.bfloat16, "cuda", factor=factor,
                              accumulate=accumulate)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_compiled_over_changing_head_counts_and_lengths(dtype):
    # Before the launches were ops, dynamo handed a symbolic head count to rope's num_warps:
    # "'SymNodeVariable' object has no attribute 'value'" (the kit, 2026-11-27).
    compiled_over_shapes_case("cuda", "inductor", dtype)
