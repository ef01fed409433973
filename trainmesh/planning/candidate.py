"""A candidate plan (its degrees, schedule, microbatching, recomputation, sharding) and what
both halves of the cost model read of it: the schedule's bubble and the microbatch-chunks a
rank holds at its peak, whether it runs as DDP, and the model's shape as the estimates use
it. The memory model (``memory_model``) and the time model (``cost_model``) build on this;
pure arithmetic, no torch."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from trainmesh.models.llama.model_math import rank_blocks, stage_split
from trainmesh.parallel.dims import replicates
from trainmesh.parallel.pipeline.ir import PipeShape, splits_backward, v_shaped
from trainmesh.spec.mesh_rules import relays

GIB = 1024**3
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
AUTO_SCHEDULES = SCHEDULES[:3]  # what the planner weighs unasked; zero-bubble ones when named
CHUNKED = ("interleaved-1f1b", "zbv", "dualpipev")  # schedules that run vpp chunks per rank
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
    # blocks of each pipeline stage, in model order (``parallelism.stage_layers``); None: the
    # default split (``model_math.stage_split``)
    stage_layers: tuple[int, ...] | None = None
    ep_overlap: bool = False  # the MoE all-to-alls in two halves (``parallelism.ep_overlap``)
    # Multi-head Latent Attention over the cp ring moves each token's latent, expanded on
    # arrival (``parallelism.cp_latent``), or the expanded keys and values
    cp_latent: bool = True
    # How tokens reach their experts (``parallelism.ep_dispatch``: auto, direct or relay; not
    # searched: the spec's, priced with the other way beside it)
    ep_dispatch: str = "auto"
    ep_node_ranks: int | None = None  # the ranks a node holds (``parallelism.ep_node_ranks``)
    # DualPipeV's pairs on two threads, one's exchanges behind the other's compute
    # (``schedule.pair_overlap``; other schedules have no pairs)
    pair_overlap: bool = True

    def node_ranks(self, per_node: int) -> int:
        """The ranks one node (fast domain) holds: ``parallelism.ep_node_ranks``, else the
        topology's ``per_node``."""
        return self.ep_node_ranks or per_node

    def ep_on_node(self, per_node: int) -> int:
        """The ranks of an EP group on one node (its ranks are every tp-th)."""
        return max(1, min(self.ep, self.node_ranks(per_node) // self.tp))

    def relays(self, model, per_node: int, overlap: bool | None = None) -> bool:
        """Whether the EP groups can and would dispatch in two hops (``mesh_rules.relays``, the
        engine's rule; ``cost_model.relayed`` adds the price to auto's choice). ``overlap``:
        with the exchanges in halves or not (None: as the candidate has them)."""
        moe = getattr(model, "moe", None)
        if self.ep == 1 or moe is None:
            return False
        nodes = self.node_ranks(per_node)
        member_nodes = [g * self.tp // nodes for g in range(self.ep)]  # (a group at a node's start)
        return relays(self.ep_dispatch, member_nodes, moe.top_k,
                      self.ep_overlap if overlap is None else overlap)

    def moves_latent(self, model) -> bool:
        """Whether context parallel moves ``model``'s compressed latent (``cp_moved``; not
        under a split backward, whose weight pass would run the ring's backward again)."""
        return (self.cp > 1 and self.cp_latent and getattr(model, "mla", None) is not None
                and not splits_backward(self.schedule))

    def blocks(self, model) -> int:
        """The most blocks a pipeline rank holds (``model_math.rank_blocks``: uneven where
        pp × vpp does not divide them)."""
        return rank_blocks(model.n_layers, self.pp, self.vpp, self.stage_layers)

    def chunk_blocks(self, model) -> int:
        """The most blocks one model chunk (pipeline stage) holds."""
        return max(stage_split(model.n_layers, self.pp * self.vpp, self.stage_layers))

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


@functools.lru_cache(maxsize=4096)  # (a plan's search asks per candidate: few are distinct)
def bubble_fraction(schedule: str, pp: int, vpp: int, m: int,
                    stage_costs: tuple[float, ...] | None = None, bound: bool = False) -> float:
    """Idle fraction of a pipelined step (backward = 2 × forward; a split backward's input and
    weight halves 1 each): the time the ranks wait, on each other or for the slowest stage.
    Stages alike (``stage_costs`` None or equal): closed forms for GPipe, 1F1B and
    interleaved; the zero-bubble schedules are played by the simulator. Stages that differ
    (``stage_costs``: each stage's cost, in model order — their blocks, the head on the
    last: ``model_math.stage_flops``): every schedule is played with them (cached); or, with
    ``bound``, the least it can be (``_least_makespan``: no play)."""
    if pp == 1:
        return 0.0
    if stage_costs is not None and max(stage_costs) > min(stage_costs) * (1 + 1e-6):
        mean = sum(stage_costs) / len(stage_costs)
        scale = tuple(round(x / mean, 3) for x in stage_costs)
        busy = m * 3 / vpp * sum(scale)  # (the simulator's units: a stage's forward 1/vpp)
        span = (_least_makespan if bound else _makespan)(schedule, pp, vpp, m, scale)
        return 1.0 - busy / (pp * span)
    if splits_backward(schedule):
        return _played(schedule, pp, vpp, m)[0]
    v = vpp if schedule == "interleaved-1f1b" else 1
    idle = (pp - 1) / v
    return idle / (m + idle)


def _rank_stages(schedule: str, pp: int, vpp: int) -> list[list[int]]:
    """Each rank's stages, as the schedule places them (``PipeShape.stages_of``)."""
    shape = PipeShape(pp, vpp, 1, v_shape=v_shaped(schedule))
    return [shape.stages_of(r) for r in range(pp)]


@functools.lru_cache(maxsize=4096)
def _least_makespan(schedule: str, pp: int, vpp: int, m: int, scale: tuple[float, ...]) -> float:
    """A step no schedule of these stages can beat: each rank runs all its work, m × its
    stages' forward and backward, after the first microbatch's forward has come through the
    stages before its first, and (a whole backward: its last action is the first chunk's
    backward of the last microbatch) before that backward has gone back through them. Equal
    to the closed forms when the stages are alike (a split backward's W may come last: no
    drain counted there)."""
    def fill_drain(r: int) -> float:  # (the stages before rank r's first, in model order)
        ahead = scale[:r]
        return sum(ahead) / vpp * (1 if splits_backward(schedule) else 3)
    return max(fill_drain(r) + m * 3 / vpp * sum(scale[s] for s in stages)
               for r, stages in enumerate(_rank_stages(schedule, pp, vpp)))


def _makespan(schedule: str, pp: int, vpp: int, m: int, scale: tuple[float, ...]) -> float:
    """The simulator's step time for stages costing ``scale``: played up to a few microbatches
    (2·pp, or 4·pp for two or more chunks a rank); for more, on from the last play at the
    pace of its steady state, each microbatch adding the larger of what the last plays added
    and the busiest rank's work (a pipeline cannot run faster than its slowest rank: so that
    the line, which the plays may still bend towards, never runs below it). A plan then plays
    each schedule's few sizes rather than one per microbatch count."""
    first = 2 * pp if schedule in CHUNKED else pp
    anchor = 2 * first
    if m <= anchor:
        return _played(schedule, pp, vpp, m, scale)[2]
    low, high = (_played(schedule, pp, vpp, k, scale)[2] for k in (first, anchor))
    busiest = 3 / vpp * max(sum(scale[s] for s in stages)
                            for stages in _rank_stages(schedule, pp, vpp))
    return high + (m - anchor) * max((high - low) / (anchor - first), busiest)


@functools.lru_cache(maxsize=1024)
def _played(schedule: str, pp: int, vpp: int, m: int, scale: tuple[float, ...] | None = None
            ) -> tuple[float, tuple[int, ...], float]:
    """(bubble, peak in-flight chunks per rank, step time) of the schedule played by the
    simulator, its stages' costs × ``scale`` (None: alike)."""
    from trainmesh.parallel.pipeline.schedules import build_schedule, pipe_shape
    from trainmesh.parallel.pipeline.simulate import Costs, simulate

    res = simulate(build_schedule(schedule, pp, vpp, m), pp * vpp, m,
                   Costs(1 / vpp, 2 / vpp, stage_scale=scale), shape=pipe_shape(schedule, pp, vpp, m))
    return res.bubble_fraction, tuple(res.peak_in_flight), res.step_time


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
    if v_shaped(schedule):
        return _played(schedule, pp, vpp, m)[1][pp_rank]
    # microbatches through a chunk at once: the first (largest) of interleaved 1F1B's groups
    # (``schedules.interleave_groups``: m // pp groups, sizes differing by at most one)
    group = -(-m // (m // pp)) if m >= pp else pp
    return min(m * vpp, 2 * (pp - pp_rank - 1) + (vpp - 1) * group + 1)

def has_moe_blocks(model) -> bool:
    """Whether the model has MoE blocks (``moe`` set and not every block kept dense), as the
    engine finds them in the built model."""
    moe = getattr(model, "moe", None)
    return moe is not None and moe.dense_layers < model.n_layers


def runs_ddp(model, c: Candidate) -> bool:
    """Whether ``c`` runs as DDP rather than ZeRO-3 (``parallel/dims.replicates``)."""
    return replicates(c.dp, c.dp_replicate, c.pp, c.tp, c.cp, has_moe_blocks(model))

def dense_layers(model) -> int:
    moe = getattr(model, "moe", None)
    return moe.dense_layers if moe is not None else 0


def kv_dim(model) -> int:
    return model.n_kv_heads * head_width(model)


def latent_dim(model) -> int:
    """What Multi-head Latent Attention's ring moves for a token's keys and values: its
    latent and its rotary key (whole on every tp rank)."""
    return model.mla.kv_lora_rank + model.mla.qk_rope_head_dim


def cp_moved(model, c: Candidate, part: int) -> float:
    """Elements one rank's block of ``part`` tokens moves over the context-parallel ring: the
    latents (``Candidate.moves_latent``), or the keys and values of its tp rank's heads."""
    if c.moves_latent(model):
        return part * latent_dim(model)
    return 2 * part * kv_dim(model) / c.tp


def latent_expansion_flops(model, c: Candidate, part: int, forwards: float = 1.0) -> float:
    """The extra FLOPs of expanding the moved latents where they are attended, per layer and
    microbatch: each of cp blocks expanded by the rank's heads' rows of ``wkv_b`` in each of
    ``forwards`` forwards (2 where recomputed), again in backward and folded back (two
    matmuls), less the expansion of its own tokens the model runs anyway (its forwards and
    backward): (forwards + 3)·cp − (forwards + 2) expansions of ``part`` tokens."""
    if not c.moves_latent(model):
        return 0.0
    m = model.mla
    rows = model.n_heads * (m.qk_nope_head_dim + m.v_head_dim) / c.tp
    return ((forwards + 3) * c.cp - (forwards + 2)) * 2.0 * part * m.kv_lora_rank * rows


def head_width(model) -> int:
    """A head's width as context parallel moves it: GQA's head_dim, or Multi-head Latent
    Attention's query/key and value heads padded to the wider (its key/value heads: every
    head, ``n_kv_heads = n_heads``)."""
    mla = getattr(model, "mla", None)
    if mla is not None:
        return max(mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim)
    return getattr(model, "head_dim", None) or model.dim // model.n_heads
