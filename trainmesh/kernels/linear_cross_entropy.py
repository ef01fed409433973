"""Fused output projection + cross-entropy in Triton: the (tokens × vocab) logits never exist.

Rows (tokens) are taken in chunks whose logits are CHUNK_FACTOR times the size of h; for a
chunk of n rows and the local vocabulary V (a shard under tensor parallel, starting at v0):
    z      = h Wᵀ                                   (n, V), the only logits alive at a time
    m, s   = max_v z, Σ_v exp(z − m)               one pass over V in blocks (online softmax)
    t      = z[target − v0] if the target is local, else 0
  under TP, combined over the "tp" group:  M = max m,  S = Σ s·exp(m − M),  T = Σ t
    lse    = M + log S,     loss += Σ_rows (lse − T)
    dz     = (exp(z − lse) − onehot(target)) / N     written over z, in place
    dh     = dz W          (partial over the tp group: each rank holds its vocabulary's part)
    dW    += dzᵀ h     (in W's dtype, or float32 with ACCUMULATE = "fp32")
One program per row streams the row in blocks of up to MAX_BLOCK_V logits: without tensor
parallel the loss and dz come from one launch per chunk. Gradients are computed in the
forward, while the chunk's logits exist, and scaled by the incoming gradient in backward
(the design Liger-Kernel published). The loss is the mean over all N rows, in float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from trainmesh.kernels.launch import plain

MAX_BLOCK_V = 32768  # a row's logits are read in blocks of up to this many (32 warps on a GPU)
# Rows per chunk: a chunk's logits are CHUNK_FACTOR times the size of the whole input h, and
# the weight's gradient accumulates in the weight's dtype (as Liger-Kernel does) or float32.
# Chosen by the GPU check kit's sweep (bench/kernels.py --lce-sweep); see bench/RESULTS.md.
CHUNK_FACTOR = 8
ACCUMULATE = "native"
# ... and never more than this many logits (512 MiB in bf16: the sweep's 8k tokens × 4096 ×
# vocab 128k at CHUNK_FACTOR 8), so that a long context's chunk does not grow with its tokens
# (8 GiB of logits at 128k tokens × 4096 without the cap).
MAX_CHUNK_LOGITS = 1 << 28


@triton.jit
def _row_stats(base, target, V, BLOCK_V: tl.constexpr):
    """Online softmax over one row of logits: its max m, Σ exp(z − m) and its target's logit."""
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        t += tl.sum(tl.where(cols == target, z, 0.0), axis=0)
    return m, s, t


@triton.jit
def _row_grad(base, target, lse, V, scale, BLOCK_V: tl.constexpr):
    """(softmax − onehot(target)) × scale written over the row's logits."""
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(base + cols, g.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _ce_fused(Z, TARGETS, LOSS, stride, V, scale, BLOCK_V: tl.constexpr):
    """One program per row, whole vocabulary local: loss and gradient in one launch (the
    row's second read mostly comes from L2)."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGETS + row)
    base = Z + row * stride
    m, s, t = _row_stats(base, target, V, BLOCK_V)
    lse = m + tl.log(s)
    tl.store(LOSS + row, lse - t)
    _row_grad(base, target, lse, V, scale, BLOCK_V)


@triton.jit
def _ce_stats(Z, TARGETS, M, S, TGT, stride, V, v0, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m, s, t = _row_stats(Z + row * stride, tl.load(TARGETS + row) - v0, V, BLOCK_V)
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(TGT + row, t)


@triton.jit
def _ce_grad(Z, TARGETS, LSE, stride, V, v0, scale, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _row_grad(Z + row * stride, tl.load(TARGETS + row) - v0, tl.load(LSE + row), V, scale,
              BLOCK_V)


def chunk_rows(n_rows: int, vocab: int, dim: int, factor: int = CHUNK_FACTOR,
               max_logits: int = MAX_CHUNK_LOGITS) -> int:
    """Rows per chunk so that a chunk's logits are about ``factor`` times the whole input h,
    and at most ``max_logits``."""
    rows = min(n_rows, triton.cdiv(n_rows * factor, triton.cdiv(vocab, dim)), max_logits // vocab)
    return max(1, rows)


def _launch(vocab: int) -> dict:
    """Block size and warps for a per-row pass over ``vocab`` logits: wide blocks and many
    warps, so that one program per row streams its row at memory speed."""
    block = min(MAX_BLOCK_V, triton.next_power_of_2(vocab))
    return {"BLOCK_V": block, "num_warps": max(4, min(32, block // 1024))}


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, w_VD: torch.Tensor, targets_N: torch.Tensor, v0: int,
                group: dist.ProcessGroup | None, factor: int, accumulate: str) -> torch.Tensor:
        n_rows, dim = h_ND.shape
        vocab = w_VD.shape[0]
        h, w, targets = (plain(t).contiguous() for t in (h_ND, w_VD, targets_N))
        # Without gradients to give (evaluation), the loss alone: no dz, dh or dW.
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if grads else None
        fp32 = accumulate == "fp32" and w.dtype != torch.float32
        grad_w = (torch.zeros(vocab, dim, dtype=torch.float32 if fp32 else w.dtype, device=h.device)
                  if grads else None)
        losses = torch.empty(n_rows, dtype=torch.float32, device=h.device)
        launch = _launch(vocab)
        step = chunk_rows(n_rows, vocab, dim, factor)
        z_buf = torch.empty(min(step, n_rows), vocab, dtype=h.dtype, device=h.device)
        for start in range(0, n_rows, step):
            hc, tc = h[start:start + step], targets[start:start + step]
            n = hc.shape[0]
            z = torch.mm(hc, w.T, out=z_buf[:n])  # (n, V) logits of this chunk only
            if group is None and grads:
                _ce_fused[(n,)](z, tc, losses[start:start + n], z.stride(0), vocab, 1.0 / n_rows,
                                **launch)
            else:
                m, s, t = (torch.empty(n, dtype=torch.float32, device=h.device) for _ in range(3))
                _ce_stats[(n,)](z, tc, m, s, t, z.stride(0), vocab, v0, **launch)
                if group is not None:
                    m_all = m.clone()
                    dist.all_reduce(m_all, dist.ReduceOp.MAX, group=group)
                    s = s * torch.exp(m - m_all)
                    dist.all_reduce(s, group=group)
                    dist.all_reduce(t, group=group)
                    m = m_all
                lse = m + torch.log(s)
                losses[start:start + n] = lse - t
                if not grads:
                    continue
                _ce_grad[(n,)](z, tc, lse, z.stride(0), vocab, v0, 1.0 / n_rows, **launch)
            torch.mm(z, w, out=grad_h[start:start + n])
            if not fp32:
                grad_w.addmm_(z.T, hc)
            elif h.is_cuda:  # cuBLAS accumulates bf16 products into the float32 buffer
                torch.addmm(grad_w, z.T, hc, out_dtype=torch.float32, out=grad_w)
            else:
                grad_w += (z.T @ hc).float()
        if grads:
            ctx.save_for_backward(grad_h, grad_w if not fp32 else grad_w.to(w.dtype))
        return losses.sum() / n_rows

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # Scaled in place: the saved gradients are used once (no retain_graph through the loss).
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h.mul_(grad_loss.to(grad_h.dtype)), grad_w.mul_(grad_loss.to(grad_w.dtype)),
                None, None, None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         factor: int | None = None, accumulate: str | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against ``targets`` (any leading shape).

    ``weight`` may be a DTensor sharded on the vocabulary (``Shard(0)`` over the "tp" mesh, as
    the vocab-parallel output projection leaves it): each rank then works on its vocabulary
    slice and the log-sum-exp is combined across the group. ``h`` may be a plain tensor
    (replicated) or a DTensor (sequence-parallel, gathered here). ``factor`` and ``accumulate``
    override CHUNK_FACTOR and ACCUMULATE (the kit's sweep)."""
    factor = CHUNK_FACTOR if factor is None else factor
    accumulate = ACCUMULATE if accumulate is None else accumulate
    if accumulate not in ("native", "fp32"):
        raise ValueError(f"linear_cross_entropy: accumulate={accumulate!r}; use native or fp32")
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        # Autocast does not reach the kernel's out=/in-place matmuls: compute in its dtype
        # (autograd casts the gradients back to the parameters' dtype).
        dtype = torch.get_autocast_dtype(device_type)
        h, weight = h.to(dtype), weight.to(dtype)
    if not isinstance(weight, DTensor):
        if isinstance(h, DTensor):
            raise ValueError("linear_cross_entropy: h is a DTensor but the head weight is not")
        return LinearCrossEntropyFunction.apply(h.flatten(0, -2), weight, targets.flatten(), 0, None,
                                                factor, accumulate)
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
                                            mesh.get_group(), factor, accumulate)
