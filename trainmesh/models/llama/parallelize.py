"""How to parallelize the Llama model: Megatron-style tensor parallel (+ sequence parallel) as
DTensor plans, and activation checkpointing. Order: TP → AC → ZeRO-3.

Parameter names and full shapes are untouched, so checkpoints do not depend on the TP degree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainmesh.models.llama.model import Llama, mtp_blocks
from trainmesh.models.moe.moe import FLOAT8_GROUPED, MoE, float8_grouped_kind, moe_layers
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
        top["tok_embeddings"] = embedding_style(sequence_parallel)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1),
                                        use_local_output=False)
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(a, block, between, sequence_parallel))
        if a.mla is not None:
            block.attention.tp_mesh = tp_mesh
    if getattr(model, "mtp", None) is not None:
        _mtp_tensor_parallel(model, tp_mesh, sequence_parallel)
    return model


def embedding_style(sequence_parallel: bool) -> RowwiseParallel:
    """The token embedding's tensor-parallel style: vocab-parallel, its output in the layout
    between blocks (``apply_tensor_parallel``; also a pipeline stage's copy of it,
    ``parallel/pipeline/shared.py: LocalCopy``)."""
    return RowwiseParallel(input_layouts=Replicate(),
                           output_layouts=Shard(1) if sequence_parallel else Replicate())


def _mtp_tensor_parallel(model: Llama, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Multi-token prediction's modules under tensor parallel: their blocks split as the
    model's are, without sequence parallel (each runs on T − k positions, which tp need not
    divide): activations whole on every tp rank, an MoE block taking this rank's share of the
    positions (uneven where tp does not divide them); their projection and norms whole
    (each tp rank computes them alike, their gradients alike: the blocks' and the head's
    inputs are summed over tp in backward). ``model.mtp_tp`` gathers what they read."""
    a = model.args
    for module in model.mtp.values():
        plan = block_plan(a, module.block, Replicate(), sequence_parallel=False)
        if isinstance(module.block.feed_forward, MoE):
            del plan["feed_forward"]
            _split_positions_over_tp(module.block.feed_forward, tp_mesh)
        parallelize_module(module.block, tp_mesh, plan)
        if a.mla is not None:
            module.block.attention.tp_mesh = tp_mesh
    model.mtp_tp = MTPTensorParallel(tp_mesh, sequence_parallel)


def _split_positions_over_tp(moe: MoE, tp_mesh: DeviceMesh) -> None:
    """An MoE block whose input is whole on every tp rank takes this rank's share of its
    positions (``torch.chunk``'s, as DTensor shards: uneven where tp does not divide them) and
    gives back the whole output; in backward its input's gradient is gathered whole. The
    whole length is the block's dispatch's (``expert.apply_expert_parallel``: the module's
    T − k, or beside context parallel the rank's part of the sequence), so nothing is kept
    between the two hooks (a recomputation may stop between them)."""

    def before(module, args):
        (x,) = args
        return (DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
                .redistribute(tp_mesh, [Shard(1)]).to_local(),)

    def after(module, args, out):
        shape = torch.Size((out.shape[0], module.dispatch.whole_len, *out.shape[2:]))
        whole = DTensor.from_local(out, tp_mesh, [Shard(1)], run_check=False, shape=shape,
                                   stride=torch.empty(shape, device="meta").stride())
        return whole.redistribute(tp_mesh, [Replicate()]).to_local()

    moe.register_forward_pre_hook(before)
    moe.register_forward_hook(after)


class MTPTensorParallel:
    """What multi-token prediction reads under tensor parallel (``Llama.mtp_tp``): the model's
    normalised output and the embedding of the tokens ahead, whole (they may be sequence
    shards); the head (column-parallel over the vocabulary) takes a module's output as a
    replicated DTensor; the modules' loss term joins the model's loss (a DTensor under
    ``loss_parallel``)."""

    def __init__(self, mesh: DeviceMesh, sequence_parallel: bool):
        self.mesh, self.sequence_parallel = mesh, sequence_parallel

    def model_output(self, h: torch.Tensor) -> torch.Tensor:
        return h.full_tensor() if isinstance(h, DTensor) else h

    def embedded(self, e: torch.Tensor) -> torch.Tensor:
        """The embedding module's output: under sequence parallel this rank's positions."""
        if isinstance(e, DTensor):
            return e.full_tensor()
        if not self.sequence_parallel:
            return e
        return DTensor.from_local(e, self.mesh, [Shard(1)], run_check=False).full_tensor()

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(h, self.mesh, [Replicate()], run_check=False)

    def loss(self, value: torch.Tensor) -> torch.Tensor:
        return value.full_tensor() if isinstance(value, DTensor) else value

    def joined(self, term: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        if isinstance(loss, DTensor):
            return DTensor.from_local(term, loss.device_mesh, [Replicate()], run_check=False)
        return term


def block_plan(a, block: nn.Module, between, sequence_parallel: bool) -> dict[str, object]:
    """One block's tensor-parallel plan (``between``: the activations' layout between blocks).
    What it splits (``ColwiseParallel``, ``RowwiseParallel``) the cost model counts as divided
    over tp; the rest of the block stays whole on every tp rank (``stage_params._block_parts``)."""
    plan: dict[str, object] = (_mla_plan(a.mla, between) if a.mla is not None else {
        "attention": PrepareModuleInput(input_layouts=(between, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=between),
    })
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
    return plan


def _mla_plan(mla, between) -> dict[str, object]:
    """Multi-head Latent Attention's heads split: the per-head up-projections (``wq`` or
    ``wq_b``, ``wkv_b``) by columns, ``wo`` by rows. The block's input is gathered whole and the
    latent projections and their norms are not split: every tp rank computes them whole, and
    their gradients are whole too — the up-projections' inputs are summed over tp in backward
    (as a column-parallel input is), and so is the shared rotary key's (``MLAttention.tp_mesh``;
    where context parallel moves the latent, ``wkv_b``'s weight is used directly and the
    latent's gradient is summed there)."""
    return {
        "attention": PrepareModuleInput(input_layouts=(between, None, None),
                                        desired_input_layouts=(Replicate(), None, None),
                                        use_local_output=True),
        "attention.wq" if mla.q_lora_rank is None else "attention.wq_b": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=between),
    }


def tp_partial_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that the TP plan leaves whole on every tp rank while each rank computes with
    a part of what they act on, so each rank's gradient is a part of the whole: an MoE block's
    (its tp rank's share of the tokens) and the per-head q/k norms (its heads)."""
    out = [p for _, moe in moe_layers(model) for p in moe.parameters()]
    for block in [*model.layers.values(), *mtp_blocks(model)]:
        for name in ("q_norm", "k_norm"):
            if getattr(block.attention, name, None) is not None:
                out.append(getattr(block.attention, name).weight)
    return out


def sum_partial_grads_over_tp(params: list[nn.Parameter], tp_mesh: DeviceMesh | None) -> None:
    """After the data-parallel reduction (ZeRO-3 leaves each tp rank of a replica the same
    shard positions): sum ``tp_partial_params``' gradients over tp, in one all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if tp_mesh is None or tp_mesh.size() == 1 or not grads:
        return
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=tp_mesh.get_group())
    offset = 0
    for g in local:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def apply_activation_checkpointing(model: nn.Module, mode: str, stride: int = 1) -> nn.Module:
    """``full``: recompute every block in backward; ``selective``: every ``stride``-th block;
    ``none``: keep all activations. Names are unchanged (no wrapper modules)."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}; use none, full or selective")
    for i, block in enumerate([*model.layers.values(), *mtp_blocks(model)]):
        block.recompute = mode == "full" or (mode == "selective" and i % stride == 0)
    return model


def apply_context_parallel(model: Llama, context, positions: torch.Tensor | None) -> Llama:
    """Every attention block attends through ``context`` (a ``parallel.context.ContextParallel``:
    the ring of ranks holding the rest of each sequence, or document masks alone); the RoPE
    tables take the rank's tokens' global ``positions`` (None: 0 … T−1). On the meta device,
    before the buffers are filled."""
    model.context, model.rope_positions = context, positions
    for block in model.layers.values():
        block.attention.context = context
    if getattr(model, "mtp", None) is not None and context.cp > 1:
        for block in mtp_blocks(model):  # (without documents: the modules attend causally)
            block.attention.context = context
        model.mtp_cp = MTPContextParallel(context, positions)
    return model


class MTPContextParallel:
    """What multi-token prediction reads under context parallel (``Llama.mtp_cp``). The
    modules run on the rank's part of each sequence as the model does (its chunks, the ring
    attending over the rest), whole: the k-th module's positions are those with a token k + 1
    ahead (< T − k), and the rest run along unread (causal attention never looks ahead; an MoE
    block routes only the module's: ``MoE.rows``). The tokens ahead of a rank's positions
    are other ranks' (past its chunks' ends): the targets are all-gathered over the ring
    (T integers a sequence, once per microbatch). Each module's loss is the mean over its
    positions on this rank, weighed by their share of the sequence's T − k × cp: the mean
    over the ring (ZeRO-3's gradients, the step's metrics) is then one process's."""

    def __init__(self, context, positions: torch.Tensor):
        self.context, self.positions = context, positions
        self.seq_len = positions.numel() * context.cp
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.order = context.ring_positions(self.seq_len)  # (the all-gather's order)

    def whole(self, targets_BT: torch.Tensor) -> torch.Tensor:
        """The whole sequences' targets (B, T) from every rank's part of them."""
        if self.positions.device != targets_BT.device:  # (once: not a copy per microbatch)
            self.positions = self.positions.to(targets_BT.device)
            self.order = self.order.to(targets_BT.device)
            self._rows = {}
        parts = [torch.empty_like(targets_BT) for _ in range(self.context.cp)]
        # (timed as the ring's other waits: the step's breakdown counts it as exposed)
        self.context.timed(dist.all_gather, parts, targets_BT.contiguous(), group=self.context.group)
        return torch.empty(targets_BT.shape[0], self.seq_len, dtype=targets_BT.dtype,
                           device=targets_BT.device).index_copy_(1, self.order, torch.cat(parts, 1))

    def ahead(self, whole: torch.Tensor, k: int) -> torch.Tensor:
        """The tokens k ahead of this rank's positions (the k-th module's input; past the
        end the last, which only positions no loss reads take)."""
        return whole[:, (self.positions + k - 1).clamp(max=self.seq_len - 1)]

    def scored(self, whole: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The k-th module's rows on this rank (positions with a token k + 1 ahead), their
        targets, and the weight of their mean loss (their share of T − k, × cp)."""
        if k not in self._rows:  # (once per module: finding them is a host sync)
            rows = torch.nonzero(self.positions < self.seq_len - k).flatten()
            self._rows[k] = rows, self.positions[rows] + k  # (and where their targets are)
        rows, wanted = self._rows[k]
        share = rows.numel() * self.context.cp / (self.seq_len - k)
        return rows, whole[:, wanted], share


def apply_compile(model: nn.Module, split_backward: bool = False,
                  prediction_blocks: bool = True) -> nn.Module:
    """torch.compile every transformer block in place (``Module.compile``: the block keeps its
    name and its parameters theirs, so checkpoints do not change): regional compilation, one
    compiled graph shared by blocks of the same shape. After TP and activation checkpointing
    (the recomputation is traced with the block), before ZeRO-3 (whose hooks stay outside the
    graph). What cannot be traced — context parallel's ring, an MoE block's dispatch with its
    host sync — runs eagerly between graphs. ``split_backward`` (zero-bubble schedules: the
    input gradients first, the weights' later, keeping the graph): the compiled backward may
    not donate its buffers to the first part (a process-wide torch setting).
    ``prediction_blocks``: the multi-token modules' blocks too (False beside tensor parallel:
    dynamo fails on them there, a RecursionError while tracing, torch 2.13; they run eagerly,
    a block or two beside the model's)."""
    if split_backward:
        torch._functorch.config.donated_buffer = False
    for block in [*model.layers.values(), *(mtp_blocks(model) if prediction_blocks else ())]:
        block.compile()
    return model


def apply_float8(model: nn.Module, recipe: str, device_type: str,
                 all_gather_in_float8: bool, capability: tuple[int, int] | None = None
                 ) -> nn.Module:
    """The blocks' linear layers as torchao's ``Float8Linear`` (weights and names unchanged;
    on the meta device, before ZeRO-3): ``recipe`` tensorwise | rowwise (torchao's recipes);
    ``all_gather_in_float8``: ZeRO-3 gathers the tensorwise-scaled weights in float8 (half the
    bytes of bf16). Left out: the output head and any linear whose sides do not divide by 16
    (the float8 matmul's tiles), and the routers. On CPU, torchao's emulation (for tests:
    float8 rounding, float32 matmuls). The MoE blocks' stacked experts run torchao's float8
    grouped GEMMs, whatever the recipe, of the kind the device (``capability``) runs
    (``moe.float8_grouped_kind``: rowwise scales on Hopper, MXFP8 on Blackwell and, emulated,
    on CPU), where their widths divide by its alignment."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(
        config, emulate=device_type != "cuda",
        enable_fsdp_float8_all_gather=all_gather_in_float8 and recipe == "tensorwise")

    def chosen(module: nn.Module, fqn: str) -> bool:
        return (type(module) is nn.Linear and fqn.startswith("layers.") and "router" not in fqn
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    model = convert_to_float8_training(model, config=config, module_filter_fn=chosen)
    kind = float8_grouped_kind(device_type, capability)
    for _, moe in moe_layers(model):
        w1 = moe.experts.w1  # (experts, ffn, dim)
        if kind is not None and not (w1.shape[1] % FLOAT8_GROUPED[kind]
                                     or w1.shape[2] % FLOAT8_GROUPED[kind]):
            moe.experts.float8 = kind
    return model
