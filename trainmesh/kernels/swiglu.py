"""SwiGLU in Triton: elementwise over flat blocks, forward and backward.

    y  = silu(g) · u,   silu(g) = g · σ(g)
    dg = dy · u · σ(g) · (1 + g · (1 − σ(g)))
    du = dy · silu(g)
The backward recomputes σ(g) from the saved inputs instead of keeping silu(g) (one tensor of
the gate's size saved, not two). Float32 arithmetic, stores in the tensors' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainmesh.kernels.launch import opaque_when_compiled, plain

BLOCK = 1024


@triton.jit
def _swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def _gated_like(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(g)


@opaque_when_compiled("swiglu_fwd", _gated_like)
def _forward(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(g)
    n = g.numel()
    _swiglu_fwd[(triton.cdiv(n, BLOCK),)](g, u, y, n, BLOCK=BLOCK)
    return y


def _grads_like(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(g), torch.empty_like(u)


@opaque_when_compiled("swiglu_bwd", _grads_like)
def _backward(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    _swiglu_bwd[(triton.cdiv(n, BLOCK),)](dy, g, u, dg, du, n, BLOCK=BLOCK)
    return dg, du


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape:
            raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        g, u = plain(gate).contiguous(), plain(up).contiguous()
        ctx.save_for_backward(g, u)
        return _forward(g, u)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        g, u = ctx.saved_tensors
        return _backward(plain(dy).contiguous(), g, u)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(gate, up)
