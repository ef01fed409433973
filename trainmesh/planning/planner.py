"""The mesh planner: the candidate plans (``search_space``) priced a tier of idle accelerators
at a time, infeasible ones rejected with a reason, the rest ranked by predicted throughput
(``cost_model`` for the time, ``memory_model`` for a rank's memory). No torch, no ray."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trainmesh.planning.candidate import GIB, SCHEDULES, Candidate
from trainmesh.planning.cost_model import Estimate, estimate
from trainmesh.planning.devices import DeviceSpec
from trainmesh.planning.memory_model import memory_bytes, memory_over, uses_fused_kernels
from trainmesh.planning.search_space import (
    LONG_CONTEXT,
    Layout,
    PlanRequest,
    Rejection,
    candidates,
)
from trainmesh.planning.stage_params import memoized
from trainmesh.planning.topology import Topology
from trainmesh.spec.mesh_rules import consecutive_nodes, float8_device_problems, uneven_ep_nodes
from trainmesh.spec.validate import layout_problems

MEMORY_HEADROOM = 0.9  # plan within this fraction of device memory
# A search prices layouts a tier of idle accelerators at a time (fewest first) until it holds
# this many feasible plans: a plan's table (``trainmesh plan --top``'s default) and what
# ``explain`` compares the choice with are among them
PLANS_WEIGHED = 10


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
                "ep_dispatch": ("relay" if e.ep_relay else "direct") if c.ep > 1 else None,
                "dp_replicate": c.dp_replicate, "cp": c.cp, "cp_mode": c.cp_mode,
                "memory_per_rank_gib": round(e.memory_per_rank_gib, 3),
                "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s,
                "tflops_per_gpu": e.tflops_per_gpu, "mfu": e.mfu,
                "bubble_fraction": e.bubble_fraction}


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
        if c.ep > 1 and c.ep_dispatch == "relay":  # (the ranks' nodes as allocated)
            nodes = (consecutive_nodes(c.world_size, c.ep_node_ranks) if c.ep_node_ranks
                     else [b for b, n in enumerate(node_ranks) for _ in range(n)])
            held = uneven_ep_nodes(c.pp, c.dp, c.cp, c.tp, c.ep, nodes)
            if held is not None:
                rejected.append(Rejection(c, f"topology: parallelism.ep_dispatch=relay needs "
                                             f"each node to hold as many ranks of an EP group; "
                                             f"at ep={c.ep} one group's nodes hold {held}"))
                return
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
            c.dp_replicate, c.cp, c.cp_mode, c.recompute_stride, c.cp_latent)


__all__ = ["PlanRequest", "PlanResult", "RankedPlan", "Rejection", "plan", "SCHEDULES"]


def gib_apart(a: float, b: float) -> tuple[str, str]:
    """Bytes ``a`` and ``b`` as GiB with one decimal, or as many more (up to 4) as it takes for
    two different sizes not to print alike ("72.0 GiB exceeds 72.0 GiB")."""
    for digits in range(1, 5):
        x, y = f"{a / 1024**3:.{digits}f}", f"{b / 1024**3:.{digits}f}"
        if x != y:
            break
    return x, y
