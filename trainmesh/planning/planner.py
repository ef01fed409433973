"""The mesh planner: enumerate candidate plans, reject infeasible ones with a reason, rank the
rest by predicted throughput (``cost_model`` for the time, ``memory_model`` for a rank's
memory). No torch, no ray."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from trainmesh.models.llama.model_math import cost_split, stage_split
from trainmesh.parallel.dims import replicates
from trainmesh.parallel.pipeline.ir import splits_backward, v_shaped
from trainmesh.planning.candidate import GIB, RECOMPUTE, SCHEDULES, Candidate, has_moe_blocks
from trainmesh.planning.cost_model import Estimate, estimate
from trainmesh.planning.devices import DeviceSpec
from trainmesh.planning.memory_model import memory_bytes, memory_over, uses_fused_kernels
from trainmesh.planning.stage_params import memo, memoized
from trainmesh.planning.topology import Topology
from trainmesh.spec.mesh_rules import (
    cp_problems,
    divisors,
    dp_fits,
    dp_problems,
    ep_degrees,
    float8_device_problems,
    hsdp_problems,
    microbatches_per_replica,
    pp_problems,
    runnable_problems,
    stage_layers_problems,
    tp_problems,
)
from trainmesh.spec.problems import Problem
from trainmesh.spec.validate import Workload, layout_problems

MEMORY_HEADROOM = 0.9  # plan within this fraction of device memory
# A search prices layouts a tier of idle accelerators at a time (fewest first) until it holds
# this many feasible plans: a plan's table (``trainmesh plan --top``'s default) and what
# ``explain`` compares the choice with are among them
PLANS_WEIGHED = 10
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
class RankedPlan:
    candidate: Candidate
    estimate: Estimate
    idle: int = 0  # accelerators of the cluster this plan leaves unused (spares)
    node_ranks: tuple[int, ...] = ()  # ranks on each node used (Topology.allocate)

    def as_row(self) -> dict[str, object]:
        c, e = self.candidate, self.estimate
        return {"tp": c.tp, "pp": c.pp, "dp": c.dp, "world_size": c.world_size,
                "idle": self.idle, "vpp": c.vpp, "schedule": c.schedule,
                "microbatch_size": c.microbatch_size, "num_microbatches": c.num_microbatches,
                "recompute": c.recompute, "keep_gathered": c.keep_gathered,
                "reduce_dtype": c.reduce_dtype, "sequence_parallel": c.sequence_parallel,
                "ep": c.ep, "ep_overlap": c.ep_overlap and c.ep > 1,
                "dp_replicate": c.dp_replicate, "cp": c.cp, "cp_mode": c.cp_mode,
                "memory_per_rank_gib": round(e.memory_per_rank_gib, 3),
                "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s,
                "tflops_per_gpu": e.tflops_per_gpu, "mfu": e.mfu,
                "bubble_fraction": e.bubble_fraction}


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


@dataclass(frozen=True)
class PlanResult:
    plans: list[RankedPlan]  # best first
    rejected: list[Rejection]
    model: Any = None  # the model config planned for
    device: DeviceSpec | None = None  # the accelerator planned for
    # A plan priced stage by stage (``_by_stage``), for those the search left at its bound
    price: Callable[[RankedPlan], RankedPlan] | None = field(default=None, repr=False)
    request: PlanRequest | None = field(default=None, repr=False)  # what was planned for
    # Layouts not priced: each leaves more accelerators idle than a feasible plan does (the
    # search's order puts their plans after every such plan: ``plan``'s ``every`` prices them)
    unpriced: int = 0

    def priced(self, p: RankedPlan) -> RankedPlan:
        """``p`` with its stages each priced at its own cost (as the first plans are)."""
        return p if p.estimate.by_stage or self.price is None else self.price(p)

    def first_priced(self, plans: list[RankedPlan]) -> RankedPlan:
        """The first of ``plans`` (in the search's order) once each is priced stage by stage."""
        return _by_stage(plans, self.priced, 1)[0]

    def first(self, n: int) -> list[RankedPlan]:
        """The first ``n`` plans, each priced stage by stage, in the order pricing every plan
        so would give (the search prices its first PRICED_FIRST so; more on asking)."""
        if n > PRICED_FIRST and self.price is not None:
            return _by_stage(self.plans, self.priced, n)[:n]
        return self.plans[:n]

    @property
    def best(self) -> RankedPlan:
        if not self.plans:
            raise ValueError("no feasible plan: " + summarize_rejections(self.rejected))
        return self.plans[0]


def summarize_rejections(rejected: list[Rejection]) -> str:
    """Counts per kind, and the example that came closest for memory."""
    if not rejected:
        return ("no candidate plan matches the pinned settings together (degrees, vpp, schedule, "
                "microbatch size, recompute)")
    kinds: dict[str, int] = {}
    for r in rejected:
        kind = r.reason.split(":")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    text = ", ".join(f"{n} rejected for {k}" for k, n in sorted(kinds.items()))
    mem = [r for r in rejected if r.reason.startswith("memory")]
    if mem:
        closest = _closest_for_memory(mem)
        c = closest.candidate
        text += (f"; closest for memory: tp={c.tp} pp={c.pp} dp={c.dp} recompute={c.recompute} "
                 f"— {closest.reason}")
    elif rejected:
        text += f"; e.g. {rejected[0].reason}"
    return text


def _closest_for_memory(rejected: list[Rejection]) -> Rejection:
    """The memory rejection whose heaviest rank holds least: those rejected at a bound
    (``at_least``) made exact only while the bound could still beat the best so far."""
    def exact(r: Rejection) -> float:
        return float(r.reason.split()[1])
    best, best_gib = None, float("inf")
    for r in sorted(rejected, key=lambda r: r.at_least):
        if r.at_least / GIB >= best_gib:
            break
        if exact(r) < best_gib:
            best, best_gib = r, exact(r)
    return best


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
                                        overlap if ep > 1 else False)


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


def plan(req: PlanRequest, topo: Topology, every: bool = False) -> PlanResult:
    """The feasible plans that leave the fewest accelerators idle, best first (then by
    predicted tokens/s), and every rejection among the candidates priced; those leaving more
    idle are counted unpriced (``every``: all feasible plans, whatever they leave idle, and
    all rejections). A sequence shorter than LONG_CONTEXT is planned with context parallel
    only when nothing fits without it."""
    with memoized(), _no_cycle_collection():
        result = _plan(req, topo, None, every)
        if not result.plans and "cp" not in req.fixed and req.seq_len < LONG_CONTEXT:
            again = _plan(req, topo, True, every)
            if again.plans:
                return again
        return result


def float8_refusal(float8: str, device: DeviceSpec, compiled: bool) -> str | None:
    """Why ``training.float8`` cannot run on ``device``, naming the fix (None: it can): a GPU
    without float8 matmuls, or float8 without ``model.compile`` on a GPU
    (``mesh_rules.float8_device_problems``, the ranks' own check)."""
    gpu = device.name != "cpu"
    if float8 != "none" and gpu and not device.float8_tflops:
        return (f"training.float8={float8} needs float8 matmuls, which the {device.name} has "
                "not (H100, H200, L40S, B200 have): set training.float8=none")
    broken = float8_device_problems(float8, "cuda" if gpu else "cpu", None, compiled)
    return broken[0] if broken else None


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector paused for a search's length: a search makes ~10^5 short-lived
    objects (candidates, rejections) and no cycles, and the collector's passes over them took
    a fifth of a 16,384-GPU plan's time (measured). Resumed after, if it ran before."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan(req: PlanRequest, topo: Topology, long: bool | None, every: bool) -> PlanResult:
    limit = topo.device.memory_gib * MEMORY_HEADROOM * 1024**3
    fused = uses_fused_kernels(req.kernels, topo.device.name, req.compiled)
    ranked, rejected = [], []
    broken = float8_refusal(req.float8, topo.device, req.compiled)
    if broken:  # (the reason the ranks would refuse it with)
        return PlanResult([], [Rejection(None, f"float8: {broken}")], req.model, topo.device,
                          None, req)
    layouts: dict[tuple[int, int], tuple[int, ...]] = {}
    work, checked = req.workload, {}
    # Expert parallel degrees ≥ 2 of one layout come largest first (``_ep_choices``), and a
    # rank's memory does not grow with ep there: the experts' gathered copies shrink with it;
    # their shards (over all of dp) and the activations (planned at the imbalance bound or
    # the capacity, whatever ep) do not change. So once one does not fit, the smaller ones
    # are rejected by its bytes, a bound (``too_big``: the layout without ep → those bytes).
    too_big: dict[tuple, float] = {}  # (_without_ep)
    # The search's order puts fewer accelerators idle before any speed (``_order``): the
    # layouts are priced a tier of idle accelerators at a time, fewest first, and once the
    # tiers priced hold PLANS_WEIGHED feasible plans of two layouts of degrees or more, those
    # leaving more idle
    # are dominated — none could come before them — and are counted, not priced
    # (``PlanResult.unpriced``; ``every``: priced all the same).
    tiers: dict[int, list[Layout]] = {}
    for c in candidates(req, topo, long):
        if isinstance(c, Rejection):
            rejected.append(c)
        else:
            tiers.setdefault(topo.world_size - c.world_size, []).append(c)
    order = sorted(tiers)
    framework = topo.device.framework_gib * 1024**3

    def weigh(c: Candidate) -> None:
        """``c`` ranked, or rejected with its reason."""
        without_ep = _without_ep(c) if c.ep > 1 else None
        if without_ep in too_big:
            need, have = gib_apart(too_big[without_ep], limit)
            rejected.append(Rejection(c, f"memory: {need} GiB per rank or more (as at a larger ep) "
                                         f"exceeds {have} GiB ({MEMORY_HEADROOM:.0%} of "
                                         f"{topo.device.memory_gib:g} GiB {topo.device.name})"))
            return
        # The spec's own rules, so that what is planned can be pinned: once per layout (the
        # candidates of one differ in recomputation, ZeRO-3 policy and cp mode only)
        layout = (c.tp, c.pp, c.dp, c.cp, c.ep, c.vpp, c.dp_replicate, c.schedule,
                  c.sequence_parallel, c.microbatch_size, c.stage_layers)
        if layout not in checked:
            checked[layout] = layout_problems(work, c)
        broken = checked[layout]
        if broken:
            rejected.append(Rejection(c, f"{broken[0].kind or 'spec'}: {broken[0]}"))
            return
        mem, over = memory_over(req.model, c, req.seq_len, req.compute_bytes, framework, fused,
                                limit)
        if over:  # (its heaviest rank's bytes, exact, when the reason is read)
            if without_ep is not None:
                too_big[without_ep] = mem
            rejected.append(Rejection(c, functools.partial(
                _over_memory, req, c, framework, fused, limit, topo.device), at_least=mem))
            return
        key = (c.tp, c.world_size)
        if key not in layouts:
            layouts[key] = topo.allocate(c.tp, c.world_size)
        node_ranks = layouts[key]
        est = estimate(req.model, c, req.seq_len, topo.device, node_ranks[0], req.compute_bytes,
                       fused, mem, by_stage=False, float8=req.float8)
        ranked.append(RankedPlan(c, est, topo.world_size - c.world_size, node_ranks))

    unpriced = 0  # (layouts)
    for n, idle in enumerate(order):
        # (and two layouts of degrees at least: ``explain`` names the best other one)
        if (len(ranked) >= max(1, PLANS_WEIGHED) and not every
                and len({degrees_of(p.candidate) for p in ranked}) >= 2):
            unpriced = sum(len(tiers[i]) for i in order[n:])
            break
        for layout in tiers[idle]:
            for c in layout.options():
                weigh(c)

    def price(p: RankedPlan) -> RankedPlan:
        return dataclasses.replace(p, estimate=estimate(
            req.model, p.candidate, req.seq_len, topo.device, p.node_ranks[0], req.compute_bytes,
            fused, p.estimate.memory_per_rank_gib * 1024**3, float8=req.float8))
    return PlanResult(_by_stage(ranked, price), rejected, req.model, topo.device, price, req,
                      unpriced)


def _over_memory(req: PlanRequest, c: Candidate, framework: float, fused, limit: float,
                 device: DeviceSpec) -> str:
    with memoized():
        mem = memory_bytes(req.model, c, req.seq_len, req.compute_bytes, framework, fused)
    need, have = gib_apart(mem, limit)
    return (f"memory: {need} GiB per rank exceeds {have} GiB ({MEMORY_HEADROOM:.0%} of "
            f"{device.memory_gib:g} GiB {device.name})")


# The first plans of a search priced stage by stage: the best is then certain (a table's rows
# are priced on asking, ``PlanResult.first``; a re-plan needs the best only). Each play of a
# deep interleaved pipeline with uneven stages takes ~0.1 s here (405B: pp 16 × vpp 4).
PRICED_FIRST = 1


def _order(p: RankedPlan) -> tuple:
    """A search's order: every accelerator that can be used is used (fewest idle first), then
    the fastest: the cost model has no fixed per-step costs, so for small models it would
    otherwise trade accelerators the user gave the job for a prediction it cannot make
    precisely."""
    return (p.idle, -p.estimate.tokens_per_s, p.estimate.memory_per_rank_gib)


def _by_stage(ranked: list[RankedPlan], price: Callable[[RankedPlan], RankedPlan],
              first: int | None = None) -> list[RankedPlan]:
    """``ranked`` in the search's order with its ``first`` (default PRICED_FIRST) plans
    priced stage by stage (``estimate``'s ``by_stage``: each pipeline stage at its own cost,
    the simulator playing the schedule). A search prices every plan it weighs at the least its
    stages allow (``candidate._least_makespan``: no play, a bound the play never beats), so
    plans are priced in that order until the next one's bound is slower than the
    ``first``-th priced: none left at its bound can come before them."""
    first = PRICED_FIRST if first is None else first
    ranked = sorted(ranked, key=_order)
    done: list[tuple] = []
    for i, p in enumerate(ranked if first else []):
        if len(done) >= first and _order(p) > done[first - 1]:
            break
        if not p.estimate.by_stage:
            ranked[i] = p = price(p)
        bisect.insort(done, _order(p))
    return sorted(ranked, key=_order)


def degrees_of(c: Candidate) -> tuple[int, ...]:
    """What makes two plans different layouts to ``explain``: (tp, pp, dp, vpp, cp)."""
    return c.tp, c.pp, c.dp, c.vpp, c.cp


def _without_ep(c: Candidate) -> tuple:
    """Every field of ``c`` but its expert-parallel degree."""
    return (c.tp, c.pp, c.dp, c.vpp, c.schedule, c.microbatch_size, c.num_microbatches,
            c.recompute, c.sequence_parallel, c.keep_gathered, c.reduce_dtype, c.padding,
            c.dp_replicate, c.cp, c.cp_mode, c.recompute_stride)


__all__ = ["PlanRequest", "PlanResult", "RankedPlan", "Rejection", "plan", "SCHEDULES"]


def gib_apart(a: float, b: float) -> tuple[str, str]:
    """Bytes ``a`` and ``b`` as GiB with one decimal, or as many more (up to 4) as it takes for
    two different sizes not to print alike ("72.0 GiB exceeds 72.0 GiB")."""
    for digits in range(1, 5):
        x, y = f"{a / 1024**3:.{digits}f}", f"{b / 1024**3:.{digits}f}"
        if x != y:
            break
    return x, y
