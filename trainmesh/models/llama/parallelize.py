"""How to parallelize the Llama model: Megatron-style tensor parallel (+ sequence parallel) as
DTensor plans, and activation checkpointing. Order: TP → AC → ZeRO-3.

Parameter names and full shapes are untouched, so checkpoints do not depend on the TP degree.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainmesh.models.llama.model import Llama
from trainmesh.models.moe.moe import MoE
from trainmesh.spec.mesh_rules import runnable_problems, tp_problems


def apply_tensor_parallel(model: Llama, tp_mesh: DeviceMesh, sequence_parallel: bool) -> Llama:
    """Heads split column-wise (q/k/v) and row-wise (o); MLP gate/up column-wise and down
    row-wise; vocab-parallel embedding and output projection, whose logits stay sharded on
    the vocabulary (use ``loss_parallel()`` around the loss). With sequence parallel the
    activations between blocks, and the norms, are sharded on the sequence dimension.
    A Mixture-of-Experts MLP is not split: it takes this rank's share of the sequence and
    gives its output back in the layout between blocks (``trainmesh/parallel/expert.py``)."""
    tp = tp_mesh.size()
    a = model.args
    broken = [*tp_problems(a, tp), *runnable_problems(a, tp, 1, sequence_parallel)]
    if broken:
        raise ValueError("; ".join(str(p) for p in broken))
    between = Shard(1) if sequence_parallel else Replicate()  # layout of (B, T, D) between blocks
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1),
                                        use_local_output=False)
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention": PrepareModuleInput(input_layouts=(between, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=between),
        }
        if isinstance(block.feed_forward, MoE):
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(between,), desired_input_layouts=(Shard(1),), use_local_input=True,
                output_layouts=(Shard(1),), desired_output_layouts=(between,))
        else:
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(between,),
                                                   desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=between)})
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    return model


def apply_activation_checkpointing(model: nn.Module, mode: str, stride: int = 1) -> nn.Module:
    """``full``: recompute every block in backward; ``selective``: every ``stride``-th block;
    ``none``: keep all activations. Names are unchanged (no wrapper modules)."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}; use none, full or selective")
    for i, block in enumerate(model.layers.values()):
        block.recompute = mode == "full" or (mode == "selective" and i % stride == 0)
    return model
