"""Context parallel: each sequence split over the ``cp`` ranks of a ring, attention exact across
them.

The sequence is cut into 2·cp chunks and rank i holds chunks i and 2·cp−1−i, so that under a
causal mask every rank has the same work (an early chunk sees few keys, its partner many).
Each rank computes attention for its own queries against every rank's keys and values, one
block (a rank's two chunks) at a time, and merges the partial results by their log-sum-exp:

- ``ring``: the key/value blocks travel around the ring by point-to-point; the transfer of the
  next block is posted before the current block's attention, so it overlaps it. Backward sends
  them round again with their gradients, which arrive back at their owner after cp hops.
- ``allgather`` (Llama 3's): all-gather the keys and values once (cheap with grouped-query
  attention: only the key/value heads travel), attend locally, reduce-scatter their gradients.

What travels for a block's keys and values is the keys and values themselves, or fewer values
they are made from where they are attended (``attend_compressed``: Multi-head Latent
Attention's latent, expanded by each rank; their gradients fold back into it).

Chunk pairs a query cannot see are skipped (a later key chunk under the causal mask, or with
document masks two chunks without a common document). Grouped-query attention's key/value
heads travel unexpanded.
Point-to-point follows NCCL's rules: both directions of a hop are posted together in one batch,
every rank posts the same sequence, and a batch's messages meet in posting order.

The same code runs at cp = 1 for document masks alone (no communication).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from trainmesh.kernels import attention
from trainmesh.parallel.clock import WaitLog

MODES = ("ring", "allgather")


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) a rank holds: i and 2·cp−1−i."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_spans(seq_len: int, cp_rank: int, cp: int) -> list[tuple[int, int]]:
    """(start, length) in the sequence of each of a rank's chunks, in its local order."""
    if seq_len % (2 * cp):
        raise ValueError(f"training.seq_len={seq_len} is not divisible by 2 × cp = {2 * cp}")
    c = seq_len // (2 * cp)
    return [(i * c, c) for i in chunk_ids(cp_rank, cp)]


def local_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """The global positions of a rank's tokens, in its local order (for RoPE)."""
    return torch.cat([torch.arange(s, s + n) for s, n in local_spans(seq_len, cp_rank, cp)])


def shard_sequence(t_BT: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """A rank's chunks of a whole (B, T, ...) sequence tensor."""
    return torch.cat([t_BT[:, s:s + n] for s, n in local_spans(t_BT.shape[1], cp_rank, cp)], 1)


@dataclass
class ContextParallel(WaitLog):
    """One rank's place in a context-parallel ring (``group`` None at cp = 1) and how it
    attends: ``mode`` ring | allgather; ``eos``: the end-of-document token when documents are
    masked from each other (None: one causal sequence); ``post``: ``batch_isend_irecv`` or the
    NCCL-rules layer; ``block``/``block_backward``: the attention-with-LSE kernels;
    ``compressed``: a model that offers fewer values than its keys and values to move
    (``attend_compressed``) moves those at cp > 1 (``parallelism.cp_latent``). Its
    ``WaitLog`` holds where the rank was blocked on the ring this step."""

    cp: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    mode: str = "ring"
    eos: int | None = None
    post: Callable = dist.batch_isend_irecv
    block: Callable = attention.attention_block
    block_backward: Callable = attention.attention_block_backward
    compressed: bool = True
    peers: list[int] = field(default_factory=list)  # global ranks, by cp coordinate
    sent: int = 0  # bytes this rank sent over the ring this step (a ring collective's share)

    def ring_positions(self, seq_len: int) -> torch.Tensor:
        """Every rank's tokens' positions in a sequence of ``seq_len``, rank after rank (the
        order an all-gather over the ring lays their parts end to end in)."""
        return torch.cat([local_positions(seq_len, r, self.cp) for r in range(self.cp)])

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"parallelism.cp_mode={self.mode!r}; use one of {', '.join(MODES)}")
        if self.cp > 1 and not self.peers:
            self.peers = [dist.get_global_rank(self.group, i) for i in range(self.cp)]

    def start(self, clock) -> None:
        super().start(clock)
        self.sent = 0

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(cp, *t.shape): every rank's ``t``, waited for and counted."""
        self.sent += t.nbytes * (self.cp - 1)
        return self.timed(_all_gather, t, self.cp, self.group)

    def reduce_scatter(self, out: torch.Tensor, parts: torch.Tensor) -> None:
        """``out``: the sum over the ring of every rank's ``parts[own rank]`` (``parts``
        (cp, *out.shape)), waited for and counted."""
        self.sent += out.nbytes * (self.cp - 1)
        self.timed(dist.reduce_scatter_single, out, parts.flatten(0, 1), group=self.group)

    @property
    def next_peer(self) -> int:
        return self.peers[(self.rank + 1) % self.cp]

    @property
    def prev_peer(self) -> int:
        return self.peers[(self.rank - 1) % self.cp]

    # -- documents -----------------------------------------------------------------------
    def document_ids(self, tokens_BT: torch.Tensor) -> torch.Tensor | None:
        """Each local token's document (the count of end-of-document tokens before it in the
        whole sequence), or None without document masks. A collective over the ring (each
        chunk's count of documents ended) at cp > 1."""
        if self.eos is None:
            return None
        B, T = tokens_BT.shape
        ends = (tokens_BT == self.eos).view(B, 2, T // 2).long()
        counts = ends.sum(-1)  # (B, 2): documents ended in each local chunk
        if self.cp > 1:
            every = self.gather(counts.contiguous())
            by_chunk = counts.new_zeros((B, 2 * self.cp))
            for r in range(self.cp):
                by_chunk[:, list(chunk_ids(r, self.cp))] = every[r]
        else:
            by_chunk = counts
        before = torch.cumsum(by_chunk, 1) - by_chunk  # documents ended before each chunk
        mine = before[:, list(chunk_ids(self.rank, self.cp))] if self.cp > 1 else before
        return (torch.cumsum(ends, -1) - ends + mine.unsqueeze(-1)).view(B, T)

    # -- attention -----------------------------------------------------------------------
    @torch.compiler.disable  # point-to-point and host syncs: eager between compiled graphs
    def attend(self, q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor,
               docs_BT: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys (the
        rank's own tokens in local chunk order, shapes (B, T_local, heads, head_dim)), within
        documents given ``docs_BT``, the scores scaled by ``scale`` (None: 1/√head_dim);
        (B, T_local, n_heads, head_dim) out."""
        B, T, H, D = q_BTHD.shape
        Hkv = k_BTHD.shape[2]
        q = q_BTHD.view(B, T, Hkv, H // Hkv, D).permute(0, 2, 3, 1, 4)
        k = k_BTHD.unsqueeze(3).permute(0, 2, 3, 1, 4)
        v = v_BTHD.unsqueeze(3).permute(0, 2, 3, 1, 4)
        out = _Attention.apply(q, torch.stack([k, v]), docs_BT, self, scale, STACKED)
        return out.permute(0, 3, 1, 2, 4).reshape(B, T, H, D)  # (from (B, Hkv, rep, T, D))

    @torch.compiler.disable
    def attend_compressed(self, q_BTHD: torch.Tensor, packed_BTP: torch.Tensor, keys: Keys,
                          weights: Sequence[torch.Tensor], docs_BT: torch.Tensor | None = None,
                          scale: float | None = None) -> torch.Tensor:
        """``attend`` where a token's keys and values come from fewer values than they hold
        (Multi-head Latent Attention's latent): ``packed_BTP`` (B, T_local, P) is what travels
        round the ring (or is all-gathered) and ``keys.expand(block, weights)`` makes a block's
        keys and values where they are used, one head per query head; their gradients fold
        back into the packed values' (which travel home) and ``weights``' (summed here)."""
        B, T, H, D = q_BTHD.shape
        q = q_BTHD.permute(0, 2, 1, 3).unsqueeze(2)  # (B, H, 1, T, D)
        out = _Attention.apply(q, packed_BTP, docs_BT, self, scale, keys, *weights)
        return out.squeeze(2).permute(0, 2, 1, 3)

    def pairs(self, owner: int, docs_q: torch.Tensor | None, docs_k: torch.Tensor | None,
              c: int) -> list[tuple[int, int, bool, torch.Tensor | None]]:
        """(local query chunk, key chunk of ``owner``'s block, causal, document mask or None)
        for every pair a query can see: a key chunk before the query chunk (whole) or the same
        one (causal), and with documents only pairs with a document in common (decided for
        the block's pairs at once: one host sync per block)."""
        mine, theirs = chunk_ids(self.rank, self.cp), chunk_ids(owner, self.cp)
        seen = [(i, j, kb == qa) for i, qa in enumerate(mine) for j, kb in enumerate(theirs)
                if kb <= qa]
        if docs_q is None:
            return [(i, j, causal, None) for i, j, causal in seen]
        masks, visible = [], []
        tril = torch.ones(c, c, dtype=torch.bool, device=docs_q.device).tril()
        for i, j, causal in seen:
            mask = (docs_q[:, None, None, i * c:(i + 1) * c, None]
                    == docs_k[:, None, None, None, j * c:(j + 1) * c])
            masks.append(mask)
            visible.append((mask & tril if causal else mask).any())
        keep = torch.stack(visible).tolist()
        return [(i, j, causal, m) for (i, j, causal), m, k in zip(seen, masks, keep, strict=True)
                if k]

    def blocks(self, tensors: Sequence[torch.Tensor]) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """(owner, its block) for every rank's block of ``tensors`` (this rank's own first).
        Ring: the next block's transfer is in flight while the caller works on this one."""
        cur = [t.contiguous() for t in tensors]
        if self.cp == 1:
            yield 0, cur
            return
        if self.mode == "allgather":
            every = [self.gather(t) for t in cur]
            for step in range(self.cp):
                owner = (self.rank - step) % self.cp
                yield owner, [e[owner] for e in every]
            return
        for step in range(self.cp):
            nxt, handles = None, None
            if step < self.cp - 1:
                nxt = [torch.empty_like(t) for t in cur]
                handles = self.exchange(cur, nxt)
            yield (self.rank - step) % self.cp, cur
            if handles is not None:
                self.timed(_wait, handles)
                cur = nxt

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> list:
        """Post one hop of the ring: ``send`` to the next rank, ``recv`` from the previous."""
        self.sent += sum(t.nbytes for t in send)
        ops = [dist.P2POp(dist.isend, t, self.next_peer, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev_peer, self.group) for t in recv]
        return self.post(ops)


def _all_gather(t: torch.Tensor, n: int, group) -> torch.Tensor:
    """(n, *t.shape): every rank's ``t`` (concatenated on dim 0 as gloo requires)."""
    out = t.new_empty((n * t.shape[0], *t.shape[1:]))
    dist.all_gather_single(out, t, group=group)
    return out.view(n, *t.shape)


def _wait(handles) -> None:
    for h in handles:
        h.wait()


def _merge(acc: tuple | None, out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """Two partial attentions over disjoint keys → their union's, by log-sum-exp (float32;
    a query that saw no key in one part has lse −inf there, weight 0)."""
    out = out.float()
    if acc is None:
        return out, lse
    o, old = acc
    new = torch.logaddexp(old, lse)
    finite = torch.isfinite(new)
    w_old = torch.where(finite, torch.exp(old - new), 0.0).unsqueeze(-1)
    w_new = torch.where(finite, torch.exp(lse - new), 0.0).unsqueeze(-1)
    return o * w_old + out * w_new, new


class Keys(Protocol):
    """How a block's keys and values come from what travels for them (``_Attention``)."""

    def expand(self, block: torch.Tensor, weights: Sequence[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each (B, Hkv, 1, T, D), from a travelling block."""

    def grad_buffers(self, d_block: torch.Tensor, k: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (dk, dv) the block's attention gradients are added to."""

    def fold(self, block: torch.Tensor, weights: Sequence[torch.Tensor], dk: torch.Tensor,
             dv: torch.Tensor, d_block: torch.Tensor, d_weights: list[torch.Tensor]) -> None:
        """Add (dk, dv)'s share to the block's gradient ``d_block`` and ``d_weights``."""


class _Stacked:
    """Keys and values travel as themselves, stacked: one (2, B, Hkv, 1, T, D) buffer whose
    gradient buffer holds dk and dv in place."""

    def expand(self, block, weights):
        return block[0], block[1]

    def grad_buffers(self, d_block, k):
        return d_block[0], d_block[1]

    def fold(self, block, weights, dk, dv, d_block, d_weights) -> None:
        pass  # (accumulated in place)


STACKED = _Stacked()


class _Attention(torch.autograd.Function):
    """Exact causal attention over a context-parallel ring (``ContextParallel``'s layout). A
    block travels as one buffer (its keys and values stacked, or what ``keys`` makes them
    from) beside its tokens' documents, its gradient as one fp32 buffer: one message per hop
    and direction, one collective."""

    @staticmethod
    def forward(ctx, q, travel, docs, cpx: ContextParallel, scale: float | None, keys: Keys,
                *weights):
        T = q.shape[3]
        c = T // 2
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        qs = (q[..., :c, :], q[..., c:, :])
        acc: list[tuple | None] = [None, None]
        for owner, block in cpx.blocks([travel] + ([] if docs is None else [docs])):
            docs_k = block[1] if docs is not None else None
            seen = cpx.pairs(owner, docs, docs_k, c)
            if not seen:  # (documents can hide a whole block: nothing to expand)
                continue
            kb, vb = keys.expand(block[0], weights)
            for i, j, causal, mask in seen:
                o, lse = cpx.block(qs[i], kb[..., j * c:(j + 1) * c, :],
                                   vb[..., j * c:(j + 1) * c, :], causal, mask, scale)
                acc[i] = _merge(acc[i], o, lse)
        out = torch.cat([acc[0][0], acc[1][0]], dim=3).to(q.dtype)
        lse = torch.cat([acc[0][1], acc[1][1]], dim=3)
        ctx.save_for_backward(q, travel, out, lse, docs, *weights)
        ctx.cpx, ctx.scale, ctx.keys = cpx, scale, keys
        return out

    @staticmethod
    def backward(ctx, dout):
        q, travel, out, lse, docs, *weights = ctx.saved_tensors
        cpx, scale, keys = ctx.cpx, ctx.scale, ctx.keys
        c = q.shape[3] // 2
        sl = (slice(0, c), slice(c, 2 * c))
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        d_weights = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in weights]

        def accumulate(owner, block, docs_k, d_block) -> None:
            seen = cpx.pairs(owner, docs, docs_k, c)
            if not seen:
                return
            kb, vb = keys.expand(block, weights)
            dk, dv = keys.grad_buffers(d_block, kb)
            for i, j, causal, mask in seen:
                gq, gk, gv = cpx.block_backward(
                    dout[..., sl[i], :], q[..., sl[i], :], kb[..., sl[j], :], vb[..., sl[j], :],
                    out[..., sl[i], :], lse[..., sl[i]], causal, mask, scale)
                dq[..., sl[i], :] += gq
                dk[..., sl[j], :] += gk
                dv[..., sl[j], :] += gv
            keys.fold(block, weights, dk, dv, d_block, d_weights)

        travels = [travel] + ([] if docs is None else [docs])
        if cpx.cp == 1 or cpx.mode == "allgather":
            every = ([cpx.gather(t) for t in travels]
                     if cpx.cp > 1 else [t.unsqueeze(0) for t in travels])
            grads = torch.zeros((cpx.cp, *travel.shape), dtype=torch.float32, device=q.device)
            for owner in range(cpx.cp):
                accumulate(owner, every[0][owner], every[1][owner] if docs is not None else None,
                           grads[owner])
            if cpx.cp == 1:
                d_travel = grads[0]
            else:  # each owner gets the sum of every rank's part of its block's gradient
                d_travel = torch.empty_like(grads[0])
                cpx.reduce_scatter(d_travel, grads)
        else:  # ring: blocks go round again, their gradients travel with them back home
            cur = travels
            d_travel = torch.zeros(travel.shape, dtype=torch.float32, device=q.device)
            for step in range(cpx.cp):
                owner = (cpx.rank - step) % cpx.cp
                nxt, handles = None, None
                if step < cpx.cp - 1:
                    nxt = [torch.empty_like(t) for t in cur]
                    handles = cpx.exchange(cur, nxt)
                accumulate(owner, cur[0], cur[1] if docs is not None else None, d_travel)
                arrived = torch.empty_like(d_travel)
                if handles is not None:
                    cpx.timed(_wait, handles)
                    cur = nxt
                cpx.timed(_wait, cpx.exchange([d_travel], [arrived]))
                d_travel = arrived
        return (dq.to(q.dtype), d_travel.to(travel.dtype), None, None, None, None,
                *(d.to(w.dtype) for w, d in zip(weights, d_weights, strict=True)))
