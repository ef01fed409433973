"""Pictures of schedules: the planned grid as a PNG, measured timelines as a Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path

from trainmesh.parallel.pipeline.ir import Op, Schedule
from trainmesh.parallel.pipeline.simulate import SimResult


def chrome_trace(timelines: list[list[tuple[str, float, float]]]) -> dict:
    """Measured (name, start, end) per rank → Chrome/Perfetto trace events (one row per rank)."""
    t0 = min((s for row in timelines for _, s, _ in row), default=0.0)
    events = []
    for rank, row in enumerate(timelines):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        for name, start, end in row:
            kind = "compute" if ("F" in name or "B" in name) and "+" not in name else "p2p"
            if any(tag in name for tag in ("RF", "SF", "RB", "SB")):
                kind = "p2p"
            events.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": rank,
                           "ts": (start - t0) * 1e6, "dur": max(0.0, end - start) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_json(obj: dict, path: str | Path) -> Path:
    p = Path(path)
    p.write_text(json.dumps(obj))
    return p


def plot_schedule(sim: SimResult, title: str, path: str | Path) -> Path:
    """The simulated schedule as a PNG: one row per rank, forward and backward boxes labelled
    with stage and microbatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = len(sim.timeline)
    fig, ax = plt.subplots(figsize=(max(8.0, sim.step_time * 0.6), 0.6 * pp + 1.2))
    for rank, row in enumerate(sim.timeline):
        for a, start, end in row:
            if a.op not in (Op.FORWARD, Op.BACKWARD):
                continue
            shade = 0.35 + 0.5 * (a.stage // pp) / max(1, (a.stage // pp) + 1)
            color = (0.2, 0.45, 0.9, shade) if a.op is Op.FORWARD else (0.95, 0.55, 0.15, shade)
            ax.broken_barh([(start, end - start)], (pp - 1 - rank + 0.1, 0.8), facecolors=color,
                           edgecolors="black", linewidth=0.5)
            ax.text((start + end) / 2, pp - 1 - rank + 0.5, str(a), ha="center", va="center",
                    fontsize=7)
    ax.set_yticks([pp - 1 - r + 0.5 for r in range(pp)], [f"rank {r}" for r in range(pp)])
    ax.set_xlabel("time (forward = 1 unit)")
    ax.set_title(f"{title} — bubble {sim.bubble_fraction:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def planned_grid_text(schedule: Schedule) -> str:
    from trainmesh.parallel.pipeline.ir import grid

    return grid(schedule)
