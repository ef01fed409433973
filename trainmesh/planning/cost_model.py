"""Memory and step-time estimates for one candidate plan (pure arithmetic, no torch).

Memory per rank (bytes) counts what the runtime allocates (``rank_memory``; checked against
the tensors a real rank holds by ``trainmesh run --dry-run`` and the memory-matrix test):
  * Shards (ZeRO-3 over dp; TP shards the matrices, norms are replicated over tp): fp32 master
    parameters (4 bytes each), fp32 gradients (4) and two fp32 Adam moments (8).
  * FSDP2's gathered copies in the compute dtype. ``keep_gathered``: the rank's whole part
    stays gathered all step (reshard after forward/backward off until the last microbatch)
    and its gradients accumulate unsharded, in the reduce dtype (FSDP2 upcasts them), until
    the one reduce-scatter at the last microbatch. Otherwise: two blocks (computing + prefetched)
    plus the root's embedding / norm / head, gradients reduce-scattered after every
    microbatch (one block's unsharded gradients at a time). FSDP2 makes the gathered copy
    even at dp = 1 — except for pipeline stages at dp = 1 in float32, which are not wrapped
    (nothing to shard or cast): their gradients are plain fp32 ``.grad``.
  * The peak is the larger of two moments: while microbatches run (gathered copies, their
    gradients, activations, backward transients) and the step's end (the last reduce-scatter,
    or the sharded gradients while AdamW's fused step updates in place), on top of parameters
    and moments.
  * Activations autograd saves, counted from this implementation (torch ops, fused
    attention), per layer and microbatch in units of s·b·h elements of the compute dtype,
    f = ffn_dim / dim: without sequence parallel 6 + (5 + 4f)/t (block input, norm
    statistics' inputs and outputs replicated; q, k and v after GQA expansion, attention out,
    wo input; SwiGLU gate, up, silu(gate), w2 input sharded); with sequence parallel
    2 + (9 + 4f)/t (the gathered norm outputs stay whole). The Triton kernels keep less:
    4 + (5 + 3f)/t, or 2 + (7 + 3f)/t with sequence parallel. Full recomputation keeps only the
    block input (1, or 1/t with sequence parallel) plus one block's activations while it is
    recomputed. A rank holds ``in_flight_chunks`` microbatch-chunks at its peak (Megatron's
    warm-up counts: GPipe m, 1F1B p − r, interleaved 2(p − r − 1) + (v − 1)p + 1).
  * The last stage's final norm and, without the fused head kernel, the fp32 log-probabilities
    of one microbatch (saved) and their gradient (transient): 2 × 4·s·b·V/t; with it, the
    input and head-weight gradients it computes in forward (s·b·h + V·h/t).
  * A framework allowance per device (CUDA context, allocator slack, NCCL buffers; on CPU the
    rank process with torch and Ray loaded).

Step time (seconds):
  * compute = training FLOPs of the global batch / (world × peak × efficiency) plus a fixed
    device cost per block and microbatch (kernels' launch latency and tails), × 4/3 with full
    recomputation (one more forward); or, where longer, the host's time to issue that work
    (per block and microbatch): a GPU left waiting for its host by small microbatches (the
    figures are ``DeviceSpec``'s, fitted on an H200 and assumed for the other GPUs; zero on a
    CPU rank, whose host is its device); stretched by the pipeline bubble: the ideal time
    covers m microbatches, the schedule takes m + (p-1)/v of them. Not modelled: an MoE
    block's host sync (its dispatch reads the expert counts), where host and device add
    rather than overlap; communication a host-bound step could hide in the device's idle time.
  * TP: 4 all-reduces (or all-gather + reduce-scatter pairs under SP, same volume) of the
    layer's activations per layer per microbatch (2 forward, 2 backward), ring cost
    2(t-1)/t × bytes / intra-node bandwidth. Assumed not overlapped with compute.
  * PP: one activation send forward and one gradient send backward per stage boundary per
    microbatch (× v under interleaving) over inter-node bandwidth; assumed not overlapped.
  * DP (ZeRO-3): parameters all-gathered in the compute dtype (once per step when kept
    gathered, else twice per microbatch: forward and backward) and gradients reduce-scattered
    in the reduce dtype (once per step when kept gathered, else once per microbatch):
    bytes × (d-1)/d / bandwidth (intra-node when the DP group fits in a node); under hybrid
    sharding d is the shard group and the reduce-scattered gradients are all-reduced across
    the replica groups. Assumed overlapped with compute except what exceeds half the compute
    time, on GPUs; on CPU ranks (no streams) not at all; each collective's latency grows with
    its ring (a hop per participant) and is not hidden (``_zero3_exposed``).
  * DP without sharding (DDP: shard groups of one rank, a dense model without tp, pp or cp):
    the gradients all-reduced once per step in 25 MiB buckets, 2(d-1)/d × bytes, while the
    last microbatch's backward runs; hidden behind it except the last bucket, the
    embedding's (``_ddp_exposed``). Memory: every rank holds the whole float32 state; under a narrower
    compute dtype autocast keeps each weight's cast for backward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from trainmesh.models.llama.model_math import (
    blocks_held,
    chunk_kinds,
    flops_per_token,
    fullest_ranks,
    rank_blocks,
    stage_split,
)
from trainmesh.parallel.dims import replicates
from trainmesh.parallel.pipeline.ir import splits_backward
from trainmesh.planning.devices import DeviceSpec
from trainmesh.planning.stage_params import (
    block_tensors,
    holds_head,
    memo,
    mtp_block_is_moe,
    rank_params,
)
from trainmesh.spec.kernel_choice import fused_ops

GIB = 1024**3
FRAMEWORK_BYTES = 2.0 * GIB  # CUDA context, allocator slack, NCCL/gloo buffers
MATMUL_EFFICIENCY = 0.55  # achievable fraction of peak for large bf16 matmuls
PP_LATENCY_S = 20e-6  # per point-to-point message
# Per ZeRO-3 collective (one per FSDP unit: each block and the root): launch and
# synchronisation that overlapping with compute does not hide. It is what makes re-gathering
# for every microbatch cost time even when the bytes would hide behind compute.
COLLECTIVE_LATENCY_S = 20e-6
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size (bucket_cap_mb)
# Per hop of a ring collective (NCCL's all-gather and reduce-scatter are rings): a collective
# over n ranks pays n - 1 of them, so ZeRO-3 over hundreds of replicas pays for its size.
# Assumed, not measured here (NCCL's tree and NVLS algorithms grow more slowly); the hybrid
# sharding choice at scale rests on them.
HOP_LATENCY_INTER_S = 5e-6
HOP_LATENCY_INTRA_S = 1e-6
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")
AUTO_SCHEDULES = SCHEDULES[:3]  # what the planner weighs unasked; zero-bubble ones when named
CHUNKED = ("interleaved-1f1b", "zbv")  # schedules that run vpp chunks per rank
RECOMPUTE = ("none", "selective", "full")  # selective: every recompute_stride-th block


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
    reduce_dtype: str = "float32"  # gradient reduce-scatter dtype (FSDP2's reduce_dtype)
    ep: int = 1  # expert parallel, folded over dp (MoE models)
    # padding microbatches over all replicas (dp not dividing the microbatches: the replicas
    # with the smaller share run one of weight 0 to keep the collectives aligned)
    padding: int = 0
    # hybrid sharding (HSDP): ZeRO-3 inside groups of dp / dp_replicate replicas, gradients
    # all-reduced across the dp_replicate groups
    dp_replicate: int = 1
    cp: int = 1  # context parallel: each sequence over cp ranks (ZeRO-3 over dp × cp)
    cp_mode: str = "ring"  # ring | allgather
    recompute_stride: int = 2  # with selective recomputation: every N-th block of a rank

    def blocks(self, model) -> int:
        """The most blocks a pipeline rank holds (``model_math.rank_blocks``: uneven where
        pp × vpp does not divide them)."""
        return rank_blocks(model.n_layers, self.pp, self.vpp)

    def chunk_blocks(self, model) -> int:
        """The most blocks one model chunk (pipeline stage) holds."""
        return max(stage_split(model.n_layers, self.pp * self.vpp))

    def recomputed(self, layers: int) -> float:
        """The fraction of a rank's ``layers`` blocks recomputed in backward (selective: the
        rank's blocks 0, N, 2N, … as ``apply_activation_checkpointing`` picks them)."""
        if self.recompute == "full":
            return 1.0
        if self.recompute == "selective":
            return -(-layers // self.recompute_stride) / layers
        return 0.0

    @property
    def dp_shard(self) -> int:
        """Replicas a ZeRO-3 shard group spans (all of dp without hybrid sharding)."""
        return self.dp // self.dp_replicate

    @property
    def zero_shards(self) -> int:
        """Ranks a ZeRO-3 shard group spans: its replicas and their context-parallel peers."""
        return self.dp_shard * self.cp

    @property
    def reduce_bytes(self) -> int:
        return 2 if self.reduce_dtype == "bfloat16" else 4

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


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
    ep_comm_s: float = 0.0  # MoE token all-to-alls (dispatch and combine, forward and backward)
    cp_comm_s: float = 0.0  # context parallel's key/value traffic not hidden behind attention
    host_bound: bool = False  # the host issuing the blocks' work takes longer than the device runs it


def bubble_fraction(schedule: str, pp: int, vpp: int, m: int) -> float:
    """Idle fraction of a pipelined step with uniform stage costs (backward = 2 × forward; a
    split backward's input and weight halves 1 each). Closed forms for GPipe, 1F1B and
    interleaved; the zero-bubble schedules are played by the simulator (cached)."""
    if pp == 1:
        return 0.0
    if splits_backward(schedule):
        return _zero_bubble(schedule, pp, vpp, m)[0]
    v = vpp if schedule == "interleaved-1f1b" else 1
    idle = (pp - 1) / v
    return idle / (m + idle)


@functools.lru_cache(maxsize=256)
def _zero_bubble(schedule: str, pp: int, vpp: int, m: int) -> tuple[float, tuple[int, ...]]:
    from trainmesh.parallel.pipeline.schedules import build_schedule, pipe_shape
    from trainmesh.parallel.pipeline.simulate import Costs, simulate

    res = simulate(build_schedule(schedule, pp, vpp, m), pp * vpp, m, Costs(1 / vpp, 2 / vpp),
                   shape=pipe_shape(schedule, pp, vpp, m))
    return res.bubble_fraction, tuple(res.peak_in_flight)


def in_flight_chunks(schedule: str, pp: int, vpp: int, m: int, pp_rank: int) -> int:
    """Microbatch-chunks of activations rank ``pp_rank`` holds at its peak (a chunk is one of
    its ``vpp`` model chunks; 1 chunk per rank without interleaving). A split backward holds
    them until the W."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - pp_rank)
    if schedule == "zb-h1":  # rank r holds its W's back r microbatches: pp on every rank
        return min(m, pp)
    if schedule == "zbv":
        return _zero_bubble(schedule, pp, vpp, m)[1][pp_rank]
    # microbatches through a chunk at once: the first (largest) of interleaved 1F1B's groups
    # (``schedules.interleave_groups``: m // pp groups, sizes differing by at most one)
    group = -(-m // (m // pp)) if m >= pp else pp
    return min(m * vpp, 2 * (pp - pp_rank - 1) + (vpp - 1) * group + 1)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds at its peak in a step, by kind (see the module docstring)."""

    params: float
    grads: float  # while microbatches run (unsharded, in the compute dtype, while kept gathered)
    optimizer: float
    gathered: float
    activations: float  # saved for backward, the last stage's fp32 log-probabilities included
    transient: float  # briefly, in backward: a recomputed block's activations, log-prob grads
    end_of_step: float  # beyond params + optimizer at the last reduce-scatter / optimizer step
    framework: float

    @property
    def total(self) -> float:
        """The step's peak: the larger of while microbatches run and the step's end."""
        running = self.grads + self.gathered + self.activations + self.transient
        return self.params + self.optimizer + max(running, self.end_of_step) + self.framework

    def as_gib(self) -> dict[str, float]:
        out = {k: v / GIB for k, v in self.__dict__.items()}
        out["total"] = self.total / GIB
        return out


def activation_units(model, tp: int, sequence_parallel: bool, recompute: str,
                     fused: Fused = False, ep: int = 1, cp: int = 1, moe_block: bool = True) -> float:
    """Saved activations of one layer and microbatch, in s·b·h elements (module docstring);
    ``moe_block``: of an MoE model's MoE block (False: one of its leading dense blocks).
    ``fused``: the Triton kernels (all, or the set of ops that run them), whose RMSNorm keeps
    only its input (not the normalised copy) and whose SwiGLU keeps gate and up only.
    ``cp`` > 1: the context-parallel attention keeps the key/value heads unexpanded (q, k, v:
    1 + 2·kv/h instead of 3)."""
    if recompute == "full":
        return 1.0 / tp if sequence_parallel and tp > 1 else 1.0
    f = model.ffn_dim / model.dim
    attn = 5.0 if cp == 1 else 3.0 + 2.0 * model.n_kv_heads / model.n_heads
    latent = 0.0  # what tensor parallel does not split (each tp rank computes it whole)
    if getattr(model, "mla", None) is not None:
        attn, latent = mla_activation_units(model)
    norm = 1 if _runs(fused, "rms_norm") else 2  # per norm, besides the output the next matmul keeps
    mlp = (3 if _runs(fused, "swiglu") else 4) * f
    moe = getattr(model, "moe", None)
    if moe is not None and moe_block:  # the MoE block: its tp rank's share of the tokens
        mlp = moe_activation_units(model, ep, tp)
    if sequence_parallel and tp > 1:
        return 2 + (2 * norm + attn + mlp) / tp + latent
    return 2 + 2 * norm + (attn + mlp) / tp + latent


def mla_activation_units(model) -> tuple[float, float]:
    """Multi-head Latent Attention's saved activations of one layer, in s·b·h elements: the
    heads' part (split by tp: the query, the expanded keys with the shared rotary key in each,
    the values and the attention's output) and the latents' (whole on every tp rank: the
    query's and the key/value latent with their norms' outputs, the rotary key)."""
    m, h = model.mla, model.n_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    heads = (2 * h * qk + 2 * h * m.v_head_dim) / model.dim
    latent = (2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + m.qk_rope_head_dim) / model.dim
    return heads, latent


# Dropless routing gives no bound on an expert's tokens: memory is planned for the busiest rank
# receiving this multiple of its even share (an untrained router routes unevenly; the
# "dropless MoE runs out of memory early in training" failure). With capacity_factor set, the
# capacity is the bound: it caps an expert over a whole microbatch, whose tokens tp ranks split
# (each tp rank's EP group computes its own share), so one tp rank's share may hold all of it.
MOE_IMBALANCE = 2.0


def moe_activation_units(model, ep: int = 1, tp: int = 1) -> float:
    """An MoE block's saved activations per token, in units of h elements: each of the top-k
    copies of the token (the gathered input, its expert's gate, up, silu(gate) and w2 input,
    and the expert's output), plus the shared expert's SwiGLU. With expert parallel a rank
    computes what its experts receive: planned at the imbalance bound (or the capacity, which
    under tp is a whole microbatch's: up to tp × capacity_factor of a rank's share, and never
    more than every token of the share: experts / top_k); without, every copy is its own
    whatever the routing."""
    moe = model.moe
    bound = 1.0 if ep == 1 else (min(moe.capacity_factor * tp, moe.experts / moe.top_k)
                                 if moe.capacity_factor is not None else MOE_IMBALANCE)
    routed = moe.top_k * bound * (2 + 4 * moe.expert_ffn_dim / model.dim)
    return routed + 4 * moe.shared_experts * moe.expert_ffn_dim / model.dim


def rank_memory(model, c: Candidate, seq_len: int, pp_rank: int = 0, compute_bytes: int = 2,
                framework_bytes: float = FRAMEWORK_BYTES, fused_head: Fused = False,
                ) -> MemoryBreakdown:
    """Peak bytes of rank ``pp_rank`` of the pipeline (any dp/tp coordinate); ``fused_head``:
    the Triton kernels run — all of them (True) or the set of ops that do (RMSNorm, SwiGLU,
    RoPE, the fused linear + cross-entropy). Its two parts, the state (parameters, gradients,
    optimizer, gathered copies) and the activations, each read a few of the candidate's
    fields: a plan's search keeps them for the candidates that share those (``memo``)."""
    last = holds_head(c.schedule, c.pp, pp_rank)
    ddp = runs_ddp(model, c)
    unwrapped = c.pp > 1 and c.dp * c.cp == 1 and compute_bytes == 4
    state_key = (c.pp, pp_rank, last, c.vpp, c.tp, c.zero_shards, c.ep, c.reduce_bytes,
                 compute_bytes, ddp, unwrapped, c.keep_gathered, c.num_microbatches > 1)
    params, grads, gathered, end_of_step = memo(
        "state", model, state_key,
        lambda: _state_bytes(model, c, pp_rank, compute_bytes, ddp, unwrapped))
    sp = c.sequence_parallel and c.tp > 1
    kinds = chunk_kinds(model.n_layers, c.pp, c.vpp, pp_rank, _dense_layers(model))
    act_key = (seq_len, c.cp, c.cp_mode, c.microbatch_size, c.tp, sp, c.recompute,
               c.recompute_stride, fused_head, c.ep, c.pp, c.vpp, last, compute_bytes, kinds)
    per_chunk, head, transient, head_transient = memo(
        "activations", model, act_key,
        lambda: _activation_bytes(model, c, seq_len, compute_bytes, fused_head, sp, last, kinds))
    chunks = in_flight_chunks(c.schedule, c.pp, c.vpp, c.num_microbatches, pp_rank)
    return MemoryBreakdown(params=params, grads=grads, optimizer=2 * params,
                           gathered=gathered, activations=per_chunk * chunks + head,
                           transient=transient + head_transient,
                           end_of_step=end_of_step, framework=framework_bytes)


def _state_bytes(model, c: Candidate, pp_rank: int, compute_bytes: int, ddp: bool,
                 unwrapped: bool) -> tuple[float, float, float, float]:
    """(fp32 parameters, gradients while microbatches run, gathered copies, the step's end)
    of rank ``pp_rank``; the two Adam moments are twice the parameters."""
    rp = rank_params(model, c.pp, pp_rank, c.schedule, c.vpp)
    reduce_bytes = c.reduce_bytes
    local = rp.local(c.tp, c.zero_shards)
    layer_gathered = rp.layer_gathered(c.tp, c.ep)
    # A unit's gradients come out of backward in the compute dtype and are cast to the reduce
    # dtype for its reduce-scatter into the fp32 sharded gradients (4 × local). Across
    # microbatches without a reduce-scatter FSDP2 accumulates them unsharded in the reduce
    # dtype. AdamW's fused step updates in place: the optimizer step adds nothing beyond
    # the gradients (the foreach step made one parameter-sized fp32 temporary).
    reduce_unit = (compute_bytes + reduce_bytes) * layer_gathered
    if ddp:  # DDP: one dtype (float32 weights), gradients viewing its buckets;
        # under a narrower compute dtype autocast keeps each weight's cast for backward
        gathered = compute_bytes * local if compute_bytes < 4 else 0.0
        grads, end_of_step = 4 * local, 4 * local
    elif unwrapped:  # stages not wrapped (nothing to shard or cast): plain fp32 grads
        gathered, grads, end_of_step = 0.0, 4 * local, 4 * local
    elif c.keep_gathered and c.num_microbatches > 1:
        gathered = compute_bytes * rp.gathered(c.tp, c.ep)
        grads = reduce_bytes * rp.gathered(c.tp, c.ep) + compute_bytes * layer_gathered
        end_of_step = gathered + grads + 4 * local + reduce_unit  # the last reduce-scatter
    elif c.keep_gathered:
        gathered = compute_bytes * rp.gathered(c.tp, c.ep)
        grads = 4 * local + reduce_unit
        end_of_step = 4 * local
    else:
        held = blocks_held(model.n_layers, c.pp, c.vpp)[pp_rank] + rp.mtp_modules
        root = max(0.0, rp.gathered(c.tp, c.ep) - held * layer_gathered)  # (this rank's blocks'
        # and multi-token modules' blocks: FSDP units of their own)
        gathered = compute_bytes * (2 * layer_gathered + root)
        grads = 4 * local + reduce_unit
        end_of_step = 4 * local
    return 4 * local, grads, gathered, end_of_step


def _activation_bytes(model, c: Candidate, seq_len: int, compute_bytes: int, fused_head: Fused,
                      sp: bool, last: bool, kinds: tuple[tuple[int, int], ...]
                      ) -> tuple[float, float, float, float]:
    """(activations of one microbatch-chunk in flight — the rank's heaviest chunk of those
    ``kinds`` (dense, MoE blocks) —, the last stage's extra (final norm, logits or the fused
    loss's gradients), the transients of a block's backward, the head's) on one rank."""
    tokens = seq_len // c.cp * c.microbatch_size  # a context-parallel rank's part of each sequence
    sbh = tokens * model.dim
    f = c.recomputed(c.blocks(model))
    kept = activation_units(model, c.tp, sp, "none", fused_head, c.ep, c.cp)
    full = activation_units(model, c.tp, sp, "full", fused_head, c.ep, c.cp) if f > 0 else 0.0
    dense = (activation_units(model, c.tp, sp, "none", fused_head, c.ep, c.cp, moe_block=False)
             if any(d for d, _ in kinds) else kept)
    per_chunk = max((1 - f) * (d * dense + m * kept) + f * full * (d + m) for d, m in kinds)
    per_chunk *= sbh * compute_bytes
    transient = 0.0
    if f > 0:  # one block's activations exist while it is recomputed
        transient += max(kept, dense) * sbh * compute_bytes
    transient += cp_transient_bytes(model, c, seq_len, compute_bytes)
    head = head_transient = 0.0
    if last:
        norm = 1 if _runs(fused_head, "rms_norm") else 2
        head += (norm / c.tp + 1 if sp else norm + 1) * sbh * compute_bytes  # final norm
        # Multi-token prediction (cp = 1; the last stage): each module's two input norms, their
        # concatenation, its block (recomputed as ``apply_activation_checkpointing`` picks the
        # blocks after the model's), its norm and the input its head's matmul keeps; under tp
        # whole on every rank but the block's split heads (no sequence parallel inside)
        depth = getattr(getattr(model, "mtp", None), "depth", 0)
        held = sum(d + m for d, m in kinds)  # (the rank's blocks: the modules' come after them)
        for k in range(depth):
            again = c.recompute == "full" or (
                c.recompute == "selective" and (held + k) % c.recompute_stride == 0)
            block = activation_units(model, c.tp, False, "full" if again else "none",
                                     fused_head, c.ep, c.cp)
            head += (3 * norm + 3 + block) * sbh * compute_bytes
        if _runs(fused_head, "linear_cross_entropy"):  # the fused loss computes its gradients
            # in forward and keeps them
            head += (1 + depth) * (sbh / (c.tp if sp else 1)
                                   + model.vocab_size * model.dim / c.tp) * compute_bytes
        else:  # fp32 log-probabilities (saved), then their gradient in and out in backward
            logprobs = 4.0 * tokens * model.vocab_size / c.tp
            head += (1 + depth) * logprobs
            head_transient += 2 * logprobs
    return per_chunk, head, transient, head_transient


# What torch Distributed Checkpoint adds to each tensor an uncoordinated save writes, its framing
# in the shard file and its entry in the rank's own metadata (torch 2.13, measured: 8.2 KiB per
# tensor of ZeRO-3 shards); negligible beside real shards, a sixth of a tiny test model's.
DCP_ENTRY_BYTES = 8 * 1024


def snapshot_host_bytes(model, c: Candidate, pp_rank: int | None = None) -> float:
    """Host memory the in-memory checkpoint tier holds for one rank (``pp_rank``; None: the
    heaviest) at its peak, while a snapshot is written: its own newest two snapshots and the
    one being written, a buddy's two copies and the one arriving (DCP files: each the fp32
    parameter and AdamW shards, 12 bytes per local parameter, and DCP's framing of each
    tensor), and the host copy the snapshot is written from."""
    ranks = ({0, c.pp - 1, *fullest_ranks(model.n_layers, c.pp, c.vpp, _dense_layers(model))}
             if pp_rank is None else {pp_rank})

    def one(r: int) -> float:
        state = 12 * rank_params(model, c.pp, r, c.schedule, c.vpp).local(c.tp, c.zero_shards)
        return 6 * (state + 3 * DCP_ENTRY_BYTES * _tensors(model, c, r)) + state
    return max(one(r) for r in ranks)


def _tensors(model, c: Candidate, pp_rank: int) -> int:
    """Parameter tensors of a pipeline rank's part: its blocks (``block_tensors``), its
    multi-token modules (two input norms, the projection, the output norm and a block each),
    the embedding, the final norm and head."""
    rp = rank_params(model, c.pp, pp_rank, c.schedule, c.vpp)
    last = holds_head(c.schedule, c.pp, pp_rank)
    return (block_tensors(model, False) * rp.dense_blocks + block_tensors(model, True) * rp.moe_blocks
            + rp.mtp_modules * (4 + block_tensors(model, mtp_block_is_moe(model)))
            + (pp_rank == 0) + (last and 1 + (not (model.tie_embeddings and pp_rank == 0)))
            + (rp.mtp_modules > 0 and pp_rank != 0))  # (the embedding's copy, with the modules)


Fused = bool | frozenset  # every op fused (True), none (False), or the ops that are


def _runs(fused: Fused, op: str) -> bool:
    return fused if isinstance(fused, bool) else op in fused


def uses_fused_kernels(kernels, device_name: str, compiled: bool = False) -> frozenset[str]:
    """The ops ``model.kernels`` runs as Triton kernels on this device (``auto``: what the GPU
    check kit measured faster there than the torch path, compiled with ``model.compile``;
    ``spec/kernel_choice.py``)."""
    return fused_ops(kernels, device_name, compiled)


def memory_bytes(model, c: Candidate, seq_len: int, compute_bytes: int = 2,
                 framework_bytes: float = FRAMEWORK_BYTES, fused: Fused = False) -> float:
    """Peak bytes on the heaviest rank: the first pipeline rank (embedding, most activations
    in flight), the last (head, logits), or where the stages are uneven the first of those
    holding the most blocks and the first of those holding the most MoE blocks."""
    ranks = {0, c.pp - 1, *fullest_ranks(model.n_layers, c.pp, c.vpp, _dense_layers(model))}
    return max(rank_memory(model, c, seq_len, r, compute_bytes, framework_bytes, fused).total
               for r in ranks)


def _ring_latency(participants: int, crosses_nodes: bool) -> float:
    """Latency of one ring collective: its launch, plus a hop per other participant."""
    hop = HOP_LATENCY_INTER_S if crosses_nodes else HOP_LATENCY_INTRA_S
    return COLLECTIVE_LATENCY_S + hop * (participants - 1)


def _zero3_exposed(model, c: Candidate, device: DeviceSpec, per_node: int, compute_bytes: int,
                   compute: float) -> float:
    """ZeRO-3's step time not hidden behind compute. Inside a shard group (all of dp, or
    dp / dp_replicate replicas under hybrid sharding): parameters all-gathered and gradients
    reduce-scattered, ring cost (s-1)/s × bytes / bandwidth; under hybrid sharding the
    reduce-scatters' accumulated output (1/s of the gradients) is then all-reduced across the
    dp_replicate groups once per step, 2(r-1)/r × bytes. Under expert parallel the experts
    gather and reduce over their own ring, s / ep (one FSDP unit per MoE block). A group within
    a node uses intra-node bandwidth. Overlapped with compute except what exceeds half of it;
    each collective's latency (one hop per other participant of its ring) is paid per FSDP
    unit, not hidden."""
    rp = rank_params(model, c.pp, 0, c.schedule, c.vpp)
    s, r = c.zero_shards, c.dp_replicate
    # Under expert parallel the experts (split over ep) are FSDP units of their own, one per
    # MoE block, sharded over the rest of the shard group: s / ep ranks.
    experts = rp.experts / c.ep if c.ep > 1 else 0.0
    dense, se = rp.gathered(c.tp, c.ep) - experts, max(1, s // c.ep)
    moe_units = sum(1 for i in range(model.n_layers) if i >= model.moe.dense_layers) / c.pp \
        if experts else 0.0
    shard_inside = s * c.tp <= per_node
    gathers = 1 if c.keep_gathered else 2 * c.num_microbatches
    reduces = 1 if c.keep_gathered else c.num_microbatches
    per_element = gathers * compute_bytes + reduces * c.reduce_bytes
    units = c.blocks(model) + 1
    time, latency = 0.0, 0.0
    hidden = 0.5 * compute if device.streams else 0.0
    bw = device.intra_node_gbps if shard_inside else device.inter_node_gbps
    if s > 1:
        time += per_element * dense * (s - 1) / s / (bw * 1e9)
        latency += (gathers + reduces) * units * _ring_latency(s, not shard_inside)
    if se > 1 and experts:
        time += per_element * experts * (se - 1) / se / (bw * 1e9)
        latency += (gathers + reduces) * moe_units * _ring_latency(se, not shard_inside)
    if r > 1:
        whole_inside = c.dp * c.cp * c.tp <= per_node
        bw = device.intra_node_gbps if whole_inside else device.inter_node_gbps
        # once per step: re-gathering reduce-scatters every microbatch, all-reduces at the
        # last; what each rank holds after its reduce-scatters (experts: 1/se of its ep part)
        time += 2 * (r - 1) / r * c.reduce_bytes * rp.local(c.tp, s) / (bw * 1e9)
        latency += (units + moe_units) * 2 * _ring_latency(r, not whole_inside)
    return max(0.0, time - hidden) + latency


def has_moe_blocks(model) -> bool:
    """Whether the model has MoE blocks (``moe`` set and not every block kept dense), as the
    engine finds them in the built model."""
    moe = getattr(model, "moe", None)
    return moe is not None and moe.dense_layers < model.n_layers


def runs_ddp(model, c: Candidate) -> bool:
    """Whether ``c`` runs as DDP rather than ZeRO-3 (``parallel/dims.replicates``)."""
    return replicates(c.dp, c.dp_replicate, c.pp, c.tp, c.cp, has_moe_blocks(model))


def _ddp_exposed(model, c: Candidate, device: DeviceSpec, per_node: int, compute: float) -> float:
    """DDP's all-reduce not hidden behind compute: the whole model's gradients in the reduce
    dtype, once per step (the other microbatches accumulate locally), in buckets of
    DDP_BUCKET_BYTES all-reduced while the last microbatch's backward (two thirds of its
    compute) runs, ring cost 2(d-1)/d × bytes / bandwidth and each bucket's latency. All of
    it hides but the last bucket, on GPUs and CPU ranks alike (gloo's own thread) — the
    embedding's, whose gradient comes last (its lookup is the first op) and which, larger
    than a bucket, is a bucket of its own."""
    nbytes = c.reduce_bytes * rank_params(model, 1, 0, c.schedule).gathered(1, 1)
    buckets = max(1, math.ceil(nbytes / DDP_BUCKET_BYTES))
    inside = c.dp <= per_node
    bw = device.intra_node_gbps if inside else device.inter_node_gbps
    latency = _ring_latency(c.dp, not inside)

    def ring(b: float) -> float:
        return 2 * (c.dp - 1) / c.dp * b / (bw * 1e9)

    last = max(min(nbytes, DDP_BUCKET_BYTES), c.reduce_bytes * model.vocab_size * model.dim)
    total = ring(nbytes) + buckets * latency
    return max(total - 2 / 3 * compute / c.num_microbatches, ring(last) + latency)


def _dense_layers(model) -> int:
    moe = getattr(model, "moe", None)
    return moe.dense_layers if moe is not None else 0


def _kv_dim(model) -> int:
    return model.n_kv_heads * _head_width(model)


def _head_width(model) -> int:
    """A head's width as context parallel moves it: GQA's head_dim, or Multi-head Latent
    Attention's query/key and value heads padded to the wider (its key/value heads: every
    head, ``n_kv_heads = n_heads``)."""
    mla = getattr(model, "mla", None)
    if mla is not None:
        return max(mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim)
    return getattr(model, "head_dim", None) or model.dim // model.n_heads


def cp_transient_bytes(model, c: Candidate, seq_len: int, compute_bytes: int) -> float:
    """What context-parallel attention holds while a layer runs, beyond saved activations: the
    fp32 partial outputs merged in forward and the fp32 query gradient accumulated in
    backward (q-sized each); all-gather, every rank's keys and values (compute dtype) and in
    backward their fp32 gradients; ring, the block being used and the one arriving, and two
    fp32 gradient blocks (the one travelling, the one arriving)."""
    if c.cp == 1:
        return 0.0
    part = seq_len // c.cp * c.microbatch_size
    block = 2 * part * _kv_dim(model) / c.tp  # K and V elements
    queries = 4 * part * model.n_heads * _head_width(model) / c.tp  # fp32, q-sized
    if c.cp_mode == "allgather":
        return queries + c.cp * block * (compute_bytes + 4)
    return queries + block * (2 * compute_bytes + 2 * 4)


def cp_exposed(model, c: Candidate, seq_len: int, device: DeviceSpec, per_node: int,
               compute_bytes: int) -> float:
    """Context parallel's key/value traffic per step that compute does not hide. Ring: each of
    cp − 1 hops sends a block (K and V of seq/cp tokens, the rank's key/value heads), hidden
    behind the attention of the block at hand (forward: 4·(s/cp)²·h/t/2 FLOPs per block,
    causal; backward twice that) except what exceeds it; backward sends the blocks' fp32
    gradients cp hops on, after each block (not hidden). All-gather: the keys and values
    gathered in forward and again in backward, their fp32 gradients reduce-scattered; not
    hidden. Per layer and microbatch; full recomputation runs the forward's again. The ring is
    within a node when cp × tp fits one."""
    if c.cp == 1:
        return 0.0
    inside = c.cp * c.tp <= per_node
    bw = (device.intra_node_gbps if inside else device.inter_node_gbps) * 1e9
    part = seq_len // c.cp * c.microbatch_size
    block = 2 * part * _kv_dim(model) / c.tp  # elements of one rank's K and V
    forwards = 1 + c.recomputed(c.blocks(model))
    if c.cp_mode == "allgather":
        moved = (c.cp - 1) * block * ((forwards + 1) * compute_bytes + 4)
        per_layer = moved / bw + (forwards + 2) * _ring_latency(c.cp, not inside)
    else:
        hop = block * compute_bytes / bw + PP_LATENCY_S
        attn = 4.0 * part * part * model.dim / c.tp / 2  # one block's causal-average FLOPs
        attn_s = attn / (device.peak_tflops * 1e12 * MATMUL_EFFICIENCY)
        fwd = (c.cp - 1) * max(hop - attn_s, PP_LATENCY_S)
        bwd = (c.cp - 1) * max(hop - 2 * attn_s, PP_LATENCY_S)
        grads = c.cp * (block * 4 / bw + PP_LATENCY_S)
        per_layer = forwards * fwd + bwd + grads
    return per_layer * c.blocks(model) * c.num_microbatches


def estimate(model, c: Candidate, seq_len: int, device: DeviceSpec, per_node: int,
             compute_bytes: int = 2, fused: Fused = False,
             memory: float | None = None) -> Estimate:
    """``c``'s step time and throughput (module docstring) and its memory per rank
    (``memory``: the bytes ``memory_bytes`` gave for it, where the caller has them)."""
    # Every replica computes num_microbatches; the padding's tokens are not trained on.
    tokens = (c.dp * c.num_microbatches - c.padding) * c.microbatch_size * seq_len
    flops = flops_per_token(model, seq_len) * tokens
    computed = flops * c.dp * c.num_microbatches / (c.dp * c.num_microbatches - c.padding)
    h, layers = model.dim, c.blocks(model)
    ideal = computed / (c.world_size * device.peak_tflops * 1e12 * MATMUL_EFFICIENCY)
    again = 1.0 + c.recomputed(layers) / 3.0  # one more forward per recomputed block
    # Per block and microbatch: the device's fixed cost, and the host issuing the work.
    device_s = (ideal + layers * c.num_microbatches * device.kernel_overhead_s) * again
    host_s = layers * c.num_microbatches * device.host_dispatch_s * again
    bubble = bubble_fraction(c.schedule, c.pp, c.vpp, c.num_microbatches)
    compute = max(device_s, host_s) / (1.0 - bubble)
    act_bytes = compute_bytes * seq_len // c.cp * c.microbatch_size * h
    tp_comm = 0.0
    if c.tp > 1:
        per_op = 2 * (c.tp - 1) / c.tp * act_bytes / (device.intra_node_gbps * 1e9)
        tp_comm = 4 * per_op * layers * c.num_microbatches
    pp_comm = 0.0
    if c.pp > 1:
        v = c.vpp if c.schedule in CHUNKED else 1
        msg = act_bytes / c.tp / (device.inter_node_gbps * 1e9) + PP_LATENCY_S
        pp_comm = 2 * msg * c.num_microbatches * v
    ep_comm = 0.0
    moe = getattr(model, "moe", None)
    if moe is not None and c.ep > 1:  # 4 all-to-alls per MoE block and microbatch (6 when
        # full recompute runs the forward's two again)
        moe_layers = sum(1 for i in range(model.n_layers) if i >= moe.dense_layers) / c.pp
        per_a2a = (seq_len // c.cp * c.microbatch_size / c.tp * moe.top_k * h * compute_bytes
                   * (c.ep - 1) / c.ep)
        bw = device.intra_node_gbps if c.ep * c.tp <= per_node else device.inter_node_gbps
        calls = 4 + 2 * c.recomputed(c.blocks(model))
        ep_comm = calls * per_a2a / (bw * 1e9) * moe_layers * c.num_microbatches
    if moe is not None and moe.capacity_factor is not None and c.tp * c.cp > 1:
        # Capacity decided over the whole microbatch: its tp × cp ranks all-gather its
        # assignments (8 bytes each) per MoE block and microbatch, again under recompute.
        moe_layers = sum(1 for i in range(model.n_layers) if i >= moe.dense_layers) / c.pp
        g = c.tp * c.cp
        gathered = seq_len * c.microbatch_size * moe.top_k * 8 * (g - 1) / g
        bw = device.intra_node_gbps if g <= per_node else device.inter_node_gbps
        calls = 1 + c.recomputed(c.blocks(model))
        ep_comm += calls * gathered / (bw * 1e9) * moe_layers * c.num_microbatches
    dp_exposed = 0.0
    if c.dp * c.cp > 1:
        dp_exposed = (_ddp_exposed(model, c, device, per_node, compute) if runs_ddp(model, c)
                      else _zero3_exposed(model, c, device, per_node, compute_bytes, compute))
    cp_comm = cp_exposed(model, c, seq_len, device, per_node, compute_bytes)
    step = compute + tp_comm + pp_comm + dp_exposed + ep_comm + cp_comm
    achieved = flops / step / c.world_size
    return Estimate(
        memory_per_rank_gib=(memory if memory is not None else memory_bytes(
            model, c, seq_len, compute_bytes, device.framework_gib * GIB, fused)) / GIB,
        step_time_s=step, tokens_per_s=tokens / step, tflops_per_gpu=achieved / 1e12,
        mfu=achieved / (device.peak_tflops * 1e12), bubble_fraction=bubble, compute_s=compute,
        tp_comm_s=tp_comm, pp_comm_s=pp_comm, dp_exposed_s=dp_exposed, ep_comm_s=ep_comm,
        cp_comm_s=cp_comm, host_bound=host_s > device_s)
