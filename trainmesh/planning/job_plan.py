"""Turn a job spec and a topology into the parallel degrees a run uses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainmesh.parallel.dims import ParallelDims
from trainmesh.planning.candidate import GIB, Candidate
from trainmesh.planning.memory_model import snapshot_host_bytes
from trainmesh.planning.planner import PlanRequest, PlanResult, plan, summarize_rejections
from trainmesh.planning.topology import Topology
from trainmesh.spec.job import JobSpec


class PlanError(ValueError):
    pass


def request_for(spec: JobSpec) -> PlanRequest:
    par, tr = spec.parallelism, spec.training
    fixed: dict[str, int | str | bool] = {}
    if not par.auto:
        fixed.update(tp=par.tp, pp=par.pp, dp=par.dp, vpp=par.vpp, ep=par.ep, cp=par.cp,
                     cp_mode=par.cp_mode,
                     dp_replicate=par.dp_replicate,
                     microbatch_size=tr.microbatch_size, schedule=spec.schedule.name,
                     sequence_parallel=par.sequence_parallel,
                     recompute=spec.activation_checkpoint.mode,
                     recompute_stride=spec.activation_checkpoint.stride)
    if par.keep_gathered is not None:
        fixed["keep_gathered"] = par.keep_gathered
    fixed["ep_overlap"] = par.ep_overlap
    fixed["ep_dispatch"] = par.ep_dispatch
    fixed["pair_overlap"] = spec.schedule.pair_overlap
    if par.ep_node_ranks is not None:
        fixed["ep_node_ranks"] = par.ep_node_ranks
    fixed["cp_latent"] = par.cp_latent
    if par.stage_layers is not None:
        fixed["stage_layers"] = tuple(par.stage_layers)
    fixed["reduce_dtype"] = par.reduce_dtype
    compute_bytes = 2 if tr.dtype == "bfloat16" else 4
    return PlanRequest(spec.model, tr.global_batch_size, tr.seq_len, compute_bytes, fixed,
                       spec.model.kernels, spec.model.compile, spec.data.document_mask, tr.float8)


def plan_job(spec: JobSpec, topo: Topology) -> tuple[ParallelDims, PlanResult]:
    """Explicit degrees are checked against the cluster; ``auto`` takes the planner's best.
    Either may leave accelerators idle (``RankedPlan.idle``)."""
    par = spec.parallelism
    if not par.auto and par.world_size > topo.world_size:
        raise PlanError(f"parallelism: tp×pp×dp×cp = {par.world_size} ranks but the cluster has "
                        f"{topo.world_size} accelerators; lower the degrees or add nodes")
    result = plan(request_for(spec), topo)
    if not result.plans:
        raise PlanError("parallelism: no feasible plan on this cluster: "
                        + summarize_rejections(result.rejected)
                        + "; lower the degrees, shorten the sequence or add accelerators")
    best = result.best.candidate
    return ParallelDims(pp=best.pp, dp=best.dp, tp=best.tp, ep=best.ep, cp=best.cp), result


def effective_spec(spec: JobSpec, c: Candidate, relay: bool | None = None) -> JobSpec:
    """The spec with the plan's choices written in: what the ranks build and run. ``relay``:
    the plan's ``Estimate.ep_relay``; where it is False, ``ep_dispatch: auto`` becomes
    direct (the relay would not pay, or cannot run). Where it is True auto stays: the ranks
    relay where their real nodes allow it (``mesh_rules.relays``), which the planner assumed
    (consecutive ranks on nodes of its topology's size), else run direct."""
    dispatch = spec.parallelism.ep_dispatch
    if dispatch == "auto" and relay is False:
        dispatch = "direct"
    par = spec.parallelism.model_copy(update={
        "auto": False, "tp": c.tp, "pp": c.pp, "dp": c.dp, "vpp": c.vpp,
        "ep": c.ep, "dp_replicate": c.dp_replicate, "cp": c.cp, "cp_mode": c.cp_mode,
        "sequence_parallel": c.sequence_parallel and c.tp > 1,
        "keep_gathered": c.keep_gathered, "reduce_dtype": c.reduce_dtype,
        "ep_overlap": c.ep_overlap and c.ep > 1, "cp_latent": c.cp_latent,
        "ep_dispatch": dispatch,
        "stage_layers": list(c.stage_layers) if c.stage_layers else None})
    update = {"parallelism": par,
              "schedule": spec.schedule.model_copy(update={"name": c.schedule}),
              "training": spec.training.model_copy(update={"microbatch_size": c.microbatch_size})}
    if spec.parallelism.auto:  # the planner chose recomputation too
        update["activation_checkpoint"] = spec.activation_checkpoint.model_copy(
            update={"mode": c.recompute, "stride": c.recompute_stride})
    return spec.model_copy(update=update)


@dataclass(frozen=True)
class Replan:
    """A re-plan after a failure or resize: the new degrees, the plans, the effective spec,
    and what changed beyond dp (None when the pinned degrees were kept)."""

    dims: ParallelDims
    result: PlanResult
    spec: JobSpec
    changed: str | None = None


def replan_job(spec: JobSpec, topo: Topology) -> Replan:
    """After a failure or resize, with the same global batch and microbatch size (gradient
    accumulation absorbs the dp change). Degrees the user pinned (tp, pp, vpp, schedule,
    recompute) are kept and only dp changes when they still fit; otherwise any degrees that
    fit, and ``changed`` says what changed and why. A plan below ``elastic.min_world_size``
    is refused."""
    par = spec.parallelism
    req = request_for(spec)
    req.fixed["microbatch_size"] = spec.training.microbatch_size
    changed, result = None, None
    if not par.auto:
        req.fixed.pop("dp")
        req.fixed["max_ep"] = req.fixed.pop("ep")  # kept where it still divides the new dp
        # part of dp: kept where it still divides the new dp, else the largest below it that does
        req.fixed["max_dp_replicate"] = req.fixed.pop("dp_replicate")
        result = plan(req, topo)
        if not result.plans:
            changed = (f"the pinned tp={par.tp}, pp={par.pp}, cp={par.cp}, vpp={par.vpp} no longer fit the "
                       f"{topo.world_size} accelerators left ("
                       f"{summarize_rejections(result.rejected)})")
    if result is None or not result.plans:
        # (a pinned pipeline dropped takes its pinned split: the planner splits its own)
        auto = spec.model_copy(update={"parallelism": par.model_copy(
            update={"auto": True, **({} if par.auto else {"stage_layers": None})})})
        req = request_for(auto)
        req.fixed["microbatch_size"] = spec.training.microbatch_size
        if not par.auto:  # a pinned ep (and dp_replicate) stays an upper bound
            req.fixed["max_ep"] = par.ep
            req.fixed["max_dp_replicate"] = par.dp_replicate
        result = plan(req, topo)
    if not result.plans:
        raise PlanError("parallelism: no feasible plan on the accelerators left: "
                        + summarize_rejections(result.rejected))
    best = result.best
    c = best.candidate
    floor = spec.elastic.min_world_size
    if c.world_size < floor:
        raise PlanError(f"elastic.min_world_size: the best plan on the {topo.world_size} "
                        f"accelerators left uses {c.world_size} (tp={c.tp} × pp={c.pp} × "
                        f"dp={c.dp}), below elastic.min_world_size="
                        f"{floor}; lower elastic.min_world_size or add nodes")
    if changed:
        changed += f"; re-planned to tp={c.tp}, pp={c.pp}, cp={c.cp}, vpp={c.vpp}, dp={c.dp}"
    dims = ParallelDims(pp=c.pp, dp=c.dp, tp=c.tp, ep=c.ep, cp=c.cp)
    return Replan(dims, result, effective_spec(spec, c, best.estimate.ep_relay), changed)


def plan_for(spec: JobSpec, topo: Topology, replan: bool) -> Replan:
    """The plan a run uses on ``topo``: a job's first plan (pinned degrees checked as given;
    ``auto``: the planner's best for the batch) or, with ``replan``, ``replan_job``'s."""
    if replan or spec.parallelism.auto:
        new = replan_job(spec, topo)
        fits = [] if snapshot_problem(spec, new.result.best.candidate, topo) is None else [
            p for p in new.result.plans if snapshot_problem(spec, p.candidate, topo) is None]
        if not fits and new.result.unpriced and snapshot_problem(
                spec, new.result.best.candidate, topo) is not None:
            # none weighed fits: those leaving more accelerators idle too (usually no lighter
            # on a node, their ranks' shards larger by as much as they are fewer: not always)
            new = dataclasses.replace(new, result=plan(new.result.request, topo, every=True))
            fits = [p for p in new.result.plans if snapshot_problem(spec, p.candidate, topo) is None]
        if fits:  # the fastest plan whose snapshots fit (a DDP rank's hold the whole state:
            # dp times a ZeRO-3 rank's)
            head = new.result.first_priced(fits)  # (priced stage by stage, as the first are)
            c = head.candidate
            rest = [p for p in new.result.plans if p.candidate != c]
            result = dataclasses.replace(new.result, plans=[head, *(p for p in rest if p in fits),
                                                            *(p for p in rest if p not in fits)])
            new = Replan(ParallelDims(pp=c.pp, dp=c.dp, tp=c.tp, ep=c.ep, cp=c.cp), result,
                         effective_spec(spec, c, head.estimate.ep_relay), new.changed)
    else:
        dims, result = plan_job(spec, topo)
        new = Replan(dims, result, effective_spec(spec, result.best.candidate,
                                                  result.best.estimate.ep_relay))
    check_snapshot_memory(spec, new.result.best.candidate, topo)
    return new


def check_snapshot_memory(spec: JobSpec, c: Candidate, topo: Topology) -> None:
    """``checkpoint.in_memory``: a node's ranks' snapshots and their buddies' copies must fit
    in its host memory (known from Ray or ``topology.host_memory_gib``)."""
    problem = snapshot_problem(spec, c, topo)
    if problem is not None:
        raise PlanError(problem)


def snapshot_problem(spec: JobSpec, c: Candidate, topo: Topology) -> str | None:
    """Why ``c``'s in-memory snapshots do not fit a node's host memory, or None."""
    host = topo.host_memory_gib
    if not spec.checkpoint.in_memory.every or host is None:
        return None
    per_rank = snapshot_host_bytes(spec.model, c)
    ranks = max(topo.allocate(c.tp, c.world_size))
    need = per_rank * ranks
    if need > host * GIB:
        return (f"checkpoint.in_memory: snapshots need {need / GIB:.1f} GiB of host memory per "
                f"node ({per_rank / GIB:.2f} GiB per rank at its peak: its own two snapshots and "
                f"one being written, a buddy's two and one arriving, and the host copy, × {ranks} "
                f"ranks) but a node has {host:.1f} GiB; set checkpoint.in_memory.every=0, "
                "or spread the model over more ranks (parallelism.dp, pp)")
    return None
