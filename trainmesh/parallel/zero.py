"""ZeRO-3 over the "dp" axis through FSDP2 ``fully_shard``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_zero3(model: nn.Module, dp_mesh: DeviceMesh, compute_dtype: torch.dtype = torch.float32,
                reshard_after_forward: bool = True) -> nn.Module:
    """Shard parameters, gradients and optimizer state over ``dp_mesh`` (``model`` is a Llama
    or a pipeline stage of one): one FSDP unit per
    transformer block (its all-gather overlaps the previous block's compute), then the root
    for the embedding, final norm and head. Master weights and optimizer state stay float32;
    with ``compute_dtype=bfloat16`` parameters are gathered in bf16 and gradients reduced in
    fp32."""
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp)
    # The root's parameters are needed again right at backward start: keep them gathered.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    return model
