"""The planner's search space: every candidate layout of a cluster — degrees (tp, pp, dp, cp,
ep), pipeline chunks and schedule, microbatching, recomputation, ZeRO-3 policy and hybrid
sharding — with a Rejection (its reason) for each structurally impossible one (the spec's mesh
rules, the cluster's nodes). A layout's options are made when it is priced (``Layout``), so that
a search can leave whole tiers of them unmade (``planner``). No torch, no ray."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from trainmesh.models.llama.model_math import cost_split, stage_split
from trainmesh.parallel.dims import replicates
from trainmesh.parallel.pipeline.ir import splits_backward, v_shaped
from trainmesh.planning.candidate import RECOMPUTE, Candidate, has_moe_blocks
from trainmesh.planning.stage_params import memo
from trainmesh.planning.topology import Topology
from trainmesh.spec.mesh_rules import (
    cp_problems,
    divisors,
    dp_fits,
    dp_problems,
    ep_degrees,
    hsdp_problems,
    microbatches_per_replica,
    pp_problems,
    runnable_problems,
    stage_layers_problems,
    tp_problems,
)
from trainmesh.spec.problems import Problem
from trainmesh.spec.validate import Workload

MICROBATCH_SIZES = (1, 2, 4, 8)
VPP_CHOICES = (1, 2, 4)
CP_CHOICES = (1, 2, 4, 8, 16, 32)
CP_MODES = ("ring", "allgather")
# Context parallel is weighed for sequences this long (Llama 3 used it for its 131K stage,
# not its 8K one), or for shorter ones when nothing else fits; never leaving a rank fewer
# tokens of a sequence than CP_MIN_TOKENS (its ring transfers could not hide).
LONG_CONTEXT = 16384
CP_MIN_TOKENS = 1024


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for: the model shape, batch geometry and what the user pinned."""

    model: object  # a ModelConfig or LlamaArgs
    global_batch_size: int
    seq_len: int
    compute_bytes: int = 2  # bf16
    fixed: dict[str, int | str | bool] = field(default_factory=dict)  # e.g. {"tp": 2}
    kernels: str = "auto"  # model.kernels: the Triton kernels keep fewer activations
    compiled: bool = False  # model.compile: what auto picks against (spec/kernel_choice.py)
    document_mask: bool = False  # data.document_mask: attention inside each document
    float8: str = "none"  # training.float8: its linears are not built beside tensor parallel

    @property
    def workload(self) -> Workload:
        """What every candidate must split, as the spec's rules see it."""
        return Workload(self.model, self.global_batch_size, self.seq_len, self.document_mask,
                        self.float8)


@dataclass(frozen=True)
class Rejection:
    candidate: Candidate | None
    # "memory: ...", "divisibility: ...", "topology: ...", "tied embeddings: ..."; or what
    # makes it when first read (a memory rejection's exact bytes: ``reason``)
    why: str | Callable[[], str]
    at_least: float = 0.0  # a memory rejection's bytes on the rank that exceeded (a bound)

    @property
    def reason(self) -> str:
        if not isinstance(self.why, str):
            object.__setattr__(self, "why", self.why())
        return self.why


def _rule_rejection(problem: Problem) -> Rejection:
    """A candidate that breaks one of the mesh rules (``spec/mesh_rules.py``), with its message."""
    return Rejection(None, f"{problem.kind}: {problem}")


# A pipeline degree that does not divide the blocks is considered when its fullest stage holds
# at most this much more than the mean (DeepSeek-V3's 61 blocks over 16 stages: 4 against 3.8)
UNEVEN_STAGES_MAX = 1.15


@functools.lru_cache(maxsize=256)
def _pipeline_degrees(n_layers: int) -> tuple[int, ...]:
    """The pipeline degrees considered: those dividing the blocks, and the powers of two up to
    them whose uneven stages (``model_math.stage_split``) are near even (``UNEVEN_STAGES_MAX``)."""
    uneven = {1 << k for k in range(n_layers.bit_length())
              if max(stage_split(n_layers, 1 << k)) <= UNEVEN_STAGES_MAX * n_layers / (1 << k)}
    return tuple(sorted({*divisors(n_layers), *uneven}))


def _cp_choices(req: PlanRequest, long: bool) -> list[int]:
    """The pinned cp, or 1 and (for a long sequence, ``long``) every power of two that cuts
    it into 2·cp chunks of at least CP_MIN_TOKENS / 2 tokens."""
    if "cp" in req.fixed:
        return [int(req.fixed["cp"])]
    if not long:
        return [1]
    return [c for c in CP_CHOICES if c == 1 or (req.seq_len % (2 * c) == 0
                                                 and req.seq_len // c >= CP_MIN_TOKENS)]


class Layout(NamedTuple):
    """A candidate layout (degrees, schedule, microbatching): the accelerators it uses, and its
    candidates (recomputation, ZeRO-3 policy, hybrid sharding, ep, cp mode) made on asking."""

    world_size: int
    options: Callable[[], Iterator[Candidate]]


def candidates(req: PlanRequest, topo: Topology,
               long: bool | None = None) -> Iterator[Layout | Rejection]:
    """Every (tp, pp, dp, vpp, schedule, microbatch size) that fits the cluster (a ``Layout``:
    its recomputation, ZeRO-3 and sharding options made when it is priced), yielding a
    Rejection (with its reason) for the structurally impossible ones.

    A plan need not use every accelerator: tp divides the accelerators of the largest node
    and TP groups stay whole inside nodes (``Topology.usable``), and tp × pp × dp may be
    less than what is usable (whole tp × pp replicas, at most one per microbatch of the
    global batch, which is always kept), so the rest stay idle (spares). ``long``: weigh
    context parallel (default: for sequences of LONG_CONTEXT tokens or more)."""
    m, fixed = req.model, req.fixed
    cps = _cp_choices(req, req.seq_len >= LONG_CONTEXT if long is None else long)
    largest = topo.largest_node
    tps = [int(fixed["tp"])] if "tp" in fixed else divisors(largest)
    for tp in tps:
        if largest % tp:
            yield Rejection(None, f"topology: tp={tp} does not divide the {largest} "
                                  "accelerators of a node (TP groups stay whole inside a node)")
            continue
        broken = [*tp_problems(m, tp), *runnable_problems(m, tp, 1)]
        if broken:
            yield _rule_rejection(broken[0])
            continue
        usable = topo.usable(tp).world_size
        pps = [int(fixed["pp"])] if "pp" in fixed else _pipeline_degrees(m.n_layers)
        if req.document_mask and "pp" not in fixed:  # documents need the tokens
            pps = [1]
        for pp in pps:
            broken = runnable_problems(m, 1, pp)
            if broken:
                yield _rule_rejection(broken[0])
                continue
            for cp in cps:
                if tp * pp * cp > usable:
                    yield Rejection(None, f"topology: tp×pp×cp = {tp}×{pp}×{cp} exceeds the "
                                          f"{usable} accelerators usable in whole TP groups of {tp}")
                    continue
                split = (bool(fixed.get("sequence_parallel", tp > 1))
                         or getattr(m, "moe", None) is not None)  # a rank's part split over tp
                broken = cp_problems(req.seq_len, cp, tp, int(fixed.get("ep", 1)), pp, split)
                if broken:
                    yield _rule_rejection(broken[0])
                    continue
                yield from _inner(req, tp, pp, usable // (tp * pp * cp), largest, cp)


def _dp_choices(req: PlanRequest, pp: int, mbs: int, max_dp: int) -> list[int | Rejection]:
    """``_dp_options``, kept for the search (many layouts share pp, microbatch size and the
    replicas the cluster holds)."""
    return memo("dp_choices", req.model, (req.global_batch_size, mbs, max_dp, pp,
                                          req.fixed.get("dp")),
                lambda: list(_dp_options(req, pp, mbs, max_dp)))


def _dp_options(req: PlanRequest, pp: int, mbs: int, max_dp: int) -> Iterator[int | Rejection]:
    """The data-parallel degrees whose microbatches fill the pipeline, at most ``max_dp`` (the
    replicas the usable accelerators hold) and at most the global batch's microbatches. Any dp
    runs (shares differ by one microbatch at most, the shorter ones padded: see
    ``microbatches_per_replica``); the divisors of
    the microbatch count are offered, and the largest dp that fits besides, so that a plan
    can use every replica the cluster holds — but not one where fewer replicas would run as
    many microbatches each (its extra replicas would only run padding)."""
    B, fixed = req.global_batch_size, req.fixed
    if B % mbs:
        return
    micro = B // mbs

    def problem(dp: int) -> str | None:
        if dp_fits(B, mbs, dp, pp):
            return None
        broken = dp_problems(B, mbs, dp, pp)[0]
        return f"{broken.kind}: {broken}"

    def wasted(dp: int) -> bool:
        """Fewer replicas would run as many microbatches each: the extra ones only pad."""
        return -(-micro // microbatches_per_replica(B, mbs, dp)) < dp

    if "dp" in fixed:
        dp = int(fixed["dp"])
        if dp > max_dp:
            yield Rejection(None, f"topology: dp={dp} needs more than the {max_dp} replicas of "
                                  f"tp×pp the usable accelerators hold")
            return
        why = problem(dp)
        yield dp if why is None else Rejection(None, why)
        return
    top = min(max_dp, micro)
    fits = lambda d: dp_fits(B, mbs, d, pp) and not wasted(d)  # noqa: E731
    largest = next((d for d in range(top, 0, -1) if fits(d)), None)
    dps = sorted({d for d in divisors(micro) if d <= top and fits(d)}
                 | ({largest} if largest else set()))
    if not dps:
        yield Rejection(None, f"divisibility: no dp ≤ {max_dp} splits the global batch {B} into "
                              f"microbatches of {mbs} that fill {pp} pipeline stage(s)")
    yield from dps


def _inner(req: PlanRequest, tp: int, pp: int, max_dp: int,
           per_node: int, cp: int = 1) -> Iterator[Layout | Rejection]:
    m, fixed, B = req.model, req.fixed, req.global_batch_size
    for vpp in VPP_CHOICES:
        if ("vpp" in fixed and vpp != fixed["vpp"]) or (pp == 1 and vpp > 1):
            continue
        broken = pp_problems(m, pp, vpp)
        if broken:
            yield _rule_rejection(broken[0])
            continue
        broken = stage_layers_problems(fixed.get("stage_layers"), pp, vpp)
        if broken:
            yield _rule_rejection(broken[0])
            continue
        # The zero-bubble schedules are considered when named (schedule.name), not on their own.
        schedules = ("1f1b",) if pp == 1 else (
            ("interleaved-1f1b", "zbv", "dualpipev") if vpp == 2 else ("interleaved-1f1b",) if vpp > 1
            else ("gpipe", "1f1b", "zb-h1"))
        schedules = tuple(s for s in schedules if not splits_backward(s) or fixed.get("schedule") == s)
        for schedule in schedules:
            if "schedule" in fixed and pp > 1 and schedule != fixed["schedule"]:
                continue
            for mbs in MICROBATCH_SIZES:
                if "microbatch_size" in fixed and mbs != fixed["microbatch_size"]:
                    continue
                for dp in _dp_choices(req, pp, mbs, max_dp):
                    if isinstance(dp, Rejection):
                        yield dp
                        continue
                    n_micro = microbatches_per_replica(B, mbs, dp)
                    yield Layout(tp * pp * dp * cp, functools.partial(
                        _options, req, tp, pp, dp, vpp, schedule, mbs, n_micro,
                        n_micro * dp - B // mbs, per_node, cp))


def _replicate_choices(req: PlanRequest, tp: int, dp: int, ep: int, per_node: int,
                       pp: int = 1, cp: int = 1) -> list[int]:
    """Hybrid sharding's replica groups for ``dp``: the pinned ``dp_replicate`` (on a re-plan
    the largest that divides the new dp up to it), else plain
    ZeRO-3 (1); once a shard group over all of dp would span more than 8 nodes, shard
    groups of one node or of 8 nodes (whole nodes of the largest size: consecutive replicas
    share them; on mixed node sizes a group may straddle nodes) of at least 2 replicas; and,
    for a dense model without tp, pp or cp, groups of one replica (dp: DDP, every rank holding
    the whole state, the fastest data parallel where that fits). Beside expert parallel a
    shard group holds whole EP groups (of ep / cp replicas)."""
    if "dp_replicate" in req.fixed:
        return [int(req.fixed["dp_replicate"])]

    def whole_ep_groups(r: int) -> bool:  # the spec's rule: shard groups of whole EP groups
        return ep == 1 or not hsdp_problems(dp, r, ep, cp)

    if "max_dp_replicate" in req.fixed:  # a re-plan of a pinned layout
        top = int(req.fixed["max_dp_replicate"])
        return [max(r for r in range(1, top + 1) if dp % r == 0 and whole_ep_groups(r))]
    out = [1]
    ranks = tp * cp  # of one replica in a stage: a shard group spans dp_shard of them
    if dp * ranks > 8 * per_node:
        for nodes in (1, 8):
            shard = nodes * per_node // ranks
            if (shard > 1 and nodes * per_node % ranks == 0 and dp % shard == 0 and shard < dp
                    and whole_ep_groups(dp // shard)):
                out.append(dp // shard)
    if replicates(dp, dp, pp, tp, cp, has_moe_blocks(req.model)):
        out.append(dp)
    return out


def _options(req: PlanRequest, tp: int, pp: int, dp: int, vpp: int, schedule: str, mbs: int,
             n_micro: int, padding: int = 0, per_node: int = 8,
             cp: int = 1) -> Iterator[Candidate]:
    """Recomputation, ZeRO-3 policy, hybrid sharding and context-parallel mode for one layout."""
    fixed = req.fixed
    sp = bool(fixed.get("sequence_parallel", tp > 1))
    keeps = (True, False)  # FSDP2 gathers a copy even at dp = 1
    if splits_backward(schedule):  # a split backward's W needs the forward's parameters
        keeps = (True,)
    elif "keep_gathered" in fixed:
        keeps = (bool(fixed["keep_gathered"]),)
    reduce = str(fixed.get("reduce_dtype", "float32"))
    stride = int(fixed.get("recompute_stride", 2))
    split = _stage_layers(req, pp, vpp, schedule)
    moe = has_moe_blocks(req.model)
    overlap = bool(fixed.get("ep_overlap", False))  # (priced, not chosen: explain says)
    latent = bool(fixed.get("cp_latent", True)) and req.float8 == "none"  # (float8: expanded)
    modes = ("ring",) if cp == 1 else (str(fixed["cp_mode"]),) if "cp_mode" in fixed else CP_MODES
    for ep in _ep_choices(req, dp, cp):
        for rc in RECOMPUTE:
            if "recompute" in fixed and rc != fixed["recompute"]:
                continue
            for keep in keeps:
                for rep in _replicate_choices(req, tp, dp, ep, per_node, pp, cp):
                    if keep != keeps[0] and replicates(dp, rep, pp, tp, cp, moe):
                        continue  # (DDP gathers nothing: one candidate, not one per policy)
                    for mode in modes:
                        yield Candidate(tp, pp, dp, vpp, schedule, mbs, n_micro, rc, sp, keep,
                                        reduce, ep, padding, rep, cp, mode, stride, split,
                                        overlap if ep > 1 else False, latent,
                                        str(fixed.get("ep_dispatch", "auto")),
                                        fixed.get("ep_node_ranks"),
                                        bool(fixed.get("pair_overlap", True)))


def _stage_layers(req: PlanRequest, pp: int, vpp: int, schedule: str) -> tuple[int, ...] | None:
    """The blocks of each pipeline stage: as pinned (``parallelism.stage_layers``); where the
    planner chooses the pipeline (``pp`` not pinned), split by their cost
    (``model_math.cost_split``: the head and multi-token modules weigh on the last stage)
    where that differs from the even split (None: the even split; zbv's V takes even
    splits only)."""
    if "stage_layers" in req.fixed:
        return tuple(req.fixed["stage_layers"]) if pp > 1 else None
    if pp == 1 or "pp" in req.fixed or v_shaped(schedule):
        return None
    k = pp * vpp
    split = memo("cost_split", req.model, (req.seq_len, k),
                 lambda: cost_split(req.model, req.seq_len, k))
    return None if split == tuple(stage_split(req.model.n_layers, k)) else split


def _ep_choices(req: PlanRequest, dp: int, cp: int = 1) -> list[int]:
    """Expert-parallel degrees for ``dp`` replicas (and their ``cp`` context-parallel ranks):
    the pinned one (``fixed["ep"]``, checked by the spec), the largest up to
    ``fixed["max_ep"]`` (a re-plan keeps the user's ep where it still divides), or every one
    that divides dp × cp and the experts (a multiple of cp: whole rings)."""
    fixed = req.fixed
    if getattr(req.model, "moe", None) is None:
        return [1]
    if "ep" in fixed:
        return [int(fixed["ep"])]
    valid = [e for e in ep_degrees(req.model, dp * cp) if e == 1 or e % cp == 0]
    if "max_ep" in fixed:
        return [max(e for e in valid if e <= int(fixed["max_ep"]))]
    return valid[::-1]  # largest first: where it does not fit, no smaller ep ≥ 2 does (_plan)
