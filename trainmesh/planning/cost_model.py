"""Step-time estimates for one candidate plan (pure arithmetic, no torch; a rank's memory is
``memory_model``'s, the candidate and its schedule's bubble ``candidate``'s).

Step time (seconds):
  * compute = training FLOPs of the global batch / (world × peak × efficiency) plus a fixed
    device cost per block and microbatch (kernels' launch latency and tails), × 4/3 with full
    recomputation (one more forward); or, where longer, the host's time to issue that work
    (per block and microbatch): a GPU left waiting for its host by small microbatches (the
    figures are ``DeviceSpec``'s, fitted on an H200 and assumed for the other GPUs; zero on a
    CPU rank, whose host is its device); stretched by the pipeline bubble: the ideal time
    covers m microbatches, the schedule takes m + (p-1)/v of them with stages alike. Stages
    differ (their blocks' counts and kinds; the head and the multi-token modules on the last:
    ``model_math.stage_flops``): the simulator plays the schedule with each stage at its own
    cost, and the lighter stages wait for the heavier (``by_stage``; a search prices the
    first plans so, ``planner._by_stage``). Not modelled: an MoE
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
    embedding's (``_ddp_exposed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainmesh.models.llama.model_math import (
    blocks_held,
    flops_per_token,
    linear_shapes,
    stage_flops,
)
from trainmesh.planning.candidate import (
    CHUNKED,
    GIB,
    Candidate,
    bubble_fraction,
    cp_moved,
    latent_expansion_flops,
    runs_ddp,
)
from trainmesh.planning.devices import DeviceSpec
from trainmesh.planning.memory_model import Fused, memory_bytes
from trainmesh.planning.stage_params import holds_head, memo, rank_params

MATMUL_EFFICIENCY = 0.55  # achievable fraction of peak for large bf16 matmuls
PP_LATENCY_S = 20e-6  # per point-to-point message
# The MoE exchanges in two halves issue the experts' part of a block twice: this share of a
# block's fixed per-microbatch cost (forward and backward) more. Assumed, not yet measured.
HALVES_EXTRA = 0.25
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
# training.float8 (``float8_parts``): the blocks' linears (and experts) at the device's float8
# peak, less what their casts cost: bytes moved per element cast (each linear's input and
# output per token, its weight per microbatch: reading, finding the scale, writing, forward and
# backward), fitted to the step ratio of 8 of Llama 3 8B's blocks at microbatch 4 on an H200
# (tensorwise, under torch.compile: 0.695 s against bf16's 0.837); and the host's time to
# issue a block's work, this many times bf16's (the scaling and cast kernels), fitted to `1b`
# at microbatch 2 there (0.500 s, the GPU 47% busy). The 8B shape at microbatch 2, not fitted
# to: 0.88× bf16's step predicted, 0.86× measured (bench/planner.py). Rowwise scales and the
# experts' grouped GEMMs: assumed alike (not measured).
FLOAT8_CAST_BYTES = 28.0
FLOAT8_HOST_FACTOR = 2.05


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
    # The pipeline's stages priced each at its own cost (blocks, the head on the last: the
    # simulator's bubble), not alike (the closed forms: a lower bound on the step)
    by_stage: bool = True
    ep_overlap: bool = False  # the all-to-alls in two halves (``parallelism.ep_overlap``)
    # The step time the halves save, or would (negative: where they cost more)
    ep_overlap_gain_s: float = 0.0
    ep_relay: bool = False  # the exchanges in two hops (``parallelism.ep_dispatch``)
    # The step time relaying saves over the direct exchange, or would (negative: it costs)
    ep_relay_gain_s: float = 0.0
    ep_nodes: int = 1  # the nodes an EP group spans
    ep_nodes_reached: float = 0.0  # the nodes a token's experts sit on, on average
    # DualPipeV's pairs (``schedule.pair_overlap``): the exchanges they hide, seconds a step
    ep_pair_hidden_s: float = 0.0
    # training.float8: the step time its matmuls save less what its casts (and the host's extra
    # work, where that bounds the step) cost (negative: slower than bf16)
    float8_gain_s: float = 0.0


def _ring_latency(participants: int, crosses_nodes: bool) -> float:
    """Latency of one ring collective: its launch, plus a hop per other participant."""
    hop = HOP_LATENCY_INTER_S if crosses_nodes else HOP_LATENCY_INTRA_S
    return COLLECTIVE_LATENCY_S + hop * (participants - 1)


def _zero3_exposed(model, c: Candidate, device: DeviceSpec, per_node: int, compute_bytes: int,
                   compute: float, float8_elements: float = 0.0) -> float:
    """ZeRO-3's step time not hidden behind compute. Inside a shard group (all of dp, or
    dp / dp_replicate replicas under hybrid sharding): parameters all-gathered and gradients
    reduce-scattered, ring cost (s-1)/s × bytes / bandwidth; under hybrid sharding the
    reduce-scatters' accumulated output (1/s of the gradients) is then all-reduced across the
    dp_replicate groups once per step, 2(r-1)/r × bytes. Under expert parallel the experts
    gather and reduce over their own ring, s / ep (one FSDP unit per MoE block). A group within
    a node uses intra-node bandwidth. Overlapped with compute except what exceeds half of it;
    each collective's latency (one hop per other participant of its ring) is paid per FSDP
    unit, not hidden. ``float8_elements`` of the dense weights gather in float8 (one byte
    each; ``float8_gathered``)."""
    rp = rank_params(model, c.pp, 0, c.schedule, c.vpp, c.stage_layers)
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
        # (a float8 weight gathers a byte an element, not compute_bytes)
        time -= gathers * (compute_bytes - 1) * min(float8_elements, dense) * (s - 1) / s / (bw * 1e9)
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


def cp_exposed(model, c: Candidate, seq_len: int, device: DeviceSpec, per_node: int,
               compute_bytes: int) -> float:
    """Context parallel's key/value traffic per step that compute does not hide. Ring: each of
    cp − 1 hops sends a block (K and V of seq/cp tokens, the rank's key/value heads), hidden
    behind the attention of the block at hand (forward: 4·(s/cp)²·h/t/2 FLOPs per block,
    causal; backward twice that) except what exceeds it; backward sends the blocks' fp32
    gradients cp hops on, after each block (not hidden). All-gather: the keys and values
    gathered in forward and again in backward, their fp32 gradients reduce-scattered; not
    hidden. Per layer and microbatch (the multi-token modules' blocks too, on the rank with
    the head: ``ring_blocks``); full recomputation runs the forward's again. The ring is
    within a node when cp × tp fits one. Multi-head Latent Attention's ring moves latents
    (``cp_moved``) and adds their expansion where they arrive (``latent_expansion_flops``),
    counted here as the ring's cost."""
    if c.cp == 1:
        return 0.0
    inside = c.cp * c.tp <= per_node
    bw = (device.intra_node_gbps if inside else device.inter_node_gbps) * 1e9
    part = seq_len // c.cp * c.microbatch_size
    block = cp_moved(model, c, part)  # elements of one rank's block (K and V, or latents)
    forwards = 1 + c.recomputed(c.blocks(model))
    expand_s = (latent_expansion_flops(model, c, part, forwards)
                / (device.peak_tflops * 1e12 * MATMUL_EFFICIENCY))
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
    return (per_layer + expand_s) * ring_blocks(model, c) * c.num_microbatches


def ring_blocks(model, c: Candidate) -> int:
    """The most blocks a rank runs over the context-parallel ring a microbatch: its pipeline
    blocks, and on the rank with the head the multi-token modules' blocks too (each attends
    over the ring as the model's do)."""
    held = c.blocks(model)
    depth = getattr(getattr(model, "mtp", None), "depth", 0) or 0
    if not depth:
        return held
    split = blocks_held(model.n_layers, c.pp, c.vpp, c.stage_layers)
    last = next(r for r in range(c.pp) if holds_head(c.schedule, c.pp, r))
    return max(held, split[last] + depth)


def moe_blocks(model) -> int:
    """The model's MoE blocks (those after ``moe.dense_layers``)."""
    return max(0, model.n_layers - model.moe.dense_layers)


def ep_exposed(model, c: Candidate, seq_len: int, device: DeviceSpec, per_node: int,
               compute_bytes: int) -> tuple[float, float]:
    """The MoE blocks' token all-to-alls per step, whole and overlapped in two halves
    (``parallelism.ep_overlap``). Whole: 4 per block and microbatch (6 when full recompute runs
    the forward's two again), each a rank's routed tokens (top_k copies of its share of the
    microbatch) less the 1/ep that stays, plus a message's latency, all exposed. Halves: each
    half-exchange costs half the bytes plus a message's latency; forward, the first half's way
    out is exposed, the second's hides behind the first half's experts, the first's way back
    behind the second half's experts, and the second's way back behind the shared expert;
    backward the same with the experts' backward (twice their forward), the last way out
    exposed (``estimate`` adds what issuing the experts' part twice costs). Whole, each
    exchange is relayed where ``parallelism.ep_dispatch`` would relay it without the halves,
    else direct (``ep_exchange_s``); in halves, direct."""
    moe = model.moe
    layers = moe_blocks(model) / c.pp
    tokens = seq_len // c.cp * c.microbatch_size / c.tp
    forwards = 1 + c.recomputed(c.blocks(model))
    direct, relay = ep_exchange_s(model, c, seq_len, device, per_node, compute_bytes)
    whole_relayed = relayed(model, c, seq_len, device, per_node, compute_bytes, overlap=False)
    whole = (2 * forwards + 2) * (relay if whole_relayed else direct) * layers * c.num_microbatches
    x = direct - PP_LATENCY_S  # (the halves: direct exchanges)
    rate = device.peak_tflops * 1e12 * MATMUL_EFFICIENCY
    experts_s = tokens * moe.top_k * 6 * model.dim * moe.expert_ffn_dim / rate  # forward
    shared_s = tokens * 6 * model.dim * moe.shared_experts * moe.expert_ffn_dim / rate
    half = x / 2 + PP_LATENCY_S
    fwd = half + 2 * max(0.0, half - experts_s / 2) + max(0.0, half - shared_s)
    bwd = 2 * half + 2 * max(0.0, half - experts_s)
    return whole, (forwards * fwd + bwd) * layers * c.num_microbatches


def paired_share(pp: int, microbatches: int) -> float:
    """The share of a DualPipeV rank's chunk forwards (and whole backwards) that run in pairs,
    on its first rank, which pairs fewest: 2m − 3pp + 1 of its 2m (rank r pairs min(r, pp − 2)
    more; ``schedules.dualpipev_pairs``, torch's order, tested against this)."""
    return max(0.0, (2 * microbatches - 3 * pp + 1) / (2 * microbatches))


def pair_hidden_s(c: Candidate, exposed_s: float, busy_s: float) -> float:
    """Of ``exposed_s`` a step of MoE exchanges, what DualPipeV's pairs hide
    (``schedule.pair_overlap``: each half's exchanges in flight while the other half computes):
    the pairs' share of them, up to the pairs' share of the rank's compute ``busy_s`` (the
    bubble not counted); the warm-up's and drain's unpaired ones stay exposed."""
    if c.schedule != "dualpipev" or not c.pair_overlap or c.pp == 1 or c.ep == 1:
        return 0.0
    share = paired_share(c.pp, c.num_microbatches)
    return min(share * exposed_s, share * busy_s)


def nodes_reached(moe, nodes: int) -> float:
    """The nodes a token's experts sit on, on average, the experts spread evenly over
    ``nodes``: where the router's groups map onto the nodes (``n_group`` a multiple of them,
    each node whole groups), those of its ``topk_group`` groups (at most ``topk_group``);
    else those of ``top_k`` experts drawn at random."""
    if nodes <= 1:
        return 1.0
    if moe.n_group > 1 and moe.n_group % nodes == 0:
        g, t = moe.n_group, moe.topk_group
        missed = math.comb(g - g // nodes, t) / math.comb(g, t)
    else:
        e, k = moe.experts, moe.top_k
        missed = math.comb(e - e // nodes, k) / math.comb(e, k)
    return nodes * (1 - missed)


def ep_exchange_s(model, c: Candidate, seq_len: int, device: DeviceSpec, per_node: int,
                  compute_bytes: int) -> tuple[float, float]:
    """One MoE exchange's seconds (a block's dispatch or combine, forward or backward), direct
    and relayed (``parallelism.ep_dispatch``), an EP group over N nodes (``Candidate.ep_on_node``:
    P of its ranks a node). Direct: a rank's top_k copies of its tokens, (N − 1)/N of them to
    other nodes and (P − 1)/ep to its own node's other ranks, at once over the two links, plus
    a message's latency. Relayed: a token crosses once to each other node it reaches
    (``nodes_reached``; its choices' weights and ids beside it: 8 bytes a choice out and 4
    back in the dispatch, none in the combine, 3 an exchange on average), then the relay hands
    the node's choices on over the node's links (top_k copies, (P − 1)/P of them to another
    rank): the two hops one after the other, and three latencies (its five collectives each
    way out, two back)."""
    moe = model.moe
    tokens = seq_len // c.cp * c.microbatch_size / c.tp
    row = model.dim * compute_bytes
    on_node = c.ep_on_node(per_node)
    nodes = max(1, -(-c.ep // on_node))
    inter, intra = device.inter_node_gbps * 1e9, device.intra_node_gbps * 1e9
    copies = tokens * moe.top_k * row
    direct = max(copies * (nodes - 1) / nodes / inter,
                 copies * (on_node - 1) / c.ep / intra) + PP_LATENCY_S
    across = tokens * nodes_reached(moe, nodes) * (nodes - 1) / nodes * (row + 3 * moe.top_k)
    inside = copies * (on_node - 1) / on_node
    relayed = across / inter + inside / intra + 3 * PP_LATENCY_S
    return direct, relayed


def relayed(model, c: Candidate, seq_len: int, device: DeviceSpec, per_node: int,
            compute_bytes: int, overlap: bool | None = None) -> bool:
    """Whether ``c``'s exchanges run relayed: where they can and the spec asks (``relay``), or
    (``auto``, the planner's choice, written into the plan's spec) where they would and the
    relay is priced faster (``ep_exchange_s``). ``overlap``: as ``Candidate.relays``."""
    if not c.relays(model, per_node, overlap):
        return False
    if c.ep_dispatch == "relay":
        return True
    direct, relay = ep_exchange_s(model, c, seq_len, device, per_node, compute_bytes)
    return relay < direct


def float8_parts(model, c: Candidate, seq_len: int, device: DeviceSpec) -> tuple[float, float]:
    """(the bf16 seconds a rank's float8 linears — ``model_math.linear_shapes``, its blocks'
    share — take per step, the seconds their casts add), the matmuls at MATMUL_EFFICIENCY of
    the dense peak: at the float8 peak they take ``peak / float8_tflops`` of it. Casts:
    FLOAT8_CAST_BYTES per element at the device's memory bandwidth, each linear's input and
    output per token copy, its weights per microbatch (routed experts: the rank's, 1/ep).
    Only what ``apply_float8`` converts: sides that divide by 16; routed experts where the
    device runs float8 grouped GEMMs (``DeviceSpec.float8_grouped``)."""
    n, moe = model.n_layers, getattr(model, "moe", None)
    dense = min(n, moe.dense_layers) if moe is not None else n
    flops = acts = weights = 0.0

    def converted(a: int, b: int, held: int) -> bool:
        return not (a % 16 or b % 16) and (held == 1 or device.float8_grouped)
    for layer, count in ((0, dense), (n - 1, n - dense)):
        for a, b, k, held in [x for x in linear_shapes(model, layer) if converted(x[0], x[1], x[3])
                              ] if count else ():
            flops += count * 6 * a * b * k
            acts += count * (a + b) * k
            weights += count * a * b * (held / c.ep if held > 1 else 1)
    share = c.blocks(model) / n / c.tp  # (float8 is refused beside tp: kept for the form)
    tokens = c.num_microbatches * c.microbatch_size * seq_len / c.cp
    linear_s = flops * tokens * share / (device.peak_tflops * 1e12 * MATMUL_EFFICIENCY)
    cast = FLOAT8_CAST_BYTES * (acts * tokens + weights * c.num_microbatches) * share
    return linear_s, cast / (device.hbm_gbps * 1e9)


def float8_gathered(model, c: Candidate, device: DeviceSpec) -> float:
    """The elements of a rank's weights that ZeRO-3 all-gathers in float8 under
    ``training.float8: tensorwise`` (torchao's float8 all-gather): the converted linears of
    its blocks (``float8_parts``' rule), not the routed experts (their grouped GEMMs cast
    after the gather)."""
    n, moe = model.n_layers, getattr(model, "moe", None)
    dense = min(n, moe.dense_layers) if moe is not None else n
    elements = 0.0
    for layer, count in ((0, dense), (n - 1, n - dense)):
        elements += count * sum(a * b for a, b, _, held in linear_shapes(model, layer)
                                if held == 1 and not (a % 16 or b % 16)) if count else 0.0
    return elements * c.blocks(model) / n / c.tp


def estimate(model, c: Candidate, seq_len: int, device: DeviceSpec, per_node: int,
             compute_bytes: int = 2, fused: Fused = False,
             memory: float | None = None, by_stage: bool = True,
             float8: str = "none") -> Estimate:
    """``c``'s step time and throughput (module docstring) and its memory per rank
    (``memory``: the bytes ``memory_bytes`` gave for it, where the caller has them).
    ``by_stage``: a pipeline's bubble from its stages' own costs (``model_math.stage_flops``,
    played by the simulator); else the least it can be with them (``_least_makespan``: no
    play; a lower bound on the step, which a plan's search ranks by first)."""
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
    if float8 != "none" and device.float8_tflops > 0 and device.hbm_gbps > 0:
        linear_s, cast_s = float8_parts(model, c, seq_len, device)
        device_s += (cast_s - linear_s * (1 - device.peak_tflops / device.float8_tflops)) * again
        host_s *= FLOAT8_HOST_FACTOR
    stages = (memo("stage_flops", model, (seq_len, c.pp * c.vpp, c.stage_layers),
                   lambda: stage_flops(model, seq_len, c.pp * c.vpp, c.stage_layers))
              if c.pp > 1 else None)
    bubble = bubble_fraction(c.schedule, c.pp, c.vpp, c.num_microbatches, stages,
                             bound=not by_stage)
    compute = max(device_s, host_s) / (1.0 - bubble)
    moe = getattr(model, "moe", None)
    ep_comm, ep_gain, relay_gain, reached, ep_nodes, pair_hidden = 0.0, 0.0, 0.0, 0.0, 1, 0.0
    if moe is not None and c.ep > 1:
        whole, halves = ep_exposed(model, c, seq_len, device, per_node, compute_bytes)
        # The relay's saving over the direct exchange (negative: its cost), whichever runs
        direct, relay = ep_exchange_s(model, c, seq_len, device, per_node, compute_bytes)
        calls = (2 * (1 + c.recomputed(layers)) + 2) * moe_blocks(model) / c.pp * c.num_microbatches
        relay_gain = (direct - relay) * calls
        ep_nodes = max(1, -(-c.ep // c.ep_on_node(per_node)))
        reached = nodes_reached(moe, ep_nodes)
        # In halves the experts' part of each MoE block is issued twice: HALVES_EXTRA more of
        # its fixed costs, on the device and on the host (hidden where the other is longer).
        extra = HALVES_EXTRA * moe_blocks(model) / c.pp * c.num_microbatches * again
        halved = max(device_s + extra * device.kernel_overhead_s,
                     host_s + extra * device.host_dispatch_s) / (1.0 - bubble)
        ep_gain = (compute + whole) - (halved + halves)
        compute, ep_comm = (halved, halves) if c.ep_overlap else (compute, whole)
        pair_hidden = pair_hidden_s(c, ep_comm, max(device_s, host_s))
        ep_comm -= pair_hidden
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
    if moe is not None and moe.capacity_factor is not None and c.tp * c.cp > 1:
        # Capacity decided over the whole microbatch: its tp × cp ranks all-gather its
        # assignments (8 bytes each) per MoE block and microbatch, again under recompute.
        moe_layers = moe_blocks(model) / c.pp
        g = c.tp * c.cp
        gathered = seq_len * c.microbatch_size * moe.top_k * 8 * (g - 1) / g
        bw = device.intra_node_gbps if g <= per_node else device.inter_node_gbps
        calls = 1 + c.recomputed(c.blocks(model))
        ep_comm += calls * gathered / (bw * 1e9) * moe_layers * c.num_microbatches
    dp_exposed = 0.0
    if c.dp * c.cp > 1:
        dp_exposed = (_ddp_exposed(model, c, device, per_node, compute) if runs_ddp(model, c)
                      else _zero3_exposed(model, c, device, per_node, compute_bytes, compute,
                                          float8_gathered(model, c, device)
                                          if float8 == "tensorwise" else 0.0))
    cp_comm = cp_exposed(model, c, seq_len, device, per_node, compute_bytes)
    step = compute + tp_comm + pp_comm + dp_exposed + ep_comm + cp_comm
    achieved = flops / step / c.world_size
    f8_gain = 0.0  # (the whole step's: ZeRO-3 hides less behind a shorter compute)
    if float8 != "none" and device.float8_tflops > 0 and device.hbm_gbps > 0:
        f8_gain = estimate(model, c, seq_len, device, per_node, compute_bytes, fused, memory,
                           by_stage).step_time_s - step
    return Estimate(
        memory_per_rank_gib=(memory if memory is not None else memory_bytes(
            model, c, seq_len, compute_bytes, device.framework_gib * GIB, fused)) / GIB,
        step_time_s=step, tokens_per_s=tokens / step, tflops_per_gpu=achieved / 1e12,
        mfu=achieved / (device.peak_tflops * 1e12), bubble_fraction=bubble, compute_s=compute,
        tp_comm_s=tp_comm, pp_comm_s=pp_comm, dp_exposed_s=dp_exposed, ep_comm_s=ep_comm,
        cp_comm_s=cp_comm, host_bound=host_s > device_s, by_stage=by_stage or c.pp == 1,
        ep_overlap=c.ep_overlap and c.ep > 1, ep_overlap_gain_s=ep_gain, float8_gain_s=f8_gain,
        ep_relay=(moe is not None and c.ep > 1
                  and relayed(model, c, seq_len, device, per_node, compute_bytes)),
        ep_relay_gain_s=relay_gain, ep_nodes=ep_nodes, ep_nodes_reached=reached,
        ep_pair_hidden_s=pair_hidden)
