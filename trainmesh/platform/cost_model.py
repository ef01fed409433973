"""Memory and step-time estimates for one candidate plan (pure arithmetic, no torch).

Memory per rank (bytes), on the heaviest pipeline stage (first: embedding; last: head + logits):
  * ZeRO-3 states: fp32 master weights, fp32 gradients and two fp32 Adam moments = 16 bytes per
    parameter, divided over tp (TP shards weights) and dp (ZeRO-3 shards the rest).
  * Gathered working copies: the compute-dtype parameters of two transformer blocks (the one
    computing and the one prefetched), divided by tp.
  * Activations per microbatch and layer with a fused (flash) attention, after Korthikanti et al.
    2022: s·b·h·(10 + 24/t) bytes without sequence parallel, s·b·h·34/t with it; full
    recomputation keeps only each layer's input, 2·s·b·h (/t with SP). The first stage holds
    ``in_flight`` microbatches: m for GPipe, min(m, p) for 1F1B, min(m, p + (p-1)/v) for
    interleaved 1F1B (in units of a whole stage's activations).
  * Logits in fp32 for one microbatch on the last stage (vocab / tp), and a fixed
    framework/communication-buffer allowance.

Step time (seconds):
  * compute = training FLOPs of the global batch / (world × peak × efficiency), × 4/3 with full
    recomputation (one more forward); stretched by the pipeline bubble: the ideal time covers
    m microbatches, the schedule takes m + (p-1)/v of them.
  * TP: 4 all-reduces (or all-gather + reduce-scatter pairs under SP, same volume) of the
    layer's activations per layer per microbatch (2 forward, 2 backward), ring cost
    2(t-1)/t × bytes / intra-node bandwidth. Assumed not overlapped with compute.
  * PP: one activation send forward and one gradient send backward per stage boundary per
    microbatch (× v under interleaving) over inter-node bandwidth; assumed not overlapped.
  * DP (ZeRO-3): parameters all-gathered for forward and backward (once per step when kept
    gathered across microbatches, else once per microbatch) and gradients reduce-scattered once
    per step: (gathers + 1) × stage bytes × (d-1)/d / bandwidth (intra-node when the DP group
    fits in a node). Assumed overlapped with compute except what exceeds half the compute
    time. Keeping parameters gathered costs the stage's unsharded parameters and gradients
    in memory instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmesh.models.llama.model_math import flops_per_token, layer_params
from trainmesh.platform.devices import DeviceSpec

GIB = 1024**3
FRAMEWORK_BYTES = 2.0 * GIB  # CUDA context, allocator slack, NCCL/gloo buffers
MATMUL_EFFICIENCY = 0.55  # achievable fraction of peak for large bf16 matmuls
PP_LATENCY_S = 20e-6  # per point-to-point message
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
RECOMPUTE = ("none", "full")


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    dp: int
    vpp: int
    schedule: str
    microbatch_size: int
    num_microbatches: int
    recompute: str
    sequence_parallel: bool = False
    # ZeRO-3 gathers parameters once per step and keeps them (and unsharded gradients) across
    # microbatches (True), or re-gathers them for every microbatch (False).
    keep_gathered: bool = True

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Estimate:
    memory_per_rank_gib: float
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_exposed_s: float


def bubble_fraction(schedule: str, pp: int, vpp: int, m: int) -> float:
    """Idle fraction of a pipelined step with uniform stage costs."""
    if pp == 1:
        return 0.0
    v = vpp if schedule == "interleaved-1f1b" else 1
    idle = (pp - 1) / v
    return idle / (m + idle)


def in_flight(schedule: str, pp: int, vpp: int, m: int) -> float:
    """Microbatches of activations the first stage holds at its peak."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp))
    return min(float(m), pp + (pp - 1) / vpp)


def memory_bytes(model, c: Candidate, seq_len: int, compute_bytes: int = 2) -> float:
    """Peak bytes on the heaviest rank (see module docstring)."""
    h, V = model.dim, model.vocab_size
    per_layer_params = layer_params(model)
    layers = model.n_layers // c.pp
    emb = V * h
    head = 0 if model.tie_embeddings else V * h
    first = layers * per_layer_params + emb + (head + h if c.pp == 1 else 0)
    last = layers * per_layer_params + head + h + (emb if c.pp == 1 else 0)
    stage_params = max(first, last)
    states = 16.0 * stage_params / (c.tp * c.dp)
    if c.keep_gathered and c.dp > 1:  # the stage's params and grads stay unsharded all step
        working = (compute_bytes + 4) * stage_params / c.tp
    else:  # two blocks in flight (computing + prefetched)
        working = 2 * compute_bytes * per_layer_params / c.tp
    sbh = seq_len * c.microbatch_size * h
    if c.recompute == "full":
        per_layer = 2.0 * sbh / (c.tp if c.sequence_parallel else 1)
    elif c.sequence_parallel:
        per_layer = 34.0 * sbh / c.tp
    else:
        per_layer = sbh * (10.0 + 24.0 / c.tp)
    acts = per_layer * layers * in_flight(c.schedule, c.pp, c.vpp, c.num_microbatches)
    logits = 4.0 * seq_len * c.microbatch_size * V / c.tp * 2  # logits + their gradient
    return states + working + acts + logits + FRAMEWORK_BYTES


def estimate(model, c: Candidate, seq_len: int, device: DeviceSpec, per_node: int,
             compute_bytes: int = 2) -> Estimate:
    tokens = c.dp * c.num_microbatches * c.microbatch_size * seq_len
    flops = flops_per_token(model, seq_len) * tokens
    ideal = flops / (c.world_size * device.peak_tflops * 1e12 * MATMUL_EFFICIENCY)
    if c.recompute == "full":
        ideal *= 4.0 / 3.0
    bubble = bubble_fraction(c.schedule, c.pp, c.vpp, c.num_microbatches)
    compute = ideal / (1.0 - bubble)
    h, layers = model.dim, model.n_layers // c.pp
    act_bytes = compute_bytes * seq_len * c.microbatch_size * h
    tp_comm = 0.0
    if c.tp > 1:
        per_op = 2 * (c.tp - 1) / c.tp * act_bytes / (device.intra_node_gbps * 1e9)
        tp_comm = 4 * per_op * layers * c.num_microbatches
    pp_comm = 0.0
    if c.pp > 1:
        v = c.vpp if c.schedule == "interleaved-1f1b" else 1
        msg = act_bytes / c.tp / (device.inter_node_gbps * 1e9) + PP_LATENCY_S
        pp_comm = 2 * msg * c.num_microbatches * v
    dp_exposed = 0.0
    if c.dp > 1:
        params_per_rank = model_params_per_stage(model, c.pp) / c.tp
        bw = device.intra_node_gbps if c.dp * c.tp <= per_node else device.inter_node_gbps
        gathers = 2 if c.keep_gathered else 2 * c.num_microbatches
        dp_time = (gathers + 1) * compute_bytes * params_per_rank * (c.dp - 1) / c.dp / (bw * 1e9)
        dp_exposed = max(0.0, dp_time - 0.5 * compute)
    step = compute + tp_comm + pp_comm + dp_exposed
    achieved = flops / step / c.world_size
    return Estimate(
        memory_per_rank_gib=memory_bytes(model, c, seq_len, compute_bytes) / GIB,
        step_time_s=step, tokens_per_s=tokens / step, tflops_per_gpu=achieved / 1e12,
        mfu=achieved / (device.peak_tflops * 1e12), bubble_fraction=bubble, compute_s=compute,
        tp_comm_s=tp_comm, pp_comm_s=pp_comm, dp_exposed_s=dp_exposed)



def model_params_per_stage(model, pp: int) -> float:
    """Parameters of the first stage (its blocks and the embedding)."""
    return model.n_layers // pp * layer_params(model) + model.vocab_size * model.dim
