"""What a pipeline-parallel run leaves behind for people: the planned schedule (grid and the
simulated PNG) beside the measured per-rank timeline of the last step (Chrome/Perfetto trace)."""

from __future__ import annotations

from pathlib import Path

from trainmesh.parallel.dims import ParallelDims
from trainmesh.spec.job import JobSpec


def write_pipeline_artifacts(out: Path, spec: JobSpec, dims: ParallelDims, group) -> list[Path]:
    """Write the three files into ``out`` and return their paths (none without a pipeline).
    ``group.timelines()[rank]`` is a rank's measured (action, start, end) list; one row per
    pipeline stage (dp = tp = 0)."""
    if dims.pp == 1:
        return []
    timelines = group.timelines()
    from trainmesh.parallel.pipeline.ir import grid
    from trainmesh.parallel.pipeline.schedules import build_schedule
    from trainmesh.parallel.pipeline.simulate import simulate
    from trainmesh.parallel.pipeline.trace import chrome_trace, plot_schedule, write_json

    tr, vpp = spec.training, spec.parallelism.vpp
    m = tr.global_batch_size // (dims.dp * tr.microbatch_size)
    sched = build_schedule(spec.schedule.name, dims.pp, vpp, m)
    paths = [out / "pipeline_schedule.txt", out / "pipeline_schedule.png", out / "pipeline_trace.json"]
    paths[0].write_text(grid(sched) + "\n")
    plot_schedule(simulate(sched, dims.pp * vpp, m), spec.schedule.name, paths[1])
    stage_ranks = [dims.rank_of(i, 0, 0) for i in range(dims.pp)]
    write_json(chrome_trace([timelines[r] for r in stage_ranks]), paths[2])
    return paths
