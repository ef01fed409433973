"""What a pipeline-parallel run leaves behind for people: the planned schedule (grid and the
simulated PNG on unit costs), and plan against measurement for the last step: the simulator
fed the costs measured in that step beside the measured per-rank timeline, as one
Chrome/Perfetto trace and one two-panel PNG."""

from __future__ import annotations

from pathlib import Path

from trainmesh.parallel.dims import ParallelDims
from trainmesh.spec.job import JobSpec

NAMES = ("pipeline_schedule.txt", "pipeline_schedule.png", "pipeline_trace.json",
         "pipeline_planned_vs_measured.png")


def write_pipeline_artifacts(out: Path, spec: JobSpec, dims: ParallelDims, group) -> list[Path]:
    """Write the files of ``NAMES`` into ``out`` and return their paths (none without a
    pipeline). ``group.timelines()[rank]`` is a rank's measured (action, start, end) list; one
    row per pipeline stage (dp = tp = 0)."""
    if dims.pp == 1:
        return []
    timelines = group.timelines()
    from trainmesh.parallel.pipeline.ir import grid
    from trainmesh.parallel.pipeline.schedules import build_schedule, pipe_shape
    from trainmesh.parallel.pipeline.simulate import Costs, simulate
    from trainmesh.parallel.pipeline.trace import chrome_trace, measured_costs, plot_schedule, write_json
    from trainmesh.spec.mesh_rules import microbatches_per_replica

    tr, v, kind = spec.training, spec.parallelism.vpp, spec.schedule.name
    m = microbatches_per_replica(tr.global_batch_size, tr.microbatch_size, dims.dp)
    sched, shape = build_schedule(kind, dims.pp, v, m), pipe_shape(kind, dims.pp, v, m)
    paths = [out / name for name in NAMES]
    paths[0].write_text(grid(sched) + "\n")
    plot_schedule(simulate(sched, dims.pp * v, m, Costs(1.0, 2.0), shape=shape), kind, paths[1])
    measured = [timelines[r] for r in (dims.rank_of(i, 0, 0) for i in range(dims.pp))]
    planned = simulate(sched, dims.pp * v, m, measured_costs(measured), shape=shape)
    write_json(chrome_trace(measured, planned), paths[2])
    plot_schedule(planned, kind, paths[3], measured=measured)
    return paths
