"""What failures, recoveries and checkpoints cost on a mesh: this project's measured figures
scaled to a cluster by bytes and bandwidth. No torch, no Ray.

The measured part (``Measured``) comes from ``bench/recovery.py`` (bench/history/journal.md,
2026-11-22: a tiny model, 8 → 4 ranks on a simulated 2-node cluster) and ``bench/planner.py``.
What a development machine cannot measure is an assumption (``Assumptions``), every one a
command-line flag of ``trainmesh goodput``. The scaling, written down:

- state: each rank checkpoints its ZeRO-3 shard of the fp32 parameters and both AdamW moments,
  12 bytes per parameter it owns (its stage's largest rank); a node holds ``ranks per node``
  such shards.
- storage bandwidth of a node: ``min(storage_node_gbps, storage_total_gbps / nodes)`` (a node's
  link, or its share of the storage system's aggregate when every node writes at once). DCP
  wrote at 0.86–1.40× a plain sequential write here, so it is taken to reach that bandwidth.
- synchronous save: blocks training for the node's state / that bandwidth. Background save
  (``checkpoint.async_save``): blocks for the rank's state / ``d2h_gbps`` (the copy to host
  memory), and is durable once written, a synchronous save's time later.
- restore from storage: the measured fixed part (building the model parts, loading a tiny state)
  plus the node's state / the node's bandwidth (every node reads its part at once).
- re-forming the process groups: the measured time on 4 ranks plus ``pg_init_s_per_1k_ranks``
  per thousand ranks (communicator set-up grows with the world).
- detecting a fault, by kind (shares from Llama 3's interruption table, Meta 2024: GPU, HBM and
  software faults end the rank's process; a switch, cable, NIC, power or host fault makes the
  node unreachable; watchdog timeouts and silent corruption show as hangs): a crash is
  reported by Ray at once (measured); an unreachable node when Ray's health check gives up
  (``failure_threshold`` 5 × ``timeout`` 10 s, Ray's defaults); a hang only when the
  collective timeout fires (``runtime.collective_timeout_s``).
- the control plane: the ranks run segments of steps without the controller
  (``Controller._train``); at each boundary — a segment's end — the controller reads every
  rank's answer and starts the next segment, ``boundary_ms_per_rank`` of its time per rank
  while the ranks wait (measured with stand-in ranks: ``bench/control_plane.py``). Segments
  last ``SEGMENT_STEPS`` steps or ``SEGMENT_S`` seconds, longer where the boundary would take
  more than 1% of that, and (up to 2 minutes) until it is at most 0.25 ms a step
  (``cadence.segment_caps``). Amortised over the segment, it is added to
  the step time; a save, called on every rank at a boundary, blocks for one more.
- restart-from-checkpoint (Ray Train v2, TorchTitan under torchrun): the measured Ray Train v2
  restart (new workers, their set-up, a tiny checkpoint load) plus the same communicator and
  storage terms; it needs its whole world back, so without a spare node it waits for the
  replacement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainmesh.planning.cadence import segment_caps
from trainmesh.planning.stage_params import rank_params

STATE_BYTES_PER_PARAM = 12  # fp32 parameter + AdamW exp_avg + exp_avg_sq


@dataclass(frozen=True)
class Measured:
    """bench/recovery.py and bench/planner.py, development machine, 2026-11-22."""

    crash_detect_s: float = 0.03  # a rank's death to the controller seeing the failed step
    decide_s: float = 0.66  # health check of the survivors, first backoff (0.5 s), re-plan
    warm_reform_s: float = 0.64  # survivors leave their process group and join a new one
    cold_reform_s: float = 4.32  # placement group, new actors importing torch, process group
    warm_restore_s: float = 1.76  # build the model parts, DCP load (tiny state)
    cold_restore_s: float = 4.84
    first_step_s: float = 1.46  # the first step on the new mesh (its set-up included)
    restart_s: float = 13.0  # Ray Train v2: failure to restarted workers with the state loaded
    planner_s_16k: float = 2.1  # a plan for 16,384 GPUs (bench/planner.py, 2026-11-26)
    # the controller's time per rank at a segment boundary (bench/control_plane.py, 2026-11-30:
    # 0.45, 0.56 and 0.52 ms at 8, 32 and 128 ranks; the largest count's. 2026-11-29's run of
    # the same bench gave 0.89, 1.40 and 1.73 ms on the same machine, then about half as fast)
    boundary_ms_per_rank: float = 0.52


# Where each term comes from, as ``trainmesh goodput`` prints it: measured (the bench, its
# date, the ranks it ran on) or assumed (a flag of its own).
SOURCES = {
    "crash_detect_s": "measured, 8 ranks (bench/recovery.py, 2026-11-22)",
    "decide_s": "measured, 8 → 4 ranks (bench/recovery.py, 2026-11-22)",
    "warm_reform_s": "measured, 8 → 4 ranks (bench/recovery.py, 2026-11-22); + pg_init_s_per_1k_ranks",
    "cold_reform_s": "measured, 8 → 4 ranks (bench/recovery.py, 2026-11-22); + pg_init_s_per_1k_ranks",
    "warm_restore_s": "measured, tiny state (bench/recovery.py, 2026-11-22); + bytes / bandwidth",
    "cold_restore_s": "measured, tiny state (bench/recovery.py, 2026-11-22)",
    "first_step_s": "measured, 4 ranks (bench/recovery.py, 2026-11-22)",
    "restart_s": "measured, Ray Train v2, 4 workers (bench/recovery.py, 2026-11-22); + pg_init_s_per_1k_ranks",
    "planner_s_16k": "measured, 16,384 GPUs planned (bench/planner.py, 2026-11-26)",
    "boundary_ms_per_rank": "measured, 128 stand-in ranks (bench/control_plane.py, 2026-11-30)",
}


@dataclass(frozen=True)
class Assumptions:
    storage_node_gbps: float = 10.0  # a node's link to checkpoint storage, GB/s
    storage_total_gbps: float = 2000.0  # the storage's aggregate (Llama 3's Tectonic: 2 TB/s)
    d2h_gbps: float = 25.0  # device-to-host copy of a background save (PCIe 5 x16, pinned)
    pg_init_s_per_1k_ranks: float = 5.0
    node_lost_detect_s: float = 50.0  # Ray's health check: 5 failures × 10 s timeout
    crash_share: float = 0.80
    unreachable_share: float = 0.13
    hang_share: float = 0.07


MEASURED, ASSUMED = Measured(), Assumptions()


@dataclass(frozen=True)
class MeshCosts:
    """One mesh: its speed, and what saving, restoring and re-forming it cost."""

    label: str  # e.g. "tp8·pp8·dp16"
    world: int
    nodes: int
    step_s: float
    tokens_per_step: int
    state_gb_per_rank: float
    save_blocked_s: float
    save_write_s: float  # writing a save to storage
    save_durable_s: float  # from the save's start until it is durable
    restore_s: float  # from storage, the model parts built
    restore_bytes_s: float  # the reading part of it
    warm_reform_s: float
    cold_reform_s: float
    restart_s: float  # restart-from-checkpoint: every worker anew (restore not included)
    control_s: float = 0.0  # the control plane's part of ``step_s`` (segment boundaries)


def control_s_per_step(world: int, step_s: float, m: Measured = MEASURED) -> float:
    """The controller's boundary time, per step: ``boundary_ms_per_rank`` × ranks once a
    segment, a segment as the controller sizes it (``cadence.segment_caps``: at most
    BOUNDARY_SHARE of its time goes to the boundary, and, up to SEGMENT_BUDGET_S, at most
    BOUNDARY_S_PER_STEP a step)."""
    boundary = m.boundary_ms_per_rank / 1000 * world
    steps, until_s = segment_caps(boundary, step_s)
    # (the ranks end a segment at the first step that starts past ``until_s``)
    return boundary / max(1, min(steps, math.ceil(until_s / max(step_s, 1e-9))))


# A pipeline's layout as the state per rank reads it: (schedule, chunks a rank, blocks of each
# stage or None for the even split)
Stages = tuple[str, int, tuple[int, ...] | None]


def state_gb_per_rank(model, tp: int, pp: int, dp: int, stages: Stages | None = None) -> float:
    """The fullest rank's checkpointed state (GB): its stages' blocks as ``stages`` lays them
    out (None: one stage a rank, split evenly)."""
    schedule, vpp, split = stages if stages is not None else ("1f1b", 1, None)
    params = max(rank_params(model, pp, r, schedule, vpp, split).local(tp, dp)
                 for r in range(pp))
    return params * STATE_BYTES_PER_PARAM / 1e9


def mesh_costs(model, tp: int, pp: int, dp: int, nodes: int, step_s: float, tokens_per_step: int,
               async_save: bool, a: Assumptions = ASSUMED, m: Measured = MEASURED,
               dp_replicate: int = 1, stages: Stages | None = None) -> MeshCosts:
    """A mesh's checkpoint and recovery costs. Under hybrid sharding (``dp_replicate`` > 1) a
    rank holds 1 / (dp / dp_replicate) of its stage's state: a save copies all of it to host
    memory but writes each replicated shard once (DCP's de-duplication spreads them over the
    replicas), and a restore reads every rank's whole part. ``stages``: the pipeline's
    schedule, chunks a rank and blocks a stage (None: one even stage a rank)."""
    world = tp * pp * dp
    per_rank = state_gb_per_rank(model, tp, pp, dp // dp_replicate, stages)
    written_per_node = per_rank * world / dp_replicate / max(1, nodes)
    read_per_node = per_rank * world / max(1, nodes)
    bw = min(a.storage_node_gbps, a.storage_total_gbps / max(1, nodes))
    write = written_per_node / bw
    pg = a.pg_init_s_per_1k_ranks * world / 1000
    hsdp = f" (hsdp {dp_replicate}×{dp // dp_replicate})" if dp_replicate > 1 else ""
    control = control_s_per_step(world, step_s, m)
    boundary = m.boundary_ms_per_rank / 1000 * world  # a save's call to every rank: a boundary
    return MeshCosts(
        label=f"tp{tp}·pp{pp}·dp{dp}{hsdp}", world=world, nodes=nodes, step_s=step_s + control,
        tokens_per_step=tokens_per_step, state_gb_per_rank=per_rank,
        save_blocked_s=boundary + (per_rank / a.d2h_gbps if async_save else write),
        save_write_s=write, save_durable_s=per_rank / a.d2h_gbps + write if async_save else write,
        restore_s=m.warm_restore_s + read_per_node / bw, restore_bytes_s=read_per_node / bw,
        warm_reform_s=m.warm_reform_s + pg, cold_reform_s=m.cold_reform_s + pg,
        restart_s=m.restart_s + pg, control_s=control)


def detect_s(kind: str, collective_timeout_s: float, a: Assumptions = ASSUMED,
             m: Measured = MEASURED) -> float:
    return {"crash": m.crash_detect_s, "process": m.crash_detect_s, "notice": m.crash_detect_s,
            "unreachable": a.node_lost_detect_s, "hang": collective_timeout_s}[kind]


def predicted_save(model, tp: int, pp: int, dp: int, nodes: int, async_save: bool,
                   a: Assumptions = ASSUMED, dp_replicate: int = 1,
                   stages: Stages | None = None) -> tuple[float, float]:
    """(seconds a save blocks training, seconds it takes to be written), before one is measured."""
    c = mesh_costs(model, tp, pp, dp, nodes, 1.0, 0, async_save, a, dp_replicate=dp_replicate,
                   stages=stages)
    return c.save_blocked_s, c.save_write_s
