"""One block of attention with its log-sum-exp (and its backward given the merged output and
log-sum-exp of every block a query saw): the op context parallel and document masks are
built on (``parallel/context.py``).

Grouped-query layout, key/value heads never expanded in the caller: ``q`` (B, Hkv, rep, Tq,
hd), ``k``/``v`` (B, Hkv, 1, Tk, hd); ``causal``: the block is on the diagonal (Tq = Tk, a
query sees the keys up to its own position); ``mask`` (B, 1, 1, Tq, Tk) bool or None: where a
query may look (document masks). The output is float32 (merged across blocks in float32),
the log-sum-exp too, −inf where a query sees nothing in this block.

- CPU: torch's fused flash-attention kernel that returns the log-sum-exp (7× the explicit math
  at 512 tokens, equal to it within float32 rounding; its backward given the merged output
  and log-sum-exp is exact: tested).
- CUDA, bf16/fp16 without a document mask: the fused flash-attention kernel and its backward,
  called the same way. It has not run on a GPU here: ``make gpu-check`` compares it with the
  explicit math on the first GPU lent.
- Otherwise (fp32 on a GPU, document masks on a GPU): the explicit math of
  ``reference.attention_block``, over slices of QUERY_SLICE queries so that a long chunk's
  scores never exist whole (B × heads × QUERY_SLICE × Tk floats at a time).
"""

from __future__ import annotations

import torch

from trainmesh.kernels import reference

QUERY_SLICE = 1024
_DENSE: dict[tuple, tuple] = {}


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        q4, k4, v4 = _heads(q, k, v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, attn_mask=_float_mask(mask, q.dtype), scale=scale)
        if mask is not None:  # a query that sees no key here: lse −inf (the kernel gives 0)
            lse = lse.masked_fill(~mask.flatten(1, 2).any(-1), float("-inf"))
        return out.view(q.shape).float(), lse.view(q.shape[:-1])
    if _flash_on_gpu(q, mask):
        q4, k4, v4 = _heads(q, k, v)
        r = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, causal,
                                                                scale=scale)
        return r[0].view(q.shape).float(), r[1][..., :q.shape[3]].reshape(q.shape[:-1])
    outs, lses = [], []
    for r0 in range(0, q.shape[3], QUERY_SLICE):
        r1 = min(r0 + QUERY_SLICE, q.shape[3])
        o, lse = reference.attention_block(q[..., r0:r1, :], k, v,
                                           _bool_mask(q, k, causal, mask, r0, r1), scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 3), torch.cat(lses, 3)


def attention_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                             mask: torch.Tensor | None,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this block, float32 (dk, dv summed over each key/value head's queries)."""
    if q.device.type == "cpu" or _flash_on_gpu(q, mask):
        q4, k4, v4 = _heads(q, k, v)
        shape = q4.shape
        args = (dout.reshape(shape).to(q.dtype), q4, k4, v4, out.reshape(shape).to(q.dtype),
                lse.reshape(shape[:-1]).contiguous())
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *args, 0.0, causal, attn_mask=_float_mask(mask, q.dtype), scale=scale)
        else:
            cum_q, cum_k, seed, offset = _dense_flash_state(q.device, q.dtype)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                *args, cum_q, cum_k, shape[2], k4.shape[2], 0.0, causal, seed, offset,
                scale=scale)
        B, Hkv, rep, Tk, D = (*k.shape[:2], q.shape[2], *k.shape[3:])
        return (dq.view(q.shape).float(), dk.view(B, Hkv, rep, Tk, D).sum(2, keepdim=True).float(),
                dv.view(B, Hkv, rep, Tk, D).sum(2, keepdim=True).float())
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for r0 in range(0, q.shape[3], QUERY_SLICE):
        r1 = min(r0 + QUERY_SLICE, q.shape[3])
        gq, gk, gv = reference.attention_block_backward(
            dout[..., r0:r1, :], q[..., r0:r1, :], k, v, out[..., r0:r1, :], lse[..., r0:r1],
            _bool_mask(q, k, causal, mask, r0, r1), scale)
        dq[..., r0:r1, :] = gq
        dk += gk
        dv += gv
    return dq, dk, dv


def _dense_flash_state(device: torch.device, dtype: torch.dtype) -> tuple:
    """What CUDA's flash forward returns for dense (not nested) inputs without dropout, for
    its backward (sequence offsets, RNG state): taken from one tiny forward, once per device,
    so that a block's backward is called as autograd would call it."""
    key = (device, dtype)
    if key not in _DENSE:
        x = torch.zeros(1, 1, 1, 8, device=device, dtype=dtype)
        r = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False)
        _DENSE[key] = (r[2], r[3], r[6], r[7])
    return _DENSE[key]


def _flash_on_gpu(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return (q.device.type == "cuda" and mask is None and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] <= 256)


def _heads(q, k, v):
    """(B, H, T, hd) views for the fused kernels; K/V expanded to the query heads (per block)."""
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


def _bool_mask(q, k, causal: bool, mask: torch.Tensor | None, r0: int = 0,
               r1: int | None = None) -> torch.Tensor | None:
    """Queries r0:r1's mask (causal: up to their own positions; and ``mask``'s)."""
    r1 = q.shape[3] if r1 is None else r1
    part = None if mask is None else mask[..., r0:r1, :]
    if not causal:
        return part
    tril = torch.ones(r1 - r0, k.shape[3], dtype=torch.bool, device=q.device).tril(r0)
    return tril if part is None else part & tril
