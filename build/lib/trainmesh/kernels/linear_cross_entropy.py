"""Fused output projection + cross-entropy in Triton: the (tokens × vocab) logits never exist.

Rows (tokens) are taken in chunks of about the hidden size's worth of logits; for a chunk of
n rows and the local vocabulary V (a shard under tensor parallel, starting at v0):
    z      = h Wᵀ                                   (n, V), the only logits alive at a time
    m, s   = max_v z, Σ_v exp(z − m)               one pass over V in blocks (online softmax)
    t      = z[target − v0] if the target is local, else 0
  under TP, combined over the "tp" group:  M = max m,  S = Σ s·exp(m − M),  T = Σ t
    lse    = M + log S,     loss += Σ_rows (lse − T)
    dz     = (exp(z − lse) − onehot(target)) / N     written over z, in place
    dh     = dz W          (partial over the tp group: each rank holds its vocabulary's part)
    dW    += dzᵀ h
Gradients are computed in the forward, while the chunk's logits exist, and scaled by the
incoming gradient in backward (Liger-Kernel's fused linear cross-entropy does the same). The
loss is the mean over all N rows, in float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from trainmesh.kernels.launch import plain

BLOCK_V = 1024


@triton.jit
def _ce_stats(Z, TARGETS, M, S, TGT, stride, V, v0, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(TARGETS + row) - v0
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(Z + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        t += tl.sum(tl.where(cols == target, z, 0.0), axis=0)
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(TGT + row, t)


@triton.jit
def _ce_grad(Z, TARGETS, LSE, stride, V, v0, scale, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(TARGETS + row) - v0
    lse = tl.load(LSE + row)
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(Z + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(Z + row * stride + cols, g.to(Z.dtype.element_ty), mask=mask)


def chunk_rows(n_rows: int, vocab: int, dim: int) -> int:
    """Rows per chunk so that a chunk's logits are about the size of the whole input h."""
    return max(1, triton.cdiv(n_rows, triton.cdiv(vocab, dim)))


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, w_VD: torch.Tensor, targets_N: torch.Tensor, v0: int,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        n_rows, dim = h_ND.shape
        vocab = w_VD.shape[0]
        h, w, targets = (plain(t).contiguous() for t in (h_ND, w_VD, targets_N))
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(vocab, dim, dtype=torch.float32, device=h.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        block = min(BLOCK_V, triton.next_power_of_2(vocab))
        step = chunk_rows(n_rows, vocab, dim)
        for start in range(0, n_rows, step):
            hc, tc = h[start:start + step], targets[start:start + step]
            n = hc.shape[0]
            z = hc @ w.T  # (n, V) logits of this chunk only
            m, s, t = (torch.empty(n, dtype=torch.float32, device=h.device) for _ in range(3))
            _ce_stats[(n,)](z, tc, m, s, t, z.stride(0), vocab, v0, BLOCK_V=block)
            if group is not None:
                m_all = m.clone()
                dist.all_reduce(m_all, dist.ReduceOp.MAX, group=group)
                s = s * torch.exp(m - m_all)
                dist.all_reduce(s, group=group)
                dist.all_reduce(t, group=group)
                m = m_all
            lse = m + torch.log(s)
            loss += (lse - t).sum()
            _ce_grad[(n,)](z, tc, lse, z.stride(0), vocab, v0, 1.0 / n_rows, BLOCK_V=block)
            grad_h[start:start + n] = z @ w
            grad_w += (z.T @ hc).float()
        ctx.save_for_backward(grad_h, grad_w.to(w.dtype))
        return loss / n_rows

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss.to(grad_w.dtype), None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against ``targets`` (any leading shape).

    ``weight`` may be a DTensor sharded on the vocabulary (``Shard(0)`` over the "tp" mesh, as
    the vocab-parallel output projection leaves it): each rank then works on its vocabulary
    slice and the log-sum-exp is combined across the group. ``h`` may be a plain tensor
    (replicated) or a DTensor (sequence-parallel, gathered here)."""
    if not isinstance(weight, DTensor):
        if isinstance(h, DTensor):
            raise ValueError("linear_cross_entropy: h is a DTensor but the head weight is not")
        return LinearCrossEntropyFunction.apply(h.flatten(0, -2), weight, targets.flatten(), 0, None)
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError("linear_cross_entropy: the head weight must be sharded on the vocabulary "
                         f"over one mesh dim (Shard(0)); got {weight.placements}")
    w_local = weight.to_local()
    if not isinstance(h, DTensor):
        h = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
    # Every rank needs every row; its dh covers only its vocabulary slice, hence Partial.
    h_local = h.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    v0 = mesh.get_local_rank() * w_local.shape[0]
    return LinearCrossEntropyFunction.apply(h_local.flatten(0, -2), w_local, targets.flatten(), v0,
                                            mesh.get_group())
