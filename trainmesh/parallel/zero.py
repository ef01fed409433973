"""ZeRO-3 over the "dp" axis through FSDP2 ``fully_shard``, with the planner's sharding policy;
or, when every shard group is one rank (``parallelism.dp_replicate`` = dp), plain replication
through DDP (torch's composable ``replicate``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True)
class ZeroPolicy:
    """How ZeRO-3 trades memory for communication within a step (a planner output).

    ``keep_gathered``: each FSDP unit is gathered at its first forward of the step and stays
    gathered, with unsharded fp32 gradients accumulating, until the last microbatch's backward
    reduce-scatters once (one all-gather and one reduce-scatter per step; the rank's whole part
    gathered all step). Otherwise parameters are freed after every forward and re-gathered for
    backward, and gradients are reduce-scattered after every microbatch (two all-gathers and a
    reduce-scatter per microbatch; only two blocks gathered at a time)."""

    keep_gathered: bool = True
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    def before_backward(self, module: nn.Module, is_last: bool) -> None:
        """Set ``module``'s FSDP flags for a microbatch's backward (``is_last``: the step's
        last one for this module)."""
        sync = is_last or not self.keep_gathered
        # A backward that reduce-scatters must also wait for it, or every microbatch's
        # reduce-scatter inputs (unsharded fp32 gradients) stay alive until the step's end.
        module.set_is_last_backward(sync)
        module.set_requires_gradient_sync(sync)
        module.set_reshard_after_backward(sync)
        # Hybrid sharding: reduce-scatter inside the shard group as above, but all-reduce the
        # accumulated shards across the replica groups once, at the step's last microbatch.
        module.set_requires_all_reduce(is_last)

    @staticmethod
    def before_split_backward(module: nn.Module) -> None:
        """A split backward (I now, W later) runs outside FSDP's hooks' timing: keep the
        parameters gathered and the gradients unreduced through every I and W of the step."""
        module.set_is_last_backward(False)
        module.set_requires_gradient_sync(False)
        module.set_reshard_after_backward(False)

    @staticmethod
    def reduce_after_split_backward(module: nn.Module) -> None:
        """After a stage's last W: reduce-scatter its gradients and reshard, by calling FSDP's
        post-backward for every parameter group itself (what torch.distributed.pipelining does
        for split backwards: autograd never ran FSDP's own hooks at the right moment)."""
        module.set_is_last_backward(True)
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
        state = fully_shard.state(module)
        for sub in state._state_ctx.all_states:
            for group in sub._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()


@dataclass(frozen=True)
class ReplicatePolicy:
    """Data parallel without sharding: every rank holds the whole model and its optimizer
    state, and DDP all-reduces the gradients in buckets while backward runs (the last
    microbatch's only: the others accumulate locally). What TorchTitan applies when the
    shard degree is 1, and the fastest data parallel for a model whose state fits each rank:
    no parameter gathers, and the one reduction overlaps backward, also on CPU ranks."""

    def before_backward(self, module: nn.Module, is_last: bool) -> None:
        module.set_requires_gradient_sync(is_last)


def apply_replicate(model: nn.Module, group: dist.ProcessGroup, device: torch.device,
                    reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """DDP over ``group`` (built at the first forward, after the weights are filled: it
    broadcasts rank 0's). Gradients are views into DDP's buckets (no second copy of them),
    all-reduced in ``reduce_dtype`` (bfloat16: torch's bf16 compression hook, each bucket
    cast, averaged and written back into the float32 gradients)."""
    from torch.distributed._composable.replicate import replicate

    model = replicate(model, process_group=group, gradient_as_bucket_view=True, device_id=device)
    if reduce_dtype == torch.bfloat16:
        model.register_comm_hook(group, _bf16_all_reduce)
    elif reduce_dtype != torch.float32:
        raise ValueError(f"DDP reduces in float32 or bfloat16, not {reduce_dtype}")
    return model


def _bf16_all_reduce(group, bucket):  # (DDP checks a hook's annotations as objects: none)
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that hook by its name
    unless NCCL runs it, but gloo all-reduces bfloat16 too (CPU ranks). ``group``: the
    process group; ``bucket``: a ``dist.GradBucket``; returns the reduction's future."""
    return bf16_compress_hook(group, bucket)


@dataclass(frozen=True)
class ExpertSharding:
    """Expert parallel's experts: ZeRO-3 over ``mesh`` (the replicas of each expert: "edp", or
    under hybrid sharding ("dp_replicate", "edp_shard")), gradients divided by
    ``divide_factor`` (every data-parallel replica's tokens reached them)."""

    mesh: DeviceMesh
    divide_factor: float


def _expert_dim(shards: int):
    """FSDP's placement for stacked expert weights (3-D, expert-major): dim 0, the experts,
    when there are at least as many here as shards; otherwise dim 1 (the expert's rows), or
    some ranks would hold whole experts and others only padding. Other parameters: dim 0."""
    def place(p: nn.Parameter) -> Shard | None:
        local = p.to_local() if isinstance(p, DTensor) else p
        return Shard(1) if p.ndim == 3 and local.shape[0] < shards else None
    return place


def apply_zero3(model: nn.Module, dp_mesh: DeviceMesh, policy: ZeroPolicy,
                experts: ExpertSharding | None = None) -> nn.Module:
    """Shard parameters, gradients and optimizer state over ``dp_mesh`` (``model`` is a Llama
    or a pipeline stage of one; a 2-D ``dp_mesh`` is hybrid sharding: sharded over its second
    dimension, replicated over its first, gradients all-reduced across the replicas): one FSDP
    unit per transformer block (its all-gather overlaps the previous block's compute), then the
    root for the embedding, final norm and head.
    With ``experts``, each MoE block's experts are a unit of their own on its mesh.
    Master weights and optimizer state stay float32; parameters are gathered in
    ``policy.param_dtype`` and gradients reduced in ``policy.reduce_dtype``."""
    mp = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
    shards = dp_mesh.size(dp_mesh.ndim - 1)  # HSDP (2-D mesh): shards over the last dim
    blocks = [*(model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers),
              *(m.block for m in (getattr(model, "mtp", None) or {}).values())]
    # (multi-token prediction's blocks: units of their own too)
    for block in blocks:
        routed = getattr(block.feed_forward, "experts", None)
        if experts is not None and routed is not None:
            fully_shard(routed, mesh=experts.mesh, reshard_after_forward=not policy.keep_gathered,
                        mp_policy=mp,
                        shard_placement_fn=_expert_dim(experts.mesh.size(experts.mesh.ndim - 1)))
            routed.set_gradient_divide_factor(experts.divide_factor)
            # gloo has no PREMUL_SUM: sum, then divide. Not where the reduce-scatter's group
            # is one rank (hybrid sharding too), where FSDP divides while copying and would
            # divide again after (torch 2.13).
            if (experts.mesh.size(experts.mesh.ndim - 1) > 1
                    and dist.get_backend(experts.mesh.get_group(0)) == "gloo"):
                routed.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=not policy.keep_gathered,
                    mp_policy=mp, shard_placement_fn=_expert_dim(shards))
    # The root's parameters are needed again right at backward start: keep them gathered.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    return model
