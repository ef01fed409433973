"""Peak memory of one rank of a candidate plan (pure arithmetic, no torch; the step time is
``cost_model``'s).

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
  * DP without sharding (DDP): every rank holds the whole float32 state; under a narrower
    compute dtype autocast keeps each weight's cast for backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmesh.models.llama.model_math import blocks_held, chunk_kinds, fullest_ranks
from trainmesh.planning.candidate import (
    GIB,
    Candidate,
    cp_moved,
    dense_layers,
    head_width,
    in_flight_chunks,
    kv_dim,
    runs_ddp,
)
from trainmesh.planning.stage_params import (
    block_tensors,
    holds_head,
    memo,
    mtp_block_is_moe,
    rank_params,
)
from trainmesh.spec.kernel_choice import fused_ops

FRAMEWORK_BYTES = 2.0 * GIB  # CUDA context, allocator slack, NCCL/gloo buffers


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
                     fused: Fused = False, ep: int = 1, cp: int = 1, moe_block: bool = True,
                     cp_latent: bool = True) -> float:
    """Saved activations of one layer and microbatch, in s·b·h elements (module docstring);
    ``moe_block``: of an MoE model's MoE block (False: one of its leading dense blocks).
    ``fused``: the Triton kernels (all, or the set of ops that run them), whose RMSNorm keeps
    only its input (not the normalised copy) and whose SwiGLU keeps gate and up only.
    ``cp`` > 1: the context-parallel attention keeps the key/value heads unexpanded (q, k, v:
    1 + 2·kv/h instead of 3); Multi-head Latent Attention's, ``mla_activation_units``."""
    if recompute == "full":
        return 1.0 / tp if sequence_parallel and tp > 1 else 1.0
    f = model.ffn_dim / model.dim
    attn = 5.0 if cp == 1 else 3.0 + 2.0 * model.n_kv_heads / model.n_heads
    latent = 0.0  # what tensor parallel does not split (each tp rank computes it whole)
    if getattr(model, "mla", None) is not None:
        attn, latent = mla_activation_units(model, cp, cp_latent)
    norm = 1 if _runs(fused, "rms_norm") else 2  # per norm, besides the output the next matmul keeps
    mlp = (3 if _runs(fused, "swiglu") else 4) * f
    moe = getattr(model, "moe", None)
    if moe is not None and moe_block:  # the MoE block: its tp rank's share of the tokens
        mlp = moe_activation_units(model, ep, tp)
    if sequence_parallel and tp > 1:
        return 2 + (2 * norm + attn + mlp) / tp + latent
    return 2 + 2 * norm + (attn + mlp) / tp + latent


def mla_activation_units(model, cp: int = 1, cp_latent: bool = True) -> tuple[float, float]:
    """Multi-head Latent Attention's saved activations of one layer, in s·b·h elements: the
    heads' part (split by tp: the query, the expanded keys with the shared rotary key in each,
    the values and the attention's output) and the latents' (whole on every tp rank: the
    query's and the key/value latent with their norms' outputs, the rotary key). Under
    context parallel the ring keeps its heads padded to the wider width: the query, the
    output and the output projection's input, and the expanded keys and values unless it
    moves the latents (``cp_latent``), which it keeps in their place."""
    m, h = model.mla, model.n_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    heads = (2 * h * qk + 2 * h * m.v_head_dim) / model.dim
    if cp > 1:
        width = max(qk, m.v_head_dim)
        heads = h * ((2 if cp_latent else 4) * width + m.v_head_dim) / model.dim
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
                 compute_bytes, ddp, unwrapped, c.keep_gathered, c.num_microbatches > 1,
                 c.stage_layers)
    params, grads, gathered, end_of_step = memo(
        "state", model, state_key,
        lambda: _state_bytes(model, c, pp_rank, compute_bytes, ddp, unwrapped))
    sp = c.sequence_parallel and c.tp > 1
    kinds = chunk_kinds(model.n_layers, c.pp, c.vpp, pp_rank, dense_layers(model), c.stage_layers)
    act_key = (seq_len, c.cp, c.cp_mode, c.microbatch_size, c.tp, sp, c.recompute,
               c.recompute_stride, fused_head, c.ep, c.pp, c.vpp, last, compute_bytes, kinds,
               c.stage_layers, c.cp_latent)
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
    rp = rank_params(model, c.pp, pp_rank, c.schedule, c.vpp, c.stage_layers)
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
        held = blocks_held(model.n_layers, c.pp, c.vpp, c.stage_layers)[pp_rank] + rp.mtp_modules
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
    latent = c.moves_latent(model)
    kept = activation_units(model, c.tp, sp, "none", fused_head, c.ep, c.cp, cp_latent=latent)
    full = activation_units(model, c.tp, sp, "full", fused_head, c.ep, c.cp) if f > 0 else 0.0
    dense = (activation_units(model, c.tp, sp, "none", fused_head, c.ep, c.cp, moe_block=False,
                              cp_latent=latent)
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
        # Multi-token prediction (the last stage; under cp on the rank's part of the sequence,
        # its block's ring among the transients above): each module's two input norms, their
        # concatenation, its block (recomputed as ``apply_activation_checkpointing`` picks the
        # blocks after the model's), its norm and the input its head's matmul keeps; under tp
        # whole on every rank but the block's split heads (no sequence parallel inside)
        depth = getattr(getattr(model, "mtp", None), "depth", 0)
        held = sum(d + m for d, m in kinds)  # (the rank's blocks: the modules' come after them)
        for k in range(depth):
            again = c.recompute == "full" or (
                c.recompute == "selective" and (held + k) % c.recompute_stride == 0)
            block = activation_units(model, c.tp, False, "full" if again else "none",
                                     fused_head, c.ep, c.cp, cp_latent=latent)
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
    ranks = ({0, c.pp - 1, *fullest_ranks(model.n_layers, c.pp, c.vpp, dense_layers(model),
                                           c.stage_layers)}
             if pp_rank is None else {pp_rank})

    def one(r: int) -> float:
        state = 12 * rank_params(model, c.pp, r, c.schedule, c.vpp, c.stage_layers).local(
            c.tp, c.zero_shards)
        return 6 * (state + 3 * DCP_ENTRY_BYTES * _tensors(model, c, r)) + state
    return max(one(r) for r in ranks)


def _tensors(model, c: Candidate, pp_rank: int) -> int:
    """Parameter tensors of a pipeline rank's part: its blocks (``block_tensors``), its
    multi-token modules (two input norms, the projection, the output norm and a block each),
    the embedding, the final norm and head."""
    rp = rank_params(model, c.pp, pp_rank, c.schedule, c.vpp, c.stage_layers)
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
    return max(rank_memory(model, c, seq_len, r, compute_bytes, framework_bytes, fused).total
               for r in heaviest_ranks(model, c))


def memory_over(model, c: Candidate, seq_len: int, compute_bytes: int, framework_bytes: float,
                fused: Fused, limit: float) -> tuple[float, bool]:
    """``memory_bytes``, stopping at the first of those ranks over ``limit``: (its bytes, True)
    — the heaviest rank's are at least that —, or (the heaviest rank's, False) where all fit.
    A plan's search rejects most candidates for memory: it needs no more to reject one."""
    worst = 0.0
    for r in heaviest_ranks(model, c):
        held = rank_memory(model, c, seq_len, r, compute_bytes, framework_bytes, fused).total
        if held > limit:
            return held, True
        worst = max(worst, held)
    return worst, False


def heaviest_ranks(model, c: Candidate) -> tuple[int, ...]:
    """The pipeline ranks one of which holds the most (``memory_bytes``), the first (the most
    activations in flight) first."""
    if c.pp == 1:
        return (0,)
    ranks = [0, c.pp - 1, *fullest_ranks(model.n_layers, c.pp, c.vpp, dense_layers(model),
                                         c.stage_layers)]
    return tuple(dict.fromkeys(ranks))

def cp_transient_bytes(model, c: Candidate, seq_len: int, compute_bytes: int) -> float:
    """What context-parallel attention holds while a layer runs, beyond saved activations: the
    fp32 partial outputs merged in forward and the fp32 query gradient accumulated in
    backward (q-sized each); all-gather, every rank's keys and values (compute dtype) and in
    backward their fp32 gradients; ring, the block being used and the one arriving, and two
    fp32 gradient blocks (the one travelling, the one arriving). Where the ring moves
    latents (``cp_moved``) those are the blocks, and one block is expanded at a time: its
    keys and values and their padded copies (compute dtype), in backward their fp32
    gradients, the expansion's output and its gradient, and the fp32 gradient of ``wkv_b``'s
    rows that the ring's backward accumulates."""
    if c.cp == 1:
        return 0.0
    part = seq_len // c.cp * c.microbatch_size
    block = cp_moved(model, c, part)
    queries = 4 * part * model.n_heads * head_width(model) / c.tp  # fp32, q-sized
    expanded = 0.0
    if c.moves_latent(model):
        m = model.mla
        rows = model.n_heads * (m.qk_nope_head_dim + m.v_head_dim) / c.tp
        expanded = (2 * part * kv_dim(model) / c.tp * (2 * compute_bytes + 4)
                    + part * rows * (compute_bytes + 4) + rows * m.kv_lora_rank * 4)
    if c.cp_mode == "allgather":
        return queries + c.cp * block * (compute_bytes + 4) + expanded
    return queries + block * (2 * compute_bytes + 2 * 4) + expanded
