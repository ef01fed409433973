"""What happens after a training step, as data: the controller runs its after-step hooks in the
order of one list (``Controller._after_step_hooks``), each given the step's :class:`AfterStep`;
a hook that returns a :class:`Stop` ends the run loop at this step boundary."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainmesh.controller.states import Stop
from trainmesh.models.llama.model_math import flops_per_token
from trainmesh.parallel.dims import ParallelDims
from trainmesh.spec.job import JobSpec


@dataclass(frozen=True)
class AfterStep:
    """One finished step as the hooks see it."""

    step: int  # steps done, this one included
    last: bool  # the job's last step
    stats: list[dict[str, Any]]  # every rank's (``RankWorker.train_step``)
    seconds: float  # the step's wall time, as the controller saw it
    group: Any  # the worker group
    dims: ParallelDims
    tracker: Any
    # every rank's stats (a segment's last step, a boundary); False: rank 0's alone (a step
    # inside a segment: logged, nothing acted on)
    whole: bool = True


Hook = Callable[[AfterStep], Stop | None]


def step_metrics(spec: JobSpec, peak_tflops: float) -> Callable[[dict[str, Any], float], dict]:
    """What a step logs, from rank 0's stats and the step's seconds: loss, lr, grad norm, speed
    and MFU (``peak_tflops``: the whole mesh's), and the model's auxiliary losses (multi-token
    prediction's ``mtp_loss``). The FLOPs per token are counted once."""
    tr = spec.training
    tokens, flops = tr.global_batch_size * tr.seq_len, flops_per_token(spec.model, tr.seq_len)

    def metrics(stats: dict[str, Any], step_s: float, world: int = 1) -> dict[str, float]:
        tps = tokens / step_s
        return {"loss": stats["loss"], "lr": stats["lr"], "grad_norm": stats["grad_norm"],
                "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world, "step_time_s": step_s,
                "mfu": flops * tps / (peak_tflops * 1e12), **(stats.get("losses") or {})}

    return metrics


# A straggler: a rank whose blocks' forward compute lags the median rank's by more than this
# fraction (and by STRAGGLER_FLOOR_S, so that a tiny step's jitter names nobody). Not the step
# time: in a synchronous step every rank's step ends together, the fast ones waiting inside
# ZeRO-3's collectives — time the host clock cannot tell from compute; a block's own forward
# (timed after its gathers) it can.
STRAGGLER_MARGIN = 0.25
STRAGGLER_FLOOR_S = 0.05
PER_RANK_METRICS = 64  # ranks whose own step breakdown goes to MLflow (aggregates: always)


def breakdown_metrics(stats: list[dict[str, Any]], stages: list[int] | None = None,
                      judge: bool = True) -> tuple[dict[str, float], dict | None]:
    """MLflow metrics of where a step went, from every rank's ``breakdown``: each time's median
    and max over the ranks (``step/compute_s``, ``step/compute_s_max`` …), the highest memory
    peak, the mean GPU utilisation, each rank's own (``rank3/compute_s``) up to
    PER_RANK_METRICS ranks; and, with ``judge``, the straggler: a rank whose forward compute
    lags the median of the ranks doing the same work (its pipeline stage: ``stages[rank]``)
    (``{"rank", "forward_s", "median_forward_s"}``), or None."""
    rows = [r.get("breakdown") for r in stats]
    if not rows or any(r is None for r in rows):
        return {}, None
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for r in rows for k in r):  # a rank may lack one (no NVML)
        vals = sorted(float(r[key]) for r in rows if key in r)
        if key.endswith("_s"):
            out[f"step/{key}"] = statistics.median(vals)
            out[f"step/{key}_max"] = vals[-1]
        elif key.startswith("memory"):
            out[f"memory/{key.removeprefix('memory_')}_max"] = vals[-1]
        else:
            out[f"system/{key}"] = sum(vals) / len(vals)
    if len(rows) <= PER_RANK_METRICS:
        out.update({f"rank{i}/{k}": float(v) for i, r in enumerate(rows) for k, v in r.items()})
    if not judge:
        return out, None
    stages = stages or [0] * len(rows)
    worst = None
    for stage in set(stages):
        ranks = [r for r in range(len(rows)) if stages[r] == stage]
        forward = {r: rows[r]["forward_s"] for r in ranks}
        median = statistics.median(forward.values())
        slowest = max(ranks, key=forward.__getitem__)
        lag = forward[slowest] - median
        if (forward[slowest] > median * (1 + STRAGGLER_MARGIN) and lag > STRAGGLER_FLOOR_S
                and (worst is None or lag > worst[0])):
            worst = (lag, {"rank": slowest, "forward_s": forward[slowest],
                           "median_forward_s": median})
    return out, worst[1] if worst else None


def expert_metrics(stats: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each MoE block's step statistics, merged over the ranks (every pipeline stage reports
    its own blocks; the ranks of a stage agree): ``{block: {load_max_over_mean, aux_loss,
    dropped, bias_norm}}``, with the totals over blocks under ``"all"``."""
    blocks: dict[str, dict[str, float]] = {}
    for rank in stats:
        blocks.update(rank.get("experts") or {})
    if not blocks:
        return {}
    rows = list(blocks.values())
    total = {"load_max_over_mean": max(r["load_max_over_mean"] for r in rows),
             "aux_loss": sum(r["aux_loss"] for r in rows),
             "dropped": sum(r["dropped"] for r in rows),
             "bias_norm": max(r["bias_norm"] for r in rows)}
    return {**dict(sorted(blocks.items(), key=lambda kv: _layer_of(kv[0]))), "all": total}


def flat_expert_metrics(experts: dict[str, dict[str, float]]) -> dict[str, float]:
    """MLflow names: ``moe_<stat>`` for the totals, ``moe/layer<i>/<stat>`` per block."""
    out = {}
    for block, row in experts.items():
        prefix = "moe_" if block == "all" else f"moe/layer{_layer_of(block)}/"
        out.update({prefix + k: float(v) for k, v in row.items()})
    return out


def _layer_of(block: str) -> int:
    """``layers.7.feed_forward`` → 7."""
    parts = block.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1
