"""Rotary position embedding in Triton, interleaved pairs, one program per (batch, position).

For position t and pair i of every head, with c = cos[t, i] and s = sin[t, i]:
    y[2i]   = x[2i] · c − x[2i+1] · s
    y[2i+1] = x[2i] · s + x[2i+1] · c
The rotation is orthogonal, so the backward is the same kernel with s → −s. The forward writes
a new tensor (its input is a view of a projection's output that autograd may still need); the
backward rotates the incoming gradient in place when it is contiguous (nothing else reads it
after this node), otherwise a contiguous copy of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainmesh.kernels.launch import opaque_when_compiled, plain


@triton.jit
def _rope(X, COS, SIN, Y, T, H, HALF, stride_row, SIGN: tl.constexpr, BLOCK_H: tl.constexpr,
          BLOCK_P: tl.constexpr):
    row = tl.program_id(0)  # b * T + t
    t = row % T
    # The (heads, head dim) tile is read and written whole, contiguous (vector accesses), and
    # split into its (even, odd) pairs in registers.
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, 2 * BLOCK_P)[None, :]
    mask = (heads < H) & (cols < 2 * HALF)
    offs = row.to(tl.int64) * stride_row + heads * (2 * HALF) + cols
    pairs = tl.arange(0, BLOCK_P)[None, :]
    c = tl.load(COS + t * HALF + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * HALF + pairs, mask=pairs < HALF, other=0.0).to(tl.float32) * SIGN
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_P, 2)))
    y = tl.reshape(tl.join(x1 * c - x2 * s, x1 * s + x2 * c), (BLOCK_H, 2 * BLOCK_P))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _nothing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, sign: float) -> None:
    return None


@opaque_when_compiled("rope_rotate", _nothing, mutates=("out",))
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, sign: float) -> None:
    """out = x (contiguous, (B, T, H, D)) rotated by (cos, sin · sign); ``out`` may be ``x``."""
    B, T, H, D = x.shape
    block_h, block_p = triton.next_power_of_2(H), triton.next_power_of_2(D // 2)
    _rope[(B * T,)](x, cos, sin, out, T, H, D // 2, H * D, SIGN=sign, BLOCK_H=block_h,
                    BLOCK_P=block_p, num_warps=max(1, min(8, block_h * block_p // 256)))


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTHD: torch.Tensor, cos_TD2: torch.Tensor, sin_TD2: torch.Tensor):
        B, T, H, D = x_BTHD.shape
        if D % 2 or cos_TD2.shape != (T, D // 2) or sin_TD2.shape != (T, D // 2):
            raise ValueError(f"rope: x {tuple(x_BTHD.shape)} needs cos/sin of shape "
                             f"({T}, {D // 2}), got {tuple(cos_TD2.shape)}/{tuple(sin_TD2.shape)}")
        x = plain(x_BTHD).contiguous()
        cos, sin = cos_TD2.contiguous(), sin_TD2.contiguous()
        ctx.save_for_backward(cos, sin)
        out = torch.empty_like(x)
        _rotate(x, cos, sin, out, 1.0)
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dy = plain(dy)
        dy = dy if dy.is_contiguous() else dy.contiguous()
        _rotate(dy, cos, sin, dy, -1.0)
        return dy, None, None


def rope(x_BTHD: torch.Tensor, cos_TD2: torch.Tensor, sin_TD2: torch.Tensor) -> torch.Tensor:
    return RopeFunction.apply(x_BTHD, cos_TD2, sin_TD2)
