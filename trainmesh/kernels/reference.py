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


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of exact attention and its log-sum-exp, for merging blocks (context parallel,
    document masks). Grouped-query layout, K/V never expanded: ``q`` (B, Hkv, rep, Tq, hd),
    ``k``/``v`` (B, Hkv, 1, Tk, hd); ``mask`` broadcastable to (B, Hkv, rep, Tq, Tk), True
    where a query sees a key (None: every key). Returns out (B, Hkv, rep, Tq, hd)
    and lse (B, Hkv, rep, Tq), both float32 (blocks are merged in float32), lse −inf for a
    query that sees no key here (its out 0)."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1))  # rows of −inf: p = 0
    return p @ v.float(), lse


def attention_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             mask: torch.Tensor | None,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's part of dq, dk, dv given the *merged* ``out`` and ``lse`` of all blocks a
    query saw (softmax over every block: p = exp(s − lse)); dk, dv summed over the query heads
    of each key/value head (shapes as ``k``, ``v``), all float32."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    do = dout.float()
    dv = (p.transpose(-1, -2) @ do).sum(2, keepdim=True)
    dp = do @ v.float().transpose(-1, -2)
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ k.float()) * scale
    dk = (ds.transpose(-1, -2) @ q.float()).sum(2, keepdim=True) * scale
    return dq, dk, dv
