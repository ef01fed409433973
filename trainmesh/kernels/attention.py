"""One block of attention with its log-sum-exp (and its backward given the merged output and
log-sum-exp of every block a query saw): the op context parallel and document masks are
built on (``parallel/context.py``).

Grouped-query layout, key/value heads never expanded in the caller: ``q`` (B, Hkv, rep, Tq,
hd), ``k``/``v`` (B, Hkv, 1, Tk, hd); ``causal``: the block is on the diagonal (Tq = Tk, a
query sees the keys up to its own position); ``mask`` (B, 1, 1, Tq, Tk) bool or None: where a
query may look (document masks). The log-sum-exp is float32, −inf where a query sees nothing.

On CPU the fused flash-attention kernel that returns the log-sum-exp (7× the explicit math at
512 tokens, equal to it within float32 rounding); elsewhere the explicit math of
``reference.attention_block``. CUDA's fused variants are not used yet: they have not run on
a GPU here (``make gpu-check`` compares them when one is lent).
"""

from __future__ import annotations

import torch

from trainmesh.kernels import reference


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type != "cpu":
        return reference.attention_block(q, k, v, _bool_mask(q, k, causal, mask), scale)
    q4, k4, v4 = _heads(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, k4, v4, 0.0, causal, attn_mask=_float_mask(mask, q.dtype), scale=scale)
    if mask is not None:  # a query that sees no key here: lse −inf (the kernel gives 0)
        lse = lse.masked_fill(~mask.flatten(1, 2).any(-1), float("-inf"))
    return out.view(q.shape), lse.view(q.shape[:-1])


def attention_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                             mask: torch.Tensor | None,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.device.type != "cpu":
        return reference.attention_block_backward(dout, q, k, v, out, lse,
                                                  _bool_mask(q, k, causal, mask), scale)
    q4, k4, v4 = _heads(q, k, v)
    shape = q4.shape
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.reshape(shape), q4, k4, v4, out.reshape(shape).to(q.dtype),
        lse.reshape(shape[:-1]), 0.0, causal, attn_mask=_float_mask(mask, q.dtype), scale=scale)
    B, Hkv, rep, Tk, D = (*k.shape[:2], q.shape[2], *k.shape[3:])
    return (dq.view(q.shape).float(), dk.view(B, Hkv, rep, Tk, D).sum(2, keepdim=True).float(),
            dv.view(B, Hkv, rep, Tk, D).sum(2, keepdim=True).float())


def _heads(q, k, v):
    """(B, H, T, hd) views for the fused kernel; K/V expanded to the query heads (per block)."""
    B, Hkv, rep, Tq, D = q.shape
    Tk = k.shape[3]
    return (q.reshape(B, Hkv * rep, Tq, D),
            k.expand(B, Hkv, rep, Tk, D).reshape(B, Hkv * rep, Tk, D),
            v.expand(B, Hkv, rep, Tk, D).reshape(B, Hkv * rep, Tk, D))


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """(B, 1, Tq, Tk) additive: 0 where a query may look, −inf elsewhere."""
    if mask is None:
        return None
    m = mask.flatten(1, 2)
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, float("-inf"))


def _bool_mask(q, k, causal: bool, mask: torch.Tensor | None) -> torch.Tensor | None:
    if not causal:
        return mask
    tril = torch.ones(q.shape[3], k.shape[3], dtype=torch.bool, device=q.device).tril()
    return tril if mask is None else mask & tril
