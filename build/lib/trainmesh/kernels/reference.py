"""Torch references for the fused ops: the math every Triton kernel must reproduce.

They run wherever Triton cannot (CPU) and are what the kernel tests compare against. Each
computes in float32 and returns the input's dtype, as the kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x², last dim) + eps) · w."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up."""
    return F.silu(gate) * up


def rope(x_BTHD: torch.Tensor, cos_TD2: torch.Tensor, sin_TD2: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by the angle whose cos/sin are given per
    position and pair: (x1·cos − x2·sin, x1·sin + x2·cos)."""
    x1, x2 = x_BTHD.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos_TD2[:, None, :], sin_TD2[:, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x_BTHD)


def linear_cross_entropy(h_ND: torch.Tensor, weight_VD: torch.Tensor,
                         targets_N: torch.Tensor) -> torch.Tensor:
    """Mean over rows of −log softmax(h Wᵀ)[target], logits in float32 (materialised here)."""
    return F.cross_entropy(F.linear(h_ND, weight_VD).float(), targets_N)
