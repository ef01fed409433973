"""Multi-head Latent Attention (DeepSeek-V2/V3). Knows nothing of meshes.

Queries come through a low-rank projection (``wq_a``, its RMSNorm ``q_a_norm``, ``wq_b``) or a
full one (``wq``); keys and values through one compressed latent per token (``wkv_a``, its
RMSNorm ``kv_a_norm``) expanded per head (``wkv_b``). ``wkv_a`` also gives one rotary key that
every head shares (decoupled RoPE), beside each head's unrotated key. A head's query/key has
``qk_nope_head_dim + qk_rope_head_dim`` dimensions, its value ``v_head_dim``.

Tensor parallel splits the heads: ``wq``/``wq_b`` and ``wkv_b`` by columns, ``wo`` by rows; the
latent projections and their norms are whole on every tp rank, and so are their gradients: the
column-parallel up-projections sum their inputs' gradients over tp, and the shared rotary key,
used by this rank's heads alone, has its gradient summed here (``tp_mesh``); where context
parallel moves the latent (``LatentKeys``) the latent and rotary key are summed here together.

RoPE rotates interleaved pairs (2i, 2i+1) here, as DeepSeek's weights are laid out
(``rope_interleave``), so Hugging Face's rows need no permutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.models.llama.rope import softmax_scale

# The latents' RMSNorm epsilon: DeepSeek's (its code and transformers' fix it, whatever the
# model's rms_norm_eps)
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAArgs:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_config(cls, cfg: Any) -> MLAArgs | None:
        """From an ``MLAConfig`` (or a dict with its fields); None stays None (GQA)."""
        if cfg is None or isinstance(cfg, MLAArgs):
            return cfg
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        return cls(kv_lora_rank=get("kv_lora_rank"), qk_nope_head_dim=get("qk_nope_head_dim"),
                   qk_rope_head_dim=get("qk_rope_head_dim"), v_head_dim=get("v_head_dim"),
                   q_lora_rank=get("q_lora_rank"))


class MLAttention(nn.Module):
    """(B, T, D) → (B, T, D), with the model's RoPE tables of ``qk_rope_head_dim``."""

    def __init__(self, args, norm_cls):
        super().__init__()
        m: MLAArgs = args.mla
        self.mla, self.ops, self.dropout = m, args.ops, args.dropout
        self.scale = softmax_scale(m.qk_head_dim, args.rope_scaling)
        h, d = args.n_heads, args.dim
        if m.q_lora_rank is None:
            self.wq = nn.Linear(d, h * m.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(d, m.q_lora_rank, bias=False)
            self.q_a_norm = norm_cls(m.q_lora_rank, LATENT_NORM_EPS, args.ops)
            self.wq_b = nn.Linear(m.q_lora_rank, h * m.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_norm = norm_cls(m.kv_lora_rank, LATENT_NORM_EPS, args.ops)
        self.wkv_b = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.wo = nn.Linear(h * m.v_head_dim, d, bias=False)
        self.context = None  # context parallel / document masks (``_attend_in_context``)
        self.tp_mesh = None  # tensor parallel (``parallelize._mla_plan``): the heads' mesh

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        m = self.mla
        B, T, _ = x_BTD.shape
        q = self.wq(x_BTD) if m.q_lora_rank is None else self.wq_b(self.q_a_norm(self.wq_a(x_BTD)))
        # -1 for the head count: under tensor parallel each rank holds a slice of the heads.
        q = q.view(B, T, -1, m.qk_head_dim)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x_BTD).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_norm(latent)
        # the tables sliced here, where T is the whole sequence even under sequence parallel
        q_rope = self.ops.rope(q_rope.contiguous(), cos[:T], sin[:T])
        k_rope = self.ops.rope(k_rope.reshape(B, T, 1, m.qk_rope_head_dim), cos[:T], sin[:T])
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self._ring_moves_latent():
            return self.wo(self._attend_compressed(q, latent, k_rope, docs).reshape(B, T, -1))
        kv = self.wkv_b(latent).view(B, T, -1, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        if self.tp_mesh is not None:
            k_rope = _summed_in_backward(k_rope, self.tp_mesh)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.context is not None:  # context parallel and/or document masks
            return self.wo(self._attend_in_context(q, k, v, docs).reshape(B, T, -1))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=self.scale,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def _ring_moves_latent(self) -> bool:
        """Under context parallel (cp > 1) the ring moves each token's latent and rotary key
        (``LatentKeys``) where the ring is told to (``ContextParallel.compressed``: the engine
        decides, from ``parallelism.cp_latent``, the schedule and float8)."""
        cx = self.context
        return cx is not None and cx.cp > 1 and cx.compressed

    def _attend_compressed(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                           docs: torch.Tensor | None) -> torch.Tensor:
        """Over the ring, which moves a token's latent and rotary key (kv_lora_rank +
        qk_rope_head_dim values, against heads × 2 × the padded head width expanded) and
        expands them by ``wkv_b`` where they are attended. Under tensor parallel the latent's
        gradient is this rank's heads' part: summed over tp here, as the rotary key's."""
        m = self.mla
        width = max(q.shape[-1], m.v_head_dim)
        packed = torch.cat([latent, k_rope.squeeze(2)], dim=-1)
        if self.tp_mesh is not None:
            packed = _summed_in_backward(packed, self.tp_mesh)
        w = self.wkv_b.weight
        w = w.to_local() if hasattr(w, "to_local") else w  # (tp: this rank's heads' rows)
        out = self.context.attend_compressed(F.pad(q, (0, width - q.shape[-1])), packed,
                                             LatentKeys(m, width), [w], docs, scale=self.scale)
        return out[..., :m.v_head_dim]

    def _attend_in_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           docs: torch.Tensor | None) -> torch.Tensor:
        """Over the context-parallel ring (``parallel/context.py``), which moves a block's
        keys and values as one buffer: the narrower of the query/key and value heads is padded
        with zeros to the wider (zero query/key dimensions add nothing to a score, zero value
        dimensions give zero outputs, cut off here), the scale given as MLA's."""
        width = max(q.shape[-1], v.shape[-1])
        q, k = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k))
        out = self.context.attend(q, k, F.pad(v, (0, width - v.shape[-1])), docs, scale=self.scale)
        return out[..., :v.shape[-1]]


@dataclass(frozen=True)
class LatentKeys:
    """MLA's keys and values made from what context parallel moves for them (``parallel.
    context.Keys``): a block (B, T, kv_lora_rank + qk_rope_head_dim) of tokens' normed latents
    and rotated rotary keys, expanded by ``wkv_b``'s weight (rows: heads × (qk_nope_head_dim
    + v_head_dim)) into (B, heads, 1, T, width) keys and values, padded to ``width`` as
    ``_attend_in_context`` pads them. The gradients fold back through matmuls in the
    weight's dtype (as a linear's backward runs), accumulated in float32."""

    mla: MLAArgs
    width: int

    def expand(self, block: torch.Tensor, weights) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.mla
        B, T, _ = block.shape
        latent, k_rope = block.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = F.linear(latent, weights[0]).view(B, T, -1, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, kv.shape[2], -1)], dim=-1)
        k, v = (F.pad(t, (0, self.width - t.shape[-1])) for t in (k, v))
        return k.transpose(1, 2).unsqueeze(2), v.transpose(1, 2).unsqueeze(2)

    def grad_buffers(self, d_block: torch.Tensor, k: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                torch.zeros(k.shape, dtype=torch.float32, device=k.device))

    def fold(self, block, weights, dk, dv, d_block, d_weights) -> None:
        m = self.mla
        L, nope = m.kv_lora_rank, m.qk_nope_head_dim
        dk, dv = dk.squeeze(2).transpose(1, 2), dv.squeeze(2).transpose(1, 2)  # (B, T, H, width)
        w = weights[0]
        d_kv = torch.cat([dk[..., :nope], dv[..., :m.v_head_dim]], dim=-1).flatten(2).to(w.dtype)
        d_block[..., :L] += d_kv @ w
        d_block[..., L:] += dk[..., nope:nope + m.qk_rope_head_dim].sum(2)
        d_weights[0] += d_kv.flatten(0, 1).T @ block[..., :L].to(w.dtype).flatten(0, 1)


def _summed_in_backward(t: torch.Tensor, mesh) -> torch.Tensor:
    """``t`` unchanged; its gradient summed over ``mesh`` in backward (each tp rank's heads
    give a part of it): a replicated DTensor whose local gradient is declared partial."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()])
