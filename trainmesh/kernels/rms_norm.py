"""RMSNorm in Triton: one program per row forward, row blocks in backward.

Forward, for a row x of width D:
    r = 1 / sqrt(mean(x²) + eps)          (kept per row for backward, float32)
    n = x · r                               (rounded to x's dtype, as the reference does)
    y = n · w
Backward, with dy the output gradient:
    dn = dy · w
    dx = r · (dn − n · mean(dn · n))
    dw = Σ_rows dy · n                       (each program sums its block of rows into one
                                              float32 partial; the partials are summed after)
All arithmetic is float32 after the loads; stores cast back to the tensor's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainmesh.kernels.launch import as_rows, opaque_when_compiled, plain, row_programs


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, stride_x, stride_y, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    n = (x * rstd).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (n * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, n_rows, D,
                  rows_per_program, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for row in range(first, last):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        n = x * rstd
        dn = dy * w
        dx = rstd * (dn - n * (tl.sum(dn * n, axis=0) / D))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * n
    tl.store(DW_PARTIAL + pid * D + cols, dw, mask=mask)


def _normed_like(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x2), x2.new_empty(x2.shape[0], dtype=torch.float32)


@opaque_when_compiled("rms_norm_fwd", _normed_like)
def _forward(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, D) -> y and each row's 1/rms (float32)."""
    n_rows, d = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    _rms_norm_fwd[(n_rows,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), d, eps,
                             BLOCK_D=triton.next_power_of_2(d))
    return y, rstd


def _grads_like(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x2), torch.empty_like(weight)


@opaque_when_compiled("rms_norm_bwd", _grads_like)
def _backward(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
              rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (rows, D) and dw (D,) in the weight's dtype, summed over the programs' partials."""
    n_rows, d = x2.shape
    programs = row_programs(n_rows, x2.device)
    per = triton.cdiv(n_rows, programs)
    dx = torch.empty_like(x2)
    dw_partial = torch.empty(programs, d, dtype=torch.float32, device=x2.device)
    _rms_norm_bwd[(programs,)](dy2, x2, weight, rstd, dx, dw_partial, dy2.stride(0),
                               x2.stride(0), dx.stride(0), n_rows, d, per,
                               BLOCK_D=triton.next_power_of_2(d))
    return dx, dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2, shape = as_rows(x)
        weight = plain(weight)
        y, rstd = _forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dy2, _ = as_rows(dy)  # (waits on a collective's result too)
        dx, dw = _backward(dy2, x2, weight, rstd)
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)
