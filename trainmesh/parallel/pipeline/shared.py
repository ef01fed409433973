"""A parameter that two pipeline stages on different ranks both use: multi-token prediction's
token embedding, which the first stage applies to the input and the last stage (with the
prediction modules and the head) to the tokens ahead. Each of the two ranks holds a copy under
the parameter's own name, so checkpoints, which deduplicate equal shards, and every other
mesh see one tensor.

The copies start equal (the init is by name, an import reads the same tensor) and stay equal:
after the data-parallel reduction each rank sends its gradient to the other and adds the one
it receives (the same sum on both: addition commutes exactly), so the optimizer, whose state
for the two started equal too, moves both alike. The global gradient norm counts the gradient
once, on the first stage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# The exchange's message tag (gloo matches tags; the pipeline's own are below 2**20)
TAG = 1 << 20


@dataclass
class SharedAcrossStages:
    """One rank's copy of ``param``; ``peer``: the global rank holding the other copy (same
    data, tensor and context parallel coordinates, so the same shard of it), reached over the
    pipeline's ``group``; ``post`` posts point-to-point batches (``dist.batch_isend_irecv`` or
    the rank's bounded version); ``counted``: whether this copy's gradient counts in the norm."""

    param: nn.Parameter
    peer: int
    group: dist.ProcessGroup
    post: Callable
    counted: bool

    def sum_grads(self) -> None:
        """Both copies' gradients summed, on both ranks (collective between the two)."""
        grad = self.param.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        theirs = torch.empty_like(local)
        works = self.post([dist.P2POp(dist.isend, local.contiguous(), self.peer, self.group, TAG),
                           dist.P2POp(dist.irecv, theirs, self.peer, self.group, TAG)])
        for work in works:
            work.wait()
        local.add_(theirs)


def embedding_across_stages(model: nn.Module, first_rank: int, last_rank: int, pp_rank: int,
                            peer_of: Callable[[int], int], group: dist.ProcessGroup,
                            post: Callable) -> SharedAcrossStages | None:
    """The token embedding shared by the first stage (on pipeline rank ``first_rank``) and the
    multi-token prediction modules of the last (on ``last_rank``), if ``model`` (this rank's
    Llama) holds one of two copies; None where there is nothing to keep equal (no prediction
    modules, one rank holding both stages, or neither here). ``peer_of(pp_rank)``: the global
    rank at that pipeline position with this rank's other coordinates."""
    if model.args.mtp is None or first_rank == last_rank or pp_rank not in (first_rank, last_rank):
        return None
    other = last_rank if pp_rank == first_rank else first_rank
    return SharedAcrossStages(model.tok_embeddings.weight, peer_of(other), group, post,
                              counted=pp_rank == first_rank)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class LocalCopy:
    """Multi-token prediction where one rank holds the first and the last stage (a V schedule):
    each stage's ZeRO-3 unit must hold parameters of its own, so the last stage's modules look
    the tokens ahead up in a copy of the token embedding (``Llama.mtp_lookup``), sharded as the
    embedding is. Kept equal here, on the rank alone: the copy's gradient is added to the
    embedding's before the clip (which then counts it once, as one process's norm does), and
    the embedding's values are copied into it after every optimizer step and every restore.
    The copy is in neither the optimizer nor the checkpoint."""

    embedding: nn.Module  # the Llama's ``tok_embeddings`` (its weight as ZeRO-3 left it)
    copy: nn.Module

    def sum_grads(self) -> None:
        grad = self.copy.weight.grad
        if grad is None:
            return
        mine = self.embedding.weight
        if mine.grad is None:
            mine.grad = grad.detach().clone()
        else:
            _local(mine.grad).add_(_local(grad))
        self.copy.weight.grad = None

    @torch.no_grad()
    def sync_values(self) -> None:
        _local(self.copy.weight).copy_(_local(self.embedding.weight))
