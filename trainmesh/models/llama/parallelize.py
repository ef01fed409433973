"""How to parallelize the Llama model: Megatron-style tensor parallel (+ sequence parallel) as
DTensor plans, and activation checkpointing. Order (per STYLE.md): TP → AC → ZeRO-3.

Parameter names and full shapes are untouched, so checkpoints do not depend on the TP degree.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainmesh.models.llama.model import Llama


def valid_tp_degrees(n_heads: int, n_kv_heads: int) -> list[int]:
    return [d for d in range(1, n_kv_heads + 1) if n_heads % d == 0 and n_kv_heads % d == 0]


def apply_tensor_parallel(model: Llama, tp_mesh: DeviceMesh, sequence_parallel: bool) -> Llama:
    """Heads split column-wise (q/k/v) and row-wise (o); MLP gate/up column-wise and down
    row-wise; vocab-parallel embedding and output projection, whose logits stay sharded on
    the vocabulary (use ``loss_parallel()`` around the loss). With sequence parallel the
    activations between blocks, and the norms, are sharded on the sequence dimension."""
    tp = tp_mesh.size()
    a = model.args
    if a.n_heads % tp or a.n_kv_heads % tp:
        raise ValueError(f"parallelism.tp={tp} must divide n_heads={a.n_heads} and "
                         f"n_kv_heads={a.n_kv_heads}; valid: {valid_tp_degrees(a.n_heads, a.n_kv_heads)}")
    if a.vocab_size % tp:
        raise ValueError(f"model.vocab_size={a.vocab_size} must be divisible by parallelism.tp={tp} "
                         "for the vocab-parallel embedding; pad the vocabulary")
    if a.tie_embeddings:
        raise ValueError("model.tie_embeddings is not supported with parallelism.tp > 1; "
                         "set it to false")
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
            "feed_forward": PrepareModuleInput(input_layouts=(between,),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
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
